"""Simulated study: pools fixed for the peak, fixed for the mean, and the planner loop, over one day.

The day (placement.workload.day_periods): a cosine from night to an afternoon peak, three bursts, and a
shift from chat to long documents. The served system is the planner's latency model slowed by
`truth_factor` (the model is never exact; the loop's online correction has to find the difference, the
fixed plans never do). Each period is simulated by `sample_s` seconds of its traffic at its rate (the
steady state of that period; a backlog does not carry from one period into the next) and its counts are
scaled to the period's length. The loop decides at the end of period k from what period k showed
(measured TTFT/TPOT, lengths, rate) and its sizes serve period k+1 (a period is longer than an engine's
start-up). Fixed-for-the-peak takes, per pool, the most any period needs (an oracle that knows the
whole day); fixed-for-the-mean sizes for the day's mean rate and its overall mix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from placement.catalog import get_hardware, get_model
from placement.config import SLOSpec
from placement.latency import LatencyModel
from placement.replan import LoopSettings, Replanner, Sizes, TrafficWindow
from placement.simulator import simulate_disaggregated
from placement.workload import Period, Request, day_periods, period_requests


def window_of(p: Period, reqs: list[Request], records: list[Any]) -> TrafficWindow:
    """What an ingress would have reported for this period: every arrival, finished requests' latencies."""
    done = [r for r in records if not r.rejected]
    return TrafficWindow(p.start_s, p.start_s + p.length_s, round(p.rate_rps * p.length_s),
                         tuple(r.input_len for r in reqs[:400]), tuple(r.output_len for r in done[:400]),
                         tuple(r.ttft_s for r in done[:400]), tuple(r.tpot_s for r in done[:400] if r.output_len > 1))


def run_study(*, model: str = "llama-3.1-8b", hardware: str = "h100-sxm", slo: SLOSpec | None = None,
              periods: list[Period] | None = None, sample_s: float = 120.0, truth_factor: float = 1.25,
              max_pool: int = 16, seed: int = 0, gpu_hour_usd: float = 2.0) -> dict[str, Any]:
    slo = slo or SLOSpec(ttft_s=1.5, tpot_s=0.05, attainment=0.9)
    periods = periods or day_periods()
    model_lat = LatencyModel.from_catalog(get_model(model), get_hardware(hardware), tp=1)
    truth = model_lat.scaled(truth_factor, truth_factor)
    settings = LoopSettings(max=Sizes(max_pool, max_pool), cooldown_s=2 * periods[0].length_s, down_after=2)
    rng = np.random.default_rng(seed)
    samples = [period_requests(p, sample_s, rng) for p in periods]

    def planner() -> Replanner:
        return Replanner(model_lat, model_lat, slo, settings, seed=seed)

    def needs(p: Period, reqs: list[Request]) -> Sizes:
        rp = planner()
        rp._windows.append(window_of(p, reqs, []))
        return rp.size(rp._workload(p.rate_rps), p.rate_rps)

    # the two fixed plans (the deploy-time planner's model: no correction)
    per_period = [needs(p, r) for p, r in zip(periods, samples, strict=True)]
    peak = Sizes(max(s.prefill for s in per_period), max(s.decode for s in per_period))
    mean_rate = float(np.mean([p.rate_rps for p in periods]))
    all_reqs = [r for rs in samples for r in rs]
    pooled = Period(0.0, periods[0].length_s, mean_rate, float(np.mean([p.doc_share for p in periods])))
    mean_sizes = needs(pooled, all_reqs[:: max(1, len(all_reqs) // 2000)])

    def serve(sizes: Sizes, p: Period, reqs: list[Request]) -> tuple[dict[str, Any], Any]:
        res = simulate_disaggregated(truth, truth, sizes.prefill, sizes.decode, reqs)
        scale = p.length_s / sample_s
        met = res.attainment(slo.ttft_s, slo.tpot_s)
        return {"start_h": round(p.start_s / 3600, 2), "rate_rps": round(p.rate_rps, 3),
                "doc_share": round(p.doc_share, 3), "prefill": sizes.prefill, "decode": sizes.decode,
                "attainment": round(met, 4), "requests": round(len(reqs) * scale),
                "served_in_slo": round(met * len(reqs) * scale),
                "gpu_hours": round((sizes.prefill + sizes.decode) * model_lat.gpus * p.length_s / 3600, 3)}, res

    out: dict[str, Any] = {"strategies": {}}
    for name, sizes in (("fixed_peak", peak), ("fixed_mean", mean_sizes)):
        out["strategies"][name] = {"periods": [serve(sizes, p, r)[0] for p, r in zip(periods, samples, strict=True)]}

    rp = planner()
    cur = per_period[0]  # the deploy-time plan for the first period's traffic
    rows, decisions = [], []
    for p, reqs in zip(periods, samples, strict=True):
        row, res = serve(cur, p, reqs)
        rows.append(row)
        d = rp.step(window_of(p, reqs, res.records), cur)
        decisions.append(d.as_dict())
        cur = d.target
    errs = [d["forecast_error"] for d in decisions if d["forecast_error"] is not None]
    out["strategies"]["planner_loop"] = {"periods": rows, "decisions": decisions,
                                        "forecast_mape": round(100 * float(np.mean(errs)), 1) if errs else None,
                                        "scale_changes": sum(a["prefill"] != b["prefill"] or a["decode"] != b["decode"]
                                                             for a, b in zip(rows, rows[1:], strict=False))}
    for st in out["strategies"].values():
        ps = st["periods"]
        req = sum(r["requests"] for r in ps)
        ok = sum(r["served_in_slo"] for r in ps)
        gh = sum(r["gpu_hours"] for r in ps)
        st["summary"] = {"requests": req, "served_in_slo": ok, "attainment": round(ok / req, 4) if req else None,
                         "goodput_rps": round(ok / sum(p.length_s for p in periods), 3),
                         "gpu_hours": round(gh, 2), "in_slo_per_gpu_hour": round(ok / gh, 1) if gh else None,
                         "usd": round(gh * gpu_hour_usd, 2),
                         "periods_below_target": sum(r["attainment"] < slo.attainment for r in ps)}
    out["setup"] = {"model": model, "hardware": hardware, "slo": slo.model_dump(), "periods": len(periods),
                    "period_s": periods[0].length_s, "sample_s": sample_s, "truth_factor": truth_factor,
                    "max_pool": max_pool, "seed": seed, "gpu_hour_usd": gpu_hour_usd,
                    "fixed_peak": peak._asdict(), "fixed_mean": mean_sizes._asdict(),
                    "loop_settings": {"down_after": settings.down_after, "cooldown_s": settings.cooldown_s}}
    return out


def write_study(result: dict[str, Any], out_dir: str | Path, provenance: dict[str, str]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"provenance": provenance, **result}
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out / "results.json")
    _plot(result, out / "day.png")
    lines = ["# Planner loop study: fixed for the peak, fixed for the mean, the loop (simulated)", ""]
    for k in ("date", "git_commit", "cpu", "command"):
        lines.append(f"- {k.replace('_', ' ')}: `{provenance.get(k)}`" if k == "command" else f"- {k.replace('_', ' ')}: {provenance.get(k)}")
    s = result["setup"]
    lines += ["", f"{s['model']} on {s['hardware']} (catalog roofline, 1 GPU per engine); SLO TTFT {s['slo']['ttft_s']} s, "
              f"TPOT {s['slo']['tpot_s'] * 1000:.0f} ms, attainment {s['slo']['attainment']}; {s['periods']} periods of "
              f"{s['period_s'] / 60:.0f} min, each simulated by {s['sample_s']:.0f} s of its traffic; the served system "
              f"is the model x{s['truth_factor']} (see placement/replan_study.py); ${s['gpu_hour_usd']}/GPU-hour.", "",
              "| strategy | pools | attainment | served in SLO | goodput req/s | GPU-hours | in SLO per GPU-hour | $ | periods below target |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, st in result["strategies"].items():
        m = st["summary"]
        pools = (f"{s['fixed_peak']['prefill']}P+{s['fixed_peak']['decode']}D" if name == "fixed_peak" else
                 f"{s['fixed_mean']['prefill']}P+{s['fixed_mean']['decode']}D" if name == "fixed_mean" else
                 f"{min(r['prefill'] for r in st['periods'])}-{max(r['prefill'] for r in st['periods'])}P + "
                 f"{min(r['decode'] for r in st['periods'])}-{max(r['decode'] for r in st['periods'])}D")
        lines.append(f"| {name} | {pools} | {m['attainment']:.3f} | {m['served_in_slo']} of {m['requests']} | "
                     f"{m['goodput_rps']} | {m['gpu_hours']} | {m['in_slo_per_gpu_hour']} | {m['usd']} | "
                     f"{m['periods_below_target']} |")
    loop = result["strategies"]["planner_loop"]
    lines += ["", f"The loop's own forecast error (next period's rate, mean |forecast - observed| / observed): "
              f"{loop['forecast_mape']}%; pool changes over the day: {loop['scale_changes']}. Per-period rows and "
              "every decision (with its reason and corrections) are in results.json; `day.png` plots rate and pools.", ""]
    (out / "README.md").write_text("\n".join(lines))
    return out


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    loop = result["strategies"]["planner_loop"]["periods"]
    hours = [r["start_h"] for r in loop]
    a1.plot(hours, [r["rate_rps"] for r in loop], label="arrival rate (req/s)")
    a1b = a1.twinx()
    a1b.plot(hours, [r["doc_share"] for r in loop], "k:", label="document share")
    a1.set_ylabel("req/s")
    a1b.set_ylabel("document share")
    a1.legend(loc="upper left")
    for name, style in (("fixed_peak", "--"), ("fixed_mean", "-."), ("planner_loop", "-")):
        ps = result["strategies"][name]["periods"]
        a2.step(hours, [r["prefill"] + r["decode"] for r in ps], style, where="post",
                label=f"{name} GPUs (attainment {result['strategies'][name]['summary']['attainment']:.2f})")
    a2.set_xlabel("hour of day")
    a2.set_ylabel("GPUs (prefill + decode)")
    a2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)


def main_study(out_dir: str, command: str, **kw: Any) -> dict[str, Any]:
    from placement.validation_report import provenance

    res = run_study(**kw)
    prov = provenance(command, source="simulated (placement/replan_study.py)", paths=("placement", "cluster"))
    write_study(res, out_dir, prov)
    return res
