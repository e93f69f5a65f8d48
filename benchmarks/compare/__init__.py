"""Colocated vs disaggregated serving on the same resources: one tool deploys each shape in turn,
replays the same traffic against both and writes one side-by-side report.

    python -m benchmarks.compare [--model smollm2] [--rates 0.25,0.5,1,2] [--num-requests N | --duration S]
        [--workload chat|longdoc] [--input-len L --output-len L] [--ttft-slo S --tpot-slo S] [--out DIR]

The package is also the toolkit for any comparison of deployment variants on the same traffic (shapes,
routing, engine optimisations). Modules, one job each:

generic (a later benchmark composes these)
  variant        Variant(name, overrides): a deploy config = a shared base + what the variant changes
  traffic        Traffic (workload, bounds, seed) and Step(key, rate, traffic): the same requests for all
  deployment     InProcessDeployment / SubprocessDeployment: start one variant, wait ready, stop cleanly
  runner         run_variant (deploy, quality, probe, replay steps, per-variant report, stop), run_in_turn
  step           measure_step / replay_steps: one run_benchmark step with CPU and server sampling, retries
  options        RunOptions: SLO, timeouts, cost, affinity, probe, quality, output dir, progress lines
  procstat       CPU seconds of our process tree per component, foreign load, from /proc
  quiet          QuietBudget and wait_quiet: waiting for a shared machine to go quiet
  affinity       the engines' CPU affinity, and re-allowing every CPU
  server_stats   /v1/stats sampling (batch, queue, KV use, KV transfers) and /metrics means
  probe          idle_probe: no-load TTFT and TPOT
  planner        placement-simulator predictions on the exact requests sent, errors, the table
  quality_check  greedy outputs per variant and offline vLLM, pairwise comparison, the report section
  metrics        metrics_of (flat numbers of a RateSummary), ratio, slo_capacity
  provenance     command, dates, machine (CPU model), git commit and clean/dirty
  writer         report.json / report.md / PNG, raw.json, json_safe
  fmt, plots     table cells and Markdown tables; attainment/goodput/latency vs rate PNG

colocated vs disaggregated (this CLI)
  shapes         the two shapes as variants of one base config
  analysis       side-by-side rows, winner, foreign-load flags, TPOT sweep, findings
  tables         goodput, latency, sweep and CPU tables
  markdown       report.md
  assemble       raw.json -> report (``--from-raw``)
  cli            arguments and the run

On CPU the default shapes are 2 colocated engines vs 1 prefill + 1 decode engine. For each mode the
tool starts an embedded local Ray once, deploys (``cluster.deploy.start``), runs the greedy quality
check on the committed eval set, runs one benchmark step per rate (same seed, so the same arrivals,
lengths and prompts in both modes), samples the workers' batch sizes and every process's CPU time
while it runs, and stops the deployment. Offline vLLM (the quality reference) runs first, in a child
process. The placement planner's prediction for each shape, from the measured CPU profile and on
exactly the requests that were sent, is printed next to the measurement.

Outputs under ``--out``: ``report.json`` (everything, summaries only), ``report.md``, ``compare.png``
(if matplotlib), ``raw.json`` (what was measured, written before any report logic; ``--from-raw``
rebuilds the report from it), and ``colocated/``, ``disaggregated/`` (the plain benchmark reports,
with every per-request record). Exit status: 0; 1 when greedy outputs differ between any two sources (a bug);
2 bad arguments; 3 a deployment or benchmark failed.
"""

from __future__ import annotations

from benchmarks.compare.affinity import check_affinity, process_affinity, reset_affinity
from benchmarks.compare.analysis import findings, foreign_load, side_by_side, slo_sweep
from benchmarks.compare.assemble import assemble, load_raw
from benchmarks.compare.cli import build_parser, check_args, main, make_workload, write_outputs
from benchmarks.compare.deployment import (
    Deployed,
    Deployment,
    InProcessDeployment,
    SubprocessDeployment,
    embedded_ray,
)
from benchmarks.compare.fmt import fmt_key, fmt_ms, fmt_pct, fmt_ratio, fmt_rel, md_table
from benchmarks.compare.markdown import to_markdown
from benchmarks.compare.metrics import metrics_of, ratio, slo_capacity
from benchmarks.compare.options import RunOptions
from benchmarks.compare.planner import (
    PLANNER_KEYS,
    planner_rows,
    planner_table,
    predict_config,
    predict_steps,
    prediction_error,
    sim_summary,
)
from benchmarks.compare.plots import plot_rates
from benchmarks.compare.probe import idle_probe
from benchmarks.compare.procstat import classify_process, cpu_breakdown, cpu_snapshot, foreign_now
from benchmarks.compare.provenance import (
    Provenance,
    git_commit,
    header_lines,
    machine_info,
    parse_cpu_model,
    parse_mem_total_gib,
)
from benchmarks.compare.quality_check import (
    TokenIdsOnly,
    endpoint_outputs,
    offline_outputs,
    quality_comparisons,
    quality_section,
    quality_summary,
    quality_table,
)
from benchmarks.compare.quiet import FOREIGN_LIMIT, QuietBudget, wait_quiet
from benchmarks.compare.runner import InTurn, run_in_turn, run_variant
from benchmarks.compare.server_stats import (
    StatsSampler,
    metric_means,
    parse_metrics,
    transfer_summary,
    worker_load,
)
from benchmarks.compare.shapes import MODES, QUALITY_SOURCES, SHORT, deploy_config, shape_variant
from benchmarks.compare.step import Attempt, Replayed, measure_step, replay_steps
from benchmarks.compare.tables import goodput_table, latency_table, resources_table, sweep_table
from benchmarks.compare.traffic import Step, Traffic, parse_rates, rate_steps, request_stats
from benchmarks.compare.variant import Variant, merge, parse_overrides
from benchmarks.compare.writer import json_safe, write_raw, write_report_files

__all__ = [
    "FOREIGN_LIMIT", "MODES", "PLANNER_KEYS", "QUALITY_SOURCES", "SHORT", "Attempt", "Deployed", "Deployment",
    "InProcessDeployment", "InTurn", "Provenance", "QuietBudget", "Replayed", "RunOptions", "StatsSampler", "Step",
    "SubprocessDeployment", "TokenIdsOnly", "Traffic", "Variant", "assemble", "build_parser", "check_affinity",
    "check_args", "classify_process", "cpu_breakdown", "cpu_snapshot", "deploy_config", "embedded_ray",
    "endpoint_outputs", "findings", "fmt_key", "fmt_ms", "fmt_pct", "fmt_ratio", "fmt_rel", "foreign_load",
    "foreign_now", "git_commit", "goodput_table", "header_lines", "idle_probe", "json_safe", "latency_table", "load_raw",
    "machine_info", "main", "make_workload", "md_table", "measure_step", "merge", "metric_means", "metrics_of",
    "offline_outputs", "parse_cpu_model", "parse_mem_total_gib", "parse_metrics", "parse_overrides",
    "parse_rates", "planner_rows", "planner_table", "plot_rates", "predict_config", "predict_steps",
    "prediction_error", "process_affinity", "quality_comparisons", "quality_section", "quality_summary",
    "quality_table", "rate_steps", "ratio", "replay_steps", "request_stats", "reset_affinity", "resources_table",
    "run_in_turn", "run_variant", "shape_variant", "side_by_side", "sim_summary", "slo_capacity", "slo_sweep",
    "sweep_table", "to_markdown", "transfer_summary", "wait_quiet", "worker_load", "write_outputs", "write_raw",
    "write_report_files",
]
