"""Issue 40: every response says how it was served (x-saaf-served; usage.saaf_served in a stream), and what it
says matches what the decode worker's NIXL counters moved."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
import ray

pytestmark = pytest.mark.integration

BLOCK = 128  # vLLM's CPU KV block size


def _parse(header: str) -> list[dict[str, str]]:
    return [dict(kv.strip().split("=", 1) for kv in element.split(";")) for element in header.split(",")]


def _decode(workers):
    return next(h for role, h in workers.values() if role == "decode")


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(n)]


def test_completion_header_names_the_path_and_the_bytes_nixl_moved(endpoint, model_name, workers) -> None:
    d = _decode(workers)
    info = ray.get(d.info.remote(), timeout=30)
    before = ray.get(d.transfer_counters.remote(), timeout=30)
    body = {"model": model_name, "prompt": _prompt(40, 2 * BLOCK + 9), "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(f"{endpoint}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    after = ray.get(d.transfer_counters.remote(), timeout=30)
    (served,) = _parse(r.headers["x-saaf-served"])
    assert served["path"] == "remote" and served["kv"] == "ok", served
    prefill = {w for w, (role, _) in workers.items() if role == "prefill"}
    assert served["prefill"] in prefill and served["decode"] not in prefill, served
    assert int(served["kv_bytes"]) == 3 * info["block_bytes"]  # 265 prompt tokens: 3 blocks
    assert int(served["kv_bytes"]) == after["kv_bytes"] - before["kv_bytes"]  # what NIXL counted, no more
    assert int(served["decode_computed"]) <= 1 and float(served["kv_ms"]) > 0 and float(served["kv_gbps"]) > 0
    assert served["attempts"] == "1"
    # where its time to first token went: every stage there, the hops the difference of two of them
    render, admit, prefill, first = (float(served[k]) for k in ("render_ms", "admit_ms", "prefill_ms", "first_ms"))
    assert render >= 0 and admit >= 0 and 0 < prefill <= first, served
    assert render + admit + first <= r.elapsed.total_seconds() * 1e3 + 1, (served, r.elapsed)


def test_one_token_is_served_by_the_prefill_worker_alone(endpoint, model_name, workers) -> None:
    r = httpx.post(f"{endpoint}/v1/completions", json={"model": model_name, "prompt": "Hello", "max_tokens": 1},
                   timeout=120)
    assert r.status_code == 200, r.text
    (served,) = _parse(r.headers["x-saaf-served"])
    assert served["path"] == "prefill_only" and workers[served["prefill"]][0] == "prefill" and "kv" not in served


def test_n_completions_each_say_how_they_were_served(endpoint, model_name) -> None:
    body = {"model": model_name, "prompt": _prompt(41, 150), "max_tokens": 4, "n": 2, "temperature": 0.8,
            "seed": 3}
    r = httpx.post(f"{endpoint}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    lead, sibling = _parse(r.headers["x-saaf-served"])
    assert (lead["index"], sibling["index"]) == ("0", "1")
    assert lead["path"] == "remote" and lead["kv"] == "ok"
    # NOTE: the sibling pulls the lead's handoff onto the lead's decode worker itself (cluster/serve/leg.py)
    assert sibling["path"] == "remote" and sibling["why"] == "sibling" and sibling["kv"] == "ok", sibling
    assert sibling["decode"] == lead["decode"]


def test_stream_header_has_the_route_and_usage_chunk_the_transfer(endpoint, model_name, workers) -> None:
    client = openai.OpenAI(base_url=f"{endpoint}/v1", api_key="unused", timeout=120, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=[{"role": "user", "content": "Name three rivers in Europe."}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True})
    (route,) = _parse(raw.headers["x-saaf-served"])
    assert route["path"] == "remote" and workers[route["prefill"]][0] == "prefill"
    usage = None
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    (served,) = usage.model_extra["saaf_served"]
    d = _decode(workers)
    blocks = -(-usage.prompt_tokens // BLOCK)
    assert served["kv"] == "ok" and served["kv_bytes"] == blocks * ray.get(d.info.remote(), timeout=30)["block_bytes"]
    assert served["prefill"] == route["prefill"] and served["decode"] == route["decode"]
