"""What travels with one HTTP request from its route into our engine client's generate(): the SLO the
client asked for, and the jobs generate() created (so a stream can be admitted before it starts, and its
response can say how it was served).

NOTE: vLLM's serving layer passes only trace headers down to `EngineClient.generate()`; a contextvar set
around the serving call reaches it (generate() is called in the same task), as does any job it creates.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.config import SLOConfig
from cluster.errors import ServeError

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
MAX_SLO_MS = 3.6e6


@dataclass
class RequestContext:
    ttft_slo_s: float
    tpot_slo_s: float
    jobs: list[Any] = field(default_factory=list)  # cluster.serve.job.Job, in creation order
    completions: int = 0  # legs asked for so far (n of each prompt): serve.max_completions_per_request caps it

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], slo: SLOConfig) -> RequestContext:
        """The SLO of a request: the deployment's targets, tightened (never loosened) by its headers."""
        return cls(_header(headers, TTFT_HEADER, slo.ttft_ms), _header(headers, TPOT_HEADER, slo.tpot_ms))


def _header(headers: Mapping[str, str], name: str, default_ms: float) -> float:
    v = headers.get(name)
    if v is None:
        return default_ms / 1000
    try:
        f = float(v)
    except ValueError:
        raise ServeError(400, f"header {name} must be a number of milliseconds, got {v!r}", param=name) from None
    if not 0 < f < MAX_SLO_MS:
        raise ServeError(400, f"header {name} must be in (0, {MAX_SLO_MS:.0f}) ms, got {v}", param=name)
    # NOTE: a header may only tighten the deployment's target, so no client can opt out of admission.
    return min(f, default_ms) / 1000


CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("saaf_request", default=None)
# NOTE: set by the HTTP request's middleware (cluster/serve/served.py): every serving call's context joins it,
# so the response can say how its completions were served.
SERVED: contextvars.ContextVar[list[RequestContext] | None] = contextvars.ContextVar("saaf_served", default=None)
