"""The direct ingress's HTTP server (cluster/serve/direct.py, real uvicorn on a loopback socket) against clients
that hold the server's resources: one that stops reading a streamed response is disconnected once its writes
have been blocked for serve.send_timeout_s (the app sees http.disconnect, as when a client hangs up, and the
request is cancelled), while other clients are served meanwhile; connections beyond serve.max_connections
get a 503 in the OpenAI error shape at once."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from tests.helpers.direct_server import direct_server

SEND_TIMEOUT_S = 0.8
MAX_CONNECTIONS = 3
CHUNK = b"x" * 65536
ended: dict[str, float] = {}  # path -> when the app saw the client gone


async def _app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/ok":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    await receive()  # the (empty) body
    gone = asyncio.ensure_future(receive())  # NOTE: what Starlette's StreamingResponse watches too
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for _ in range(20_000):  # NOTE: bounded: ~1.3 GB, far more than any socket buffer holds
        if gone.done():
            break
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await asyncio.sleep(0)
    if gone.done() and gone.result()["type"] == "http.disconnect":
        ended[path] = time.monotonic()
    gone.cancel()


@pytest.fixture(scope="module")
def server():
    with direct_server(_app, header_timeout_s=30, send_timeout_s=SEND_TIMEOUT_S, max_connections=MAX_CONNECTIONS) as port:
        time.sleep(0.2)  # NOTE: the probe connection is closed before the tests count connections
        yield port


def _get(port: int, path: str = "/ok") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while True:
            chunk = c.recv(65536)
            if not chunk:
                return data
            data += chunk


def test_a_client_that_stops_reading_is_cut_after_the_send_timeout_and_others_are_served(server):
    c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.connect(("127.0.0.1", server))
    try:
        t0 = time.monotonic()
        c.sendall(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")  # and then never reads
        served = []
        while time.monotonic() - t0 < 10 * SEND_TIMEOUT_S and "/stream" not in ended:  # bounded
            served.append(_get(server).endswith(b"ok"))
            time.sleep(0.1)
        assert "/stream" in ended, "the app never saw the stalled client go"
        took = ended["/stream"] - t0
        assert SEND_TIMEOUT_S * 0.8 < took < SEND_TIMEOUT_S * 6, took
        assert served and all(served)  # the others were served while it stalled
    finally:
        c.close()


def test_connections_beyond_the_cap_get_a_503_in_the_openai_shape(server):
    held = [socket.create_connection(("127.0.0.1", server), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        data = _get(server)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower()
        err = json.loads(body)["error"]
        assert err["code"] == "too_many_connections" and "serve.max_connections" in err["message"]
    finally:
        for h in held:
            h.close()
    time.sleep(0.3)
    assert _get(server).endswith(b"ok")  # room again once they closed
