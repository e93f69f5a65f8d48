"""`python -m benchmarks.speculation`: n-gram speculative decoding (vLLM prompt lookup) against plain decoding
on this box, on a workload where it should help (templated, code-like text that repeats its prompt) and one
where it should not (open prose: the committed eval set's prompts).

Each configuration runs in its own process (one engine at a time on this box, and Prometheus counters of
its own): one vLLM engine, the bundled model, fp32, one thread, greedy, one request at a time. Reported per
workload: TPOT p50/p99 (decode seconds per output token after the first), the acceptance rate (accepted /
proposed draft tokens, vLLM's counters), tokens per step, and whether the greedy outputs are identical;
a difference is shown with the plain engine's top-2 logprob gap at the first differing token (a near-tie
there is what vLLM's numerics allow).

    python -m benchmarks.speculation --out benchmarks/results/speculation-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.compare.provenance import Provenance, header_lines, write_artefact
from benchmarks.profile import CPU_ENV

REPO = Path(__file__).resolve().parents[1]
NEAR_TIE = 0.05  # nats between the top two logprobs


def templated_prompts() -> list[tuple[str, str, int]]:
    """Text whose continuation repeats what the prompt already holds (where prompt lookup proposes well)."""
    ops = [("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"), ("mod", "%"), ("pow", "**")]
    code = "".join(f"def {n}(a, b):\n    return a {o} b\n\n" for n, o in ops[:4])
    rows = "".join(f'{{"id": {i}, "name": "item-{i}", "price": {i * 3}.00, "in_stock": true}},\n' for i in range(6))
    csv = "".join(f"{2020 + i},Q{q},{100 + 7 * i + q}\n" for i in range(3) for q in range(1, 5))
    html = "".join(f'<li class="item"><a href="/p/{i}">Product {i}</a></li>\n' for i in range(5))
    return [("code", code + "def mod(a, b):\n", 48), ("json", "[\n" + rows, 48), ("csv", "year,quarter,sales\n" + csv, 48),
            ("html", "<ul>\n" + html, 48),
            ("repeat", "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox", 40),
            ("list", "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,", 40)]


def open_prompts(limit: int) -> list[tuple[str, str, int]]:
    rows = [json.loads(line) for line in (REPO / "benchmarks" / "evalset" / "prompts.jsonl").read_text().splitlines()
            if line.strip()]
    return [(r["id"], r["prompt"], int(r.get("max_tokens", 32))) for r in rows[:limit]]


def engine_run(spec_tokens: int, prompts: list[tuple[str, str, int]], out: Path) -> None:
    """In a child process: one engine, every prompt alone, greedy; timings, outputs, counters to `out`."""
    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    import vllm
    from vllm import SamplingParams

    from engine.models import resolve_model

    kw: dict[str, Any] = {}
    if spec_tokens:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec_tokens,
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = vllm.LLM(model=str(resolve_model("smollm2")), dtype="float32", enforce_eager=True,
                   distributed_executor_backend="uni", kv_cache_memory_bytes=256 << 20, max_model_len=1024,
                   enable_prefix_caching=False, max_num_seqs=4, seed=0, disable_log_stats=False, **kw)
    engine = llm.llm_engine
    from vllm.inputs import TextPrompt

    engine.add_request("warm", TextPrompt(prompt="Hello"), SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    def counts() -> tuple[float, float]:
        m = {x.name: getattr(x, "value", 0) for x in llm.get_metrics()}
        return m.get("vllm:spec_decode_num_draft_tokens", 0.0), m.get("vllm:spec_decode_num_accepted_tokens", 0.0)

    rows = []
    for name, prompt, n in prompts:
        before = counts()
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)
        engine.add_request(name, TextPrompt(prompt=prompt), params)
        t_first, steps, out_ids, lps = None, 0, [], []
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for o in engine.step():
                c = o.outputs[0]
                if t_first is None and c.token_ids:
                    t_first = time.perf_counter()
                out_ids, lps = list(c.token_ids), c.logprobs or []
            steps += 1
        t_end = time.perf_counter()
        gaps = [sorted((x.logprob for x in d.values()), reverse=True) for d in lps]
        after = counts()
        rows.append({"name": name, "tokens": out_ids, "steps": steps, "ttft_s": (t_first or t_end) - t0,
                     "drafted": after[0] - before[0], "accepted": after[1] - before[1],
                     "tpot_s": (t_end - (t_first or t_end)) / max(1, len(out_ids) - 1),
                     "top2_gap": [round(g[0] - g[1], 4) if len(g) > 1 else None for g in gaps]})
    counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and
                hasattr(m, "value")}
    out.write_text(json.dumps({"rows": rows, "counters": counters}))


def _child(spec_tokens: int, prompts: list[tuple[str, str, int]], tmp: Path) -> dict[str, Any]:
    src, dst = tmp / f"in-{spec_tokens}.json", tmp / f"out-{spec_tokens}.json"
    src.write_text(json.dumps(prompts))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speculation", "--engine-child", str(spec_tokens),
                           str(src), str(dst)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"engine run (speculative tokens {spec_tokens}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(dst.read_text())


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def compare(plain: dict[str, Any], spec: dict[str, Any], names: set[str]) -> dict[str, Any]:
    p = [r for r in plain["rows"] if r["name"] in names]
    s = {r["name"]: r for r in spec["rows"] if r["name"] in names}
    diffs = []
    for r in p:
        a, b = r["tokens"], s[r["name"]]["tokens"]
        if a != b:
            i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            gap = r["top2_gap"][i] if i < len(r["top2_gap"]) else None
            diffs.append({"prompt": r["name"], "first_diff_at": i, "plain_top2_gap": gap,
                          "near_tie": gap is not None and gap <= NEAR_TIE})
    out_tokens = sum(len(r["tokens"]) for r in p)

    def side(rows: list[dict[str, Any]]) -> dict[str, Any]:
        t = [r["tpot_s"] for r in rows]
        return {"tpot_p50_ms": round(_pct(t, 50) * 1e3, 2), "tpot_p99_ms": round(_pct(t, 99) * 1e3, 2),
                "ttft_p50_ms": round(_pct([r["ttft_s"] for r in rows], 50) * 1e3, 2),
                "tokens_per_step": round(sum(len(r["tokens"]) for r in rows) / max(1, sum(r["steps"] for r in rows)), 3)}

    drafted = sum(r["drafted"] for r in s.values())
    return {"prompts": len(p), "output_tokens": out_tokens, "plain": side(p), "speculative": side(list(s.values())),
            "acceptance_rate": round(sum(r["accepted"] for r in s.values()) / drafted, 4) if drafted else None,
            "identical": sum(r["tokens"] == s[r["name"]]["tokens"] for r in p), "differences": diffs}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--engine-child"]:
        engine_run(int(argv[1]), [tuple(x) for x in json.loads(Path(argv[2]).read_text())], Path(argv[3]))
        return 0
    ap = argparse.ArgumentParser(prog="python -m benchmarks.speculation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for results.json and README.md")
    ap.add_argument("--tokens", type=int, default=4, help="draft tokens proposed per step")
    ap.add_argument("--open-prompts", type=int, default=10, help="eval-set prompts (open text)")
    args = ap.parse_args(argv)
    if not 1 <= args.tokens <= 16 or args.open_prompts < 1:
        ap.error(f"--tokens must be in 1..16 and --open-prompts >= 1, got {args.tokens} and {args.open_prompts}")
    prov = Provenance.start(["python", "-m", "benchmarks.speculation"], argv)
    templ, opn = templated_prompts(), open_prompts(args.open_prompts)
    with tempfile.TemporaryDirectory() as tmp:
        plain = _child(0, templ + opn, Path(tmp))
        spec = _child(args.tokens, templ + opn, Path(tmp))
    report = {"speculative_tokens": args.tokens, "counters": spec["counters"],
              "workloads": {"templated": compare(plain, spec, {n for n, *_ in templ}),
                            "open": compare(plain, spec, {n for n, *_ in opn})}}
    c = spec["counters"]
    proposed = c.get("vllm:spec_decode_num_draft_tokens")
    report["acceptance_rate_all"] = round(c.get("vllm:spec_decode_num_accepted_tokens", 0) / proposed, 4) if proposed else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_artefact(out / "results.json", prov, report)
    rep = json.loads((out / "results.json").read_text())
    lines = ["# n-gram speculative decoding vs plain decoding on this box (SmolLM2, fp32, one thread)", "",
             *header_lines(rep), "",
             f"{args.tokens} draft tokens per step; greedy; one request at a time; acceptance over both workloads "
             f"{report['acceptance_rate_all']}.", "",
             "| workload | prompts | TPOT p50 plain ms | TPOT p50 spec ms | TPOT p99 plain ms | TPOT p99 spec ms | "
             "acceptance | tokens/step spec | identical greedy outputs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, w in report["workloads"].items():
        lines.append(f"| {name} | {w['prompts']} | {w['plain']['tpot_p50_ms']} | {w['speculative']['tpot_p50_ms']} | "
                     f"{w['plain']['tpot_p99_ms']} | {w['speculative']['tpot_p99_ms']} | {w['acceptance_rate']} | "
                     f"{w['speculative']['tokens_per_step']} | {w['identical']} of {w['prompts']} |")
    for name, w in report["workloads"].items():
        for d in w["differences"]:
            lines.append(f"- {name}/{d['prompt']}: first differing token {d['first_diff_at']}; the plain engine's "
                         f"top-2 logprob gap there {d['plain_top2_gap']} ({'a near-tie' if d['near_tie'] else 'NOT a near-tie'})")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-(len(report['workloads']) + 2):]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
