"""`python -m benchmarks.profile`: measure a real vLLM engine on this machine and write the placement
planner's profile YAML (format: placement.profile_io; docs/placement.md).

Prefill: batches of token-id prompts run with max_tokens=1, timed over `engine.step()` calls.
Decode: B prompts of length L run a few steps with ignore_eos; each decode step is timed with its batch
and total context. Both are fitted to DistServe's form by non-negative least squares. It lives with the
benchmarks, not in placement/, because it runs the engine: the planner imports no engine code.

    python -m benchmarks.profile --model smollm2 --out manifests/profiles/cpu-smollm2.yaml
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import socket
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from placement.catalog import model_from_hf_config
from placement.profile_fit import fit_coefficients
from placement.profile_io import (
    EngineInfo,
    FitInfo,
    MachineInfo,
    ProfileData,
    ProfiledModel,
    TransferInfo,
    save_profile,
)

logger = logging.getLogger(__name__)

CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}


def _run_steps(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> list[tuple[float, int]]:
    """Submit prompts, step until done; return (seconds, live requests) for every step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=p), params)
    steps: list[tuple[float, int]] = []
    live = len(prompts)
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append((time.perf_counter() - t0, live))
        live -= sum(1 for o in outs if o.finished)
    return steps


def profile_engine(model_spec: str, out: str | Path, *, kv_cache_mib: int = 128, max_model_len: int = 2048,
                   prefill_lens: list[int] | None = None, decode_batches: list[int] | None = None,
                   decode_contexts: list[int] | None = None, decode_steps: int = 6, repeats: int = 2,
                   gpu_hour_usd: float = 0.1) -> ProfileData:
    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    from engine.models import resolve_model  # lazy: the lead's model preparation (may build a cache dir)

    prefill_lens = prefill_lens or [16, 64, 128, 256, 512]
    decode_batches = decode_batches or [1, 4, 8, 16]
    decode_contexts = decode_contexts or [64, 256]
    path = resolve_model(model_spec)
    arch = model_from_hf_config(path)
    import torch
    import vllm

    llm = vllm.LLM(model=str(path), dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
                   kv_cache_memory_bytes=kv_cache_mib * 2**20, max_model_len=max_model_len,
                   enable_prefix_caching=False, max_num_seqs=max(max(decode_batches), 4),
                   max_num_batched_tokens=max(max_model_len, 2 * max(prefill_lens)), seed=0)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    vocab = min(arch.vocab, 32000)

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(100, vocab, size=n)]

    _run_steps(engine, [prompt(32)], 4, "warmup")
    pre_samples: list[list[float]] = []
    batches = [[n] for n in prefill_lens] + [[n, n] for n in prefill_lens[1:3]] + [[64] * 4]
    for lens in batches:
        times = [sum(s for s, _ in _run_steps(engine, [prompt(n) for n in lens], 1, "p")) for _ in range(repeats)]
        pre_samples.append([float(sum(lens)), float(sum(n * n for n in lens)), min(times) * 1e3])
        logger.info("prefill %s tokens: %.2f ms", lens, min(times) * 1e3)
    dec_samples: list[list[float]] = []
    for ctx in decode_contexts:
        for b in decode_batches:
            steps = _run_steps(engine, [prompt(ctx) for _ in range(b)], decode_steps + 1, "d")[1:]
            full = [sec for sec, live in steps if live == b]
            if full:
                # NOTE: the median step of each (batch, context) point resists CPU-contention spikes.
                mid_ctx = b * (ctx + 1 + len(full) / 2)
                dec_samples.append([float(b), float(mid_ctx), statistics.median(full) * 1e3])
            logger.info("decode batch %d ctx %d: median %.2f ms", b, ctx,
                        statistics.median(s for s, _ in steps) * 1e3 if steps else float("nan"))
    coefficients, p_r2, d_r2 = fit_coefficients(pre_samples, dec_samples)
    kvb = arch.kv_bytes_per_token("fp32")
    cache = engine.vllm_config.cache_config
    blocks = getattr(cache, "num_gpu_blocks", None)
    block_size = int(getattr(cache, "block_size", 128) or 128)
    capacity = int(blocks * block_size) if blocks else kv_cache_mib * 2**20 // kvb
    prof = ProfileData(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        machine=MachineInfo(hostname=socket.gethostname(), platform=platform.platform(),
                            processor=platform.processor() or platform.machine(), cpu_count=os.cpu_count() or 1,
                            python=platform.python_version(), torch=torch.__version__, vllm=vllm.__version__,
                            device="cpu"),
        model=ProfiledModel(spec=model_spec, path=str(path), name=arch.name, layers=arch.layers, hidden=arch.hidden,
                            heads=arch.heads, kv_heads=arch.kv_heads, head_dim=arch.head_dim, params=arch.params),
        engine=EngineInfo(dtype="float32", tp=1, block_size=block_size, kv_cache_mib=kv_cache_mib,
                          max_model_len=max_model_len, threads=int(os.environ.get("OMP_NUM_THREADS", "1"))),
        coefficients=coefficients,
        fit=FitInfo(prefill_r2=round(p_r2, 4), decode_r2=round(d_r2, 4),
                    prefill_samples=[[round(v, 4) for v in s] for s in pre_samples],
                    decode_samples=[[round(v, 4) for v in s] for s in dec_samples]),
        kv_bytes_per_token=kvb, kv_capacity_tokens=capacity, transfer=TransferInfo(), gpu_hour_usd=gpu_hour_usd)
    save_profile(prof, out)
    return prof


def _csv_ints(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile",
                                 description="measure a vLLM engine on this machine and write a placement profile YAML")
    ap.add_argument("--model", required=True, help="smollm2, tiny-llama, or a local HF model folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-cache-mib", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prefill-lens", type=_csv_ints, default=None, help="e.g. 16,64,128,256,512")
    ap.add_argument("--decode-batches", type=_csv_ints, default=None, help="e.g. 1,4,8,16")
    ap.add_argument("--decode-contexts", type=_csv_ints, default=None, help="e.g. 64,256")
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gpu-hour-usd", type=float, default=0.1)
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    prof = profile_engine(args.model, args.out, kv_cache_mib=args.kv_cache_mib, max_model_len=args.max_model_len,
                          prefill_lens=args.prefill_lens, decode_batches=args.decode_batches,
                          decode_contexts=args.decode_contexts, decode_steps=args.decode_steps,
                          repeats=args.repeats, gpu_hour_usd=args.gpu_hour_usd)
    c = prof.coefficients
    print(f"wrote {args.out}: prefill {c.prefill_a:.4g}*sum(l) + {c.prefill_b:.4g}*sum(l^2) + {c.prefill_c:.4g} ms "
          f"(R^2 {prof.fit.prefill_r2}); decode {c.decode_a:.4g}*ctx + {c.decode_b:.4g}*batch + {c.decode_c:.4g} ms "
          f"(R^2 {prof.fit.decode_r2}); KV {prof.kv_bytes_per_token} B/token, capacity {prof.kv_capacity_tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
