"""The embedded deploy CLI as two processes, so that a signal to its whole process group is a clean stop.

systemd's default `KillMode=control-group`, `docker stop` of a shell entrypoint, `timeout` and a
terminal's Ctrl-C signal every process in the CLI's group. An embedded Ray starts its GCS, raylet, workers
and their EngineCores in that group: each would get the signal at once, the GCS dies under the driver that
is still draining (Ray prints "Failed to connect to GCS within 60 seconds" and exits the driver, our
cleanup never runs) and the EngineCores are orphaned.

NOTE: so the CLI the user started stays a thin supervisor: it re-runs itself as a child in a session of its
own (the child, Ray and the engines get no group signal), forwards each SIGINT/SIGTERM/SIGHUP it receives to
the child alone (which drains and stops everything it started, as with a signal to the CLI alone), and exits
with the child's code. The child asks the kernel for SIGTERM should the supervisor die first (even by
SIGKILL), so it never outlives the CLI either.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

CHILD_ENV = "SAAF_DEPLOY_SUPERVISOR"  # in the child's environment: the supervisor's PID
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1


def is_child() -> bool:
    return CHILD_ENV in os.environ


def become_child() -> None:
    """In the child, first thing: SIGTERM when the supervisor dies; exit if it already has."""
    parent = int(os.environ.pop(CHILD_ENV))
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # NOTE: it died before prctl took effect
        raise SystemExit(1)


def supervise(argv: list[str]) -> int:
    """Run `python -m cluster.deploy ARGV` in its own session; forward signals; return its exit code."""
    env = dict(os.environ, **{CHILD_ENV: str(os.getpid())})
    child = subprocess.Popen([sys.executable, "-m", "cluster.deploy", *argv], env=env, start_new_session=True)

    def forward(signum: int, _frame) -> None:
        if child.returncode is None:
            try:
                os.kill(child.pid, signum)
            except ProcessLookupError:
                pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    code = child.wait()  # NOTE: PEP 475: the wait resumes after each forwarded signal
    return 128 - code if code < 0 else code
