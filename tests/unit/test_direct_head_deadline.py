"""The direct ingress's HTTP server (cluster/serve/direct.py, real uvicorn on a loopback socket): a client that
connects and sends no request head, or sends it a byte at a time, is disconnected after
serve.header_timeout_s; a normal client, and a keep-alive one, are served."""

from __future__ import annotations

import socket
import time

import pytest

from tests.helpers.direct_server import direct_server

TIMEOUT_S = 0.6


async def _app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def server():
    with direct_server(_app, header_timeout_s=TIMEOUT_S) as port:
        yield port


def _closed_after(conn: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closed ``conn`` (recv returns b""), or None if still open at ``limit_s``."""
    t0 = time.monotonic()
    conn.settimeout(0.1)
    while time.monotonic() - t0 < limit_s:
        try:
            if conn.recv(1024) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0
    return None


def _get(conn: socket.socket) -> bytes:
    conn.sendall(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
    conn.settimeout(5)
    data = b""
    while not data.endswith(b"ok"):
        chunk = conn.recv(1024)
        if not chunk:
            break
        data += chunk
    return data


def test_a_connection_that_sends_nothing_is_closed_after_the_head_timeout(server):
    with socket.create_connection(("127.0.0.1", server), timeout=5) as c:
        took = _closed_after(c, 10 * TIMEOUT_S)
    assert took is not None and TIMEOUT_S * 0.8 < took < TIMEOUT_S * 5, took


def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_deadline(server):
    with socket.create_connection(("127.0.0.1", server), timeout=5) as c:
        t0 = time.monotonic()
        head = b"GET /x HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 200
        closed = False
        for b in head:  # NOTE: bounded: 200-odd bytes, 20 ms apart, ~5 s at most
            try:
                c.sendall(bytes([b]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.02)
            if time.monotonic() - t0 > 5 * TIMEOUT_S:
                break
        took = time.monotonic() - t0 if closed else _closed_after(c, 5 * TIMEOUT_S)
    assert took is not None and took < 5 * TIMEOUT_S, "a slowloris head kept its connection"


def test_normal_and_keep_alive_requests_are_served(server):
    with socket.create_connection(("127.0.0.1", server), timeout=5) as c:
        assert _get(c).startswith(b"HTTP/1.1 200")
        time.sleep(TIMEOUT_S / 3)
        assert _get(c).startswith(b"HTTP/1.1 200")  # NOTE: the deadline restarts after each response
        assert _closed_after(c, 10 * TIMEOUT_S) is not None  # and an idle keep-alive one ends too
