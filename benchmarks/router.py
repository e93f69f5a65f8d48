"""Router benchmark: policies side by side in the placement simulator, and the cost of one decision.

    python -m benchmarks.router [--cv 3 --rate 1.5 --n 600 --seed 0 --prefill 4 --decode 2
                                 --ttft-ms 3000 --tpot-ms 120 --profile PATH --workers 64 --calls 3000]

Part 1 simulates the same bursty trace (gamma arrivals, short chat prompts mixed with long documents)
on the same pools once per policy (cluster.router_sim.compare_policies) and prints SLO attainment and
goodput. Part 2 times `policy(req, prefill_stats, decode_stats)` in-process over `--workers` synthetic
workers (half prefill, half decode), with stats refreshed every 100 decisions as the ingress would.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import NamedTuple

from cluster.config import RouterConfig, SLOConfig
from cluster.router import RouteRequest, latency_from_config, make_policy
from cluster.router_sim import Pools, bursty_trace, compare_policies, format_table
from engine.stats import WorkerStats
from placement.latency import LatencyModel


class DecisionTiming(NamedTuple):
    policy: str
    workers: int
    p50_us: float
    p99_us: float


def synthetic_stats(n_prefill: int, n_decode: int, rng: random.Random, now: float
                    ) -> tuple[list[WorkerStats], list[WorkerStats]]:
    """Busy but not saturated workers, eight per node, as the ingress would see them."""
    pre, dec = [], []
    for i in range(n_prefill):
        waiting = rng.randint(0, 6)
        pre.append(WorkerStats(f"p{i}", "prefill", f"node{i // 8}", waiting, rng.randint(0, 2),
                               queued_prompt_tokens=waiting * rng.randint(50, 600), running_context_tokens=0,
                               kv_usage=0.0, kv_capacity_tokens=5760, recent_step_times_s=(), timestamp_s=now))
    for i in range(n_decode):
        run = rng.randint(0, 14)
        dec.append(WorkerStats(f"d{i}", "decode", f"node{i // 8}", rng.randint(0, 2), run,
                               queued_prompt_tokens=rng.randint(0, 400), running_context_tokens=run * rng.randint(100, 400),
                               kv_usage=rng.random() * 0.8, kv_capacity_tokens=5760,
                               recent_step_times_s=tuple(0.06 + 0.004 * run for _ in range(8)), timestamp_s=now))
    return pre, dec


def time_decisions(name: str, latency: LatencyModel, workers: int = 64, calls: int = 3000,
                   seed: int = 0) -> DecisionTiming:
    """p50/p99 microseconds of one routing decision over `workers` workers (half prefill, half decode)."""
    rng = random.Random(seed)
    policy = make_policy(name, router_cfg=RouterConfig(policy="goodput"), slo=SLOConfig(), latency=latency)
    reqs = [RouteRequest(rng.randint(16, 1500), rng.randint(1, 256), 2.0, 0.2, rng.randint(0, 200))
            for _ in range(calls)]
    samples = []
    pre, dec = synthetic_stats(workers // 2, workers - workers // 2, rng, time.time())
    clock = time.perf_counter_ns
    for k, req in enumerate(reqs):
        if k % 100 == 0:
            pre, dec = synthetic_stats(workers // 2, workers - workers // 2, rng, time.time())
        t0 = clock()
        policy(req, pre, dec)
        samples.append(clock() - t0)
    samples.sort()
    return DecisionTiming(name, workers, samples[len(samples) // 2] / 1e3, samples[int(len(samples) * 0.99)] / 1e3)


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
    ap.add_argument("--workers", type=int, default=64, help="workers in the decision microbenchmark")
    ap.add_argument("--calls", type=int, default=3000, help="decisions timed per policy")
    a = ap.parse_args(argv)
    for flag, v in (("--rate", a.rate), ("--cv", a.cv)):
        if v <= 0:
            ap.error(f"{flag} must be > 0, got {v}")
    if a.n < 1 or a.prefill < 1 or a.decode < 1 or a.workers < 2:
        ap.error(f"need --n, --prefill, --decode >= 1 and --workers >= 2, got {a.n}, {a.prefill}, {a.decode}, "
                 f"{a.workers}")
    lat = latency_from_config(RouterConfig(latency_profile=a.profile))
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
    print(f"one routing decision over {a.workers} workers ({a.workers // 2} prefill + "
          f"{a.workers - a.workers // 2} decode), {a.calls} calls:")
    for name in ("goodput", "least_loaded", "round_robin"):
        t = time_decisions(name, lat, a.workers, a.calls, a.seed)
        print(f"  {name:<14} p50 {t.p50_us:7.1f} us   p99 {t.p99_us:7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
