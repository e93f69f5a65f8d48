"""The deploy CLI as a subprocess, the way a user runs it: start, wait until ready, measure its process
tree (PSS, CPU), SIGTERM it and count what is left. Used by the footprint and soak benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.procs import tree

READY = "OpenAI-compatible endpoint:"


def pss_bytes(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def _name(pid: int) -> str:
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    name = next((c.decode(errors="replace") for c in cmd if c and not c.endswith(b"python")
                 and not c.startswith(b"-")), "?")
    return Path(name).name[:40].strip()


def pss_by_process(pids: list[int]) -> dict[str, int]:
    """PSS bytes per process, keyed 'pid name' ('name < parent' for vLLM's EngineCore children)."""
    out = {}
    for p in pids:
        try:
            name = _name(p)
            if "EngineCore" in name:
                ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
                name = f"{name} < {_name(ppid)}"
            out[f"{p} {name}"] = pss_bytes([p])
        except (OSError, ValueError, IndexError):
            continue
    return out


class DeployProcess:
    """``python -m cluster.deploy [CONFIG] --no-demo`` with its own embedded Ray."""

    def __init__(self, config: str | None = None, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.extra_env = dict(env or {})  # on top of this process's environment, for the deployment only
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    def start(self, timeout_s: float = 600) -> float:
        """Start it and wait until it prints its endpoint. Returns seconds until ready."""
        from cluster.control.runtime import LOOPBACK_ENV

        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # NOTE: always its own Ray
        env.update(LOOPBACK_ENV, PYTHONUNBUFFERED="1")
        env.update(self.extra_env)
        cmd = [sys.executable, "-m", "cluster.deploy", *([self.config] if self.config else []), "--no-demo"]
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env=env)
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = t0 + timeout_s
        while not self._ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"deploy not ready (exit code {self.proc.returncode}):\n"
                                   + "".join(self.lines[-30:]))
        return time.monotonic() - t0

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)
            if READY in line:
                self._ready.set()

    def pids(self) -> list[int]:
        return tree(self.proc.pid) if self.proc else []

    def stop(self, timeout_s: float = 120) -> int:
        """SIGTERM, wait, SIGKILL the group if it hangs. Returns how many of its processes are left."""
        if self.proc is None:
            return 0
        pids = self.pids()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        time.sleep(2)
        return sum(Path(f"/proc/{p}").exists() for p in pids)
