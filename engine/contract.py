"""The worker contract: every value a worker hands the ingress across the Ray boundary, typed in one place.

    prefill()          -> PrefillResult: the first token's RequestOutput and the KVHandoff of the prompt's KV
    decode_stream()    -> DecodeEvent items: DecodeQueued beats while the handoff waits in the decode engine's
                          queue, then one TransferTelemetry, then the RequestOutputs (tokens)
    generate_stream()  -> RequestOutputs (one engine runs the whole request)
    stats()            -> WorkerStats, what the router reads (cheap to compute, msgpack/pickle friendly)

The KV handoff and the transfer telemetry are the transfer's own types (kvtransfer/handoff.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from kvtransfer.handoff import KVHandoff, TransferTelemetry

if TYPE_CHECKING:  # NOTE: the router reads WorkerStats without importing vLLM
    from typing import TypeAlias

    from vllm.outputs import RequestOutput


class PrefillResult(NamedTuple):
    output: RequestOutput  # the first token (prompt logprobs when asked)
    handoff: KVHandoff


@dataclass
class DecodeQueued:
    """Sent by the decode worker while a handoff waits in its engine's queue (before its KV pull starts), so
    the ingress knows the request is alive there: queue time is not transfer time."""

    request_id: str
    waited_s: float


if TYPE_CHECKING:
    DecodeEvent: TypeAlias = DecodeQueued | TransferTelemetry | RequestOutput  # what decode_stream() yields


class WorkerStats(NamedTuple):
    """A snapshot of one engine worker, refreshed by the router every <= 100 ms.

    Step times are seconds, most recent last. ``kv_usage`` is the fraction (0..1) of the engine's KV
    blocks in use; ``kv_capacity_tokens`` is the engine's total KV capacity in tokens.
    """

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    node_id: str
    waiting: int  # requests queued, not yet scheduled
    running: int  # requests in the running batch
    queued_prompt_tokens: int  # prompt tokens of waiting requests that this engine has to prefill
    running_context_tokens: int  # sum of context lengths (prompt + generated) of running requests
    kv_usage: float
    kv_capacity_tokens: int
    recent_step_times_s: tuple[float, ...]
    healthy: bool = True
    timestamp_s: float = 0.0
    spec_acceptance: float | None = None  # accepted / proposed draft tokens so far (speculating engines only)
    # NOTE: requests of the engine's own latency measurement (engine/calibrate.py; in waiting/running too);
    # it runs only while no serving request does and gives way to the first that arrives
    calibrating: int = 0
    # NOTE: the engine's step token budget as vLLM settled it (max_num_batched_tokens; 0: not reported)
    step_tokens: int = 0
    # NOTE: draft tokens proposed and accepted since the engine started (speculating engines only): the
    # difference of two snapshots is the acceptance over the time between them
    spec_drafted: int = 0
    spec_accepted: int = 0
    # NOTE: whether the engine keeps a prefix cache (vLLM's enable_prefix_caching): the router predicts a
    # cached prefix only where one can be
    prefix_caching: bool = True
    # NOTE: waiting requests (in `waiting` too) whose prompt KV a prefill engine computed and this decode engine
    # pulls over NIXL, and those prompts' tokens: they hold KV and join the batch, but need no prefill here, so
    # they are no queue for a prompt prefilled on this engine (`queued_prompt_tokens` leaves them out)
    pulling: int = 0
    pulling_tokens: int = 0
