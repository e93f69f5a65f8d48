"""vLLM's own benchmark client (`vllm bench serve`) against an endpoint, beside `benchmarks.serve` on the
same workload: fixed input and output lengths (`ignore_eos`), the same number of requests at the same
Poisson rate, for both of vLLM's OpenAI backends (`openai`: /v1/completions, `openai-chat`:
/v1/chat/completions). Prints TTFT and ITL p50/p99 of both clients side by side and their ratio.

    python -m benchmarks.vllm_bench --endpoint http://127.0.0.1:8000 [--input-len 128 --output-len 32
        --num-prompts 24 --rate 1.0] [--out benchmarks/results/vllm-bench-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.client import first_model
from benchmarks.compare.provenance import Provenance
from benchmarks.serve import run_benchmark
from benchmarks.stats import SLO
from benchmarks.workload import LongDocWorkload

BACKENDS = {"openai": ("/v1/completions", "completions"), "openai-chat": ("/v1/chat/completions", "chat")}
TIMEOUT_S = 900


def vllm_bench(endpoint: str, model: str, tokenizer: str, backend: str, *, input_len: int, output_len: int,
               num_prompts: int, rate: float, seed: int) -> dict[str, Any]:
    """One `vllm bench serve` run; its own result JSON (times in ms)."""
    path, _ = BACKENDS[backend]
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "benchmarks.vllm_cli", "bench", "serve", "--backend", backend,
               "--base-url", endpoint, "--endpoint", path, "--model", model, "--tokenizer", tokenizer,
               "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
               str(output_len), "--random-range-ratio", "0", "--num-prompts", str(num_prompts),
               "--request-rate", str(rate), "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--save-result",
               "--result-dir", d, "--result-filename", "r.json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"vllm bench serve ({backend}) failed with {proc.returncode}:\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads((Path(d) / "r.json").read_text())


def ours(endpoint: str, model: str, backend: str, *, input_len: int, output_len: int, num_prompts: int,
         rate: float, seed: int) -> dict[str, Any]:
    """benchmarks.serve on the same workload; the same fields as vLLM's result (ms)."""
    _, api = BACKENDS[backend]
    res = run_benchmark(endpoint, model, LongDocWorkload(input_len, output_len, jitter=0.0), [rate],
                        num_requests=num_prompts, seed=seed, api=api, ignore_eos=True,
                        slo=SLO(ttft_s=60.0, tpot_s=10.0), warmup_requests=0, request_timeout_s=300.0)
    s, recs = res.steps[0].summary, res.steps[0].records
    return {"completed": s.succeeded, "failed": s.sent - s.succeeded,
            "total_input_tokens": sum(r.prompt_tokens or 0 for r in recs if r.ok),
            "total_output_tokens": sum(r.completion_tokens or 0 for r in recs if r.ok),
            "median_ttft_ms": s.ttft.p50 * 1e3, "p99_ttft_ms": s.ttft.p99 * 1e3,
            "median_itl_ms": s.itl.p50 * 1e3, "p99_itl_ms": s.itl.p99 * 1e3,
            "median_tpot_ms": s.tpot.p50 * 1e3}


FIELDS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def compare(endpoint: str, tokenizer: str, *, backends: list[str], input_len: int, output_len: int,
            num_prompts: int, rate: float, seed: int = 0, model: str | None = None) -> dict[str, Any]:
    model = model or first_model(endpoint, None)
    kw = {"input_len": input_len, "output_len": output_len, "num_prompts": num_prompts, "rate": rate, "seed": seed}
    rows = {}
    for backend in backends:
        v = vllm_bench(endpoint, model, tokenizer, backend, **kw)
        o = ours(endpoint, model, backend, **kw)
        rows[backend] = {"vllm_bench": {k: v.get(k) for k in ("completed", "failed", "total_input_tokens",
                                                              "total_output_tokens", *FIELDS)},
                         "benchmarks_serve": o,
                         "ratio": {k: (o[k] / v[k]) if v.get(k) else None for k in FIELDS}}
    return {"model": model, "workload": kw, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = ["| backend | client | done | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for backend, row in result["rows"].items():
        for client in ("vllm_bench", "benchmarks_serve"):
            r = row[client]
            lines.append(f"| {backend} | {client.replace('_', ' ')} | {r['completed']} | "
                         + " | ".join(f"{r[k]:.1f}" for k in FIELDS) + " |")
        lines.append(f"| {backend} | ours / vllm bench | | " + " | ".join(
            f"{row['ratio'][k]:.3f}" if row["ratio"][k] else "-" for k in FIELDS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from engine.models import resolve_model

    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="served model name (default: the endpoint's first)")
    p.add_argument("--tokenizer", default="smollm2", help="model alias or local dir for vllm bench's tokenizer")
    p.add_argument("--backends", default="openai,openai-chat")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the result JSON here (with provenance)")
    a = p.parse_args(argv)
    prov = Provenance.start(["python", "-m", "benchmarks.vllm_bench"], sys.argv[1:] if argv is None else argv)
    tok = a.tokenizer if Path(a.tokenizer).is_dir() else str(resolve_model(a.tokenizer))
    result = prov.start_fields() | compare(a.endpoint, tok, backends=a.backends.split(","), input_len=a.input_len,
                                           output_len=a.output_len, num_prompts=a.num_prompts, rate=a.rate,
                                           seed=a.seed, model=a.model) | prov.end_fields()
    print(table(result))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
