"""Routing hook of the disaggregated simulator: which prefill and decode instance serve a request.

The simulator calls `policy.choose(...)` once per arrival with a snapshot of every instance. A policy
returns `(prefill_index, decode_index)` or `None` to reject the request (the simulation counts it as
rejected and as an SLO miss). The router engineer plugs the goodput router's policy in here to compare
policies on the same trace (`simulate_disaggregated(..., requests=trace, dispatch=policy)`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple, Protocol

logger = logging.getLogger(__name__)


class InstanceView(NamedTuple):
    """What a policy may see of one instance at the moment of an arrival."""

    index: int  # type: ignore[assignment]  # NOTE: shadows tuple.index; the field name is the policy API
    role: str  # "prefill" | "decode"
    queued_requests: int
    queued_prompt_tokens: int
    running: int
    context_tokens: int
    kv_used_tokens: int
    kv_capacity_tokens: int


class DispatchPolicy(Protocol):
    def choose(self, now_s: float, prompt_len: int, output_len: int,
               prefill: Sequence[InstanceView], decode: Sequence[InstanceView]) -> tuple[int, int] | None:
        """Return (prefill index, decode index), or None to reject the request."""
        ...


class RoundRobinDispatch:
    """Cycle through prefill and decode instances independently; never rejects."""

    def __init__(self) -> None:
        self._p = 0
        self._d = 0

    def choose(self, now_s: float, prompt_len: int, output_len: int,
               prefill: Sequence[InstanceView], decode: Sequence[InstanceView]) -> tuple[int, int] | None:
        p = self._p % len(prefill)
        d = self._d % len(decode)
        self._p += 1
        self._d += 1
        return p, d


class LeastLoadedDispatch:
    """Prefill with the fewest queued prompt tokens; decode with the most free KV; never rejects."""

    def choose(self, now_s: float, prompt_len: int, output_len: int,
               prefill: Sequence[InstanceView], decode: Sequence[InstanceView]) -> tuple[int, int] | None:
        p = min(prefill, key=lambda v: (v.queued_prompt_tokens, v.running, v.index))
        d = max(decode, key=lambda v: (v.kv_capacity_tokens - v.kv_used_tokens, -v.index))
        return p.index, d.index
