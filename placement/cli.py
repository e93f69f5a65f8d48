"""Command line: `python -m placement {plan,roofline,predict,profile}`. The only module that prints.

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
    r.add_argument("--weight-dtype", default="bf16", choices=["fp8", "bf16", "fp16", "fp32"])
    r.add_argument("--kv-dtype", default="bf16", choices=["fp8", "bf16", "fp16", "fp32"])
    r.add_argument("--context", type=int, required=True, help="tokens of context per sequence")
    r.add_argument("--batch", type=_csv_ints, default=[1, 8, 32])
    r.add_argument("--gpu-hour-usd", type=float, default=None)
    r.add_argument("--json", action="store_true")

    q = sub.add_parser("predict", help="simulate one deployment shape under a fixed workload")
    q.add_argument("--model", default="llama-3.1-8b")
    q.add_argument("--hardware", default="h100-sxm")
    q.add_argument("--profile", default=None, help="measured profile YAML instead of model/hardware")
    q.add_argument("--weight-dtype", default="bf16", choices=["fp8", "bf16", "fp16", "fp32"])
    q.add_argument("--kv-dtype", default="bf16", choices=["fp8", "bf16", "fp16", "fp32"])
    q.add_argument("--mode", default="disaggregated", choices=["colocated", "disaggregated"])
    q.add_argument("--instances", type=int, default=1)
    q.add_argument("--tp", type=int, default=1)
    q.add_argument("--prefill-instances", type=int, default=1)
    q.add_argument("--prefill-tp", type=int, default=1)
    q.add_argument("--decode-instances", type=int, default=1)
    q.add_argument("--decode-tp", type=int, default=1)
    q.add_argument("--isl", type=int, required=True)
    q.add_argument("--osl", type=int, required=True)
    g = q.add_mutually_exclusive_group(required=True)
    g.add_argument("--concurrency", type=int)
    g.add_argument("--rate", type=float)
    q.add_argument("--requests", type=int, default=None)
    q.add_argument("--json", action="store_true")

    f = sub.add_parser("profile", help="measure a vLLM engine on this machine and write a profile YAML")
    f.add_argument("--model", required=True, help="smollm2, tiny-llama, or a local HF model folder")
    f.add_argument("--out", required=True)
    f.add_argument("--kv-cache-mib", type=int, default=128)
    f.add_argument("--max-model-len", type=int, default=2048)
    f.add_argument("--prefill-lens", default=None, help="e.g. 16,64,128,256,512")
    f.add_argument("--decode-batches", default=None, help="e.g. 1,4,8,16")
    f.add_argument("--decode-contexts", default=None, help="e.g. 64,256")
    f.add_argument("--decode-steps", type=int, default=6)
    f.add_argument("--repeats", type=int, default=2)
    f.add_argument("--gpu-hour-usd", type=float, default=0.1)
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


def _predict(args: argparse.Namespace) -> int:
    from placement.predict import format_prediction, predict

    out = predict(model=args.model, hardware=args.hardware, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype,
                  mode=args.mode, instances=args.instances, tp=args.tp, prefill_instances=args.prefill_instances,
                  prefill_tp=args.prefill_tp, decode_instances=args.decode_instances, decode_tp=args.decode_tp,
                  isl=args.isl, osl=args.osl, concurrency=args.concurrency, rate=args.rate, requests=args.requests,
                  profile=args.profile)
    print(json.dumps(out) if args.json else format_prediction(out))
    return 0


def _profile(args: argparse.Namespace) -> int:
    from placement.profiler import profile_engine

    def ints(s: str | None) -> list[int] | None:
        return _csv_ints(s) if s else None

    prof = profile_engine(args.model, args.out, kv_cache_mib=args.kv_cache_mib, max_model_len=args.max_model_len,
                          prefill_lens=ints(args.prefill_lens), decode_batches=ints(args.decode_batches),
                          decode_contexts=ints(args.decode_contexts), decode_steps=args.decode_steps,
                          repeats=args.repeats, gpu_hour_usd=args.gpu_hour_usd)
    c = prof.coefficients
    print(f"wrote {args.out}: prefill {c.prefill_a:.4g}*sum(l) + {c.prefill_b:.4g}*sum(l^2) + {c.prefill_c:.4g} ms "
          f"(R^2 {prof.fit.prefill_r2}); decode {c.decode_a:.4g}*ctx + {c.decode_b:.4g}*batch + {c.decode_c:.4g} ms "
          f"(R^2 {prof.fit.decode_r2}); KV {prof.kv_bytes_per_token} B/token, capacity {prof.kv_capacity_tokens} tokens")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    handlers: dict[str, Any] = {"plan": _plan, "roofline": _roofline, "predict": _predict, "profile": _profile}
    try:
        return int(handlers[args.cmd](args))
    except PlacementError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
