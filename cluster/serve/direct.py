"""Direct ingress: the ingress replica answers HTTP itself on serve.host:serve.port.

Through Ray Serve's proxy every request takes one more process hop each way (client -> proxy -> replica
and back, each a Ray call), which costs ~8-9 ms of TTFT on our CPU box. With `serve.direct` (the default)
the replica runs its own HTTP server (uvicorn, on the replica's event loop) for the same FastAPI app, so a
request goes client -> replica -> engines. Serve's proxy is not started unless `serve.proxy_port` asks for
it (one process less at startup). Ray Serve has a similar mode (RAY_SERVE_ENABLE_DIRECT_INGRESS) but picks replica ports from a
range, so an application cannot be found at its configured port; this keeps the port the config names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from typing import Any

logger = logging.getLogger(__name__)

SEND_BUFFER_BYTES = 256 << 10  # per connection; at 50 ms round trips still ~5 MB/s to one client


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so a taken port fails the replica with a clear message."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # NOTE: each accepted connection inherits this send buffer (the kernel doubles it). Left to autotuning it
    # grows to megabytes, which a client that never reads fills with a whole streamed answer: its request then
    # runs to the end for nobody, and a thousand such clients pin gigabytes of kernel memory. Bounded, writes
    # pause after ~0.6 MB unread and serve.send_timeout_s cuts the connection (deadline_protocol).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"serve.port {port} on {host} is not free ({e.strerror}); pick another "
                           "serve.port, or stop what holds it") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def mounted(app: Any, route_prefix: str) -> Any:
    if route_prefix.rstrip("/") == "":
        return app
    from starlette.applications import Starlette
    from starlette.routing import Mount

    return Starlette(routes=[Mount(route_prefix.rstrip("/"), app=app)])


def _busy_response(max_connections: int) -> bytes:
    body = json.dumps({"error": {"message": f"{max_connections} connections open on this replica "
                                            "(serve.max_connections); retry shortly",
                                 "type": "service_unavailable", "param": None, "code": "too_many_connections"}})
    return (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
            f"\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}").encode()


def deadline_protocol(header_timeout_s: float, send_timeout_s: float = 60.0, max_connections: int = 1024) -> type:
    """uvicorn's h11 protocol with two deadlines of ours (NOTE: uvicorn has neither; only the keep-alive
    one, which data of any kind resets):

    - each request's head (request line + headers): a client that connects and sends nothing, or its headers a
      byte at a time (slowloris), is disconnected `header_timeout_s` after it connected or after its previous
      response (the body has its own deadline: Guard, body_timeout_s);
    - each response's sending: a client that stops reading fills the socket's buffers, uvicorn then pauses
      the app's writes, and the request would hold its slot, its engines and its KV for as long as the client
      likes; once writing has been paused for `send_timeout_s` the connection is aborted, which the app
      sees as a disconnect (the request is cancelled and its legs closed).

    And a cap: a connection beyond `max_connections` open ones gets a 503 in the OpenAI error shape and is
    closed at once (uvicorn's own limit_concurrency answers in plain text)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = _busy_response(max_connections)

    class DeadlineProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _send_timer: asyncio.TimerHandle | None = None
        _armed_for: Any = None
        _rejected = False  # over serve.max_connections

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._armed_for = self.cycle  # NOTE: a new request's head makes a new cycle
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.cycle is self._armed_for and (self.cycle is None or self.cycle.response_complete) \
                    and not self.transport.is_closing():
                logger.info("closing a connection from %s: no request head within %gs (serve.header_timeout_s)",
                            self.client, header_timeout_s)
                self.transport.close()

        def _send_late(self) -> None:
            self._send_timer = None
            if not self.transport.is_closing():
                logger.info("aborting a connection from %s: response unread for %gs (serve.send_timeout_s)",
                            self.client, send_timeout_s)
                self.transport.abort()  # NOTE: close() would wait for the unread buffer to drain

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._send_timer = self.loop.call_later(send_timeout_s, self._send_late)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                # NOTE: answered, its write side shut, and what it sends dropped until it closes (at most 1 s):
                # closing at once with its request unread would reset the connection before it read the 503.
                self._rejected = True
                transport.write(busy)
                transport.write_eof()
                self.loop.call_later(1.0, transport.close)
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if not self._rejected:
                super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            for t in (self._head_timer, self._send_timer):
                if t is not None:
                    t.cancel()
            self._head_timer = self._send_timer = None
            super().connection_lost(exc)

    return DeadlineProtocol


async def serve_forever(app: Any, sock: socket.socket, route_prefix: str = "/", header_timeout_s: float = 30.0,
                        send_timeout_s: float = 60.0, max_connections: int = 1024) -> None:
    """Serve ``app`` on ``sock`` until the replica ends (deadlines and connection cap: deadline_protocol)."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # NOTE: the replica's signals belong to Ray
            yield

    config = uvicorn.Config(mounted(app, route_prefix), log_level="warning", access_log=False, lifespan="off",
                            timeout_keep_alive=30,
                            http=deadline_protocol(header_timeout_s, send_timeout_s, max_connections))
    server = _Server(config)
    host, port = sock.getsockname()[:2]
    logger.info("direct ingress on %s:%s%s", host, port, route_prefix)
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()
