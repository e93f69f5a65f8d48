"""`python -m placement validate`: fit on the fit part, predict every point, write the error tables.

Writes OUT/README.md (the tables, with date, git commit, CPU and the command), OUT/results.json (the
same plus the fitted parameters and every point) and, with `write_calibration`, the Python module of
fitted values that `LatencySpec(calibration=...)` reads (placement/calibration_data.py).
"""

from __future__ import annotations

import json
import logging
import math
import platform
import pprint
import subprocess
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from placement.fitting import fit_group, spec_of, subsample
from placement.validation import (
    ErrorRow,
    Prediction,
    ServingPoint,
    error_table,
    load_points,
    predict_point,
)

logger = logging.getLogger(__name__)

MIN_GROUP_POINTS = 12  # fewer fit points than this: the engine-wide fit is used
SOURCE = ("NVIDIA aiconfigurator silicon validation set (Apache-2.0), as kept in "
          "shared/reference/measured_serving.csv")
GOAL = {"ttft": 25.0, "tpot": 15.0}  # dense models on vLLM, held-out MAPE


@dataclass
class Report:
    fitted: dict[str, dict[str, float]]
    fit_loss: dict[str, float]
    predictions: list[Prediction]
    skipped: Counter[str]
    rows_total: int
    provenance: dict[str, str] = field(default_factory=dict)

    def table(self, held_out: bool, key: str = "model") -> list[ErrorRow]:
        return error_table([p for p in self.predictions if p.point.held_out == held_out], key)


def _fit_task(args: tuple[str, list[ServingPoint]]) -> tuple[str, dict[str, float], float]:
    key, pts = args
    params, loss = fit_group(pts)
    logger.info("fitted %s on %d points: loss %.3f %s", key, len(pts), loss, params)
    return key, params, loss


def _predict_task(args: tuple[ServingPoint, dict[str, float]]) -> Prediction:
    p, params = args
    return predict_point(p, spec_of({k: v for k, v in params.items() if k != "step_overhead_ms"}))


def calibration_key(p: ServingPoint, fitted: dict[str, dict[str, float]]) -> str:
    return p.group if p.group in fitted else f"{p.backend}/*/*"


def run_validation(csv_path: str | Path, jobs: int = 1) -> Report:
    points, skipped = load_points(csv_path)
    rows_total = len(points) + sum(skipped.values())
    fit_part = [p for p in points if not p.held_out]
    tasks: dict[str, list[ServingPoint]] = {}
    for p in fit_part:
        tasks.setdefault(p.group, []).append(p)
        tasks.setdefault(f"{p.backend}/*/*", []).append(p)
    todo = [(k, subsample(v)) for k, v in sorted(tasks.items()) if k.endswith("/*/*") or len(v) >= MIN_GROUP_POINTS]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        fits = list(pool.map(_fit_task, todo))
        fitted = {k: params for k, params, _ in fits}
        preds = list(pool.map(_predict_task, [(p, fitted[calibration_key(p, fitted)]) for p in points],
                              chunksize=8))
    return Report(fitted, {k: round(loss, 4) for k, _, loss in fits}, preds, skipped, rows_total)


def provenance(command: str, source: str = SOURCE, paths: tuple[str, ...] = ("placement",)) -> dict[str, str]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--", *paths)
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "git_commit": commit + (
        f" (with uncommitted changes under {', '.join(paths)})" if dirty else ""), "cpu": cpu,
        "python": platform.python_version(), "command": command, "source": source}


def _fmt(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.1f}%"


def _md_table(rows: Sequence[ErrorRow], goal: bool) -> list[str]:
    head = "| engine | model | points | TTFT MAPE | TPOT MAPE |" + (" goal (TTFT<=25%, TPOT<=15%) |" if goal else "")
    out = [head, "|" + " --- |" * (6 if goal else 5)]
    for r in rows:
        line = f"| {r.backend} | {r.label} | {r.points} | {_fmt(r.ttft_mape)} | {_fmt(r.tpot_mape)} |"
        if goal:
            if r.backend == "vllm" and "(disagg)" not in r.label:
                met = r.ttft_mape <= GOAL["ttft"] and r.tpot_mape <= GOAL["tpot"]
                line += " met |" if met else " **missed** |"
            else:
                line += " - |"
        if r.failed:
            line = line[:-1] + f" ({r.failed} not simulated) |"
        out.append(line)
    return out


def write_report(rep: Report, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pv = rep.provenance
    held = [p for p in rep.predictions if p.point.held_out]
    lines = [
        "# Prediction validation: `placement predict` against measured serving results",
        "",
        f"- date: {pv.get('date')}", f"- git commit: {pv.get('git_commit')}", f"- CPU: {pv.get('cpu')}",
        f"- command: `{pv.get('command')}`", f"- data: {pv.get('source')}",
        f"- rows: {rep.rows_total}; modelled: {len(rep.predictions)} ({len(held)} held out, "
        f"{len(rep.predictions) - len(held)} fit); skipped: {sum(rep.skipped.values())}",
        "",
        "Each row is one closed-loop run (fixed ISL/OSL, fixed concurrency) with its measured mean TTFT",
        "and TPOT. A series (every concurrency of one engine/model/GPU/precision/lengths/parallelism sweep)",
        "is held out when its SHA-256 falls in the last third. Fitted per engine/GPU/precision on the fit",
        "part (engine-wide where a group has fewer than 12 fit points): compute and HBM efficiency, fixed",
        "cost per layer and per TP all-reduce, TP efficiency, front-end TTFT share (fixed, per prompt token,",
        "per request in flight). MAPE = mean of |predicted - measured| / measured.",
        "",
        "## Held-out part, per engine and model",
        "",
        *_md_table(rep.table(True), goal=True),
        "",
        "## Held-out part, per engine (every dense model pooled)",
        "",
        *_md_table(rep.table(True, key="engine"), goal=True),
        "",
        "## Held-out part, per engine and GPU/precision",
        "",
        *_md_table(rep.table(True, key="hardware"), goal=False),
        "",
        "## Fit part (for comparison)",
        "",
        *_md_table(rep.table(False), goal=False),
        "",
        "## Not modelled",
        "",
        "| reason | rows |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in sorted(rep.skipped.items(), key=lambda kv: -kv[1])],
        "",
        "## Fitted parameters",
        "",
        "```",
        *[f"{k}: {v}  (loss {rep.fit_loss.get(k)})" for k, v in sorted(rep.fitted.items())],
        "```",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))
    doc: dict[str, Any] = {
        "provenance": pv, "fitted": rep.fitted, "fit_loss": rep.fit_loss, "skipped": dict(rep.skipped),
        "held_out_by_model": [r._asdict() for r in rep.table(True)],
        "held_out_by_hardware": [r._asdict() for r in rep.table(True, key="hardware")],
        "fit_by_model": [r._asdict() for r in rep.table(False)],
        "points": [{**pr.point._asdict(), "held_out": pr.point.held_out, "pred_ttft_ms": round(pr.ttft_ms, 3),
                    "pred_tpot_ms": round(pr.tpot_ms, 4), "error": pr.error} for pr in rep.predictions],
    }
    text = json.dumps(doc, indent=1, allow_nan=True).replace("NaN", "null")
    (out / "results.json").write_text(text + "\n")
    return out


def write_calibration(rep: Report, path: str | Path) -> None:
    body = pprint.pformat(rep.fitted, width=110, sort_dicts=True)
    Path(path).write_text(
        '"""Generated by `python -m placement validate --write-calibration placement/calibration_data.py`; do\n'
        'not edit by hand. Keys: engine/hardware/precision with `*` for any. Fitted on the fit part of\n'
        f'{SOURCE};\nsee benchmarks/results/prediction-validation/."""\n\n'
        "from __future__ import annotations\n\n"
        f"FITTED: dict[str, dict[str, float]] = {body}\n")
