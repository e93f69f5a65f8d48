"""Planner benchmark: wall time of `make_plan` for 8, 64 and 512 GPUs (1, 8, 64 nodes of 8 x H100),
Llama-3.1-8B chat traffic scaled with the cluster. Run: `python -m placement.bench [--out FILE.json]` (the JSON
holds the rows with the date, commit, CPU model and command)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from placement.config import parse_planner_config
from placement.planner import make_plan
from placement.validation_report import provenance

logger = logging.getLogger(__name__)


def bench_config(nodes: int, rate_per_gpu: float = 2.0) -> dict[str, object]:
    return {
        "model": {"name": "llama-3.1-8b", "weight_dtype": "bf16", "kv_dtype": "bf16"},
        "hardware": {"name": "h100-sxm"},
        "cluster": {"nodes": nodes, "gpus_per_node": 8},
        "workload": {"rate_rps": rate_per_gpu * nodes * 8, "arrival": "poisson",
                     "input": {"kind": "lognormal", "mean": 1500, "sd": 1200, "min": 16, "max": 16000},
                     "output": {"kind": "lognormal", "mean": 300, "sd": 250, "min": 1, "max": 4000}},
        "slo": {"ttft_s": 0.5, "tpot_s": 0.04, "attainment": 0.9},
    }


def run(node_counts: list[int]) -> list[tuple[int, float, str]]:
    rows = []
    for nodes in node_counts:
        cfg = parse_planner_config(bench_config(nodes), f"bench-{nodes}")
        t0 = time.perf_counter()
        plan = make_plan(cfg)
        dt = time.perf_counter() - t0
        p, d = plan.prefill, plan.decode
        rows.append((nodes * 8, dt, f"{p.instances}xTP{p.tp}PP{p.pp} prefill + {d.instances}xTP{d.tp}PP{d.pp} "
                                    f"decode = {plan.gpus} GPUs, goodput {plan.goodput_rps:.1f} req/s, "
                                    f"attainment {plan.attainment:.1%}"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="1,8,64", help="comma-separated node counts (8 GPUs each)")
    ap.add_argument("--out", default=None, help="also write the rows and their provenance to this JSON file")
    args = ap.parse_args()
    rows = run([int(x) for x in args.nodes.split(",")])
    for gpus, secs, summary in rows:
        print(f"{gpus:>4} GPUs: plan in {secs:6.2f} s  ({summary})")  # noqa: T201 - benchmark output
    if args.out:
        doc = {**provenance("python -m placement.bench " + " ".join(sys.argv[1:]), source="placement.bench"),
               "rows": [{"gpus": g, "plan_s": round(t, 3), "plan": s} for g, t, s in rows]}
        tmp = f"{args.out}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, args.out)  # NOTE: whole or not at all


if __name__ == "__main__":
    main()
