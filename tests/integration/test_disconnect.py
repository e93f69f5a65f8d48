"""Issue 8: a client that goes away cancels its request on the engines.

Closing the connection mid-stream, before the first token (while the prefill engine is still computing the
prompt), or while a non-streamed answer is being generated must abort the vLLM request: within a bound
every worker is back to running == 0, waiting == 0 and kv_usage == 0, well before the prefill KV lease
(transfer.kv_lease_s) would have released pinned blocks anyway. The server then serves the next request.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

pytestmark = pytest.mark.integration

FREE_BOUND_S = 8.0  # < the session deployment's kv_lease_s (10): a leaked prefill pin would show
PREFILL_FREE_S = 1.0  # a client that leaves before decoding starts frees the prefill engine's KV this fast


def _stats(workers) -> dict:
    import ray

    return {wid: ray.get(h.stats.remote(), timeout=10) for wid, (_, h) in workers.items()}


def _idle(stats: dict) -> bool:
    return all(s.running == 0 and s.waiting == 0 and s.kv_usage == 0 for s in stats.values())


CALIBRATION_MAX_S = 120.0  # the most a wait may spend on polls that see an engine measuring itself


def _wait(workers, pred, bound_s: float, what: str) -> float:
    """Seconds until `pred` holds, within `bound_s`. Polls that see an engine measuring itself (its own
    latency calibration, which runs only on an engine without serving traffic: WorkerStats.calibrating)
    neither count against the bound nor satisfy `pred`: those requests are not the test's."""
    counted, last, hard = 0.0, time.monotonic(), time.monotonic() + bound_s + CALIBRATION_MAX_S
    while True:
        stats = _stats(workers)
        now = time.monotonic()
        calibrating = any(s.calibrating for s in stats.values())
        if not calibrating:
            counted += now - last
            if pred(stats):
                return counted
        last = now
        if counted > bound_s or now > hard:
            pytest.fail(f"{what} not within {bound_s:.0f}s: " + ", ".join(
                f"{w}: waiting={s.waiting} running={s.running} kv_usage={s.kv_usage:.4f} "
                f"calibrating={s.calibrating}" for w, s in stats.items()))
        time.sleep(0.1)


def _busy(role: str, workers):
    def pred(stats: dict) -> bool:
        return any(workers[w][0] == role and (s.running or s.waiting) for w, s in stats.items())

    return pred


def _prefill_free(workers):
    def pred(stats: dict) -> bool:
        return all(s.kv_usage == 0 and not s.running and not s.waiting
                   for w, s in stats.items() if workers[w][0] == "prefill")

    return pred


def _open(endpoint: str, path: str, body: dict) -> socket.socket:
    """Send one HTTP/1.1 POST on a raw socket and return it unread: we decide exactly when to hang up."""
    u = urlsplit(endpoint)
    data = json.dumps(body).encode()
    s = socket.create_connection((u.hostname, u.port), timeout=60)
    s.sendall(f"POST {u.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _read_events(s: socket.socket, n: int, timeout_s: float = 60) -> bytes:
    """Read until ``n`` SSE events arrived (bounded in time)."""
    buf, deadline = b"", time.monotonic() + timeout_s
    while buf.count(b"data: ") < n:
        assert time.monotonic() < deadline, f"only {buf.count(b'data: ')} events in {timeout_s}s: {buf[-300:]!r}"
        chunk = s.recv(65536)
        assert chunk, f"server closed the stream early: {buf[-300:]!r}"
        buf += chunk
    return buf


def _good_request(endpoint: str, model: str) -> None:
    r = httpx.post(f"{endpoint}/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.fixture
def idle_workers(workers):
    """Start from idle engines (an earlier test may still hold a prefill lease)."""
    _wait(workers, _idle, 60, "engines idle before the test")
    return workers


def test_disconnect_mid_stream_cancels_the_request(endpoint, model_name, idle_workers):
    workers = idle_workers
    s = _open(endpoint, "/v1/chat/completions", {
        "model": model_name, "stream": True, "max_tokens": 900, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}]})
    try:
        head = _read_events(s, 4)
        assert b" 200 " in head.split(b"\r\n", 1)[0], head[:200]
        assert any(workers[w][0] == "decode" and st.running for w, st in _stats(workers).items())
    finally:
        s.close()
    took = _wait(workers, _idle, FREE_BOUND_S, "engines idle after the client hung up mid-stream")
    print(f"freed {took:.2f}s after the disconnect")
    _good_request(endpoint, model_name)


def test_disconnect_during_prefill_cancels_the_request(endpoint, model_name, idle_workers):
    """Hang up before the first token, while the prefill engine is still computing a long prompt: the
    prefill must be aborted, not finished and left pinned for the decode that never comes."""
    workers = idle_workers
    prompt = [(i * 7919) % 40_000 + 100 for i in range(900)]  # fresh ids: no prefix-cache hit
    s = _open(endpoint, "/v1/completions", {"model": model_name, "prompt": prompt, "max_tokens": 100,
                                            "ignore_eos": True, "stream": True})
    try:
        _wait(workers, _busy("prefill", workers), 30, "prefill engine busy")
    finally:
        s.close()
    kv = _wait(workers, _prefill_free(workers), PREFILL_FREE_S, "prefill KV freed after a hang-up during prefill")
    took = _wait(workers, _idle, FREE_BOUND_S, "engines idle after the client hung up during prefill")
    print(f"prefill KV freed {kv:.2f}s, all idle {took:.2f}s after the disconnect")
    _good_request(endpoint, model_name)


def test_disconnect_between_prefill_and_decode_frees_the_prefill_kv(endpoint, model_name, idle_workers):
    """Hang up on the first token (it comes from the prefill engine, while the decode engine is only about to
    pull the KV): the handoff is released or pulled and dropped, not left pinned until its lease."""
    workers = idle_workers
    prompt = [(i * 104729) % 40_000 + 100 for i in range(700)]
    s = _open(endpoint, "/v1/completions", {"model": model_name, "prompt": prompt, "max_tokens": 300,
                                            "ignore_eos": True, "stream": True})
    try:
        head = _read_events(s, 1)
        assert b" 200 " in head.split(b"\r\n", 1)[0], head[:200]
    finally:
        s.close()
    kv = _wait(workers, _prefill_free(workers), PREFILL_FREE_S, "prefill KV freed after a hang-up on token 1")
    took = _wait(workers, _idle, FREE_BOUND_S, "engines idle after the client hung up on the first token")
    print(f"prefill KV freed {kv:.2f}s, all idle {took:.2f}s after the disconnect")
    _good_request(endpoint, model_name)


def test_abandoned_non_streamed_request_is_cancelled(endpoint, model_name, idle_workers):
    workers = idle_workers
    s = _open(endpoint, "/v1/completions", {"model": model_name, "prompt": "Once upon a time",
                                            "max_tokens": 900, "ignore_eos": True})
    try:
        _wait(workers, _busy("decode", workers), 30, "decode engine busy")
    finally:
        s.close()
    took = _wait(workers, _idle, FREE_BOUND_S, "engines idle after the client gave up on a non-streamed request")
    print(f"freed {took:.2f}s after the disconnect")
    _good_request(endpoint, model_name)


def test_many_disconnects_leave_nothing_behind(endpoint, model_name, idle_workers):
    """Eight streams hung up at different points (bounded): the engines end idle and keep serving."""
    workers = idle_workers
    socks = []
    try:
        for i in range(8):
            socks.append(_open(endpoint, "/v1/completions", {
                "model": model_name, "prompt": f"Story number {i}:", "max_tokens": 600, "ignore_eos": True,
                "stream": True}))
        for i, s in enumerate(socks):
            if i % 2:
                _read_events(s, 2)
            s.close()
    finally:
        for s in socks:
            s.close()
    _wait(workers, _idle, 2 * FREE_BOUND_S, "engines idle after 8 hang-ups")
    _good_request(endpoint, model_name)
