"""Deploying one variant and tearing it down with nothing left running.

``InProcessDeployment`` runs ``cluster.control.lifecycle.start`` on the Ray this process started
(``embedded_ray``), so several variants deploy in turn on one Ray, and each engine's PID comes from the
worker itself. It gives a ``Deployed`` once the endpoint is healthy, and ``stop()`` returns how many of
the deployment's processes still ran after it (0; stragglers are ended by PID, never by name)."""

from __future__ import annotations

import contextlib
import logging
import signal
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, NamedTuple

from cluster.control import lifecycle
from cluster.control.runtime import connect
from cluster.deploy import shutdown_embedded
from engine.procs import tree

logger = logging.getLogger(__name__)


WORKER_KEYS = ("worker_id", "role", "engine_id", "pid", "kv_capacity_tokens")


class Deployed(NamedTuple):
    endpoint: str
    model: str
    startup_s: float
    workers: list[dict[str, Any]]
    """One dict per engine worker with ``WORKER_KEYS`` (None where a way of deploying cannot tell)."""
    engines: dict[int, str]
    """Engine worker PID -> worker id; the PID's descendants (vLLM's EngineCore) belong to it."""


class Deployment(ABC):
    """One variant's deployment. ``start`` blocks until ready (or raises, leaving nothing running);
    ``stop`` is safe to call once after ``start`` returned."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    @abstractmethod
    def start(self, ready_timeout_s: float) -> Deployed: ...

    @abstractmethod
    def stop(self) -> int: ...


def _reap(pids: list[int], grace_s: float) -> int:
    """Wait for ``pids`` to exit, end stragglers by PID; returns how many are still there after that."""
    from engine.procs import reap

    return len(pids) - len(reap(pids, grace_s=grace_s))


class InProcessDeployment(Deployment):
    """``cluster.control.lifecycle.start`` / ``stop`` on the Ray cluster this process is connected to."""

    def __init__(self, config: dict[str, Any], stop_grace_s: float = 30.0) -> None:
        super().__init__(config)
        self.stop_grace_s = stop_grace_s
        self._info: dict[str, Any] | None = None

    def start(self, ready_timeout_s: float) -> Deployed:
        from cluster.config import parse_config

        cfg = parse_config(self.config, f"{self.config.get('name', 'variant')} config")
        info = lifecycle.start(cfg, ready_timeout_s=ready_timeout_s)
        self._info = info
        workers = [{k: w.get(k) for k in WORKER_KEYS} for w in info["workers"]]
        engines = {w["pid"]: w["worker_id"] for w in info["workers"] if w.get("pid")}
        return Deployed(info["endpoint"], info["model"], info["startup_s"], workers, engines)

    def stop(self) -> int:
        if self._info is None:
            return 0
        info, self._info = self._info, None
        pids = [p for w in info["workers"] if w.get("pid") for p in tree(w["pid"])]
        lifecycle.stop(info["config"])
        # NOTE: the workers' processes end after their actors are killed; wait for that (bounded) so the
        # next variant never shares the CPUs with a previous one's EngineCore.
        return _reap(pids, self.stop_grace_s)


@contextlib.contextmanager
def embedded_ray(namespace: str) -> Iterator[None]:
    """A local Ray for in-process deployments; SIGTERM raises KeyboardInterrupt inside (so a killed run
    still tears down and keeps what finished); on exit Serve, Ray and any process of ours that outlived
    them are stopped."""
    def _term(*_: object) -> None:
        raise KeyboardInterrupt

    connect(None, num_cpus=None, object_store_mib=256, namespace=namespace)
    old = signal.signal(signal.SIGTERM, _term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        shutdown_embedded()
