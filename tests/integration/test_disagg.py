"""Issue 3: disaggregated serving moves each prompt's KV over NIXL and answers exactly as colocated."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from tests.helpers import sse
from tests.helpers.engines import generate, params, token_ids

pytestmark = pytest.mark.integration

BLOCK = 128  # vLLM's CPU KV block size


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    # NOTE: distinct first tokens so no two prompts share a prefix block (no decode-side cache hits).
    return [[1000 + i * 7 + k] + [rng.randrange(200, 40000) for _ in range(n - 1)]
            for k, (i, n) in enumerate(enumerate(lengths))]


def _complete(endpoint: str, model: str, prompt: list[int], max_tokens: int, stream: bool = False) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    if not stream:
        r = httpx.post(f"{endpoint}/v1/completions", timeout=180, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    return [t for chunk in sse.chunks(f"{endpoint}/v1/completions", body) for c in chunk["choices"]
            for t in (c.get("token_ids") or [])]


def _colocated(worker, prompt: list[int], max_tokens: int, rid: str) -> list[int]:
    return token_ids(generate(worker, rid, prompt, params(max_tokens, ignore_eos=True)))


def _decode_handle(workers):
    return next(h for role, h in workers.values() if role == "decode")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_disaggregated_equals_colocated_8_concurrent(endpoint, model_name, colocated_worker, workers, stream):
    """The first token comes from the prefill engine; decoding continues from prompt + that token on the decode
    engine, whose pull is capped at what the prefill computed (exact block multiples included)."""
    lengths = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 2, BLOCK * 2, 700]
    prompts = _prompts(11 + stream, lengths)
    d = _decode_handle(workers)
    before = ray.get(d.transfer_counters.remote(), timeout=30)
    t_start = time.time()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: _complete(endpoint, model_name, p, 16, stream), prompts))
    want = [_colocated(colocated_worker, p, 16, f"colo-{i}") for i, p in enumerate(prompts)]
    for n, g, w in zip(lengths, got, want, strict=True):
        assert g == w, f"prompt of {n} tokens: disaggregated {g} != colocated {w}"

    # Evidence the KV really moved: per-request telemetry, and NIXL's own byte count on the decode engine.
    log = httpx.get(f"{endpoint}/v1/stats", timeout=10).json()["transfers"]
    mine = [t for t in log if t["prompt_tokens"] in lengths and t["outcome"] == "ok"][-len(lengths):]
    assert len(mine) == len(lengths)
    info = ray.get(d.info.remote(), timeout=30)
    for t in mine:
        blocks = -(-t["prompt_tokens"] // BLOCK)
        assert t["kv_blocks"] == blocks
        assert t["kv_bytes"] == blocks * info["block_bytes"]
        assert t["decode_computed_prompt_tokens"] <= 1, t
    after = ray.get(d.transfer_counters.remote(), timeout=30)
    nixl_bytes = after["kv_bytes"] - before["kv_bytes"]
    assert nixl_bytes == sum(t["kv_bytes"] for t in mine), (nixl_bytes, mine)
    # Decode computed at most the last prompt token of each request; the rest arrived over NIXL.
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    external = after["prompt_tokens_external"] - before["prompt_tokens_external"]
    assert computed <= len(lengths), (computed, external)
    assert external >= sum(lengths) - len(lengths)
    assert time.time() - t_start < 600


def test_side_channel_ports_and_engine_ids_are_unique(workers):
    infos = [ray.get(h.info.remote(), timeout=30) for _, h in workers.values()]
    ports = [i["side_channel_port"] for i in infos]
    assert len(set(ports)) == len(ports) and all(ports)
    assert len({i["engine_id"] for i in infos}) == len(infos)


def test_side_channel_survives_garbage_then_transfers(endpoint, model_name, workers):
    """Garbage to the prefill engine's NIXL side channel (issue 36): every bad request is dropped unanswered,
    a valid handshake on the same connection is still answered with the engine's real metadata, and a
    request then moves its KV."""
    import os
    import socket

    import msgspec
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG, NixlHandshakePayload

    p = next(h for role, h in workers.values() if role == "prefill")
    d = _decode_handle(workers)
    port = ray.get(p.info.remote(), timeout=30)["side_channel_port"]
    enc = msgspec.msgpack.encode
    garbage = [(zmq.DEALER, [os.urandom(64)]), (zmq.DEALER, [b"", enc((GET_META_MSG, 0, 0)), b"x"]),
               (zmq.REQ, [b"\xc1junk"]), (zmq.REQ, [b""]), (zmq.REQ, [enc(7)]),
               (zmq.REQ, [enc((GET_META_MSG, 0))]), (zmq.REQ, [enc((GET_META_MSG, 3, 9))]),
               (zmq.REQ, [enc((GET_META_MSG, [0], 0))]), (zmq.REQ, [enc((b"bogus", 0, 0))])]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(os.urandom(512))
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
        for kind, frames in garbage:  # NOTE: one connection: the listener takes them in this order
            s.send_multipart(([b""] if kind == zmq.REQ else []) + frames)
        s.send_multipart([b"", enc((GET_META_MSG, 0, 0))])
        assert s.poll(10_000), "the prefill engine's side channel stopped answering"
        reply = s.recv_multipart()
        assert reply[0] == b"" and len(reply) == 3
        assert msgspec.msgpack.Decoder(NixlHandshakePayload).decode(reply[1]).compatibility_hash
        assert not s.poll(500)  # no answer to any bad request
    finally:
        ctx.destroy(linger=0)
    before = ray.get(d.transfer_counters.remote(), timeout=30)
    assert len(_complete(endpoint, model_name, _prompts(99, [BLOCK + 3])[0], 4)) == 4
    after = ray.get(d.transfer_counters.remote(), timeout=30)
    assert after["kv_bytes"] > before["kv_bytes"]
