"""Greedy-output equality: an OpenAI endpoint vs another endpoint vs offline vLLM, on a committed eval set.

Disaggregated, colocated and offline serving of the same model with greedy sampling must produce the
same tokens; any difference is a bug. Token ids come from vLLM's ``return_token_ids`` extension or
from ``logprobs`` tokens rendered as ``token_id:N``; a server that supports neither is compared by text
(characters). CLI::

    python -m benchmarks.quality --endpoint http://127.0.0.1:8000 --model tiny-llama \
        [--compare-endpoint URL] [--offline-model-dir DIR] [--out quality.json]

Exit status 1 when any two sources differ on any prompt.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.client import APIS, endpoint_url

logger = logging.getLogger(__name__)

EVALSET = Path(__file__).parent / "evalset" / "prompts.jsonl"
_VLLM_EXTRAS = {"return_token_ids": True, "return_tokens_as_token_ids": True}


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class GreedyOutput:
    id: str
    text: str
    token_ids: list[int] | None


@dataclass(frozen=True)
class PromptComparison:
    id: str
    match: bool
    first_divergence: int | None
    unit: str
    len_a: int
    len_b: int


@dataclass(frozen=True)
class QualityComparison:
    a: str
    b: str
    exact_match_rate: float
    prompts: list[PromptComparison]


def load_evalset(path: Path = EVALSET) -> list[EvalPrompt]:
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                d = json.loads(line)
                items.append(EvalPrompt(str(d["id"]), str(d["prompt"]), int(d["max_tokens"])))
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{path}:{n}: need JSON with id, prompt, max_tokens ({exc})") from exc
    if len({p.id for p in items}) != len(items):
        raise ValueError(f"{path}: prompt ids must be unique")
    return items


def _token_ids(choice: dict, api: str) -> list[int] | None:
    if isinstance(choice.get("token_ids"), list):
        return [int(t) for t in choice["token_ids"]]
    lp = choice.get("logprobs") or {}
    tokens = [t["token"] for t in lp.get("content") or []] if api == "chat" else lp.get("tokens") or []
    if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return [int(t.split(":", 1)[1]) for t in tokens]
    return None


def endpoint_greedy(endpoint: str, model: str, prompts: Sequence[EvalPrompt], api: str = "completions",
                    timeout_s: float = 120.0, api_key: str | None = None,
                    transport: httpx.BaseTransport | None = None) -> list[GreedyOutput]:
    """Greedy (temperature 0) outputs, one request at a time; vLLM extensions dropped if rejected."""
    url = endpoint_url(endpoint, api)
    extras: dict = dict(_VLLM_EXTRAS) | ({"logprobs": True, "top_logprobs": 0} if api == "chat" else {"logprobs": 0})
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = []
    with httpx.Client(timeout=timeout_s, trust_env=False, headers=headers, transport=transport) as client:
        for p in prompts:
            body: dict = {"model": model, "max_tokens": p.max_tokens, "temperature": 0.0, "stream": False}
            body |= {"messages": [{"role": "user", "content": p.prompt}]} if api == "chat" else {"prompt": p.prompt}
            resp = client.post(url, json=body | extras)
            if resp.status_code in (400, 422) and extras:
                logger.warning("%s rejected token-id options (%s); comparing text only", url, resp.status_code)
                extras = {}
                resp = client.post(url, json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"{url} answered {resp.status_code} for prompt {p.id!r}: {resp.text[:300]}")
            choice = resp.json()["choices"][0]
            text = (choice["message"]["content"] or "") if api == "chat" else choice["text"]
            out.append(GreedyOutput(p.id, text, _token_ids(choice, api)))
    return out


def offline_greedy(model_dir: str | Path, prompts: Sequence[EvalPrompt], api: str = "completions",
                   max_model_len: int = 512) -> list[GreedyOutput]:
    """Greedy outputs of an in-process ``vllm.LLM`` (CPU settings from shared/ENVIRONMENT.md)."""
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                       ("OMP_NUM_THREADS", "1"), ("HF_HUB_OFFLINE", "1"), ("VLLM_HOST_IP", "127.0.0.1")):
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              max_model_len=max_model_len, kv_cache_memory_bytes=64 * 2**20, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens) for p in prompts]
    if api == "chat":
        results = llm.chat([[{"role": "user", "content": p.prompt}] for p in prompts], params, use_tqdm=False)
    else:
        results = llm.generate([p.prompt for p in prompts], params, use_tqdm=False)
    return [GreedyOutput(p.id, r.outputs[0].text, list(r.outputs[0].token_ids))
            for p, r in zip(prompts, results, strict=True)]


def first_divergence(a: Sequence, b: Sequence) -> int | None:
    """Index of the first differing element (the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(a: Sequence[GreedyOutput], b: Sequence[GreedyOutput], a_name: str = "a",
            b_name: str = "b") -> QualityComparison:
    by_id = {o.id: o for o in b}
    rows = []
    for x in a:
        y = by_id.get(x.id)
        if y is None:
            raise ValueError(f"prompt {x.id!r} is in {a_name} but not in {b_name}")
        if x.token_ids is not None and y.token_ids is not None:
            seq_a, seq_b, unit = x.token_ids, y.token_ids, "token"
        else:
            seq_a, seq_b, unit = list(x.text), list(y.text), "char"
        div = first_divergence(seq_a, seq_b)
        rows.append(PromptComparison(x.id, div is None and x.text == y.text, div, unit, len(seq_a), len(seq_b)))
    rate = sum(r.match for r in rows) / len(rows) if rows else 0.0
    return QualityComparison(a_name, b_name, rate, rows)


def format_comparison(c: QualityComparison) -> str:
    lines = [f"{c.a} vs {c.b}: exact match {c.exact_match_rate:.1%} ({sum(r.match for r in c.prompts)}"
             f"/{len(c.prompts)})"]
    lines += [f"  DIFF {r.id}: first divergent {r.unit} {r.first_divergence} (lengths {r.len_a} vs {r.len_b})"
              for r in c.prompts if not r.match]
    return "\n".join(lines)


def _model_dir(spec: str) -> Path:
    from engine.checkpoints import ModelError
    from engine.models import resolve_model

    try:
        return resolve_model(spec)
    except ModelError as exc:
        raise ValueError(f"--offline-model-dir: {exc}") from exc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n")[0])
    p.add_argument("--endpoint", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name sent in requests")
    p.add_argument("--compare-endpoint", help="a second endpoint serving the same model (e.g. colocated)")
    p.add_argument("--offline-model-dir", help="model dir (or engine.models alias) for offline vLLM")
    p.add_argument("--evalset", default=str(EVALSET), help="JSONL of {id, prompt, max_tokens}")
    p.add_argument("--api", default="completions", choices=APIS)
    p.add_argument("--max-model-len", type=int, default=512, help="offline engine's max model length")
    p.add_argument("--limit", type=int, help="only the first N prompts of the eval set")
    p.add_argument("--out", help="write outputs and comparisons as JSON here")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit {args.limit}: give 1 or more")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not Path(args.evalset).is_file():
        p.error(f"--evalset {args.evalset!r} does not exist; omit it to use {EVALSET}")
    prompts = load_evalset(Path(args.evalset))[:args.limit]
    sources: dict[str, list[GreedyOutput]] = {}
    try:
        sources["endpoint"] = endpoint_greedy(args.endpoint, args.model, prompts, args.api)
        if args.compare_endpoint:
            sources["compare-endpoint"] = endpoint_greedy(args.compare_endpoint, args.model, prompts, args.api)
        if args.offline_model_dir:
            sources["offline"] = offline_greedy(_model_dir(args.offline_model_dir), prompts, args.api,
                                                args.max_model_len)
        if len(sources) == 1:
            # NOTE: with one source, check determinism: the same endpoint asked twice.
            sources["endpoint-again"] = endpoint_greedy(args.endpoint, args.model, prompts, args.api)
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:
        p.error(str(exc))
    names = list(sources)
    comparisons = [compare(sources[names[0]], sources[n], names[0], n) for n in names[1:]]
    for c in comparisons:
        print(format_comparison(c))
    if args.out:
        Path(args.out).write_text(json.dumps({"sources": {k: [asdict(o) for o in v] for k, v in sources.items()},
                                              "comparisons": [asdict(c) for c in comparisons]}, indent=1))
    return 0 if all(c.exact_match_rate == 1.0 for c in comparisons) else 1


if __name__ == "__main__":
    sys.exit(main())
