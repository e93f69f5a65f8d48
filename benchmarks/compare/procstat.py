"""CPU time of this run's own processes, per component, from /proc: each engine (its Ray actor and the
vLLM EngineCore under it), Serve, Ray and the driver, and what processes that are not ours used."""

from __future__ import annotations

import os
import time
from pathlib import Path

from engine.procs import cpu_seconds, machine_busy_s, machine_steal_s, tree

Snapshot = dict[int, tuple[str, float]]
"""pid -> (component, CPU seconds so far)."""


def cmdline(pid: int) -> str | None:
    """``/proc/PID/cmdline`` with spaces for NULs (Ray actors show their title here); None once gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return None


def classify_process(cmd: str, pid: int, self_pid: int) -> str:
    """Component name of one of our processes (workers are attributed separately, by PID tree)."""
    if pid == self_pid:
        return "driver + load client"
    if "ServeReplica" in cmd or "ProxyActor" in cmd or "ServeController" in cmd:
        return "serve (ingress, proxy, controller)"
    if "PoolController" in cmd:
        return "pool controller"
    return "ray system (gcs, raylet, agents, idle workers)"


def cpu_snapshot(engines: dict[int, str]) -> tuple[Snapshot, float]:
    """(CPU seconds of this process and each of its descendants, machine busy seconds; steal not included).

    ``engines`` maps an engine's PID to its component name; its descendants (vLLM's EngineCore)
    count toward it. Everything else under this process is named by ``classify_process``."""
    owner = {p: name for pid, name in engines.items() for p in tree(pid)}
    me = os.getpid()
    out: Snapshot = {}
    for p in tree(me):
        cmd = cmdline(p)
        if cmd is not None:
            out[p] = (owner.get(p) or classify_process(cmd, p, me), cpu_seconds([p]))
    return out, machine_busy_s()


def cpu_breakdown(before: Snapshot, after: Snapshot, wall_s: float) -> dict[str, float]:
    """Cores used per component over ``wall_s``: sum of CPU-second deltas / wall. Processes that
    appear only in ``after`` count from 0 (started during the step)."""
    used: dict[str, float] = {}
    for pid, (group, cpu) in after.items():
        prev = before.get(pid)
        delta = cpu - (prev[1] if prev and prev[0] == group else 0.0)
        used[group] = used.get(group, 0.0) + max(0.0, delta)
    return {g: round(v / wall_s, 3) for g, v in sorted(used.items())} if wall_s > 0 else {}


def machine_now(window_s: float = 3.0) -> float:
    """Cores the whole machine uses over the next ``window_s`` seconds (this run's processes included)."""
    busy0 = machine_busy_s()
    time.sleep(window_s)
    return (machine_busy_s() - busy0) / window_s


def foreign_now(window_s: float = 3.0) -> float:
    """Cores used by processes outside this run's process tree over the next ``window_s`` seconds."""
    before, busy0 = cpu_snapshot({})
    time.sleep(window_s)
    after, busy1 = cpu_snapshot({})
    ours = sum(cpu_breakdown(before, after, window_s).values())
    return max(0.0, (busy1 - busy0) / window_s - ours)


def quiet_now(window_s: float = 3.0) -> tuple[float, float]:
    """(cores used by processes outside this run's tree, cores the host stole) over the next ``window_s`` s."""
    steal = Steal()
    return foreign_now(window_s), steal.cores()


class Steal:
    """Cores the hypervisor took for other guests since creation (`cores()`): on a shared VM our processes wait
    that long without any process of this machine running."""

    def __init__(self) -> None:
        self.t0, self.s0 = time.monotonic(), machine_steal_s()

    def cores(self) -> float:
        wall = time.monotonic() - self.t0
        return round(max(0.0, machine_steal_s() - self.s0) / wall, 3) if wall > 0 else 0.0
