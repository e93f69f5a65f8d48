"""Where and when a benchmark ran: command, UTC start and end, machine (CPU model, cores, memory, load),
git commit and whether the working tree was clean. Every comparison report starts with these."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def parse_cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown"


def parse_mem_total_gib(meminfo: str) -> float | None:
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return None


def machine_info() -> dict[str, Any]:
    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""

    mem = parse_mem_total_gib(read("/proc/meminfo"))
    return {"nproc": os.cpu_count(), "memory_gib": None if mem is None else round(mem, 1),
            "cpu_model": parse_cpu_model(read("/proc/cpuinfo")), "loadavg": read("/proc/loadavg").split()[:3],
            "platform": sys.platform}


def dirty_paths(porcelain_z: str) -> list[str]:
    """Paths that make a tree dirty, from ``git status --porcelain -z``: every changed or untracked path except
    results files under benchmarks/results/ (new or re-measured, this run's or a previous run's of the same
    session not yet committed: they are not code)."""
    paths, entries = [], iter(porcelain_z.split("\0"))
    for entry in entries:
        if len(entry) < 4:
            continue
        if entry[0] in "RC":  # NOTE: a rename or copy is followed by its source path, which is not a change
            next(entries, None)
        if not entry[3:].startswith("benchmarks/results/"):
            paths.append(entry[3:])
    return paths


def git_commit() -> dict[str, Any]:
    """``{"commit", "dirty", "dirty_files", "dirty_paths"}`` of the repository this code runs from."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                                  check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""

    # NOTE: -z, and no strip(): a status line starts with a space (" M path"); stripping the output once cut
    # the first line's leading space, misread its path and marked every re-measurement dirty.
    dirty = dirty_paths(git("status", "--porcelain", "-z"))
    return {"commit": git("rev-parse", "HEAD").strip() or "unknown", "dirty": bool(dirty),
            "dirty_files": len(dirty), "dirty_paths": dirty[:20]}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Provenance:
    """Taken when a run starts (``Provenance.start``); ``end_fields()`` when it ends."""

    command: str
    started_at: str
    machine: dict[str, Any]
    git: dict[str, Any]
    t0: float = field(default_factory=time.monotonic, compare=False)

    @classmethod
    def start(cls, prog: Sequence[str], argv: Sequence[str]) -> Provenance:
        """``prog``: how the tool is invoked, e.g. ``["python", "-m", "benchmarks.compare"]``."""
        return cls(shlex.join([*prog, *argv]), _now(), machine_info(), git_commit())

    def start_fields(self) -> dict[str, Any]:
        return {"command": self.command, "started_at": self.started_at, "machine": self.machine, "git": self.git}

    def end_fields(self) -> dict[str, Any]:
        return {"finished_at": _now(), "runtime_s": round(time.monotonic() - self.t0, 1),
                "machine_end": {"loadavg": machine_info()["loadavg"]}}


def write_artefact(path: str | Path, prov: Provenance, body: dict[str, Any]) -> None:
    """A results JSON: the run's provenance around ``body``; written whole or not at all (tmp + rename)."""
    import json

    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(prov.start_fields() | body | prov.end_fields(), indent=1))
    tmp.replace(out)


def header_lines(report: dict[str, Any], machine_note: str = "") -> list[str]:
    """Markdown: the command to reproduce, dates, machine and git commit of a report that holds
    ``Provenance.start_fields()`` and ``end_fields()``."""
    mach = report["machine"]
    return ["Reproduce with:", "", "```", report["command"], "```", "",
            f"- date: {report['started_at']} to {report['finished_at']} (UTC), {report['runtime_s']:.0f} s in all",
            f"- machine: {mach['nproc']} cores ({mach['cpu_model']}), {mach['memory_gib']} GiB RAM, load average at "
            f"start {' '.join(mach['loadavg'])}, at end {' '.join(report['machine_end']['loadavg'])}"
            + (f"; {machine_note}" if machine_note else ""),
            f"- git commit: `{report['git']['commit']}`" + (" (working tree had uncommitted changes)"
                                                           if report["git"]["dirty"] else "")]
