"""Statistics over per-request timings (percentiles, SLO attainment, goodput, throughput and cost) and what a
benchmark run measured (BenchmarkResult: per-rate summaries and the raw records).

Definitions (also in docs/benchmarks.md):
- percentile: nearest rank. ``p``-th percentile of ``n`` sorted values is the value at 1-based rank
  ``ceil(p/100 * n)``: the smallest observed value with at least p% of values at or below it. Never
  interpolated, so every reported percentile is a latency some request actually saw.
- TPOT of a request = (e2e - ttft) / (output_tokens - 1); 0 for a 1-token output.
- a request meets the SLO when it succeeded, ttft <= ttft target and tpot <= tpot target.
- attainment = met / all requests sent (errors, timeouts and 429s are misses).
- goodput = met requests per second of the run (and output tokens/s of met requests).
- cost: $/hour x run duration, split between input and output tokens by prefill vs decode GPU-seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from benchmarks.client import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of ``values`` (unsorted is fine); ``p`` in (0, 100]."""
    if not values:
        raise ValueError("percentile of an empty sequence: there is nothing to summarise")
    if not 0 < p <= 100:
        raise ValueError(f"percentile p={p!r} is outside (0, 100]; give e.g. 50, 90 or 99")
    ordered = sorted(values)
    # NOTE: p * n / 100 rather than p / 100 * n: 7 / 100 * 100 is 7.000000000000001 -> rank 8.
    rank = max(1, math.ceil(p * len(ordered) / 100 - 1e-9))
    return ordered[rank - 1]


@dataclass(frozen=True)
class LatencySummary:
    """Percentiles (and, for context only, mean/min/max) of one latency series, in seconds."""

    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None
    min: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencySummary:
        if not values:
            return cls(0, None, None, None, None, None, None)
        p50, p90, p99 = (percentile(values, p) for p in PERCENTILES)
        return cls(len(values), p50, p90, p99, sum(values) / len(values), min(values), max(values))


@dataclass(frozen=True)
class SLO:
    """Latency targets a request must meet to count toward goodput."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"SLO {name}={value!r} must be > 0 seconds, e.g. ttft_s=1.0 tpot_s=0.1")


@dataclass(frozen=True)
class CostModel:
    """$/hour for the whole deployment; GPU counts per pool for a disaggregated one.

    With both pool sizes given, the prefill share of cost is prefill_gpus / (prefill_gpus + decode_gpus).
    Without them (colocated), it is estimated as sum(TTFT) / (sum(TTFT) + sum(e2e - TTFT)) over
    successful requests.
    """

    dollars_per_hour: float
    prefill_gpus: int | None = None
    decode_gpus: int | None = None

    def __post_init__(self) -> None:
        if not self.dollars_per_hour >= 0:
            raise ValueError(f"dollars_per_hour={self.dollars_per_hour!r} must be >= 0, e.g. 2.5")
        if (self.prefill_gpus is None) != (self.decode_gpus is None):
            raise ValueError("give both prefill_gpus and decode_gpus (disaggregated) or neither (colocated)")
        if self.prefill_gpus is not None and self.decode_gpus is not None:
            if min(self.prefill_gpus, self.decode_gpus) < 0 or self.prefill_gpus + self.decode_gpus == 0:
                raise ValueError(f"GPU counts prefill={self.prefill_gpus} decode={self.decode_gpus}: "
                                 "need non-negative counts with at least one GPU")


@dataclass(frozen=True)
class Cost:
    total_dollars: float
    prefill_fraction: float
    split_method: str
    dollars_per_m_input: float | None
    dollars_per_m_output: float | None


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first; None for failed requests."""
    if not record.ok or record.ttft_s is None or record.e2e_s is None:
        return None
    if record.completion_tokens <= 1:
        return 0.0
    return (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    t = tpot(record)
    return t is not None and record.ttft_s is not None and record.ttft_s <= slo.ttft_s and t <= slo.tpot_s


def cost_of(records: Sequence[RequestRecord], duration_s: float, model: CostModel) -> Cost:
    ok = [r for r in records if r.ok]
    total = model.dollars_per_hour * duration_s / 3600.0
    if model.prefill_gpus is not None and model.decode_gpus is not None:
        frac = model.prefill_gpus / (model.prefill_gpus + model.decode_gpus)
        method = f"gpu-count: prefill {model.prefill_gpus} / decode {model.decode_gpus} GPUs"
    else:
        prefill = sum(r.ttft_s or 0.0 for r in ok)
        decode = sum((r.e2e_s or 0.0) - (r.ttft_s or 0.0) for r in ok)
        frac = prefill / (prefill + decode) if prefill + decode > 0 else 0.5
        method = "time-share: sum(TTFT) / sum(e2e) over successful requests"
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    per_m_in = total * frac / input_tokens * 1e6 if input_tokens else None
    per_m_out = total * (1 - frac) / output_tokens * 1e6 if output_tokens else None
    return Cost(total, frac, method, per_m_in, per_m_out)


@dataclass(frozen=True)
class RateSummary:
    """Everything the report shows for one rate step."""

    rate: float | None
    duration_s: float
    sent: int
    succeeded: int
    rejected_429: int
    errors: dict[str, int]
    ttft: LatencySummary
    itl: LatencySummary
    tpot: LatencySummary
    e2e: LatencySummary
    slo_met: int
    attainment: float
    goodput_rps: float
    goodput_tok_s: float
    request_throughput_rps: float
    input_tok_s: float
    output_tok_s: float
    mean_tokens_per_chunk: float | None
    max_send_lag_s: float
    cost: Cost | None
    served_late: int = 0
    """Answered in full but past a target: what admission should have refused instead."""
    refusal: LatencySummary = field(default_factory=lambda: LatencySummary.of([]))
    """Send -> 429 response of the refused requests ("refused at once" is read here)."""

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], duration_s: float, rate: float | None,
              slo: SLO, cost_model: CostModel | None = None) -> RateSummary:
    """Summarise one rate step; ``duration_s`` is the step's wall time (first send to last response)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s!r} must be > 0")
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok and r.status != 429:
            errors[r.error_kind] = errors.get(r.error_kind, 0) + 1
    met = [r for r in records if meets_slo(r, slo)]
    tpots = [t for t in (tpot(r) for r in ok) if t is not None]
    chunks = sum(r.chunks for r in ok)
    return RateSummary(
        rate=rate,
        duration_s=duration_s,
        sent=len(records),
        succeeded=len(ok),
        rejected_429=sum(1 for r in records if r.status == 429),
        errors=dict(sorted(errors.items())),
        ttft=LatencySummary.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl=LatencySummary.of([gap for r in ok for gap in r.itl_s]),
        tpot=LatencySummary.of(tpots),
        e2e=LatencySummary.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        slo_met=len(met),
        attainment=len(met) / len(records) if records else 0.0,
        goodput_rps=len(met) / duration_s,
        goodput_tok_s=sum(r.completion_tokens for r in met) / duration_s,
        request_throughput_rps=len(ok) / duration_s,
        input_tok_s=sum(r.prompt_tokens for r in ok) / duration_s,
        output_tok_s=sum(r.completion_tokens for r in ok) / duration_s,
        mean_tokens_per_chunk=sum(r.completion_tokens for r in ok) / chunks if chunks else None,
        max_send_lag_s=max((r.start_s - r.scheduled_s for r in records), default=0.0),
        cost=cost_of(records, duration_s, cost_model) if cost_model is not None else None,
        served_late=len(ok) - len(met),
        refusal=LatencySummary.of([r.e2e_s for r in records if r.status == 429 and r.e2e_s is not None]),
    )


@dataclass
class StepResult:
    rate: float | None
    summary: RateSummary
    records: list[RequestRecord]


@dataclass
class BenchmarkResult:
    """Config, per-rate summaries and raw per-request records of one run."""

    config: dict
    steps: list[StepResult]
    started_at: str
    finished_at: str
    command: str | None = None
    environment: dict = field(default_factory=dict)

    def to_dict(self, include_records: bool = True) -> dict:
        out = {"config": self.config, "started_at": self.started_at, "finished_at": self.finished_at,
               "command": self.command, "environment": self.environment, "steps": []}
        for step in self.steps:
            item = {"rate": step.rate, "summary": step.summary.to_dict()}
            if include_records:
                item["records"] = [asdict(r) for r in step.records]
            out["steps"].append(item)
        return out
