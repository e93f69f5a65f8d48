"""Direct ingress: the ingress replica answers HTTP itself on serve.host:serve.port.

Through Ray Serve's proxy every request takes one more process hop each way (client -> proxy -> replica
and back, each a Ray call), which costs ~8-9 ms of TTFT on our CPU box. With `serve.direct` (the default)
the replica runs its own HTTP server (uvicorn, on the replica's event loop) for the same FastAPI app, so a
request goes client -> replica -> engines. Serve's proxy is not started unless `serve.proxy_port` asks for
it (one process less at startup). Ray Serve has a similar mode (RAY_SERVE_ENABLE_DIRECT_INGRESS) but picks replica ports from a
range, so an application cannot be found at its configured port; this keeps the port the config names.
"""

from __future__ import annotations

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


async def serve_forever(app: Any, sock: socket.socket, route_prefix: str = "/") -> None:
    """Serve ``app`` on ``sock`` until the replica ends."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # NOTE: the replica's signals belong to Ray
            yield

    config = uvicorn.Config(mounted(app, route_prefix), log_level="warning", access_log=False, lifespan="off",
                            timeout_keep_alive=30)
    server = _Server(config)
    host, port = sock.getsockname()[:2]
    logger.info("direct ingress on %s:%s%s", host, port, route_prefix)
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()
