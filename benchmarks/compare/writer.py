"""Writes a comparison report: report.json (valid JSON even with inf/nan), report.md and its PNGs."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

PlotFn = Callable[[Path], list[str]]
"""plot(out_dir) -> the file names of the PNGs it wrote there (none without matplotlib)."""


def json_safe(obj: Any) -> Any:
    """inf/nan -> strings and every key -> str, so report.json stays valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def write_report_files(out_dir: Path, report: dict[str, Any], markdown: Callable[[list[str]], str],
                       plot: PlotFn | None = None) -> list[Path]:
    """Plots first (the Markdown links them), then report.json and ``markdown(plots)`` as report.md.
    Returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot(out_dir) if plot is not None else []
    (out_dir / "report.json").write_text(json.dumps(json_safe(report), indent=1))
    (out_dir / "report.md").write_text(markdown(plots))
    return [out_dir / "report.md", out_dir / "report.json", *(out_dir / p for p in plots)]


def write_raw(out_dir: Path, raw: dict[str, Any]) -> Path:
    """Everything a run measured, before any report logic (a report can be rebuilt from it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "raw.json"
    path.write_text(json.dumps(json_safe(raw)))
    return path


def rekey(d: dict[str, Any]) -> dict[float | str, Any]:
    """JSON turned float step keys (rates) into strings; turn them back (other keys stay strings)."""
    def key(k: str) -> float | str:
        try:
            return float(k)
        except ValueError:
            return k

    return {key(k): v for k, v in d.items()}
