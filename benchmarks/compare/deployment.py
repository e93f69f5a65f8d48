"""Deploying one variant and tearing it down with nothing left running, two ways:

- ``InProcessDeployment``: ``cluster.control.lifecycle.start`` on the Ray this process started (``embedded_ray``),
  so several variants deploy in turn on one Ray, and each engine's PID comes from the worker itself;
- ``SubprocessDeployment``: ``python -m cluster.deploy CONFIG`` as a user runs it (its own embedded Ray),
  engines found by their Ray process titles.

Both give a ``Deployed`` once the endpoint is healthy, and ``stop()`` returns how many of the
deployment's processes still ran after it (0; stragglers are ended by PID, never by name)."""

from __future__ import annotations

import contextlib
import logging
import signal
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from benchmarks.compare.procstat import cmdline
from cluster.control import lifecycle
from cluster.control.pools import WORKER_CLASSES
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


class SubprocessDeployment(Deployment):
    """``python -m cluster.deploy CONFIG --no-demo`` in a child process with its own embedded Ray."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: Any = None

    def start(self, ready_timeout_s: float) -> Deployed:
        from benchmarks.client import first_model
        from benchmarks.deployproc import DeployProcess
        from cluster.config import parse_config

        cfg = parse_config(self.config)  # NOTE: errors here, before a child process starts
        self._tmp = tempfile.TemporaryDirectory(prefix="saaf-variant-")
        path = Path(self._tmp.name) / "deploy.yaml"
        path.write_text(yaml.safe_dump(self.config))
        self._proc = DeployProcess(str(path))
        try:
            startup_s = self._proc.start(ready_timeout_s)
            endpoint = lifecycle.endpoint_url(cfg)
            model = first_model(endpoint, None)
        except BaseException:
            self.stop()
            raise
        engines = find_engines(self._proc.pids())
        workers = [{"worker_id": wid, "role": wid.split("@")[0], "engine_id": None, "pid": pid,
                    "kv_capacity_tokens": None} for pid, wid in engines.items()]
        return Deployed(endpoint, model, startup_s, workers, engines)

    def stop(self) -> int:
        if self._proc is None:
            return 0
        proc, self._proc = self._proc, None
        pids = proc.pids()
        proc.stop()
        left = _reap(pids, 10.0)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return left


def find_engines(pids: list[int]) -> dict[int, str]:
    """Engine worker actors among ``pids``, by their Ray process title (``ray::PrefillWorker...``),
    named ``role@pid``: a deploy subprocess does not tell its workers' PIDs."""
    titles = {f"ray::{cls.__name__}": role for role, cls in WORKER_CLASSES.items()}
    out = {}
    for p in pids:
        cmd = cmdline(p) or ""
        role = next((r for t, r in titles.items() if cmd.startswith(t)), None)
        if role is not None:
            out[p] = f"{role}@{p}"
    return out


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
