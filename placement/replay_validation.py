"""DistServe's measured OPT-13B runs replayed (`python -m placement replay-validate`): every run's requests
simulated on the shape it ran on, predicted beside measured, per run and per series.

    python -m placement replay-validate --ref ../shared/reference/distserve-opt13b \\
        --config manifests/plan-distserve-opt13b.yaml --out benchmarks/results/prediction-validation/distserve-replay \\
        --plan manifests/plan-distserve-opt13b.yaml --plan manifests/plan-distserve-opt66b.yaml

Shapes from the file names: `vllm-N-R` is one colocated vLLM engine at TP1 (the 2024 vLLM: no chunked prefill,
so a prefill batch stalls the running decodes; backend `none`, a 2,048-token prefill budget);
`distserve-cXYdZW-N-R` one prefill instance at TP X / PP Y and one decode instance at TP Z / PP W. Nothing is
fitted here, so every run is held out: the disaggregated runs use the config's `latency` (DistServe's own
engine's TP1 coefficients, other TPs derived), the colocated ones its `colocated_latency` (vLLM's, as DistServe
profiled it) where given. With `--plan`, `plan`'s verdict on each config too. Writes results.json and README.md
(whole, or not at all).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from placement.config import load_planner_config
from placement.errors import PlacementError
from placement.planner import make_plan
from placement.replay import replay
from placement.trace import load_trace_file
from placement.validation_report import provenance

NAME = re.compile(r"^(?P<sys>vllm|distserve-c(?P<ptp>\d)(?P<ppp>\d)d(?P<dtp>\d)(?P<dpp>\d))-(?P<n>\d+)-(?P<rate>[\d.]+)$")
COLOCATED_BUDGET = 2048  # NOTE: vLLM 0.2's max_num_batched_tokens for OPT's 2,048-token context (an assumption)


def _shape(stem: str) -> dict[str, Any]:
    m = NAME.match(stem)
    if m is None:
        raise PlacementError(f"{stem}: not a DistServe run name (vllm-N-R or distserve-cXYdZW-N-R)")
    if m["sys"] == "vllm":
        return {"series": "colocated", "mode": "colocated", "tp": 1, "gpus": 1, "rate": float(m["rate"])}
    ptp, ppp, dtp, dpp = (int(m[k]) for k in ("ptp", "ppp", "dtp", "dpp"))
    name = f"P TP{ptp}{f' PP{ppp}' if ppp > 1 else ''} + D TP{dtp}{f' PP{dpp}' if dpp > 1 else ''}"
    return {"series": name, "mode": "disaggregated", "prefill_tp": ptp, "prefill_pp": ppp, "decode_tp": dtp,
            "decode_pp": dpp, "gpus": ptp * ppp + dtp * dpp, "rate": float(m["rate"])}


def _ape(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas * 100 if meas > 0 else 0.0


def rate_at(rates: list[float], attain: list[float], goal: float = 0.9) -> float | None:
    """The highest rate holding `goal` attainment, linearly between the runs around the first miss."""
    pts = sorted(zip(rates, attain, strict=True))
    if not pts or pts[0][1] < goal:
        return None
    for (r0, a0), (r1, a1) in zip(pts, pts[1:], strict=False):
        if a1 < goal:
            return r0 + (r1 - r0) * (a0 - goal) / (a0 - a1)
    return pts[-1][0]


def run(ref: str | Path, config: str | Path) -> dict[str, Any]:
    pc = load_planner_config(config)
    rows = []
    for path in sorted(Path(ref).glob("*.exp")):
        shape = _shape(path.stem)
        kw = {"tp": shape["tp"]} if shape["mode"] == "colocated" else {
            k: shape[k] for k in ("prefill_tp", "prefill_pp", "decode_tp", "decode_pp")}
        out = replay(load_trace_file(path), model=pc.model.name, hardware=str(pc.hardware.name),
                     weight_dtype=pc.model.weight_dtype, kv_dtype=pc.model.kv_dtype, mode=shape["mode"],
                     latency=pc.engine_latency(shape["mode"] == "colocated"),
                     backend="none", ttft_slo_s=pc.slo.ttft_s, tpot_slo_s=pc.slo.tpot_s,
                     max_prefill_tokens=COLOCATED_BUDGET if shape["mode"] == "colocated" else None, **kw)
        p, m = out["predicted"], out["measured"]
        rows.append({"run": path.stem, **shape, "requests": out["requests"],
                     **{f"{k}_{q}_{side}": round(f[k][q], 4) for side, f in (("meas", m), ("pred", p))
                        for k in ("ttft_s", "tpot_s") for q in ("p50", "p90")},
                     "attain_meas": round(m["attainment"], 3), "attain_pred": round(p["attainment"], 3)})
    series: dict[str, Any] = {}
    for name in dict.fromkeys(r["series"] for r in rows):
        rs = [r for r in rows if r["series"] == name]
        mape = {f"{k}_{q}": round(float(np.mean([_ape(r[f"{k}_{q}_pred"], r[f"{k}_{q}_meas"]) for r in rs])), 1)
                for k in ("ttft_s", "tpot_s") for q in ("p50", "p90")}
        gpus = rs[0]["gpus"]
        meas_rate = rate_at([r["rate"] for r in rs], [r["attain_meas"] for r in rs])
        pred_rate = rate_at([r["rate"] for r in rs], [r["attain_pred"] for r in rs])
        lowest = min(r["rate"] for r in rs)
        series[name] = {"runs": len(rs), "gpus": gpus, "mape_pct": mape, "lowest_rate": lowest,
                        "attain_max_miss_points": round(max(abs(r["attain_pred"] - r["attain_meas"]) for r in rs) * 100, 1),
                        "rate_90_meas": meas_rate, "rate_90_pred": pred_rate,
                        "per_gpu_meas": meas_rate / gpus if meas_rate else None,
                        "per_gpu_pred": pred_rate / gpus if pred_rate else None}
    ratio: dict[str, str] = {}
    dis = [s for n, s in series.items() if n != "colocated"]
    if "colocated" in series and dis:
        c = series["colocated"]
        for side in ("meas", "pred"):  # NOTE: the best disaggregated shape per GPU, on each side
            d = max(dis, key=lambda x, k=f"per_gpu_{side}": x[k] or 0.0)
            if d[f"per_gpu_{side}"] and c[f"per_gpu_{side}"]:
                ratio[side] = f"{d[f'per_gpu_{side}'] / c[f'per_gpu_{side}']:.2f}"
            elif d[f"per_gpu_{side}"]:  # NOTE: colocated missed 90% already at its lowest measured rate
                ratio[side] = f"> {d[f'per_gpu_{side}'] / (c['lowest_rate'] / c['gpus']):.2f}"
    return {"rows": rows, "series": series, "disaggregated_per_gpu_over_colocated": ratio}


def verdicts(configs: list[str | Path]) -> list[dict[str, Any]]:
    """`plan` on each config: its disaggregated/colocated per-GPU ratio against both colocated engines, with the
    colocated engine's own coefficients (colocated_latency) and, for comparison, with the pools' (the ideal
    engine the planner used before)."""
    out = []
    for path in configs:
        cfg = load_planner_config(path)
        row: dict[str, Any] = {"config": str(path), "model": cfg.model.name}
        for key, c in (("own", cfg), ("pools", cfg.model_copy(update={"colocated_latency": None}))):
            if key == "own" and cfg.colocated_latency is None:
                continue
            plan = make_plan(c)
            row[key] = {("chunked" if b.chunked_prefill else "no_chunked"): round(plan.ratio_to(b), 2)
                        for b in (plan.colocated, plan.colocated_alt) if b is not None}
            row["disaggregated_per_gpu"] = round(plan.goodput_per_gpu, 3)
        out.append(row)
    return out


def markdown(rep: dict[str, Any]) -> str:
    prov = rep["provenance"]
    out = ["# DistServe's measured OPT-13B runs, replayed", "",
           f"`{prov['command']}` ({prov['date']}, {prov['git_commit'][:12]}, {prov['cpu']}). Nothing fitted on "
           "these runs: every one is held out. SLO TTFT 0.25 s / TPOT 0.1 s; times in ms, measured / predicted.", "",
           "| run | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | attainment |", "|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        cells = [f"{r[f'{k}_meas'] * 1e3:.0f} / {r[f'{k}_pred'] * 1e3:.0f}" for k in
                 ("ttft_s_p50", "ttft_s_p90", "tpot_s_p50", "tpot_s_p90")]
        out.append(f"| {r['run']} | " + " | ".join(cells) + f" | {r['attain_meas']:.3f} / {r['attain_pred']:.3f} |")
    out += ["", "| series | runs | MAPE TTFT p50 / p90 | MAPE TPOT p50 / p90 | worst attainment miss | rate at 90%, "
            "measured / predicted | per GPU |", "|---|---|---|---|---|---|---|"]

    for name, s in rep["series"].items():
        def f(x: float | None, below: float) -> str:
            return f"< {below:.2f}" if x is None else f"{x:.2f}"

        m, lo = s["mape_pct"], s["lowest_rate"]
        out.append(f"| {name} | {s['runs']} | {m['ttft_s_p50']}% / {m['ttft_s_p90']}% | {m['tpot_s_p50']}% / "
                   f"{m['tpot_s_p90']}% | {s['attain_max_miss_points']} points | {f(s['rate_90_meas'], lo)} / "
                   f"{f(s['rate_90_pred'], lo)} req/s | {f(s['per_gpu_meas'], lo / s['gpus'])} / "
                   f"{f(s['per_gpu_pred'], lo / s['gpus'])} |")
    r = rep["disaggregated_per_gpu_over_colocated"]
    out += ["", f"Disaggregated / colocated per GPU at 90% attainment: measured {r.get('meas', '-')}, predicted "
            f"{r.get('pred', '-')}.", ""]
    if rep.get("verdicts"):
        out += ["`plan`'s verdict, disaggregated / colocated per GPU on the plan's GPUs (colocated without / with "
                "chunked prefill), the colocated engine modelled with its own coefficients and with the pools':", "",
                "| config | own coefficients | pools' coefficients |", "|---|---|---|"]
        for v in rep["verdicts"]:
            def cell(d: dict[str, float] | None) -> str:
                return "-" if not d else f"{d.get('no_chunked', '-')}x / {d.get('chunked', '-')}x"
            out.append(f"| {v['config']} | {cell(v.get('own'))} | {cell(v.get('pools'))} |")
        out.append("")
    return "\n".join(out)


def write(rep: dict[str, Any], out: str | Path, command: str) -> dict[str, Any]:
    """Write results.json and README.md (each whole or not at all); return the report with its provenance."""
    rep = {"provenance": provenance(command, source="../shared/reference/distserve-opt13b"), **rep}
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    for name, text in (("results.json", json.dumps(rep, indent=1)), ("README.md", markdown(rep))):
        tmp = d / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(d / name)
    return rep
