"""Greedy-output equality between variants and offline vLLM on the committed eval set
(``benchmarks.quality``): collecting each source's outputs, pairing sources, and the report section.

Variants that must not change outputs (shapes, routing, prefix caching) should match token for token;
for ones that may (quantization, some speculative decoding), the exact-match rate and first divergent
token say how much."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from benchmarks.compare.fmt import md_table
from benchmarks.compare.provenance import REPO

Outputs = dict[str, list[dict[str, Any]]]
"""source name -> its ``GreedyOutput`` dicts (id, text, token_ids), in eval-set order."""


class TokenIdsOnly(httpx.BaseTransport):
    """httpx transport for ``benchmarks.quality.endpoint_greedy`` against our ingress: keeps
    ``return_token_ids`` and drops ``return_tokens_as_token_ids`` and ``logprobs``, which our API
    rejects with 400 (endpoint_greedy would then drop every option and compare text only)."""

    DROP = ("return_tokens_as_token_ids", "logprobs", "top_logprobs")

    def __init__(self) -> None:
        self._inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            body = json.loads(request.content)
        except ValueError:
            return self._inner.handle_request(request)
        if isinstance(body, dict) and any(k in body for k in self.DROP):
            body = {k: v for k, v in body.items() if k not in self.DROP}
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            request = httpx.Request(request.method, request.url, headers=headers, json=body)
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


def endpoint_outputs(endpoint: str, model: str, timeout_s: float, limit: int | None = None) -> list[dict[str, Any]]:
    """Greedy outputs of the eval set (its first `limit` prompts; None: all) from one of our endpoints, compared
    by token id."""
    from benchmarks.quality import endpoint_greedy, load_evalset

    prompts = load_evalset()
    outs = endpoint_greedy(endpoint, model, prompts if limit is None else prompts[:limit], timeout_s=timeout_s,
                           transport=TokenIdsOnly())
    return [asdict(o) for o in outs]


def offline_outputs(model: str, max_model_len: int, timeout_s: float, scratch: Path) -> list[dict[str, Any]]:
    """Offline vLLM greedy outputs of the eval set, in a child process (bounded, its memory freed after).
    Raises RuntimeError with the reason when it fails or times out."""
    out = scratch / "offline-greedy.json"
    code = ("import json, sys; from dataclasses import asdict; from benchmarks.quality import load_evalset, "
            "offline_greedy; from engine.models import resolve_model; "
            f"r = offline_greedy(resolve_model({model!r}), load_evalset(), max_model_len={max_model_len}); "
            f"open({str(out)!r}, 'w').write(json.dumps([asdict(o) for o in r]))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        raise RuntimeError(f"offline vLLM did not finish within {timeout_s:.0f} s") from None
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"offline vLLM failed (exit {proc.returncode}): {err[-800:]}")
    data = json.loads(out.read_text())
    out.unlink()
    return data


def quality_comparisons(outputs: Outputs, order: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Every pair of sources (``order`` first, in that order, then the rest as given), compared."""
    from benchmarks.quality import GreedyOutput, compare

    srcs = {k: [GreedyOutput(o["id"], o["text"], o["token_ids"]) for o in v] for k, v in outputs.items()}
    names = [n for n in order if n in srcs] + [n for n in srcs if n not in order]
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    return [asdict(compare(srcs[a], srcs[b], a, b)) for a, b in pairs]


def quality_summary(outputs: Outputs, order: Sequence[str] = (), offline_error: str | None = None
                    ) -> dict[str, Any]:
    """The report's quality part: pairwise comparisons, whether all match, and the outputs themselves."""
    comps = quality_comparisons(outputs, order)
    return {"prompts": len(next(iter(outputs.values()))), "sources": list(outputs), "comparisons": comps,
            "all_match": all(c["exact_match_rate"] == 1.0 for c in comps), "offline_error": offline_error,
            "outputs": outputs}


def quality_table(comparisons: Sequence[dict[str, Any]]) -> str:
    body = []
    for c in comparisons:
        diffs = [p for p in c["prompts"] if not p["match"]]
        first = ", ".join(f"{p['id']}@{p['unit']} {p['first_divergence']}" for p in diffs[:6]) or "-"
        if len(diffs) > 6:
            first += f", ... ({len(diffs)} in all)"
        body.append([f"{c['a']} vs {c['b']}", f"{c['exact_match_rate']:.0%} "
                     f"({sum(p['match'] for p in c['prompts'])}/{len(c['prompts'])})", first])
    return md_table(["comparison", "exact match", "first divergent token (prompt@index)"], body)


BUG = "**DIFFERENCE: greedy outputs differ between sources. This is a bug to report to the lead.**"


def quality_section(q: dict[str, Any] | None, on_difference: str = BUG) -> list[str]:
    """Markdown lines of the quality part (``quality_summary``); None: the check did not run.
    ``on_difference``: the verdict when sources differ (a bug unless a variant may change outputs)."""
    md = ["## Quality: greedy outputs", ""]
    if not q:
        return [*md, "Not run (--no-quality).", ""]
    md += [f"The {q['prompts']} prompts of `benchmarks/evalset/prompts.jsonl`, temperature 0, one at a time, "
           "token ids compared.", "", quality_table(q["comparisons"]), ""]
    md += ["**All sources agree token for token.**" if q["all_match"] else on_difference, ""]
    if q.get("offline_error"):
        md += [f"Offline vLLM could not run: {q['offline_error']}", ""]
    return md
