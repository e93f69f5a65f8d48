"""report.md of ``python -m benchmarks.compare``: provenance, the goodput headline, disturbed steps,
idle probe and affinity notes, capacity, the TPOT sweep, latency, planner check, quality, CPU, findings."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from benchmarks.compare.fmt import fmt_ms, fmt_ratio
from benchmarks.compare.metrics import ratio
from benchmarks.compare.planner import planner_table
from benchmarks.compare.provenance import header_lines
from benchmarks.compare.quality_check import quality_section
from benchmarks.compare.shapes import MODES
from benchmarks.compare.tables import (
    goodput_table,
    latency_table,
    outcome_table,
    resources_table,
    router_table,
    sweep_table,
)

CPU_NOTE = (
    "Per rate step: cores used (CPU-seconds / step wall time) by each engine (Ray actor + its vLLM "
    "EngineCore), by the rest of this run's processes (driver = load client, Serve, Ray), and by "
    "processes not ours (other work on the box), and in brackets the cores the hypervisor gave other guests "
    "while ours waited (steal: a shared VM runs slower by that much); the workers' running batch from `/v1/stats` sampled "
    "every second (mean over samples where it was > 0 / max, busy % of samples; a prefill worker counts its "
    "prompt as waiting until the prompt is done, so its running count stays 0: read its load from its "
    "cores); median engine step (as the engine's stat logger records it: for a mostly idle engine this "
    "includes idle gaps); "
    "KV transfer telemetry; the ingress's own means from `/metrics` over the step (TTFT as the server "
    "sees it; prefill on the prefill worker; KV wait = decode submit to first decode output).")


def to_markdown(report: dict[str, Any], plots: Sequence[str]) -> str:
    mach, slo, w = report["machine"], report["slo"], report["workload"]
    md = [f"# Colocated vs disaggregated: {report['model']} on {mach['nproc']} CPU cores", "",
          *header_lines(report, "shared with other work (see `cores not ours` below)"),
          f"- shapes on the same {report['shapes']['colocated']['engines']} engines: colocated "
          f"{report['shapes']['colocated']['pools']} vs disaggregated {report['shapes']['disaggregated']['pools']}; "
          f"router `{report['policy']}` (disaggregation `{report.get('disaggregation', 'always')}`); engine: max_model_len {report['engine']['max_model_len']}, "
          f"KV {report['engine']['kv_cache_mib']} MiB, 1 OMP thread",
          f"- workload: `{json.dumps(w)}`, Poisson arrivals, seed {report['seed']}, at most "
          f"{report['num_requests'] or 'unbounded'} requests / {report['duration_s'] or 'unbounded'} s of arrivals "
          "per rate; the same requests (lengths, prompts, scaled arrival times) in both modes",
          f"- SLO: TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s'] * 1000:g} ms per request; attainment = "
          "met / sent; goodput = met requests / step duration",
          "", "## Goodput", "", goodput_table(report["rows"], report["foreign_load"]["rates"]), ""]
    md += _run_notes(report)
    caps = report["slo_capacity"]
    md += [f"Highest rate sustained at >= {report['attainment_target']:.0%} attainment (every tested rate up to "
           f"it): colocated {caps['colocated']} req/s, disaggregated {caps['disaggregated']} req/s; "
           f"ratio {fmt_ratio(ratio(caps['disaggregated'], caps['colocated']))}.", "",
           "## The same requests judged at other TPOT targets", "",
           f"TTFT target {slo['ttft_s']:g} s; each cell: attainment colocated / disaggregated (goodput ratio "
           "disaggregated / colocated).", "", sweep_table(report["slo_sweep"]["rows"]), "",
           "## Admission and cost", "",
           "Of the requests sent: met both targets; answered in full but late (what admission should have "
           "refused); refused with 429 (send -> 429 response); failed otherwise. $/M tokens at "
           + (f"${report['dollars_per_hour']:g}/h for the whole box" if report.get("dollars_per_hour") is not None
              else "no price (run without --dollars-per-hour)")
           + " over the step's wall time (disaggregated: split by engine count; colocated: by time in "
           "prefill vs decode).", "", outcome_table(report["rows"]), "",
           *_router_section(report),
           "## Latency (ms; nearest-rank percentiles)", "", latency_table(report["rows"]), "",
           "## Planner check", "",
           f"The placement simulator with the measured profile `{report['planner']['profile']}` on exactly the "
           "requests sent (same arrivals and lengths), predicted vs measured, error = (predicted - measured) / "
           "measured (attainment: predicted - measured, in points).", "",
           planner_table(report["planner"]["rows"]), ""]
    md += quality_section(report.get("quality"))
    md += ["## Where the CPU went", "", CPU_NOTE, "",
           resources_table(report["rows"], report["resources"], report["foreign_load"]["limit_cores"]), "",
           "## Findings (computed from the numbers above)", ""]
    md += [f"- {f}" for f in report["findings"]]
    if plots:
        md += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    md += ["", "Per-mode benchmark reports with every request: `colocated/report.md`, `disaggregated/report.md`. "
           "Definitions: docs/benchmarks.md.", ""]
    return "\n".join(md)


def _router_section(report: dict[str, Any]) -> list[str]:
    router = report.get("router") or {}
    if not router.get("rows"):
        return []
    w = router["within"]
    return ["## The router's predictions", "",
            "Per served request the router predicts TTFT (routing -> first token) and TPOT; predicted / measured "
            f"at p50 and p90 of each step. Within {w['tolerance']:.0%}: TTFT {w['ttft']['within']} of "
            f"{w['ttft']['of']}, TPOT {w['tpot']['within']} of {w['tpot']['of']} figures. Per request, "
            "ln(measured / predicted): its mean is the bias (> 0: slower than predicted), its sd the spread the "
            "router's `prediction_sigma` stands for when it turns a prediction into a chance of meeting a target.",
            "",
            router_table(router["rows"]), ""]


def _run_notes(report: dict[str, Any]) -> list[str]:
    """Disturbed steps, discarded attempts, the idle probe and the engines' CPU affinity."""
    md: list[str] = []
    fl = report["foreign_load"]
    if fl["steps"]:
        md += [f"(!) other people's processes used more than {fl['limit_cores']:g} cores of this 2-core box during "
               "these steps (cores: " + ", ".join(f"{k} {v:.2f}" for k, v in fl["steps"].items())
               + "); read those rows with care.", ""]
    if fl.get("steal_steps"):
        md += [f"(!) the hypervisor took more than {fl['steal_limit_cores']:g} cores from this VM (steal) during these "
               "steps (cores: " + ", ".join(f"{k} {v:.2f}" for k, v in fl["steal_steps"].items())
               + "), the retries being spent; read those rows with care.", ""]
    modes = report["modes"]
    redo = [f"{m} {d['rate']:g} (not ours {d['machine_other_cores']:.2f} cores"
            + ("" if d.get("machine_steal_cores") is None else f", steal {d['machine_steal_cores']:.2f}")
            + f", attainment {d['attainment']:.0%})" for m in MODES for d in modes[m].get("discarded_attempts", [])]
    if redo:
        md += ["Attempts discarded for a cleaner repeat of the same step: " + "; ".join(redo) + ".", ""]
    probes = {m: modes[m].get("idle_probe") for m in MODES}
    if all(probes.values()):
        lens = {(p.get("input_tokens"), p.get("output_tokens")) for p in probes.values()}
        ins, outs = next(iter(lens))
        shape = (f"fresh {ins}-token prompts, {outs} output tokens" if len(lens) == 1 and ins and outs
                 else "fresh prompts")
        md += [f"Idle probe (before the sweep, one request at a time, {shape}): "
               + "; ".join(f"{m} TTFT p50 {fmt_ms(p['ttft_p50_s'])} ms, TPOT p50 {fmt_ms(p['tpot_p50_s'])} ms"
                           for m, p in probes.items()) + ".", ""]
    aff = {m: modes[m].get("affinity") for m in MODES}
    if all(aff.values()):
        md += ["CPU affinity of the engine processes as deployed: " + "; ".join(
            f"{w}: " + ", ".join(f"{pr['cmd'].split(' ')[0]} {pr['cpus']}" for pr in procs)
            for m in MODES for w, procs in aff[m].items()) + "."]
        resets = {m: modes[m].get("affinity_reset_threads") for m in MODES}
        if any(v is not None for v in resets.values()):
            md += ["`--engine-affinity all`: threads re-allowed on every CPU after deploy: "
                   + ", ".join(f"{m} {v}" for m, v in resets.items()) + " (vLLM's NixlConnector pins each P/D "
                   "EngineCore to the last core of its NUMA node; colocated engines have no connector)."]
        else:
            md += ["`--engine-affinity keep`: measured with the affinity as deployed."]
        md += [""]
    return md
