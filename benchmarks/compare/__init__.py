"""Colocated vs disaggregated serving on the same resources: one tool deploys each shape in turn,
replays the same traffic against both and writes one side-by-side report.

    python -m benchmarks.compare [--model smollm2] [--rates 0.25,0.5,1,2] [--num-requests N | --duration S]
        [--workload chat|longdoc] [--input-len L --output-len L] [--ttft-slo S --tpot-slo S] [--out DIR]

The package is also the toolkit for any comparison of deployment variants on the same traffic (shapes,
routing, engine optimisations). Modules, one job each:

generic (a later benchmark composes these)
  variant        Variant(name, overrides): a deploy config = a shared base + what the variant changes
  traffic        Traffic (workload, bounds, seed) and Step(key, rate, traffic): the same requests for all
  deployment     InProcessDeployment: start one variant, wait ready, stop cleanly
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
