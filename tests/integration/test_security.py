"""Issue 36 on the session's deployment (real engines, real HTTP): one request cannot fan out beyond
serve.max_completions_per_request; clients' ids are only echoed (eight streams sharing one X-Request-Id all
complete with their own answers); the open /health says only healthy or not; /docs and /openapi.json are off."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytestmark = pytest.mark.integration

CAP = 16  # serve.max_completions_per_request's default (the session deployment leaves it)
PROMPTS = ["The capital of France is", "One, two, three,", "The sky is", "Water boils at", "My favourite colour is",
           "The opposite of hot is", "Cats and", "A week has"]


def _post(endpoint: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{endpoint}{path}", json=body, headers=headers, timeout=120, trust_env=False)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": CAP + 1}),
    ("/v1/completions", {"prompt": ["Hi"] * 9, "max_tokens": 2, "n": 2}),
    ("/v1/completions", {"prompt": ["Hi"] * (CAP + 1), "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 512}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": CAP + 1,
                              "stream": True}),
    ("/v1/chat/completions/batch", {"messages": [[{"role": "user", "content": "Hi"}]] * (CAP + 1), "max_tokens": 2}),
], ids=["n", "prompts-x-n", "prompts", "chat-n-512", "chat-stream", "batch"])
def test_fan_out_beyond_the_cap_is_a_400_naming_it(endpoint, model_name, path, body):
    before = httpx.get(f"{endpoint}/metrics", timeout=10, trust_env=False).text
    r = _post(endpoint, path, {"model": model_name, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "too_many_completions" and "serve.max_completions_per_request" in err["message"], err
    after = httpx.get(f"{endpoint}/metrics", timeout=10, trust_env=False).text
    prefills = [ln for ln in after.splitlines() if ln.startswith("saaf_prefill_seconds_count")]
    assert prefills == [ln for ln in before.splitlines() if ln.startswith("saaf_prefill_seconds_count")]  # none ran


def test_fan_out_within_the_cap_is_served(endpoint, model_name):
    r = _post(endpoint, "/v1/completions", {"model": model_name, "prompt": ["Hi", "Yes"], "max_tokens": 3, "n": 2})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2, 3]
    r = _post(endpoint, "/v1/chat/completions/batch", {"model": model_name, "max_tokens": 3,
                                                         "messages": [[{"role": "user", "content": "Hi"}]] * 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


async def _stream(client: httpx.AsyncClient, endpoint: str, model: str, prompt: str, rid: str | None) -> tuple[str, str]:
    headers = {"X-Request-Id": rid} if rid else {}
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    text, ids = [], set()
    async with client.stream("POST", f"{endpoint}/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            ids.add(chunk["id"])
            text.extend(c["text"] for c in chunk["choices"])
    assert len(ids) == 1
    return "".join(text), ids.pop()


def test_eight_streams_with_one_client_id_all_complete_with_their_own_answers(endpoint, model_name):
    async def go() -> tuple[list, list]:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
            shared = await asyncio.gather(*(_stream(c, endpoint, model_name, p, "same-id") for p in PROMPTS))
            alone = [await _stream(c, endpoint, model_name, p, None) for p in PROMPTS]
        return shared, alone

    shared, alone = asyncio.run(asyncio.wait_for(go(), timeout=300))
    assert [t for t, _ in shared] == [t for t, _ in alone]  # each its own answer, as when sent alone
    assert all("same-id" in rid for _, rid in shared)  # the client's id is echoed back


def test_open_health_says_only_healthy_and_docs_are_off(endpoint):
    r = httpx.get(f"{endpoint}/health", timeout=10, trust_env=False)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert httpx.get(f"{endpoint}{path}", timeout=10, trust_env=False).status_code == 404, path
    stats = httpx.get(f"{endpoint}/v1/stats", timeout=10, trust_env=False).json()
    assert stats["workers"]  # the workers' stats are still there, where keys apply


def test_every_listener_is_on_loopback_or_refuses_callers_without_the_ray_token(deployment, ray_session):
    """The whole process tree of this session (its embedded Ray, the engines, the ingress): each listening
    socket is on 127.0.0.1 / ::1, or refuses a gRPC call that carries no Ray token (Ray Serve's replica server
    binds [::] and unpickles what it is sent: Ray 2.60 guards it only with token auth)."""
    import os
    import stat

    from cluster.control.raytoken import requires_token
    from engine.procs import listeners, tree
    from tests.helpers.listeners import exposed, open_ones

    assert len(listeners(tree(os.getpid()))) > 5  # the scan itself works: Ray alone holds several
    found = exposed([os.getpid()])
    assert not open_ones(found), open_ones(found)  # embedded: nothing else, not even metrics, off loopback
    assert any("ServeReplica" in e.listener.process for e in found)  # Serve's [::] server is there, and was tried
    gcs = ray_session.get_runtime_context().gcs_address
    assert requires_token(gcs)
    token = os.environ["RAY_AUTH_TOKEN_PATH"]
    assert os.environ["RAY_AUTH_MODE"] == "token" and stat.S_IMODE(os.stat(token).st_mode) == 0o600


def test_n_completions_are_prefilled_once_and_each_pulls_the_kv(endpoint, model_name, workers):
    """n = 4 (seeded), a block-aligned 256-token prompt: one prefill for the request, not four; each completion
    pulls that prefill's KV (4 transfers; a reader whose first block is already in the decode engine's prefix
    cache pulls the rest) and computes no prompt block again (the decode engine
    computes at most one prompt token per completion: the last, to sample its own first token); the prefill
    engine frees the blocks once the last reader has read them (no read after they were freed, nothing left
    held); completion i equals the lone request with seed + i, as vLLM seeds its children."""
    import time

    import ray

    decode = [h for role, h in workers.values() if role == "decode"]
    prefill = [h for role, h in workers.values() if role == "prefill"]
    prompt = list(range(1000, 1000 + 256))  # NOTE: two whole CPU blocks: a prefix-cache hit would stop at one
    body = {"model": model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0.8, "ignore_eos": True}

    def counts() -> dict[str, int]:
        per = [ray.get(h.transfer_counters.remote(), timeout=30) for h in decode]
        pre = [ray.get(h.totals_snapshot.remote(), timeout=30) for h in prefill]
        m = httpx.get(f"{endpoint}/metrics", timeout=10, trust_env=False).text
        return {"prefills": int(sum(float(ln.split()[-1]) for ln in m.splitlines()
                                    if ln.startswith("saaf_prefill_seconds_count"))),
                "transfers": sum(c["transfers"] for c in per), "recomputes": sum(c["recomputes"] for c in per),
                "computed": sum(c["prompt_tokens_computed"] for c in per),
                "external": sum(c["prompt_tokens_external"] for c in per),
                "late_reads": sum(c["kv_late_reads"] for c in pre)}

    before = counts()
    many = _post(endpoint, "/v1/completions", dict(body, n=4, seed=7))
    assert many.status_code == 200, many.text
    after = counts()
    delta = {k: after[k] - before[k] for k in after}
    assert delta["prefills"] == 1 and delta["transfers"] == 4 and delta["recomputes"] == 0, delta
    # NOTE: a reader the decode engine schedules after an earlier one's pull landed finds the first block in
    # its prefix cache and pulls only the rest; either way no reader computes a prompt block itself
    assert 256 + 3 * 128 <= delta["external"] <= 4 * 256 and delta["computed"] <= 4, delta
    deadline = time.monotonic() + 20  # NOTE: well inside the KV lease: the readers' notifications freed them
    while any(ray.get(h.stats.remote(), timeout=30).kv_usage for h in prefill) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(ray.get(h.stats.remote(), timeout=30).kv_usage for h in prefill)
    assert counts()["late_reads"] == before["late_reads"]
    texts = [c["text"] for c in sorted(many.json()["choices"], key=lambda c: c["index"])]
    alone = [_post(endpoint, "/v1/completions", dict(body, seed=7 + i)).json()["choices"][0]["text"] for i in range(4)]
    assert texts == alone, (texts, alone)
