"""Issue 40: KV integrity (transfer.integrity). On the session's deployment, which runs with the check on:
clean pulls pass it; a pulled block corrupted on purpose (transfer.fault_injection) is caught by the decode engine, its
blocks recomputed, so the client still gets the answer of the clean pull, and the mismatch is counted in
the response header, /metrics and the decode worker's counters."""

from __future__ import annotations

import random
import re

import httpx
import pytest
import ray

from tests.helpers.engines import generate, params, token_ids

pytestmark = pytest.mark.integration


def _served(r: httpx.Response) -> dict[str, str]:
    (element,) = r.headers["x-saaf-served"].split(",")
    return dict(kv.strip().split("=", 1) for kv in element.split(";"))


def _mismatches_metric(endpoint: str) -> float:
    text = httpx.get(f"{endpoint}/metrics", timeout=10).text
    m = re.search(r"^saaf_kv_integrity_mismatches_total (\S+)$", text, re.M)
    assert m, "saaf_kv_integrity_mismatches_total missing from /metrics"
    return float(m.group(1))


def _complete(endpoint: str, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(f"{endpoint}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_clean_pulls_pass_and_a_corrupted_one_is_recomputed_and_counted(endpoint, model_name, workers,
                                                                         colocated_worker) -> None:
    decode = next(h for role, h in workers.values() if role == "decode")
    model = model_name
    rng = random.Random(7)
    prompts = [[rng.randrange(200, 40000) for _ in range(n)] for n in (300, 129, 700)]
    for p in prompts:
        s = _served(_complete(endpoint, model, p))
        assert (s["path"], s["kv"], s["kv_integrity"], s["decode_computed"]) == ("remote", "ok", "ok", "1"), s
    before_metric = _mismatches_metric(endpoint)
    before = ray.get(decode.transfer_counters.remote(), timeout=30)["integrity_mismatches"]

    assert ray.get(decode.inject_kv_corruption.remote(1), timeout=30) == 1
    bad = [prompts[0][0] + 1] + prompts[0][1:]  # NOTE: new to both engines' prefix caches
    r = _complete(endpoint, model, bad)
    s = _served(r)
    assert s["kv_integrity"] == "mismatch" and s["kv"] == "recomputed", s
    assert int(s["decode_computed"]) > 1, s  # the bad block (the last of 300 = 2 x 128 + 44) computed again
    assert ray.get(decode.transfer_counters.remote(), timeout=30)["integrity_mismatches"] == before + 1
    assert _mismatches_metric(endpoint) == before_metric + 1
    # the client got the right answer: one colocated engine's, greedy, from the same prompt
    want = token_ids(generate(colocated_worker, "integrity-ref", bad, params(12, ignore_eos=True)))
    assert r.json()["choices"][0]["token_ids"] == want
    # armed for one pull only: the next is clean again
    s = _served(_complete(endpoint, model, [bad[0] + 1] + bad[1:]))
    assert (s["kv"], s["kv_integrity"]) == ("ok", "ok"), s
