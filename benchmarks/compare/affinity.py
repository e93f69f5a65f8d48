"""Which CPUs each engine's processes may run on, and re-allowing all of them.

NOTE: vLLM's NixlConnector pins each prefill/decode EngineCore to the last core of its NUMA node on CPU
(engine/procs.py); a comparison of shapes must see, and may undo, that pinning before it measures."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from benchmarks.compare.procstat import cmdline
from engine.procs import tree


def process_affinity(engines: dict[int, str]) -> dict[str, list[dict[str, Any]]]:
    """CPUs each engine's processes (the Ray actor and its EngineCore child) may run on."""
    out: dict[str, list[dict[str, Any]]] = {}
    for pid, name in engines.items():
        procs = []
        for p in tree(pid):
            try:
                cpus = sorted(os.sched_getaffinity(p))
            except OSError:
                continue
            procs.append({"pid": p, "cmd": (cmdline(p) or "")[:60].strip(), "cpus": cpus})
        out[name] = procs
    return out


def reset_affinity(pids: Sequence[int], cpus: set[int]) -> int:
    """Allow every thread of ``pids`` and their descendants to run on ``cpus``; returns threads changed.
    (EngineHost already does this at start; kept so runs against older deployments compare like for like.)"""
    from engine.procs import reset_affinity as reset_one

    return sum(reset_one(p, cpus) for p in pids)


def check_affinity(engines: dict[int, str], reset: bool) -> dict[str, Any]:
    """The report's affinity fields: as deployed and, with ``reset``, threads re-allowed on every CPU
    this process may use and the affinity after that."""
    out: dict[str, Any] = {"affinity": process_affinity(engines)}
    if reset:
        out["affinity_reset_threads"] = reset_affinity(list(engines), set(os.sched_getaffinity(0)))
        out["affinity_after_reset"] = process_affinity(engines)
    return out
