"""The soak benchmark's bookkeeping: what counts as a complete answer, and the PASS/FAIL criteria."""

from __future__ import annotations

import json
import random

from benchmarks.soak import Outcome, check_answer, plan, summarise


def sse(*bodies: dict, done: bool = True) -> str:
    return "".join(f"data: {json.dumps(b)}\n\n" for b in bodies) + ("data: [DONE]\n\n" if done else "")


def test_plan_mixes_apis_streaming_and_invalid():
    rng = random.Random(0)
    ps = [plan(i, rng) for i in range(40)]
    assert {p["chat"] for p in ps} == {True, False} and {p["stream"] for p in ps} == {True, False}
    assert sum(p["invalid"] for p in ps) == 2 and all(1 <= p["max_tokens"] <= 32 for p in ps)


def test_stream_answer_needs_done_and_exact_token_count():
    p = {"stream": True, "max_tokens": 3}
    good = sse({"id": "a", "choices": [{"text": "x"}]}, {"id": "a", "choices": [], "usage": {"completion_tokens": 3}})
    assert check_answer(1, good, p) == Outcome(1, "ok", response_id="a")
    cut = sse({"id": "a", "choices": [{"text": "x"}]}, done=False)
    assert check_answer(1, cut, p).kind == "unexpected"
    short = sse({"id": "a", "choices": []}, {"id": "a", "choices": [], "usage": {"completion_tokens": 2}})
    assert check_answer(1, short, p).kind == "unexpected"
    err = sse({"error": {"message": "boom"}})
    assert check_answer(1, err, p).kind == "unexpected"


def test_whole_answer_token_count():
    p = {"stream": False, "max_tokens": 2}
    assert check_answer(2, json.dumps({"id": "b", "usage": {"completion_tokens": 2}}), p).kind == "ok"
    assert check_answer(2, json.dumps({"id": "b", "usage": {"completion_tokens": 1}}), p).kind == "unexpected"


def _res(n: int) -> dict:
    return {"requests": n, "concurrency": 4, "wall_s": 10.0, "left_running_after_sigterm": 0}


def test_summary_passes_a_clean_run():
    outs = [Outcome(i, "ok", response_id=str(i)) for i in range(8)]
    samples = [(d, 100) for d in range(8)]
    res = summarise(_res(8), outs, {"ok": 5}, {"ok": 13}, samples)
    assert set(res["checks"].values()) == {"PASS"}, res


def test_summary_fails_on_loss_duplicates_miscount_and_growth():
    outs = [Outcome(i, "ok", response_id="same") for i in range(7)]  # one lost, ids duplicated
    samples = [(0, 100), (1, 100), (7, 150)]  # +50% memory
    res = summarise(_res(8), outs, {}, {"ok": 8}, samples)
    assert res["checks"]["every request answered once"] == "FAIL"
    assert res["checks"]["no duplicate response id"] == "FAIL"
    assert res["checks"]["server count == client count"] == "FAIL"
    assert res["checks"]["memory growth < 10%"] == "FAIL"
