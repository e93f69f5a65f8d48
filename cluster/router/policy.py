"""What a routing policy is: the request it sees, the decision it returns, the contract, the registry.

A policy answers one question per request: which prefill worker and which decode worker serve it, and
is it worth admitting at all. It sees only `WorkerStats` snapshots (refreshed in the background by
`Membership`); it never waits on a worker and does no I/O, so a decision costs microseconds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from engine.contract import WorkerStats

PREFIX_MIN = 64  # tokens: the shortest prefix the router tracks (`prefix_hash`, the first rung of the ladder)


class RouteRequest(NamedTuple):
    prompt_tokens: int
    max_tokens: int
    ttft_slo_s: float
    tpot_slo_s: float
    prefix_hash: int = 0
    # NOTE: (length, hash of the first `length` prompt tokens) at 64, 128, 256, ... tokens below the prompt's
    # length (`prefix_ladder`): a worker that prefilled a prompt sharing a rung holds at least that many
    # tokens in its prefix cache, so the goodput router predicts its prefill without them
    prefixes: tuple[tuple[int, int], ...] = ()
    # NOTE: the prefill engine's first token is the client's (cluster/serve/leg.py first_token_carries): the
    # KV transfer then delays the second token, not the first. False: the decode engine samples token 1 after
    # the transfer (structured output, penalties, a seed, stop strings), so TTFT waits for it.
    first_from_prefill: bool = True


def prefix_ladder(ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Hashes of the prompt's prefixes at power-of-two lengths from PREFIX_MIN, each shorter than the
    prompt (vLLM recomputes at least the last prompt token): ~2x the prompt's length in hashing work."""
    out = []
    n = PREFIX_MIN
    while n < len(ids):
        out.append((n, hash(tuple(ids[:n]))))
        n *= 2
    return tuple(out)


class Corrections(NamedTuple):
    """What the goodput policy's predictions for one route used, handed back with its measurements.

    NOTE: what a measurement teaches is relative to the corrections its prediction used, so a burst routed
    with one correction and measured later moves it once, not once per request."""

    step_ratio: float | None = None  # the decode worker's step-time correction the TPOT used
    ttft_ratio: float | None = None
    tpot_ratio: float | None = None  # at the batch `tpot_batch` the request joined
    tpot_batch: int = 0
    ticket: int = 0  # its key to the TTFT prediction that later routes to the same batch revise


class RouteDecision(NamedTuple):
    admit: bool
    prefill: str | None  # worker id (None in colocated mode)
    decode: str | None  # worker id of the decode (or colocated) worker
    reason: str = ""
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    p_slo: float | None = None  # predicted probability of meeting both targets (a predicting policy's)
    local: bool = False  # prefill on the decode worker itself (no KV transfer); `prefill` is then None
    placement: str = ""  # "remote:<why>" / "local:<why>" (router.disaggregation), counted in /metrics
    corrections: Corrections | None = None  # the goodput policy's, for its own observe()


class Pools(NamedTuple):
    """The workers a policy chooses from, as their latest stats."""

    prefill: list[WorkerStats]
    decode: list[WorkerStats]  # the colocated workers in colocated mode


class PoolSource(Protocol):
    """Where admission reads the pools from (the ingress's membership), leaving out `exclude`d workers."""

    def pools(self, exclude: set[str] | frozenset[str] = frozenset()) -> Pools: ...


class Policy(ABC):
    """Contract of a routing policy.

    - `route(req, prefill, decode)` reads only its arguments (and the policy's own state); it never blocks.
    - `decode` is never empty when called; `prefill` is empty in colocated mode, where `decode` holds the
      colocated workers and the decision's `prefill` is None.
    - The decision names a worker of each given pool also when `admit` is False, so best-effort admission
      can still serve the request there.
    - `admit=False` means the request would most likely miss its targets (or cost others theirs); the
      caller queues or refuses it according to `router.admission`.
    - `observe_first_token(...)` is called when a request's first token arrives, `observe(...)` once per
      finished request with its measured TTFT/TPOT; the defaults ignore them.
    """

    @abstractmethod
    def route(self, req: RouteRequest, prefill: Sequence[WorkerStats],
              decode: Sequence[WorkerStats]) -> RouteDecision: ...

    def observe_first_token(self, decision: RouteDecision, req: RouteRequest,  # noqa: B027 - optional hook
                            ttft_s: float) -> None:
        """Feedback when a request's first token arrives (measured TTFT from routing), before `observe`."""

    def observe(self, decision: RouteDecision, req: RouteRequest,  # noqa: B027 - optional hook
                ttft_s: float, tpot_s: float | None) -> None:
        """Feedback after a request (measured TTFT from routing, TPOT or None for one token)."""

    def describe(self) -> dict[str, Any]:
        """What /v1/stats shows of the policy."""
        return {"policy": type(self).__name__}

    def __call__(self, req: RouteRequest, prefill: Sequence[WorkerStats],
                 decode: Sequence[WorkerStats]) -> RouteDecision:
        return self.route(req, prefill, decode)


# name -> factory; a factory receives make_policy's keyword arguments and ignores those it does not use.
POLICIES: dict[str, Callable[..., Policy]] = {}


def register(name: str) -> Callable[[Callable[..., Policy]], Callable[..., Policy]]:
    def deco(factory: Callable[..., Policy]) -> Callable[..., Policy]:
        POLICIES[name] = factory
        return factory

    return deco


def known_policies() -> list[str]:
    return sorted(POLICIES)


def make_policy(name: str, **kwargs: Any) -> Policy:
    """The policy registered as `name`. `goodput` uses `router_cfg` (RouterConfig: latency model, sigma,
    admission), `slo` (SLOConfig: default targets), and optionally `latency`/`decode_latency`
    (LatencyModels), `prefill_tp`/`decode_tp` (catalog models), `clock` and `max_prefill_tokens`."""
    if name not in POLICIES:
        raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(known_policies())}")
    return POLICIES[name](**kwargs)
