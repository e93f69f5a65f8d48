"""Router benchmark: policies side by side in the placement simulator, and the cost of one decision.

    python -m benchmarks.router [--cv 3 --rate 1.5 --n 600 --seed 0 --prefill 4 --decode 2
                                 --ttft-ms 3000 --tpot-ms 120 --profile PATH | --model M --hardware H
                                 --workers 64 --calls 3000 --decision-rate 50]

Part 1 simulates the same bursty trace (gamma arrivals, short chat prompts mixed with long documents)
on the same pools once per policy (benchmarks.router_sim.compare_policies) and prints SLO attainment and
goodput. Part 2 times `policy(req, prefill_stats, decode_stats)` in-process over `--workers` synthetic
workers (half prefill, half decode), with stats refreshed every 100 decisions as the ingress would.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import NamedTuple

from benchmarks.router_sim import (
    Pools,
    bursty_trace,
    compare_policies,
    format_sweep,
    format_table,
    sweep_rates,
)
from cluster.config import RouterConfig, SLOConfig
from cluster.router import RouteRequest, latency_from_config, make_policy
from engine.contract import WorkerStats
from placement.latency import LatencyModel


class DecisionTiming(NamedTuple):
    policy: str
    workers: int
    p50_us: float
    p99_us: float
    admitted: float  # share of the timed decisions that admitted the request


def synthetic_stats(n_prefill: int, n_decode: int, rng: random.Random, now: float, kv_capacity: int = 5760
                    ) -> tuple[list[WorkerStats], list[WorkerStats]]:
    """Busy but not saturated workers, eight per node, as the ingress would see them."""
    pre, dec = [], []
    for i in range(n_prefill):
        waiting = rng.randint(0, 4)
        pre.append(WorkerStats(f"p{i}", "prefill", f"node{i // 8}", waiting, rng.randint(0, 1),
                               queued_prompt_tokens=waiting * rng.randint(50, 400), running_context_tokens=0,
                               kv_usage=0.0, kv_capacity_tokens=kv_capacity, recent_step_times_s=(),
                               timestamp_s=now))
    for i in range(n_decode):
        run = rng.randint(0, 14)
        dec.append(WorkerStats(f"d{i}", "decode", f"node{i // 8}", rng.randint(0, 2), run,
                               queued_prompt_tokens=rng.randint(0, 400),
                               running_context_tokens=run * rng.randint(100, 400), kv_usage=rng.random() * 0.8,
                               kv_capacity_tokens=kv_capacity, recent_step_times_s=(0.06 + 0.004 * run,) * 8,
                               timestamp_s=now))
    return pre, dec


def time_decisions(name: str, latency: LatencyModel, slo: SLOConfig, workers: int = 64, calls: int = 3000,
                   seed: int = 0, rate_rps: float = 50.0) -> DecisionTiming:
    """p50/p99 microseconds of one routing decision over `workers` workers (half prefill, half decode),
    for requests with the benchmark trace's lengths arriving at `rate_rps` on a simulated clock; the
    stats refresh every 100 ms of that clock, as in the ingress."""
    rng = random.Random(seed)
    now = [0.0]
    policy = make_policy(name, router_cfg=RouterConfig(policy="goodput"), slo=slo, latency=latency,
                         clock=lambda: now[0])
    reqs = [RouteRequest(r.input_len, r.output_len, slo.ttft_ms / 1000, slo.tpot_ms / 1000, rng.randint(0, 200))
            for r in bursty_trace(calls, 1.0, seed=seed)]
    samples, admitted, refreshed = [], 0, -1.0
    clock = time.perf_counter_ns
    for req in reqs:
        now[0] += 1.0 / rate_rps
        if now[0] - refreshed >= 0.1:
            pre, dec = synthetic_stats(workers // 2, workers - workers // 2, rng, now[0], latency.kv_capacity_tokens())
            refreshed = now[0]
        t0 = clock()
        d = policy(req, pre, dec)
        samples.append(clock() - t0)
        admitted += d.admit
    samples.sort()
    p50, p99 = samples[len(samples) // 2] / 1e3, samples[int(len(samples) * 0.99)] / 1e3
    return DecisionTiming(name, workers, p50, p99, admitted / len(reqs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.router", description=__doc__.split("\n")[0])
    ap.add_argument("--cv", type=float, default=3.0, help="coefficient of variation of inter-arrival gaps")
    ap.add_argument("--rate", type=float, default=1.5, help="mean arrival rate, req/s")
    ap.add_argument("--n", type=int, default=600, help="requests in the trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-share", type=float, default=0.25, help="share of long (document) prompts")
    ap.add_argument("--prefill", type=int, default=4, help="prefill instances")
    ap.add_argument("--decode", type=int, default=2, help="decode instances")
    ap.add_argument("--ttft-ms", type=float, default=3000)
    ap.add_argument("--tpot-ms", type=float, default=120)
    ap.add_argument("--profile", default=None, help="latency profile YAML (default: the bundled CPU profile)")
    ap.add_argument("--model", default=None, help="catalog model for a roofline latency model instead (with --hardware)")
    ap.add_argument("--hardware", default=None, help="catalog accelerator, e.g. h100-sxm")
    ap.add_argument("--sweep", default=None, help="comma-separated rates: also print attainment per rate and "
                    "the highest rate with 90%% attainment, per policy (e.g. 0.5,1,1.5,2,2.5)")
    ap.add_argument("--workers", type=int, default=64, help="workers in the decision microbenchmark")
    ap.add_argument("--calls", type=int, default=3000, help="decisions timed per policy")
    ap.add_argument("--decision-rate", type=float, default=50.0,
                    help="requests/s reaching the router in the microbenchmark (stats refresh every 100 ms)")
    ap.add_argument("--out", help="also write the figures, with date, commit and machine, as JSON here")
    a = ap.parse_args(argv)
    from dataclasses import asdict, is_dataclass

    from benchmarks.compare.provenance import Provenance, write_artefact

    prov = Provenance.start(["python", "-m", "benchmarks.router"], sys.argv[1:] if argv is None else argv)
    for flag, v in (("--rate", a.rate), ("--cv", a.cv), ("--decision-rate", a.decision_rate)):
        if v <= 0:
            ap.error(f"{flag} must be > 0, got {v}")
    if a.n < 1 or a.prefill < 1 or a.decode < 1 or a.workers < 2:
        ap.error(f"need --n, --prefill, --decode >= 1 and --workers >= 2, got {a.n}, {a.prefill}, {a.decode}, "
                 f"{a.workers}")
    try:
        lat = latency_from_config(RouterConfig(latency_profile=a.profile, latency_model=a.model,
                                               latency_hardware=a.hardware))
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    slo = SLOConfig(ttft_ms=a.ttft_ms, tpot_ms=a.tpot_ms)
    trace = bursty_trace(a.n, a.rate, a.cv, a.seed, a.long_share)
    mean_in = sum(r.input_len for r in trace) / len(trace)
    print(f"trace: {a.n} requests, gamma arrivals {a.rate} req/s CV {a.cv}, seed {a.seed}, "
          f"{a.long_share:.0%} long prompts, mean prompt {mean_in:.0f} tokens")
    print(f"pools: {a.prefill} prefill + {a.decode} decode ({lat!r}); SLO TTFT {a.ttft_ms:.0f} ms, "
          f"TPOT {a.tpot_ms:.0f} ms")
    t0 = time.perf_counter()
    rows = compare_policies(trace, Pools(a.prefill, a.decode), lat, slo)
    print(format_table(rows))
    print(f"(goodput = requests meeting both targets per second of arrivals; simulated in "
          f"{time.perf_counter() - t0:.2f} s)\n")
    if a.sweep:
        try:
            rates = [float(x) for x in a.sweep.split(",")]
        except ValueError:
            ap.error(f"--sweep takes comma-separated numbers, got {a.sweep!r}")
        if min(rates) <= 0:
            ap.error(f"--sweep rates must be > 0, got {a.sweep!r}")
        sweep = sweep_rates(rates, Pools(a.prefill, a.decode), lat, slo, n=a.n, cv=a.cv, seed=a.seed)
        print(format_sweep(sweep) + "\n")
    print(f"one routing decision over {a.workers} workers ({a.workers // 2} prefill + "
          f"{a.workers - a.workers // 2} decode), {a.calls} calls at {a.decision_rate:g} req/s:")
    timings = {}
    for name in ("goodput", "least_loaded", "round_robin"):
        t = timings[name] = time_decisions(name, lat, slo, a.workers, a.calls, a.seed, a.decision_rate)
        print(f"  {name:<14} p50 {t.p50_us:7.1f} us   p99 {t.p99_us:7.1f} us   ({t.admitted:.0%} admitted)")
    print("  (p99: the first decision after a stats refresh rebuilds every worker's cached terms)")
    if a.out:
        plain = lambda x: asdict(x) if is_dataclass(x) else x._asdict() if hasattr(x, "_asdict") else x  # noqa: E731
        write_artefact(a.out, prov, {"settings": vars(a), "latency": repr(lat), "policies": [plain(r) for r in rows],
                                     "decision_timing": {k: plain(v) for k, v in timings.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
