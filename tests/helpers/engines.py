"""Calling worker actors directly in tests: vLLM SamplingParams in, RequestOutputs (and telemetry) out."""

from __future__ import annotations

from typing import Any

import ray


def params(max_tokens: int, **kw: Any) -> Any:
    """Greedy SamplingParams unless ``kw`` says otherwise (DELTA outputs, as the workers stream them)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, **kw)


def drain(gen: Any, timeout: float = 120) -> list[Any]:
    """Every item of a streaming actor call but a decode worker's DecodeQueued beats (first: telemetry)."""
    from engine.contract import DecodeQueued

    return [x for x in (ray.get(ref, timeout=timeout) for ref in gen) if not isinstance(x, DecodeQueued)]


def token_ids(items: list[Any]) -> list[int]:
    """Generated token ids of a stream of RequestOutputs (other items, e.g. telemetry, are skipped)."""
    return [t for o in items if hasattr(o, "outputs") for t in o.outputs[0].token_ids]


def text(items: list[Any]) -> str:
    return "".join(o.outputs[0].text for o in items if hasattr(o, "outputs"))


def generate(worker: Any, rid: str, prompt: list[int], p: Any, timeout: float = 120) -> list[Any]:
    return drain(worker.generate_stream.options(num_returns="streaming").remote(rid, prompt, p), timeout)
