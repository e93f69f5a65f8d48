"""The direct ingress's HTTP server (cluster/serve/direct.py, real uvicorn) on a free loopback port, in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from cluster.serve.direct import bind, serve_forever


@contextlib.contextmanager
def direct_server(app: Any, **kw: Any) -> Iterator[int]:
    """Serve ``app`` (serve_forever's keywords: timeouts, max_connections); yields its port once it accepts."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    task: list[asyncio.Task] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        task.append(loop.create_task(serve_forever(app, sock, "/", **kw)))
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task[0])

    th = threading.Thread(target=run, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # NOTE: bounded
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    try:
        yield port
    finally:
        loop.call_soon_threadsafe(task[0].cancel)
        th.join(10)
