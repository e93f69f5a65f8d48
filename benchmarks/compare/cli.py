"""``python -m benchmarks.compare``: arguments, the run (offline quality reference, planner predictions,
colocated then disaggregated on one embedded Ray), raw.json, and the report."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.compare.assemble import assemble, load_raw
from benchmarks.compare.deployment import InProcessDeployment, embedded_ray
from benchmarks.compare.markdown import to_markdown
from benchmarks.compare.options import RunOptions
from benchmarks.compare.planner import planner_table, predict_steps
from benchmarks.compare.plots import plot_rates
from benchmarks.compare.provenance import REPO, Provenance
from benchmarks.compare.quality_check import offline_outputs, quality_table
from benchmarks.compare.quiet import FOREIGN_LIMIT, STEAL_LIMIT, QuietBudget, add_budget_flags
from benchmarks.compare.runner import run_in_turn, run_variant
from benchmarks.compare.shapes import (
    DEFAULT_PROFILE,
    MODES,
    NAMESPACE,
    base_config,
    deploy_config,
    shape_variant,
    shapes,
)
from benchmarks.compare.tables import goodput_table, outcome_table, router_table
from benchmarks.compare.traffic import Traffic, parse_rates, rate_steps
from benchmarks.compare.writer import write_raw, write_report_files
from benchmarks.stats import SLO

logger = logging.getLogger(__name__)

PROG = ("python", "-m", "benchmarks.compare")
DEFAULT_PRICE = 0.10
"""$/hour of the whole box when --dollars-per-hour is not given (as benchmarks.optimizations)."""
DESCRIPTION = ("Colocated vs disaggregated serving on the same resources: one tool deploys each shape in "
               "turn,\nreplays the same traffic against both and writes one side-by-side report.")


def _say(line: str) -> None:
    print(line, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="smollm2", help="engine.model: smollm2, tiny-llama or a local HF dir")
    a("--rates", nargs="+", default=["0.25,0.5,1,2"], help="requests/s, e.g. 0.25,0.5,1,2")
    a("--num-requests", type=int, help="requests per rate step (upper bound)")
    a("--duration", type=float, help="seconds of arrivals per rate step (upper bound)")
    a("--workload", default="chat", choices=("chat", "longdoc", "mixed"),
      help="mixed: chat with long documents among it (--long-share of them, --long-input-len tokens)")
    a("--long-share", type=float, default=0.25, help="mixed: share of long documents")
    a("--long-input-len", type=int, default=1536, help="mixed: input tokens of a long document")
    a("--input-len", type=int, help="chat: median input tokens (256); longdoc: input tokens (1536)")
    a("--output-len", type=int, help="chat: median output tokens (64); longdoc: output tokens (32)")
    a("--sigma", type=float, default=0.6, help="chat: lognormal sigma of both lengths")
    a("--ttft-slo", type=float, default=2.0, help="TTFT target, seconds")
    a("--tpot-slo", type=float, default=0.1, help="TPOT target, seconds per output token")
    a("--attainment-target", type=float, default=0.9, help="attainment a rate must reach to count as sustained")
    a("--tpot-sweep", default="0.06,0.07,0.08,0.09,0.1,0.125,0.15",
      help="TPOT targets (s) to re-judge the same records at (TTFT target fixed), for the SLO-sweep table")
    a("--colocated", type=int, default=2, help="colocated engines")
    a("--prefill", type=int, default=1, help="prefill engines (disaggregated)")
    a("--decode", type=int, default=1, help="decode engines (disaggregated)")
    a("--max-model-len", type=int, default=2048)
    a("--kv-cache-mib", type=int, default=256, help="KV cache per engine (the profile was measured at 256)")
    a("--prefix-caching", action="store_true",
      help="keep vLLM's prefix caching on (off by default: every rate step replays the same prompts, which "
           "would turn later steps' prefills into cache hits)")
    a("--engine-affinity", default="all", choices=("all", "keep"),
      help="all: let every engine thread use every CPU after deploy (undoes vLLM's NIXL connector pinning "
           "P/D engines to one core on CPU, should the engine not have done it itself); keep: measure the "
           "deployment exactly as it starts")
    a("--foreign-limit", type=float, default=FOREIGN_LIMIT,
      help="cores other processes may use during a step before it counts as disturbed (shared machines)")
    a("--steal-limit", type=float, default=STEAL_LIMIT,
      help="cores the hypervisor may take for other guests (steal) during a step before it counts as disturbed "
           "(shared VMs)")
    add_budget_flags(p)
    a("--probe-requests", type=int, default=5, help="sequential requests on the idle deployment before the sweep")
    a("--policy", default="least_loaded", choices=("least_loaded", "round_robin", "goodput"), help="router policy")
    a("--disaggregation", default="always", choices=("auto", "always", "never"),
      help="router.disaggregation of the disaggregated shape: always = every prompt on a prefill worker; auto = "
           "per request, a prefill worker or the decode worker itself (goodput policy)")
    a("--port", type=int, help="Serve HTTP port for both modes (default: a free port)")
    a("--modes", default="colocated,disaggregated", help="modes to run, in order")
    a("--profile", default=str(DEFAULT_PROFILE), help="measured profile for the planner check")
    a("--dollars-per-hour", type=float, default=None,
      help="price of the whole box, for $/M input and output tokens (default 0.10; with --from-raw: the run's own "
           "price unless given)")
    a("--seed", type=int, default=0)
    a("--request-timeout", type=float, default=120.0, help="seconds per request")
    a("--no-quality", action="store_true", help="skip the greedy-output comparison")
    a("--no-offline", action="store_true", help="quality: skip offline vLLM (endpoints only)")
    a("--offline-timeout", type=float, default=420.0, help="seconds for the offline vLLM quality run")
    a("--out", help="directory for report.json, report.md, compare.png and the per-mode reports")
    a("--no-progress", action="store_true")
    a("--from-raw", metavar="RAW_JSON", help="rebuild report.md/json/png from a run's raw.json (no deployment)")
    a("-v", "--verbose", action="store_true")
    return p


def check_args(args: argparse.Namespace) -> tuple[list[float], list[str]]:
    """The rates and modes to run; sets ``args.tpot_targets``. Raises ValueError naming the bad flag."""
    rates = parse_rates(args.rates)
    if args.num_requests is None and args.duration is None:
        raise ValueError("give --num-requests N and/or --duration S to bound each rate step")
    for flag, v in (("--num-requests", args.num_requests), ("--duration", args.duration),
                    ("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo),
                    ("--request-timeout", args.request_timeout), ("--input-len", args.input_len),
                    ("--output-len", args.output_len)):
        if v is not None and not v > 0:
            raise ValueError(f"{flag} {v} must be > 0")
    if not 0 < args.attainment_target <= 1:
        raise ValueError(f"--attainment-target {args.attainment_target} must be in (0, 1]")
    for flag, v in (("--colocated", args.colocated), ("--prefill", args.prefill), ("--decode", args.decode)):
        if v < 1:
            raise ValueError(f"{flag} {v} must be >= 1")
    if args.colocated != args.prefill + args.decode:
        logger.warning("--colocated %d != --prefill %d + --decode %d: the shapes do not use the same resources",
                       args.colocated, args.prefill, args.decode)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"--modes {args.modes!r}: a comma list of distinct modes from {', '.join(MODES)}")
    try:
        args.tpot_targets = sorted(float(v) for v in args.tpot_sweep.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--tpot-sweep {args.tpot_sweep!r}: a comma list of seconds, e.g. 0.08,0.1") from None
    if any(not t > 0 for t in args.tpot_targets):
        raise ValueError(f"--tpot-sweep {args.tpot_sweep!r}: every target must be > 0")
    if args.dollars_per_hour is not None and not args.dollars_per_hour >= 0:
        raise ValueError(f"--dollars-per-hour {args.dollars_per_hour} must be >= 0, e.g. 0.10")
    if not Path(args.profile).is_file():
        raise ValueError(f"--profile {args.profile!r} does not exist")
    return rates, modes


def make_workload(args: argparse.Namespace):
    from benchmarks.workload import ChatWorkload, LongDocWorkload, MixedWorkload

    if args.workload == "longdoc":
        return LongDocWorkload(args.input_len or 1536, args.output_len or 32)
    if args.workload == "mixed":
        return MixedWorkload(args.input_len or 256, args.output_len or 64, args.sigma, args.long_input_len,
                             32, args.long_share)
    return ChatWorkload(args.input_len or 256, args.sigma, args.output_len or 64, args.sigma)


def _header(args: argparse.Namespace, prov: Provenance, rates: list[float], traffic: Traffic) -> dict[str, Any]:
    return {**prov.start_fields(), "model": args.model, "rates": rates,
            "num_requests": args.num_requests, "duration_s": args.duration, "seed": args.seed, "policy": args.policy,
            "disaggregation": args.disaggregation,
            "dollars_per_hour": DEFAULT_PRICE if args.dollars_per_hour is None else args.dollars_per_hour,
            "workload": dict(vars(traffic.workload)),
            "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo}, "attainment_target": args.attainment_target,
            "tpot_targets": args.tpot_targets, "profile": os.path.relpath(args.profile, REPO),
            "foreign_limit": args.foreign_limit, "steal_limit": args.steal_limit,
            "engine_affinity": args.engine_affinity,
            "prefix_caching": args.prefix_caching,
            "engine": {"max_model_len": args.max_model_len, "kv_cache_mib": args.kv_cache_mib},
            "shapes": shapes(args)}


def _offline(args: argparse.Namespace, out_dir: Path | None) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Offline vLLM's greedy outputs (the quality reference), or the reason it could not run."""
    tq = time.monotonic()
    try:
        # NOTE: offline_greedy's fixed 64 MiB KV cache holds ~1280 SmolLM2 tokens; the eval prompts are
        # short and greedy outputs do not depend on max_model_len.
        outs = offline_outputs(args.model, min(args.max_model_len, 1024), args.offline_timeout, out_dir or Path("/tmp"))
    except RuntimeError as exc:
        print(f"offline vLLM failed: {exc}", file=sys.stderr, flush=True)
        return None, str(exc)
    print(f"offline vLLM greedy eval set done in {time.monotonic() - tq:.0f} s", flush=True)
    return outs, None


def write_outputs(report: dict[str, Any], out_dir: Path | None) -> int:
    """Print the headline tables; write report.md/json and compare.png. Exit status 1 when greedy
    outputs differ between sources."""
    rows = report["rows"]
    print()
    print(goodput_table(rows))
    print()
    print(outcome_table(rows))
    print()
    if report.get("router", {}).get("rows"):
        print(router_table(report["router"]["rows"]))
        print()
    print(planner_table(report["planner"]["rows"]))
    if report.get("quality"):
        print()
        print(quality_table(report["quality"]["comparisons"]))
        if not report["quality"]["all_match"]:
            print("DIFFERENCE between greedy outputs: a bug to report to the lead", file=sys.stderr)
    if out_dir is not None:
        paths = write_report_files(out_dir, report, lambda plots: to_markdown(report, plots),
                                   lambda d: plot_rates(rows, MODES, report["slo"], d,
                                                        title="colocated vs disaggregated"))
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if not report.get("quality") or report["quality"]["all_match"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    from kvtransfer.config import free_port

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.from_raw:
        out = Path(args.out) if args.out else Path(args.from_raw).parent
        if args.dollars_per_hour is not None and not args.dollars_per_hour >= 0:
            parser.error(f"--dollars-per-hour {args.dollars_per_hour} must be >= 0, e.g. 0.10")
        return write_outputs(assemble(load_raw(Path(args.from_raw)), args.dollars_per_hour), out)
    try:
        rates, modes = check_args(args)
        traffic = Traffic(make_workload(args), args.num_requests, args.duration, args.seed,
                          max_total_len=args.max_model_len)
    except ValueError as exc:
        parser.error(str(exc))
    prov = Provenance.start(PROG, argv)
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    report = _header(args, prov, rates, traffic)
    steps = rate_steps(traffic, rates)
    slo = SLO(args.ttft_slo, args.tpot_slo)
    pred, lens = predict_steps(args.profile, {m: deploy_config(args, m, 8000) for m in MODES}, steps, slo)
    report["requests_per_rate"] = lens
    print("planner predictions ready; requests per rate:", {r: v["requests"] for r, v in lens.items()}, flush=True)

    quality_outputs: dict[str, list[dict[str, Any]]] = {}
    offline_error = None
    if not args.no_quality and not args.no_offline:
        offline, offline_error = _offline(args, out_dir)
        if offline is not None:
            quality_outputs["offline"] = offline

    from benchmarks.report import ProgressLine

    budget = QuietBudget(float(args.quiet_wait), args.retries)
    opts = RunOptions(slo=slo, request_timeout_s=args.request_timeout, foreign_limit=args.foreign_limit,
                      steal_limit=args.steal_limit, reset_affinity=args.engine_affinity == "all",
                      probe_requests=args.probe_requests,
                      probe_input_len=args.input_len or (1536 if args.workload == "longdoc" else 256),
                      quality=not args.no_quality, out_dir=out_dir, prog=" ".join(PROG),
                      progress=None if args.no_progress else ProgressLine(), say=_say)
    with embedded_ray(NAMESPACE):
        # NOTE: each deployment's port picked just before it starts, after Ray's own processes took theirs
        # (one picked before Ray started was once taken by then, and the run failed)
        parts, failure = run_in_turn([shape_variant(args, m) for m in modes], lambda v: run_variant(
            v.name, InProcessDeployment(v.config(base_config(args, args.port or free_port()))), steps, opts,
            budget))

    records: dict[str, dict[float, list[dict[str, Any]]]] = {}
    for mode, part in parts.items():
        if "quality_outputs" in part:
            quality_outputs[mode] = part.pop("quality_outputs")
        if "records" in part:
            records[mode] = part.pop("records")
    report.update(prov.end_fields(), failure=failure, quiet_budget_left=asdict(budget))
    raw = {"report": report, "parts": parts, "records": records, "pred": pred, "quality_outputs": quality_outputs,
           "offline_error": offline_error}
    if out_dir is not None:
        write_raw(out_dir, raw)  # NOTE: before any report logic: `--from-raw` rebuilds the report from it
    if failure is not None or set(parts) != set(MODES) or any("steps" not in p for p in parts.values()):
        if failure is None and set(parts) == set(modes):
            print(f"ran {', '.join(modes)} only: no side-by-side report"
                  + (f"; measurements in {out_dir / 'raw.json'}" if out_dir else ""))
            return 0
        print(f"error: the comparison did not complete ({failure or 'modes missing'})"
              + (f"; what finished is in {out_dir / 'raw.json'}" if out_dir else ""), file=sys.stderr)
        return 3
    return write_outputs(assemble(raw), out_dir)
