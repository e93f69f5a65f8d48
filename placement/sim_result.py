"""Simulation results: per-request records, SLO attainment, latency percentiles, throughput."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from placement.sim_instances import ReqState

logger = logging.getLogger(__name__)

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0}


class RequestRecord(NamedTuple):
    arrival_s: float
    input_len: int
    output_len: int
    ttft_s: float  # nan when rejected
    tpot_s: float  # 0 for one-token outputs; nan when rejected
    finish_s: float
    prefill: int
    decode: int
    rejected: bool


class Percentiles(NamedTuple):
    p50: float
    p90: float
    p99: float
    mean: float = float("nan")

    def at(self, name: str) -> float:
        return float(getattr(self, name))


@dataclass
class SimResult:
    records: list[RequestRecord]
    policy_rejected: int

    @classmethod
    def from_states(cls, reqs: Sequence[ReqState], policy_rejected: int) -> SimResult:
        recs = []
        for r in reqs:
            if r.rejected:
                recs.append(RequestRecord(r.arrival, r.input_len, r.output_len, float("nan"), float("nan"),
                                          float("nan"), r.prefill_idx, r.decode_idx, True))
                continue
            tpot = (r.finish - r.first_token) / (r.output_len - 1) if r.output_len > 1 else 0.0
            recs.append(RequestRecord(r.arrival, r.input_len, r.output_len, r.first_token - r.arrival, tpot,
                                      r.finish, r.prefill_idx, r.decode_idx, False))
        res = cls(recs, policy_rejected)
        res.check_integrity()
        return res

    def check_integrity(self) -> None:
        """Every request is either rejected or finished after its first token, which follows its arrival."""
        bad = [r for r in self.records if not r.rejected and not (0 <= r.ttft_s and r.finish_s >= r.arrival_s
                                                                  and r.tpot_s >= 0)]
        if bad or self.completed + self.rejected != len(self.records):
            raise AssertionError(f"simulation lost requests: {len(self.records)} total, {self.completed} completed, "
                                 f"{self.rejected} rejected, {len(bad)} inconsistent (first: {bad[:1]})")

    @property
    def total(self) -> int:
        return len(self.records)

    @property
    def rejected(self) -> int:
        return sum(1 for r in self.records if r.rejected)

    @property
    def completed(self) -> int:
        return sum(1 for r in self.records if not r.rejected)

    def attainment(self, ttft_s: float, tpot_s: float) -> float:
        """Fraction of all requests (rejected ones count as misses) meeting both targets."""
        if not self.records:
            return 0.0
        ok = sum(1 for r in self.records if not r.rejected and r.ttft_s <= ttft_s and r.tpot_s <= tpot_s)
        return ok / len(self.records)

    def _pct(self, values: list[float]) -> Percentiles:
        if not values:
            return Percentiles(float("nan"), float("nan"), float("nan"))
        v = np.asarray(values)
        a = np.percentile(v, [50, 90, 99])
        return Percentiles(float(a[0]), float(a[1]), float(a[2]), float(v.mean()))

    def ttft(self) -> Percentiles:
        return self._pct([r.ttft_s for r in self.records if not r.rejected])

    def tpot(self) -> Percentiles:
        return self._pct([r.tpot_s for r in self.records if not r.rejected and r.output_len > 1])

    @property
    def makespan_s(self) -> float:
        done = [r.finish_s for r in self.records if not r.rejected]
        if not done:
            return 0.0
        return max(done) - min(r.arrival_s for r in self.records)

    def requests_per_s(self) -> float:
        span = self.makespan_s
        return self.completed / span if span > 0 else 0.0

    def output_tok_s(self) -> float:
        span = self.makespan_s
        return sum(r.output_len for r in self.records if not r.rejected) / span if span > 0 else 0.0

    def input_tok_s(self) -> float:
        span = self.makespan_s
        return sum(r.input_len for r in self.records if not r.rejected) / span if span > 0 else 0.0
