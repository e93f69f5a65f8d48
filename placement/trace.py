"""Request traces to replay: arrival time, prompt and output tokens per request, and, where the trace was
measured, each request's TTFT and TPOT.

Formats, by suffix:
- `.exp`: DistServe's benchmark output as it is (its first line a Python literal list of per-request dicts:
  `issue_time`, `first_token_time`, `complete_time` in seconds, `prompt_len`, `output_len`, `ttft_ms`,
  `tpot_ms`; rows in completion order; the lines after it a summary, ignored);
- `.jsonl` / `.json` (one object per line) and `.csv` (header row), with columns `arrival_s` (or
  `arrival_time`, `issue_time`, `timestamp`), `input_len` (or `prompt_len`, `prompt_tokens`), `output_len`
  (or `output_tokens`), and optionally `ttft_s` / `ttft_ms` and `tpot_s` / `tpot_ms`.

Rows are sorted by arrival and shifted so the first arrives at 0. TPOT is (last token - first token) /
(output tokens - 1), as DistServe and the simulator count it; a one-token output has none.
"""

from __future__ import annotations

import ast
import csv
import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from placement.errors import PlacementError
from placement.workload import Request

ARRIVAL = ("arrival_s", "arrival_time", "issue_time", "timestamp")
INPUT = ("input_len", "prompt_len", "prompt_tokens")
OUTPUT = ("output_len", "output_tokens")


class TraceRequest(NamedTuple):
    arrival_s: float
    input_len: int
    output_len: int
    ttft_s: float | None = None  # measured, where the trace has it
    tpot_s: float | None = None

    @property
    def request(self) -> Request:
        return Request(self.arrival_s, self.input_len, self.output_len)


def _rows(p: Path) -> list[dict[str, Any]]:
    text = p.read_text()
    if p.suffix == ".exp":
        try:
            rows = ast.literal_eval(text.split("\n", 1)[0])
        except (ValueError, SyntaxError) as e:
            raise PlacementError(f"trace {p}: its first line is not DistServe's list of requests ({e})") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise PlacementError(f"trace {p}: its first line is not a list of per-request dicts")
        return rows
    if p.suffix in (".jsonl", ".json"):
        try:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as e:
            raise PlacementError(f"trace {p}: not JSON lines ({e})") from None
    return list(csv.DictReader(text.splitlines()))


def _pick(row: dict[str, Any], names: tuple[str, ...]) -> Any:
    return next((row[n] for n in names if row.get(n) not in (None, "")), None)


def _seconds(row: dict[str, Any], name: str) -> float | None:
    if row.get(f"{name}_s") not in (None, ""):
        return float(row[f"{name}_s"])
    if row.get(f"{name}_ms") not in (None, ""):
        return float(row[f"{name}_ms"]) / 1e3
    return None


def load_trace_file(path: str | Path) -> list[TraceRequest]:
    """The requests of a trace file, in arrival order from t = 0 (module docstring: formats)."""
    p = Path(path)
    if not p.is_file():
        raise PlacementError(f"trace file {str(p)!r} does not exist; give a .exp, .jsonl or .csv path")
    out = []
    for i, row in enumerate(_rows(p), 1):
        arrival, inp, outp = _pick(row, ARRIVAL), _pick(row, INPUT), _pick(row, OUTPUT)
        try:
            if arrival is None or inp is None or outp is None:
                raise KeyError("arrival, input or output length")
            out.append(TraceRequest(float(arrival), int(inp), int(outp), _seconds(row, "ttft"), _seconds(row, "tpot")))
        except (KeyError, ValueError, TypeError) as e:
            raise PlacementError(f"trace {p} row {i}: needs an arrival time ({' / '.join(ARRIVAL)}), an integer prompt "
                                 f"length ({' / '.join(INPUT)}) and output length ({' / '.join(OUTPUT)}) ({e})") from None
        if out[-1].input_len < 1 or out[-1].output_len < 1:
            raise PlacementError(f"trace {p} row {i}: lengths must be >= 1 token")
    if not out:
        raise PlacementError(f"trace {p} has no requests")
    if len({r.ttft_s is None for r in out}) > 1 or len({r.tpot_s is None for r in out}) > 1:
        raise PlacementError(f"trace {p}: measured TTFT / TPOT are given on some rows only; give them on all or none")
    out.sort(key=lambda r: r.arrival_s)
    t0 = out[0].arrival_s
    return [r._replace(arrival_s=r.arrival_s - t0) for r in out]


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.percentile(np.asarray(values, dtype=float), [50, 90, 99])
    return {"p50": float(a[0]), "p90": float(a[1]), "p99": float(a[2])}


def figures(ttft: list[float | None], tpot: list[float | None], output_lens: list[int], ttft_slo_s: float,
            tpot_slo_s: float) -> dict[str, Any]:
    """TTFT and TPOT percentiles and the share of requests meeting both targets. A request without a TTFT
    (refused, never served) misses; TPOT percentiles leave out one-token outputs."""
    met = sum(1 for f, o, n in zip(ttft, tpot, output_lens, strict=True)
              if f is not None and f <= ttft_slo_s and (n <= 1 or (o is not None and o <= tpot_slo_s)))
    return {"ttft_s": _pcts([f for f in ttft if f is not None]),
            "tpot_s": _pcts([o for o, n in zip(tpot, output_lens, strict=True) if n > 1 and o is not None]),
            "attainment": met / len(ttft) if ttft else 0.0}


def measured_figures(trace: list[TraceRequest], ttft_slo_s: float, tpot_slo_s: float) -> dict[str, Any] | None:
    """The trace's own figures (None when it was not measured)."""
    if trace[0].ttft_s is None:
        return None
    return figures([r.ttft_s for r in trace], [r.tpot_s for r in trace], [r.output_len for r in trace],
                   ttft_slo_s, tpot_slo_s)
