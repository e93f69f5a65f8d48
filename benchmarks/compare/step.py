"""Measured replay steps against a ready endpoint: each step is one ``run_benchmark`` call with the
server sampled and every process's CPU time counted while it runs; on a shared machine a disturbed
step is repeated (from the run's budget) and the cleanest attempt kept."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from benchmarks.compare.fmt import fmt_key, fmt_ms
from benchmarks.compare.options import RunOptions
from benchmarks.compare.procstat import Steal, cpu_breakdown, cpu_snapshot
from benchmarks.compare.quiet import QuietBudget, disturbed, lost_cores, wait_quiet
from benchmarks.compare.server_stats import (
    StatsSampler,
    compact_samples,
    metric_means,
    prediction_summary,
    router_counts,
    scrape_metrics,
    transfer_summary,
    worker_load,
)
from benchmarks.compare.traffic import Step
from benchmarks.serve import run_benchmark
from benchmarks.stats import BenchmarkResult


class Attempt(NamedTuple):
    result: BenchmarkResult
    """One step's benchmark result, every request record included."""
    resources: dict[str, Any]
    """Cores per component, machine and foreign cores, worker load, KV transfers, server means, samples."""


def measure_step(endpoint: str, model: str, step: Step, engines: dict[int, str], opts: RunOptions,
                 warmup: bool) -> Attempt:
    """One step with its resource accounting. ``engines``: PID -> component name (``engine <id>``)."""
    with StatsSampler(endpoint) as sampler:
        seen = {t.get("request_id") for t in sampler.transfers()}
        seq0 = max((e[0] for e in sampler.predictions()), default=0)
        m0 = scrape_metrics(endpoint)
        before, busy0 = cpu_snapshot(engines)
        steal = Steal()
        w0 = time.monotonic()
        res = run_benchmark(endpoint, model, step.traffic.workload, [step.rate], **step.traffic.bench_kwargs(),
                            slo=opts.slo, cost=opts.cost, request_timeout_s=opts.request_timeout_s,
                            warmup_requests=opts.warmup_requests if warmup else 0, progress=opts.progress)
        wall = time.monotonic() - w0
        after, busy1 = cpu_snapshot(engines)
        m1 = scrape_metrics(endpoint)
    cores = cpu_breakdown(before, after, wall)
    tel = [t for t in sampler.transfers() if t.get("request_id") not in seen]
    preds = [e for e in sampler.predictions() if e[0] > seq0]
    return Attempt(res, {"wall_s": round(wall, 2), "cpu_cores": cores,
                         "machine_busy_cores": round((busy1 - busy0) / wall, 3),
                         "machine_other_cores": round(max(0.0, (busy1 - busy0) / wall - sum(cores.values())), 3),
                         "machine_steal_cores": steal.cores(),
                         "workers": worker_load(sampler.samples), "transfers": transfer_summary(tel),
                         "server_means_s": metric_means(m0, m1), "router_predictions": prediction_summary(preds),
                         "router_counts": router_counts(sampler.first, sampler.last),
                         "samples": compact_samples(sampler.samples, w0)})


def attempt_note(key: float | str, attempt: Attempt) -> dict[str, Any]:
    """What a discarded attempt measured (kept in the report: nothing measured is hidden)."""
    s = attempt.result.steps[0].summary
    return {"rate": key, "machine_other_cores": attempt.resources["machine_other_cores"],
            "machine_steal_cores": attempt.resources.get("machine_steal_cores"), "attainment": s.attainment,
            "goodput_rps": s.goodput_rps, "ttft_p90": s.ttft.p90, "tpot_p90": s.tpot.p90}


@dataclass
class Replayed:
    """Every step of one variant, keyed by ``Step.key``; ``result`` holds all steps' records in order."""

    result: BenchmarkResult | None = None
    summaries: list[dict[str, Any]] = field(default_factory=list)
    resources: dict[float | str, dict[str, Any]] = field(default_factory=dict)
    records: dict[float | str, list[dict[str, Any]]] = field(default_factory=dict)
    discarded: list[dict[str, Any]] = field(default_factory=list)


def best_attempt(endpoint: str, model: str, step: Step, engines: dict[int, str], opts: RunOptions,
                 budget: QuietBudget, warmup: bool, label: str, out: Replayed) -> Attempt:
    """Run ``step`` until an attempt is undisturbed (foreign CPU and host steal under their limits) or the budget
    is spent; the attempt that lost the fewest cores to both wins, the others go to ``out.discarded``."""
    best: Attempt | None = None
    while True:
        gate = wait_quiet(budget, opts.foreign_limit, opts.steal_limit)
        att = measure_step(endpoint, model, step, engines, opts, warmup and best is None)
        att.resources["quiet_gate"] = gate
        foreign, steal = att.resources["machine_other_cores"], att.resources["machine_steal_cores"]
        if best is None or lost_cores(att.resources) < lost_cores(best.resources):
            if best is not None:
                out.discarded.append(attempt_note(step.key, best))
            best = att
        else:
            out.discarded.append(attempt_note(step.key, att))
        s = att.result.steps[0].summary
        engine_cores = {k[7:]: v for k, v in att.resources["cpu_cores"].items() if k.startswith("engine ")}
        opts.say(f"[{label}] rate {fmt_key(step.key)}: attainment {s.attainment:.0%}, goodput "
                 f"{s.goodput_rps:.3f} req/s, TTFT p90 {fmt_ms(s.ttft.p90)} ms, TPOT p90 {fmt_ms(s.tpot.p90)} ms, "
                 f"engine cores {engine_cores}, not ours {foreign:.2f}, host steal {steal:.2f}")
        if not disturbed(att.resources, opts.foreign_limit, opts.steal_limit) or budget.retries_left <= 0:
            return best
        budget.retries_left -= 1
        opts.say(f"[{label}] rate {fmt_key(step.key)}: other processes used {foreign:.2f} cores, the host took "
                 f"{steal:.2f}; running the step again")


def replay_steps(endpoint: str, model: str, steps: Sequence[Step], engines: dict[int, str], opts: RunOptions,
                 budget: QuietBudget, label: str) -> Replayed:
    """Every step in order on one ready deployment; the first attempt of the first step warms up."""
    out = Replayed()
    for i, step in enumerate(steps):
        att = best_attempt(endpoint, model, step, engines, opts, budget, i == 0, label, out)
        out.resources[step.key] = att.resources
        out.records[step.key] = [asdict(r) for r in att.result.steps[0].records]
        if out.result is None:
            out.result = att.result
        else:
            out.result.steps += att.result.steps
            out.result.finished_at = att.result.finished_at
        out.summaries.append(att.result.steps[0].summary.to_dict())
    return out
