"""vLLM's EngineCore in a thread of the worker actor instead of a child process (CPU engines).

NOTE: AsyncLLM always runs its EngineCore in a spawned child process; inside a Ray actor that child imports
vLLM a second time (~9 s of CPU on our boxes) and holds a second copy of the Python runtime (~0.9 GiB PSS).
On a small CPU box at startup that import competes with every other one, and the pair of processes per
engine costs memory for nothing: on CPU the model runs in the same place either way. Here the EngineCore
runs `EngineCoreProc.run_engine_core` unchanged, talking to its client over the same ZMQ sockets, but in a
thread: vLLM's process manager gets a thread-backed stand-in for `multiprocessing.Process`. What a thread
cannot do is emulated or skipped: signal handlers (the stand-in records them and `terminate()` calls the
SIGTERM handler, which is how vLLM asks its EngineCore to stop), the process title and log prefixes
(they would rename the whole actor process). Everything else, NIXL included, is vLLM's own code path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)
_local = threading.local()  # .handlers: {signum: handler} of the EngineCore thread running here
_real_signal = signal.signal


def _thread_aware_signal(signum: int, handler: Any) -> Any:
    handlers = getattr(_local, "handlers", None)
    if handlers is None or threading.current_thread() is threading.main_thread():
        return _real_signal(signum, handler)
    previous = handlers.get(signum)
    handlers[signum] = handler
    return previous


class ThreadProcess:
    """Enough of `multiprocessing.Process` for vLLM's CoreEngineProcManager and its shutdown()."""

    def __init__(self, target: Callable[..., Any], name: str = "EngineCore", kwargs: dict | None = None,
                 **_: Any) -> None:
        self.name = name
        self._target, self._kwargs = target, kwargs or {}
        self._handlers: dict[int, Any] = {}
        self._read, self._write = os.pipe()
        self.sentinel = self._read  # NOTE: readable (EOF) once the thread has ended, like a process sentinel
        self.exitcode: int | None = None
        self.pid = None  # NOTE: vLLM SIGKILLs the pid of a process that outlives shutdown: never ours
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        _local.handlers = self._handlers
        try:
            self._target(**self._kwargs)
            self.exitcode = 0
        except SystemExit as e:
            self.exitcode = 0 if e.code in (None, 0) else 1
        except BaseException:  # noqa: BLE001 - reported like a dead process: the client sees it
            logger.exception("EngineCore thread %s failed", self.name)
            self.exitcode = 1
        finally:
            os.close(self._write)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def terminate(self) -> None:
        handler = self._handlers.get(signal.SIGTERM)
        if callable(handler):
            handler(signal.SIGTERM, None)

    kill = terminate

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._read)


class _ThreadContext:
    """Stands in for the multiprocessing context vLLM's process manager asks for."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def Process(self, *args: Any, **kwargs: Any) -> ThreadProcess:  # noqa: N802 - multiprocessing's name
        return ThreadProcess(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def engine_core_in_thread() -> Iterator[None]:
    """While active, AsyncLLM construction in this process starts its EngineCore as a thread."""
    import vllm.v1.engine.core as core
    import vllm.v1.engine.utils as engine_utils

    real_ctx, real_title, real_logs = engine_utils.get_mp_context, core.set_process_title, core.decorate_logs
    engine_utils.get_mp_context = lambda: _ThreadContext(real_ctx())
    core.set_process_title = lambda *a, **k: None
    core.decorate_logs = lambda *a, **k: None
    signal.signal = _thread_aware_signal
    try:
        yield
    finally:
        engine_utils.get_mp_context = real_ctx
        # NOTE: the thread keeps running after construction; these two stay no-ops for it.
        core.set_process_title, core.decorate_logs = real_title, real_logs
        signal.signal = _real_signal
