"""Our own process tree: find descendants, what they listen on, and make sure none outlives an embedded
cluster.

NOTE: Ray 2.60's DashboardAgent and RuntimeEnvAgent can survive `ray.shutdown()` of a local cluster
(re-parented to init, ignoring SIGTERM); we end exactly the processes we started, by PID."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import time
from pathlib import Path
from typing import NamedTuple


def descendants(pid: int) -> list[int]:
    """All descendants of ``pid`` (not pid itself), from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    return [pid, *descendants(pid)]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds ``pids`` have used so far (those gone count 0)."""
    tck = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / tck
        except (OSError, IndexError, ValueError):
            continue
    return total


def _cpu_ticks() -> list[int]:
    """The machine's summed CPU times from /proc/stat (user nice system idle iowait irq softirq steal ...)."""
    return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent running something, since boot: neither idle nor stolen.

    NOTE: steal (time the hypervisor gave another guest while this one wanted to run) is no process of this
    machine's; counted as busy it read as "load not ours" on a shared VM."""
    v = _cpu_ticks()
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:7]) - idle) / os.sysconf("SC_CLK_TCK")


def machine_steal_s() -> float:
    """CPU seconds the hypervisor ran other guests while this machine's cores were ready to run, since boot."""
    v = _cpu_ticks()
    return (v[7] if len(v) > 7 else 0) / os.sysconf("SC_CLK_TCK")


class ForeignCores:
    """Cores used by processes outside this process's tree since creation (`cores()`): the load that other
    engines, benchmarks or servers on the box put beside ours."""

    def __init__(self) -> None:
        self.t0, self.own0, self.busy0 = time.monotonic(), self._own(), machine_busy_s()

    @staticmethod
    def _own() -> float:
        return cpu_seconds(tree(os.getpid()))

    def cores(self) -> float:
        wall = time.monotonic() - self.t0
        if wall <= 0:
            return 0.0
        return max(0.0, (machine_busy_s() - self.busy0) - (self._own() - self.own0)) / wall


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def reap(pids: list[int], grace_s: float = 10.0) -> list[int]:
    """Wait up to ``grace_s`` for ``pids`` to exit, then SIGTERM, then SIGKILL. Returns those killed."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in left:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 3
        while time.monotonic() < end and any(_alive(p) for p in left):
            time.sleep(0.1)
        left = [p for p in left if _alive(p)]
        if not left:
            break
    return [p for p in pids if p not in left]


def reset_affinity(pid: int, cpus: set[int]) -> int:
    """Allow every thread of ``pid`` and its descendants to run on ``cpus``; returns threads changed.

    NOTE: vLLM 0.32's NixlConnector on CPU pins its EngineCore to the last core of each NUMA node
    (nixl/base_worker.py, cores reserved for start_load_kv), so every prefill and decode engine of a node
    ends up sharing one core while the others idle (measured by benchmarks/compare.py)."""
    changed = 0
    for p in [pid, *descendants(pid)]:
        try:
            tids = [int(t.name) for t in Path(f"/proc/{p}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                if set(os.sched_getaffinity(tid)) != cpus:
                    os.sched_setaffinity(tid, cpus)
                    changed += 1
            except OSError:
                continue
    return changed


class Listener(NamedTuple):
    """A listening TCP socket of one of our processes."""

    pid: int
    process: str  # its command line, cut short
    host: str  # "127.0.0.1", "::", "::ffff:127.0.0.1", ...
    port: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.host)
        mapped = getattr(ip, "ipv4_mapped", None)
        return (mapped or ip).is_loopback


def _listening(table: str) -> dict[str, tuple[str, int]]:
    """{socket inode: (host, port)} of the LISTEN rows of a /proc/net/tcp or tcp6 table."""
    out: dict[str, tuple[str, int]] = {}
    for row in table.splitlines()[1:]:
        f = row.split()
        if len(f) < 10 or f[3] != "0A":  # NOTE: 0A = TCP_LISTEN
            continue
        addr, port = f[1].split(":")
        raw = bytes.fromhex(addr)
        # NOTE: the kernel prints each 32-bit word of the address in host (little-endian) order
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        host = socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)
        out[f[9]] = (host, int(port, 16))
    return out


def listeners(pids: list[int]) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) that one of ``pids`` holds open, matched by socket inode."""
    out = []
    for pid in pids:
        try:
            inodes = set()
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
            table: dict[str, tuple[str, int]] = {}
            for name in ("tcp", "tcp6"):
                with contextlib.suppress(OSError):
                    table.update(_listening(Path(f"/proc/{pid}/net/{name}").read_text()))
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # NOTE: gone meanwhile
            continue
        out.extend(Listener(pid, cmd[:120], *table[i]) for i in sorted(inodes) if i in table)
    return out
