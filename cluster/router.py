"""Request routing: which prefill and decode workers serve a request, from their live WorkerStats.

Policies are registered by name; ``round_robin`` and ``least_loaded`` need no model, ``goodput``
predicts TTFT/TPOT with a latency model (cluster/goodput.py, docs/router.md). A policy only reads
stats, it never waits on a worker. Build one with ``make_policy(name, router_cfg=..., slo=...)``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.stats import WorkerStats

if TYPE_CHECKING:
    from cluster.config import RouterConfig
    from placement.latency import LatencyModel

logger = logging.getLogger(__name__)

DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "manifests" / "profiles" / "cpu-smollm2.yaml"


class RouteRequest(NamedTuple):
    prompt_tokens: int
    max_tokens: int
    ttft_slo_s: float
    tpot_slo_s: float
    prefix_hash: int = 0


class RouteDecision(NamedTuple):
    admit: bool
    prefill: str | None  # worker id (None in colocated mode)
    decode: str | None  # worker id of the decode (or colocated) worker
    reason: str = ""
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    p_slo: float | None = None  # predicted probability of meeting both targets (goodput policy)


Policy = Callable[[RouteRequest, Sequence[WorkerStats], Sequence[WorkerStats]], RouteDecision]


def _load(s: WorkerStats) -> tuple[float, ...]:
    return (s.waiting + s.running, s.queued_prompt_tokens + s.running_context_tokens, s.kv_usage)


def least_loaded(req: RouteRequest, prefill: Sequence[WorkerStats], decode: Sequence[WorkerStats]):
    p = min(prefill, key=lambda s: (s.waiting, s.queued_prompt_tokens, s.running)) if prefill else None
    d = min(decode, key=_load) if decode else None
    return RouteDecision(True, p.worker_id if p else None, d.worker_id if d else None, "least_loaded")


class RoundRobin:
    def __init__(self) -> None:
        self._p = itertools.count()
        self._d = itertools.count()

    def __call__(self, req: RouteRequest, prefill: Sequence[WorkerStats], decode: Sequence[WorkerStats]):
        p = prefill[next(self._p) % len(prefill)].worker_id if prefill else None
        d = decode[next(self._d) % len(decode)].worker_id if decode else None
        return RouteDecision(True, p, d, "round_robin")


# A factory per name; it receives make_policy's keyword arguments and ignores those it does not use.
POLICIES: dict[str, Callable[..., Policy]] = {
    "least_loaded": lambda **_: least_loaded,
    "round_robin": lambda **_: RoundRobin(),
}


def make_policy(name: str, **kwargs: Any) -> Policy:
    """The policy registered as `name`. Keyword arguments go to its factory; `goodput` uses
    `router_cfg` (RouterConfig: latency model, sigma, admission), `slo` (SLOConfig: default targets),
    and optionally `latency`/`decode_latency` (LatencyModels), `prefill_tp`/`decode_tp` (catalog
    models), `clock` and `max_prefill_tokens`."""
    if name == "goodput" and name not in POLICIES:
        import cluster.goodput  # noqa: F401  (registers itself)
    if name not in POLICIES:
        names = ", ".join(sorted({*POLICIES, "goodput"}))
        raise ValueError(f"unknown router policy {name!r}; choose one of {names}")
    return POLICIES[name](**kwargs)


def latency_from_config(rc: RouterConfig | None, tp: int | None = None) -> LatencyModel:
    """The latency model the router config names: a catalog roofline (`latency_model` on
    `latency_hardware`, at `tp` or `latency_tp`), a measured profile (`latency_profile`), or the
    bundled CPU SmolLM2 profile."""
    from placement.latency import LatencyModel

    if rc is not None and rc.latency_model is not None:
        from placement.catalog import get_hardware, get_model

        assert rc.latency_hardware is not None  # RouterConfig's validator requires both
        return LatencyModel.from_catalog(get_model(rc.latency_model), get_hardware(rc.latency_hardware),
                                         tp=tp or rc.latency_tp)
    path = Path(rc.latency_profile).expanduser() if rc is not None and rc.latency_profile else DEFAULT_PROFILE
    if not path.is_absolute() and not path.is_file():
        path = DEFAULT_PROFILE.parents[2] / path  # NOTE: relative paths also resolve against the repo root
    if not path.is_file():
        raise FileNotFoundError(f"router.latency_profile {str(path)!r} does not exist; measure one with `python "
                                "-m placement profile --out PATH` or set latency_model and latency_hardware")
    return LatencyModel.from_profile(path)
