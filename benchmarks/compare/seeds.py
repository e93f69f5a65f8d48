"""Several `benchmarks.compare` runs of one workload over arrival seeds and router modes, judged together:
`python -m benchmarks.compare.seeds benchmarks/results/goodput-*-seed*` prints, per rate, the requests each
deployment met (summed over seeds), and in how many seeds the `auto` router met at least as many as the
better of colocated (in its own run) and `always` (the same seed's run); and the lone-request TTFT of each
shape, the idle probes of all seeds pooled. One run of 30 requests moves by a
few requests between identical runs on a shared 2-core box; a goal judged on one seed is judged on noise.

Reads only the runs' report.json files; runs that differ in workload, SLO, rates or request count from the
first are an error, not averaged in."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

SAME = ("workload", "slo", "rates", "num_requests", "model", "policy")


class Run(NamedTuple):
    path: Path
    mode: str  # router.disaggregation of the disaggregated deployment: auto | always | never
    seed: int
    commit: str
    dirty: bool
    outcomes: dict[str, dict[str, dict[str, Any]]]  # deployment (colocated|disaggregated) -> rate -> counts
    report: dict[str, Any]


def load(paths: Sequence[Path]) -> list[Run]:
    runs = []
    for p in paths:
        f = p / "report.json" if p.is_dir() else p
        if not f.is_file():
            raise SystemExit(f"error: {f} not found: give the --out directories of benchmarks.compare runs")
        r = json.loads(f.read_text())
        if r.get("failure"):
            raise SystemExit(f"error: {f} is a failed run ({r['failure']}); re-run it or leave it out")
        runs.append(Run(f.parent, r["disaggregation"], int(r["seed"]), r["git"]["commit"], bool(r["git"]["dirty"]),
                        r["outcomes"], r))
    if not runs:
        raise SystemExit("error: no runs given")
    first = runs[0]
    for run in runs[1:]:
        for k in SAME:
            if run.report.get(k) != first.report.get(k):
                raise SystemExit(f"error: {run.path} differs from {first.path} in {k!r} "
                                 f"({run.report.get(k)!r} vs {first.report.get(k)!r}); compare like with like")
    return runs


def _count(run: Run, deployment: str, rate: str, key: str = "met") -> int:
    return int(run.outcomes[deployment][rate][key])


def summarise(runs: Sequence[Run]) -> dict[str, Any]:
    """Per rate: met summed over the seeds that have both an `auto` and an `always` run, and the seeds where
    auto >= max(colocated in auto's run, always)."""
    by = {(r.mode, r.seed): r for r in runs}
    seeds = sorted({r.seed for r in runs if ("auto", r.seed) in by and ("always", r.seed) in by})
    rates = [str(float(x)) for x in runs[0].report["rates"]]  # NOTE: the keys of `outcomes`
    rows = []
    for rate in rates:
        auto = [_count(by[("auto", s)], "disaggregated", rate) for s in seeds]
        always = [_count(by[("always", s)], "disaggregated", rate) for s in seeds]
        colo_a = [_count(by[("auto", s)], "colocated", rate) for s in seeds]
        colo_b = [_count(by[("always", s)], "colocated", rate) for s in seeds]
        late = [_count(by[("auto", s)], "disaggregated", rate, "late") for s in seeds]
        late_always = [_count(by[("always", s)], "disaggregated", rate, "late") for s in seeds]
        wins = [s for s, a, b, c in zip(seeds, auto, always, colo_a, strict=True) if a >= max(b, c)]
        rows.append({"rate": float(rate), "seeds": seeds, "auto": auto, "always": always,
                     "colocated_in_auto_runs": colo_a, "colocated_in_always_runs": colo_b,
                     "auto_late": late, "always_late": late_always, "auto_at_least_both": wins})
    return {"runs": [{"path": str(r.path), "mode": r.mode, "seed": r.seed, "commit": r.commit, "dirty": r.dirty}
                     for r in runs], "rows": rows, "lone": lone_requests(runs), "steal": host_steal(runs)}


def host_steal(runs: Sequence[Run]) -> dict[str, Any] | None:
    """The cores the hypervisor gave other guests during the runs' steps (median and max over every step of
    both deployments): how much slower than itself a shared VM ran. None for runs that did not record it."""
    vals = [res["machine_steal_cores"] for r in runs for by_rate in (r.report.get("resources") or {}).values()
            for res in by_rate.values() if res.get("machine_steal_cores") is not None]
    if not vals:
        return None
    return {"steps": len(vals), "median_cores": round(statistics.median(vals), 3), "max_cores": round(max(vals), 3)}


def _probe(run: Run, deployment: str) -> list[float]:
    return list(((run.report.get("modes") or {}).get(deployment, {}).get("idle_probe") or {}).get("ttft_s") or [])


def lone_requests(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per router mode: the idle probe's TTFTs (sequential lone requests before the sweep) of every seed pooled,
    the disaggregated deployment's median against the colocated one's in the same runs. A median of a
    handful moves with one slow request on a shared box; the pooled one is the judge."""
    out = []
    for mode in sorted({r.mode for r in runs}):
        colo = [t for r in runs if r.mode == mode for t in _probe(r, "colocated")]
        dis = [t for r in runs if r.mode == mode for t in _probe(r, "disaggregated")]
        if not colo or not dis:
            continue
        c, d = statistics.median(colo), statistics.median(dis)
        out.append({"mode": mode, "requests": [len(colo), len(dis)], "colocated_ttft_p50_s": round(c, 4),
                    "disaggregated_ttft_p50_s": round(d, 4), "ratio": round(d / c, 3)})
    return out


def markdown(summary: dict[str, Any], n: int) -> str:
    head = ("| rate req/s | met of " + f"{n} x {len(summary['rows'][0]['seeds'])}: `auto` | `always` | colocated "
            "(`auto` runs) | colocated (`always` runs) | served late: `auto` / `always` | seeds where `auto` >= "
            "both |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in summary["rows"]:
        k = len(r["seeds"])
        lines.append(f"| {r['rate']:g} | **{sum(r['auto'])}** ({', '.join(map(str, r['auto']))}) | {sum(r['always'])} "
                     f"({', '.join(map(str, r['always']))}) | {sum(r['colocated_in_auto_runs'])} "
                     f"({', '.join(map(str, r['colocated_in_auto_runs']))}) | {sum(r['colocated_in_always_runs'])} "
                     f"({', '.join(map(str, r['colocated_in_always_runs']))}) | {sum(r['auto_late'])} / "
                     f"{sum(r['always_late'])} | {len(r['auto_at_least_both'])} of {k} |")
    for x in summary.get("lone") or []:
        lines.append(f"\nLone requests (idle probe, all seeds pooled), `{x['mode']}` runs: TTFT p50 disaggregated "
                     f"{x['disaggregated_ttft_p50_s']:.3f} s ({x['requests'][1]} requests) vs colocated "
                     f"{x['colocated_ttft_p50_s']:.3f} s ({x['requests'][0]}): {x['ratio']:.3f}x")
    st = summary.get("steal")
    if st:
        lines.append(f"\nHost steal (cores the hypervisor gave other guests) over the {st['steps']} steps: median "
                     f"{st['median_cores']:.2f}, max {st['max_cores']:.2f}")
    return "\n".join(lines)


STEP_HEAD = ("| router mode, arrival seed | rate req/s | met both targets (of {n}): colocated / disaggregated | served "
             "late: colo / disagg. | refused 429: colo / disagg. (send -> 429 p50 / max ms) | TTFT p50 / p99 s "
             "(disagg.) | ITL p50 / p99 ms (disagg.) | TPOT p50 / p99 ms (disagg.) | $/M tokens colo / disagg. | "
             "router TTFT p50 / p90 predicted/measured | router TPOT p50 / p90 | router per request ln error mean / "
             "sd: TTFT; TPOT |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def _router(run: Run, rate: float) -> dict[str, Any]:
    for row in (run.report.get("router") or {}).get("rows") or []:
        if row["mode"] == "disaggregated" and float(row["rate"]) == rate:
            return row
    return {}


def _pair(x: Any, y: Any, fmt: str, fmt_y: str | None = None) -> str:
    return " / ".join("-" if v is None else format(v, f) for v, f in ((x, fmt), (y, fmt_y or fmt)))


def step_rows(runs: Sequence[Run]) -> str:
    """One markdown row per run and rate (`auto` runs first, then by seed): what admission made of the
    requests in both deployments, the disaggregated one's latency, cost and the router's prediction error."""
    order = {"auto": 0, "always": 1, "never": 2}
    lines = [STEP_HEAD.format(n=runs[0].report["num_requests"])]
    for run in sorted(runs, key=lambda r: (order.get(r.mode, 3), r.seed)):
        for row in run.report["rows"]:
            rate = float(row["rate"])
            c, d = run.outcomes["colocated"][str(rate)], run.outcomes["disaggregated"][str(rate)]
            m = row["disaggregated"]
            refused = f"{c['refused']} / {d['refused']}"
            if d["refused"]:
                refused += f" ({d['refusal_p50_s'] * 1e3:.0f} / {d['refusal_max_s'] * 1e3:.0f})"
            rt = _router(run, rate)
            t, o = rt.get("ttft") or {}, rt.get("tpot") or {}
            lines.append(
                f"| `{run.mode}`, seed {run.seed} | {rate:g} | {c['met']} / **{d['met']}** | {c['late']} / {d['late']} | "
                f"{refused} | {_pair(m['ttft_p50'], m['ttft_p99'], '.2f')} | "
                f"{_pair(m['itl_p50'] * 1e3, m['itl_p99'] * 1e3, '.0f')} | "
                f"{_pair(m['tpot_p50'] * 1e3, m['tpot_p99'] * 1e3, '.0f')} | "
                f"{_pair(c['dollars_per_m_tokens'], d['dollars_per_m_tokens'], '.2f')} | "
                f"{_pair(t.get('p50_ratio'), t.get('p90_ratio'), '.2f')} | {_pair(o.get('p50_ratio'), o.get('p90_ratio'), '.2f')} | "
                f"{_pair(t.get('log_error_mean'), t.get('log_error_sd'), '+.2f', '.2f')}; "
                f"{_pair(o.get('log_error_mean'), o.get('log_error_sd'), '+.2f', '.2f')} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare.seeds", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="--out directories (or report.json files) of compare runs")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON instead of a markdown table")
    ap.add_argument("--steps", action="store_true", help="also print one markdown row per run and rate (the "
                                                         "README's per-step tables)")
    a = ap.parse_args(argv)
    runs = load(a.runs)
    s = summarise(runs)
    if not s["rows"] or not s["rows"][0]["seeds"]:
        print("error: no seed has both an `auto` and an `always` run", file=sys.stderr)
        return 2
    print(json.dumps(s, indent=1) if a.json else markdown(s, int(runs[0].report["num_requests"])))
    if a.steps:
        print("\n" + step_rows(runs))
    commits = sorted({(r.commit[:7], r.dirty) for r in runs})
    print(f"\nruns: {len(runs)}; commits: {', '.join(c + (' (dirty)' if d else '') for c, d in commits)}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
