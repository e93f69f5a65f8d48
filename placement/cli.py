"""Command line: `python -m placement {plan,roofline,predict,validate}`. The only module that prints.

Exit status: 0 success, 1 plan printed but no configuration meets the SLO, 2 bad input (the message
names the bad value and the fix).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from placement.errors import PlacementError

logger = logging.getLogger(__name__)


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m placement", description=__doc__.splitlines()[0])
    ap.add_argument("-v", "--verbose", action="store_true", help="log search progress to stderr")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("plan", help="size prefill/decode pools for a planner YAML")
    p.add_argument("config")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    r = sub.add_parser("roofline", help="ideal decode ceiling per batch size")
    r.add_argument("--model", required=True)
    r.add_argument("--hardware", required=True)
    r.add_argument("--gpus", type=int, default=1)
    r.add_argument("--weight-dtype", default="bf16", choices=["fp4", "fp8", "bf16", "fp16", "fp32"])
    r.add_argument("--kv-dtype", default="bf16", choices=["fp8", "bf16", "fp16", "fp32"])
    r.add_argument("--context", type=int, required=True, help="tokens of context per sequence")
    r.add_argument("--batch", type=_csv_ints, default=[1, 8, 32])
    r.add_argument("--gpu-hour-usd", type=float, default=None)
    r.add_argument("--json", action="store_true")

    q = sub.add_parser("predict", help="simulate one deployment shape under a fixed workload")
    q.add_argument("--model", default="llama-3.1-8b")
    q.add_argument("--hardware", default="h100-sxm")
    q.add_argument("--profile", default=None, help="measured profile YAML instead of model/hardware")
    q.add_argument("--weight-dtype", default="bf16", choices=["fp4", "fp8", "bf16", "fp16", "fp32"])
    q.add_argument("--kv-dtype", default="bf16", choices=["fp8", "bf16", "fp16", "fp32"])
    q.add_argument("--backend", default="vllm", choices=["vllm", "sglang", "trtllm", "none"],
                   help="serving engine: its scheduler and fitted efficiencies (none: the raw roofline, "
                        "prefill batches stall decode)")
    q.add_argument("--mode", default="disaggregated", choices=["colocated", "disaggregated"])
    q.add_argument("--local-prefill-tokens", type=int, default=0,
                   help="disaggregated: prompts of at most this many tokens prefill on their decode instance "
                        "(the router's auto placement), in a step with its running decodes")
    q.add_argument("--first-token-from-prefill", action="store_true",
                   help="disaggregated: the prefill's first token streams at once (our P/D), so the KV transfer "
                        "counts in TPOT, not TTFT (default: in TTFT, as the engines' own P/D proxies measure)")
    q.add_argument("--instances", type=int, default=1)
    q.add_argument("--tp", type=int, default=1)
    q.add_argument("--prefill-instances", type=int, default=1)
    q.add_argument("--prefill-tp", type=int, default=1)
    q.add_argument("--decode-instances", type=int, default=1)
    q.add_argument("--decode-tp", type=int, default=1)
    q.add_argument("--prefill-pp", type=int, default=1, help="disaggregated: pipeline stages per prefill instance")
    q.add_argument("--decode-pp", type=int, default=1, help="disaggregated: pipeline stages per decode instance")
    q.add_argument("--isl", type=int, default=None, help="prompt tokens per request (not with --trace)")
    q.add_argument("--osl", type=int, default=None, help="output tokens per request (not with --trace)")
    g = q.add_mutually_exclusive_group()
    g.add_argument("--concurrency", type=int)
    g.add_argument("--rate", type=float)
    q.add_argument("--requests", type=int, default=None)
    q.add_argument("--trace", default=None, help="replay exactly these requests (.exp as DistServe writes them, "
                                                 ".jsonl or .csv: arrival, prompt and output tokens, measured "
                                                 "TTFT/TPOT if any; placement/trace.py) instead of --isl/--osl/--rate")
    q.add_argument("--config", default=None, help="with --trace: model, hardware, dtypes, latency coefficients and "
                                                  "SLO from this planner YAML (e.g. manifests/plan-distserve-opt13b.yaml)")
    q.add_argument("--ttft-slo-ms", type=float, default=None, help="with --trace: TTFT target for attainment")
    q.add_argument("--tpot-slo-ms", type=float, default=None, help="with --trace: TPOT target for attainment")
    q.add_argument("--max-prefill-tokens", type=int, default=None, help="prompt tokens per prefill batch "
                                                                         "(default: the backend's)")
    q.add_argument("--json", action="store_true")

    v = sub.add_parser("validate", help="fit on part of measured serving results, report the error on the rest")
    v.add_argument("--csv", required=True, help="measured points (aiconfigurator silicon CSV)")
    v.add_argument("--out", required=True, help="folder for README.md and results.json")
    v.add_argument("--write-calibration", default=None, help="also write the fitted values as this Python "
                                                               "module (placement/calibration_data.py)")
    v.add_argument("--jobs", type=int, default=1, help="worker processes")

    st = sub.add_parser("replan-study", help="simulated day: pools fixed for the peak, for the mean, and the "
                                             "planner loop (placement/replan_study.py)")
    st.add_argument("--out", required=True, help="folder for README.md, results.json and day.png")
    st.add_argument("--model", default="llama-3.1-8b")
    st.add_argument("--hardware", default="h100-sxm")
    st.add_argument("--intervals", type=int, default=48, help="periods in the day")
    st.add_argument("--sample-s", type=float, default=60.0, help="seconds of traffic simulated per period")
    st.add_argument("--truth-factor", type=float, default=1.25, help="the served system is the model times this")
    st.add_argument("--seed", type=int, default=0)

    rv = sub.add_parser("replay-validate", help="replay DistServe's measured runs on their shapes, predicted beside "
                                                "measured (placement/replay_validation.py)")
    rv.add_argument("--ref", required=True, help="folder of DistServe .exp runs (../shared/reference/distserve-opt13b)")
    rv.add_argument("--config", required=True, help="planner YAML with the model, hardware, coefficients and SLO")
    rv.add_argument("--out", required=True, help="folder for README.md and results.json")
    rv.add_argument("--plan", action="append", default=[], help="also record `plan`'s disaggregated/colocated "
                    "verdict on this planner YAML (repeatable)")

    sub.add_parser("profile", help="moved: python -m benchmarks.profile (this command says so and exits 2)")
    return ap


def _plan(args: argparse.Namespace) -> int:
    from placement.config import load_planner_config
    from placement.plan import format_plan
    from placement.planner import make_plan

    plan = make_plan(load_planner_config(args.config))
    print(json.dumps(plan.to_json_dict()) if args.json else format_plan(plan))
    return 0 if plan.feasible else 1


def _roofline(args: argparse.Namespace) -> int:
    from placement.catalog import get_hardware, get_model
    from placement.roofline import decode_roofline, format_roofline

    m, h = get_model(args.model), get_hardware(args.hardware)
    pts = decode_roofline(m, h, gpus=args.gpus, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype,
                          context=args.context, batches=args.batch, gpu_hour_usd=args.gpu_hour_usd)
    if args.json:
        print(json.dumps([p.as_dict() for p in pts]))
    else:
        print(format_roofline(pts, f"{m.name} ({args.weight_dtype} weights, {args.kv_dtype} KV) on {args.gpus} x "
                                   f"{h.name}, context {args.context}: ideal decode ceiling"))
    return 0


def _replay(args: argparse.Namespace) -> int:
    from placement.config import load_planner_config
    from placement.replay import format_replay, replay
    from placement.trace import load_trace_file

    for flag in ("isl", "osl", "concurrency", "rate", "requests", "profile"):
        if getattr(args, flag) is not None:
            raise PlacementError(f"--{flag} does not go with --trace: the trace gives every request's arrival and "
                                 "lengths; drop it")
    trace = load_trace_file(args.trace)
    model, hardware, wdt, kdt, spec = args.model, args.hardware, args.weight_dtype, args.kv_dtype, None
    ttft, tpot = 1.0, 0.1
    if args.config:
        pc = load_planner_config(args.config)
        if pc.hardware.name is None:
            raise PlacementError(f"--trace with {args.config}: its hardware is a measured profile; replay takes a "
                                 "catalog accelerator (hardware.name)")
        model, hardware, wdt, kdt = pc.model.name, pc.hardware.name, pc.model.weight_dtype, pc.model.kv_dtype
        spec = pc.engine_latency(args.mode == "colocated")
        ttft, tpot = pc.slo.ttft_s, pc.slo.tpot_s
    out = replay(trace, model=model, hardware=hardware, weight_dtype=wdt, kv_dtype=kdt, mode=args.mode,
                 instances=args.instances, tp=args.tp, prefill_instances=args.prefill_instances,
                 prefill_tp=args.prefill_tp, decode_instances=args.decode_instances, decode_tp=args.decode_tp,
                 prefill_pp=args.prefill_pp, decode_pp=args.decode_pp,
                 latency=spec, backend=args.backend, max_prefill_tokens=args.max_prefill_tokens,
                 first_token_from_prefill=args.first_token_from_prefill,
                 ttft_slo_s=args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else ttft,
                 tpot_slo_s=args.tpot_slo_ms / 1e3 if args.tpot_slo_ms else tpot)
    if args.json:
        print(json.dumps(out))
    else:
        print(format_replay(out))
    return 0


def _predict(args: argparse.Namespace) -> int:
    from placement.predict import format_prediction, predict

    if args.trace:
        return _replay(args)
    if args.config or args.ttft_slo_ms or args.tpot_slo_ms:
        raise PlacementError("--config, --ttft-slo-ms and --tpot-slo-ms go with --trace")
    if args.isl is None or args.osl is None or (args.concurrency is None and args.rate is None):
        raise PlacementError("give --isl, --osl and one of --concurrency / --rate, or --trace FILE")
    out = predict(model=args.model, hardware=args.hardware, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype,
                  mode=args.mode, instances=args.instances, tp=args.tp, prefill_instances=args.prefill_instances,
                  prefill_tp=args.prefill_tp, decode_instances=args.decode_instances, decode_tp=args.decode_tp,
                  prefill_pp=args.prefill_pp, decode_pp=args.decode_pp,
                  isl=args.isl, osl=args.osl, concurrency=args.concurrency, rate=args.rate, requests=args.requests,
                  profile=args.profile, backend=args.backend, local_prefill_tokens=args.local_prefill_tokens,
                  first_token_from_prefill=args.first_token_from_prefill, max_prefill_tokens=args.max_prefill_tokens)
    print(json.dumps(out) if args.json else format_prediction(out))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from placement.validation_report import provenance, run_validation, write_calibration, write_report

    rep = run_validation(args.csv, jobs=max(1, args.jobs))
    rep.provenance = provenance("python -m placement " + " ".join(args.argv))
    out = write_report(rep, args.out)
    if args.write_calibration:
        write_calibration(rep, args.write_calibration)
    for row in rep.table(True):
        print(f"{row.backend:7} {row.label:24} {row.points:5} points  TTFT MAPE {row.ttft_mape:6.1f}%  "
              f"TPOT MAPE {row.tpot_mape:6.1f}%")
    print(f"wrote {out}/README.md and results.json")
    return 0


def _replan_study(args: argparse.Namespace) -> int:
    from placement.replan_study import main_study
    from placement.workload import day_periods

    if args.intervals < 2 or args.sample_s <= 0 or args.truth_factor <= 0:
        raise PlacementError(f"replan-study needs --intervals >= 2, --sample-s > 0 and --truth-factor > 0; got "
                             f"{args.intervals}, {args.sample_s}, {args.truth_factor}")
    res = main_study(args.out, "python -m placement " + " ".join(args.argv), model=args.model,
                     hardware=args.hardware, periods=day_periods(intervals=args.intervals), sample_s=args.sample_s,
                     truth_factor=args.truth_factor, seed=args.seed)
    for name, st in res["strategies"].items():
        m = st["summary"]
        print(f"{name:13} attainment {m['attainment']:.3f}  GPU-hours {m['gpu_hours']:7.1f}  "
              f"in SLO per GPU-hour {m['in_slo_per_gpu_hour']}  periods below target {m['periods_below_target']}")
    print(f"wrote {args.out}/README.md, results.json and day.png")
    return 0


def _profile(args: argparse.Namespace | None = None) -> int:
    # NOTE: the profiler runs vLLM; it lives with the benchmarks so that placement imports no engine code.
    print("the profiler moved: run `python -m benchmarks.profile --model MODEL --out PATH ...` "
          "(same options as before)", file=sys.stderr)
    return 2


def _replay_validate(args: argparse.Namespace) -> int:
    from placement.replay_validation import markdown, run, verdicts, write

    rep = run(args.ref, args.config)
    if args.plan:
        rep["verdicts"] = verdicts(args.plan)
    print(markdown(write(rep, args.out, "python -m placement " + " ".join(args.argv))))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if [a for a in argv if not a.startswith("-")][:1] == ["profile"]:
        return _profile()
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    handlers: dict[str, Any] = {"plan": _plan, "roofline": _roofline, "predict": _predict, "validate": _validate,
                                "replan-study": _replan_study, "replay-validate": _replay_validate,
                                "profile": _profile}
    try:
        return int(handlers[args.cmd](args))
    except PlacementError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
