"""`python -m benchmarks.batching`: the batch-size economics of decode, measured on this box, beside the
ceiling `placement roofline` computes from the box's own measured memory bandwidth and matmul rate.

One real vLLM engine (the bundled model, fp32, one thread: what a CPU worker runs) decodes B sequences
of `--context` tokens together for B in `--batches`; each point is the median step time while all B run
(TPOT) and B / TPOT (tokens/s). The ceiling: weights + KV bytes per step over the measured single-thread
read bandwidth, or FLOPs over the measured single-thread fp32 matmul rate, whichever is longer. The knee
is the first batch whose measured TPOT is at least 1.5x the single-sequence TPOT: below it one more
sequence rides on the weight read almost for free; past it every step pays for the extra work.

    python -m benchmarks.batching --out benchmarks/results/batching-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.compare.provenance import Provenance, header_lines, write_artefact
from benchmarks.profile import CPU_ENV, _run_steps

KNEE = 1.5


def measure_bandwidth_gbps(mib: int = 256, repeats: int = 5) -> float:
    """Single-thread read bandwidth: the best of `repeats` sums over a `mib` MiB float32 array."""
    import numpy as np

    a = np.ones(mib << 18, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def measure_matmul_tflops(n: int = 1024, repeats: int = 5) -> float:
    """Single-thread fp32 matmul rate (torch, as the engine's kernels run), best of `repeats`."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.rand(n, n), torch.rand(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e12


def measure_decode(model: str, batches: list[int], context: int, steps: int) -> tuple[list[dict[str, Any]], Any]:
    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    import numpy as np
    import vllm

    from engine.models import resolve_model
    from placement.catalog import model_from_hf_config

    path = resolve_model(model)
    arch = model_from_hf_config(path)
    kv_mib = int(max(batches) * (context + steps + 80) * arch.kv_bytes_per_token("fp32") / 2**20 * 1.2) + 64
    llm = vllm.LLM(model=str(path), dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
                   kv_cache_memory_bytes=kv_mib << 20, max_model_len=context + steps + 80,
                   enable_prefix_caching=False, max_num_seqs=max(batches),
                   max_num_batched_tokens=max(2048, context + steps + 80), seed=0)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    vocab = min(arch.vocab, 32000)
    _run_steps(engine, [[int(t) for t in rng.integers(100, vocab, size=32)]], 4, "warmup")
    rows = []
    for b in batches:
        prompts = [[int(t) for t in rng.integers(100, vocab, size=context)] for _ in range(b)]
        full = _decode_steps(engine, prompts, steps, f"b{b}")
        tpot = statistics.median(full) if full else float("nan")
        rows.append({"batch": b, "context": context, "steps_timed": len(full), "tpot_ms": round(tpot * 1e3, 3),
                     "tokens_per_s": round(b / tpot, 2), "per_user_tokens_per_s": round(1 / tpot, 2)})
        print(f"batch {b:>3}: TPOT {tpot * 1e3:8.2f} ms, {b / tpot:8.1f} tokens/s", flush=True)
    return rows, arch


def _decode_steps(engine: Any, prompts: list[list[int]], steps: int, tag: str) -> list[float]:
    """Seconds of each engine step in which all the prompts decode together: after every one has its first
    token (a big batch's prompts take several chunked-prefill steps) and before any finishes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # NOTE: max_tokens leaves room for the steps a chunked prefill spreads the first tokens over
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True, temperature=0.0)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=p), params)
    started: set[str] = set()
    times: list[float] = []
    for _ in range(10_000):  # NOTE: bounded; each request ends within its max_tokens
        if not engine.has_unfinished_requests():
            break
        all_decoding = len(started) == len(prompts)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if all_decoding and len(times) < steps and not any(o.finished for o in outs):
            times.append(dt)
        started.update(o.request_id for o in outs if o.outputs and o.outputs[0].token_ids)
        if len(times) >= steps:
            for i in range(len(prompts)):
                engine.abort_request([f"{tag}-{i}"])
    return times


def knee(rows: list[dict[str, Any]], key: str = "tpot_ms") -> int | None:
    base = rows[0][key]
    return next((r["batch"] for r in rows if r[key] >= KNEE * base), None)


def run(args: argparse.Namespace, prov: Provenance) -> dict[str, Any]:
    from placement.catalog import HardwareArch
    from placement.roofline import decode_roofline

    bw = measure_bandwidth_gbps()
    tflops = measure_matmul_tflops()
    print(f"this box, one thread: read bandwidth {bw:.1f} GB/s, fp32 matmul {tflops * 1e3:.1f} GFLOP/s", flush=True)
    rows, arch = measure_decode(args.model, args.batches, args.context, args.steps)
    hw = HardwareArch("this CPU, one thread", {"fp32": tflops}, 24.0, bw / 1e3, 0.0, 0.0, 1,
                      gpu_hour_usd=args.hour_usd)
    ceiling = decode_roofline(arch, hw, gpus=1, weight_dtype="fp32", kv_dtype="fp32", context=args.context,
                              batches=args.batches, gpu_hour_usd=args.hour_usd)
    roof = [{"batch": p.batch, "tpot_ms": round(p.tpot_s * 1e3, 3), "tokens_per_s": round(p.total_tok_s, 2),
             "bound": p.bound} for p in ceiling]
    for r in rows:
        r["usd_per_m_output_tokens"] = round(args.hour_usd / (r["tokens_per_s"] * 3600) * 1e6, 4)
    compute_from = next((p["batch"] for p in roof if p["bound"] == "compute"), None)
    return {"model": args.model, "context": args.context, "hour_usd": args.hour_usd,
            "bandwidth_gbps": round(bw, 2), "matmul_tflops": round(tflops, 5), "measured": rows, "roofline": roof,
            "knee_batch": knee(rows), "roofline_compute_bound_from": compute_from,
            "weights_mib": round(arch.weight_bytes("fp32") / 2**20, 1)}


def write_report(out: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, r = report["measured"], report["roofline"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    b = [x["batch"] for x in m]
    a1.plot(b, [x["tpot_ms"] for x in m], "o-", label="measured (vLLM, 1 thread)")
    a1.plot(b, [x["tpot_ms"] for x in r], "--", label="roofline from measured bandwidth / FLOP rate")
    a2.plot(b, [x["tokens_per_s"] for x in m], "o-", label="measured")
    a2.plot(b, [x["tokens_per_s"] for x in r], "--", label="roofline")
    for ax, y in ((a1, "TPOT (ms)"), (a2, "decode tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences decoding together)")
        ax.set_ylabel(y)
        ax.legend(fontsize=8)
        if report["knee_batch"]:
            ax.axvline(report["knee_batch"], color="grey", lw=0.8)
    fig.suptitle(f"{report['model']}, context {report['context']}: decode vs batch size")
    fig.tight_layout()
    fig.savefig(out / "batching.tmp.png", dpi=100)
    plt.close(fig)
    (out / "batching.tmp.png").replace(out / "batching.png")
    lines = [f"# Decode batch-size economics on this box: {report['model']}", "", *header_lines(report), "",
             f"Measured single-thread read bandwidth {report['bandwidth_gbps']} GB/s and fp32 matmul "
             f"{report['matmul_tflops'] * 1e3:.1f} GFLOP/s (the roofline's inputs); weights {report['weights_mib']} MiB "
             f"fp32; context {report['context']} tokens per sequence; ${report['hour_usd']}/hour for the box.", "",
             "| batch | TPOT ms | tokens/s | $/M output tokens | roofline TPOT ms | roofline tokens/s | bound |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for x, y in zip(m, r, strict=True):
        lines.append(f"| {x['batch']} | {x['tpot_ms']} | {x['tokens_per_s']} | {x['usd_per_m_output_tokens']} | "
                     f"{y['tpot_ms']} | {y['tokens_per_s']} | {y['bound']} |")
    lines += ["", f"Knee (first batch with TPOT >= {KNEE}x batch 1): {report['knee_batch']}; the roofline turns "
              f"compute-bound from batch {report['roofline_compute_bound_from']}. `batching.png` plots both."]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.batching", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for results.json, README.md and batching.png")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12, help="decode steps timed per batch")
    ap.add_argument("--hour-usd", type=float, default=0.10, help="price of the box per hour")
    args = ap.parse_args(argv)
    try:
        args.batches = sorted({int(x) for x in args.batches.split(",")})
    except ValueError:
        ap.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if args.batches[0] < 1 or args.context < 1 or args.steps < 2:
        ap.error("--batches must be >= 1, --context >= 1 and --steps >= 2")
    prov = Provenance.start(["python", "-m", "benchmarks.batching"], argv)
    report = run(args, prov)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_artefact(out / "results.json", prov, report)
    write_report(out, json.loads((out / "results.json").read_text()))
    print(f"wrote {out}/results.json, README.md and batching.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
