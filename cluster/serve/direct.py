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
import logging
import socket
from typing import Any

logger = logging.getLogger(__name__)

def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so a taken port fails the replica with a clear message."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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


def head_deadline_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline for each request's head (request line + headers): a client that
    connects and sends nothing, or its headers a byte at a time (slowloris), is disconnected `timeout_s` after
    it connected or after its previous response. NOTE: uvicorn has no such timeout of its own (only the
    keep-alive one, which data of any kind resets); the body has its own deadline (Guard, body_timeout_s)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadlineProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _armed_for: Any = None

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._armed_for = self.cycle  # NOTE: a new request's head makes a new cycle
            self._head_timer = self.loop.call_later(timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.cycle is self._armed_for and (self.cycle is None or self.cycle.response_complete) \
                    and not self.transport.is_closing():
                logger.info("closing a connection from %s: no request head within %gs (serve.header_timeout_s)",
                            self.client, timeout_s)
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    return HeadDeadlineProtocol


async def serve_forever(app: Any, sock: socket.socket, route_prefix: str = "/", header_timeout_s: float = 30.0
                        ) -> None:
    """Serve ``app`` on ``sock`` until the replica ends."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # NOTE: the replica's signals belong to Ray
            yield

    config = uvicorn.Config(mounted(app, route_prefix), log_level="warning", access_log=False, lifespan="off",
                            timeout_keep_alive=30, http=head_deadline_protocol(header_timeout_s))
    server = _Server(config)
    host, port = sock.getsockname()[:2]
    logger.info("direct ingress on %s:%s%s", host, port, route_prefix)
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()
