"""Fabric check: can every prefill node move KV bytes to every decode node over NIXL, and how fast?

Per (prefill node, decode node) pair, two short-lived Ray actors (num_cpus=0), each pinned to its node
with a hard NodeAffinitySchedulingStrategy, each own a NIXL UCX agent and one registered buffer. The
prefill actor fills its buffer with a seeded pattern; metadata goes through the driver; the decode actor
READs the buffer (the direction vLLM's NixlConnector pulls KV), then checks it byte for byte against the
pattern and against the prefill side's checksum. Pairs run one at a time, so rates do not interfere.
Deploy calls `run_fabric_check` then `require_fabric`, which raises naming every failing pair.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from itertools import product
from typing import Any, NamedTuple

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvtransfer.nixl_agent import MEMORY_KINDS, NixlRegion, RegionInfo, digest, first_mismatch, pattern

logger = logging.getLogger(__name__)

DEFAULT_NBYTES = 64 * 2**20
DEFAULT_TIMEOUT_S = 60.0
TIMED_READS = 3
# Test hooks for the failure paths; never set in production.
FAULTS = ("corrupt", "bad_metadata", "stall")


class PairResult(NamedTuple):
    prefill_node: str
    decode_node: str
    ok: bool
    gbps: float  # median over the timed READs; 0.0 when the pair failed
    seconds: float  # median seconds of one READ of the whole buffer
    error: str  # "" when ok

    def describe(self) -> str:
        return f"prefill {self.prefill_node} -> decode {self.decode_node}"


class FabricCheckError(Exception):
    """A prefill/decode pair cannot move KV bytes; the message names each failing pair."""

    def __init__(self, failed: Sequence[PairResult]) -> None:
        self.failed = list(failed)
        lines = [f"  {r.describe()}: {r.error}" for r in self.failed]
        super().__init__(
            f"fabric check failed for {len(self.failed)} prefill/decode pair(s); KV cannot move between them:\n"
            + "\n".join(lines)
            + "\nFix the NIXL/UCX path between these nodes (UCX_NET_DEVICES, UCX_TLS, firewall) and rerun "
            "`python -m kvtransfer.check`."
        )


def require_fabric(results: Sequence[PairResult]) -> None:
    """Raise FabricCheckError naming every failing pair (also when no pair was checked)."""
    if not results:
        raise FabricCheckError([PairResult("?", "?", False, 0.0, 0.0, "no pairs were checked")])
    failed = [r for r in results if not r.ok]
    if failed:
        raise FabricCheckError(failed)


@ray.remote(num_cpus=0, max_restarts=0)
class _FabricPeer:
    """One side of a pair. Prefill: owns the patterned source. Decode: READs and verifies it."""

    def __init__(self, name: str, nbytes: int, memory: str, backends: list[str]) -> None:
        self.region = NixlRegion(name, nbytes, memory, backends)

    def serve(self, seed: int, fault: str | None) -> tuple[RegionInfo, str]:
        """Fill the pattern; returns (region info, checksum of what the decode side must receive)."""
        data = pattern(self.region.nbytes, seed)
        self.region.write_host(data)
        sent_digest = digest(data)
        if fault == "corrupt":
            self.region.write_host(data[:1] ^ 0xFF, offset=self.region.nbytes // 2)
        info = self.region.info()
        if fault == "bad_metadata":
            info = replace(info, metadata=b"\x00not-nixl-metadata")
        return info, sent_digest

    def pull(self, peer: RegionInfo, seed: int, want_digest: str, timeout_s: float, fault: str | None) -> list[float]:
        """READ the peer's buffer 1 + TIMED_READS times, verifying each; returns the timed seconds."""
        if fault == "stall":
            time.sleep(timeout_s + 30)
        try:
            self.region.connect(peer)
        except Exception as exc:
            raise RuntimeError(
                f"decode agent cannot load the prefill agent's metadata ({type(exc).__name__}: {exc})"
            ) from exc
        want = pattern(self.region.nbytes, seed)
        deadline = time.monotonic() + timeout_s
        timed: list[float] = []
        for i in range(1 + TIMED_READS):  # the first READ also opens the connection: not timed
            self.region.zero()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"READs did not finish within {timeout_s:.1f} s")
            seconds = self.region.read_blocks(peer, self.region.nbytes, [0], [0], left)
            got = self.region.read_host()
            bad = first_mismatch(got, want)
            if bad is not None:
                raise RuntimeError(
                    f"data corrupted in transit: byte {bad} of {self.region.nbytes} is {int(got[bad])}, "
                    f"expected {int(want[bad])}"
                )
            if digest(got) != want_digest:
                raise RuntimeError("received bytes match the pattern but not the prefill side's checksum")
            if i:
                timed.append(seconds)
        return timed


def _check_pair(
    prefill: str,
    decode: str,
    nbytes: int,
    timeout_s: float,
    memory: str,
    backends: list[str],
    env: Mapping[str, str],
    seed: int,
    fault: str | None,
) -> PairResult:
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return max(0.1, deadline - time.monotonic())

    opts: dict[str, Any] = {"runtime_env": {"env_vars": dict(env)}} if env else {}
    if memory == "VRAM":
        opts["num_gpus"] = 1
    tag = f"{os.getpid()}-{seed}"
    actors = []
    step = "starting the prefill actor and filling its buffer"
    try:
        src = _FabricPeer.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(prefill, soft=False), **opts
        ).remote(f"fabric-prefill-{tag}", nbytes, memory, backends)
        actors.append(src)
        dst = _FabricPeer.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(decode, soft=False), **opts
        ).remote(f"fabric-decode-{tag}", nbytes, memory, backends)
        actors.append(dst)
        info, want_digest = ray.get(src.serve.remote(seed, fault), timeout=left())
        step = "starting the decode actor, READing and verifying the buffer"
        # NOTE: the actor gets a little less time than the driver waits, so its own error arrives first.
        pull = dst.pull.remote(info, seed, want_digest, max(0.1, left() - 2.0), fault)
        seconds = statistics.median(ray.get(pull, timeout=left()))
        return PairResult(prefill, decode, True, nbytes / seconds / 1e9, seconds, "")
    except Exception as exc:  # any failure is this pair's result, named by the caller
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            error = f"timed out after {timeout_s:.0f} s while {step}"
        else:
            error = f"{_describe(exc)} (while {step})"
        logger.warning("fabric check: prefill %s -> decode %s failed: %s", prefill, decode, error)
        return PairResult(prefill, decode, False, 0.0, 0.0, error)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


def _describe(exc: BaseException) -> str:
    """'Type: message' of the remote exception inside a Ray task error, on one line."""
    cause = getattr(exc, "cause", None)
    inner = cause if isinstance(cause, BaseException) else exc
    lines = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {lines[-1] if lines else repr(inner)}"


def run_fabric_check(
    pairs: Sequence[tuple[str, str]],
    nbytes: int = DEFAULT_NBYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory: str = "DRAM",
    *,
    backends: Sequence[str] = ("UCX",),
    env: Mapping[str, str] | None = None,
    seed: int = 0x5AAF,
    fault: str | None = None,
) -> list[PairResult]:
    """Move a verified `nbytes` buffer over NIXL for each (prefill node_id, decode node_id) pair.

    Needs ray.init() done. Each pair gets `timeout_s` in all; a failing pair does not stop the others.
    `backends`: the NIXL backends the engines use (e.g. ["LIBFABRIC"] on EFA). `env`: extra environment
    for the check's actors (e.g. {"UCX_TLS": "tcp"}); otherwise they inherit their node's environment.
    `fault` is a test hook ("corrupt", "bad_metadata", "stall") that breaks the check on purpose.
    """
    if memory not in MEMORY_KINDS:
        raise ValueError(f"memory={memory!r} is not supported: use one of {MEMORY_KINDS}")
    if nbytes <= 0 or timeout_s <= 0:
        raise ValueError(f"nbytes={nbytes} and timeout_s={timeout_s} must be positive")
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"fault={fault!r} is not a known test fault: use one of {FAULTS} or None")
    results = []
    for i, (prefill, decode) in enumerate(pairs):
        results.append(
            _check_pair(prefill, decode, nbytes, timeout_s, memory, list(backends), env or {}, seed + i, fault)
        )
    return results


def fabric_pairs_from_cluster(
    prefill_nodes: Sequence[str] | None = None, decode_nodes: Sequence[str] | None = None
) -> list[tuple[str, str]]:
    """(prefill, decode) node-id pairs of the connected cluster's alive nodes.

    Default: every ordered pair of distinct alive nodes; a single-node cluster gives (node, node), which
    still runs the two sides in two processes. Given node lists (the planned pools), every pair of them,
    including a node with itself when it hosts both pools.
    """
    alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    if not alive:
        raise RuntimeError("the Ray cluster reports no alive node: is ray.init() connected to the right cluster?")
    prefill = list(prefill_nodes) if prefill_nodes is not None else alive
    decode = list(decode_nodes) if decode_nodes is not None else alive
    unknown = sorted(set(prefill + decode) - set(alive))
    if unknown:
        raise ValueError(f"node ids {unknown} are not alive nodes of this cluster (alive: {alive})")
    if prefill_nodes is not None or decode_nodes is not None:
        return list(product(prefill, decode))
    if len(alive) == 1:
        return [(alive[0], alive[0])]
    return [(p, d) for p, d in product(prefill, decode) if p != d]
