"""What the sockets of a process tree let in: each listener on loopback, or refusing a call without Ray's token."""

from __future__ import annotations

from cluster.control.raytoken import refuses_unauthenticated, unauthenticated_answers
from engine.procs import Listener, listeners, tree


def exposed(roots: list[int]) -> list[tuple[Listener, dict[str, str]]]:
    """Every listener of the trees under ``roots`` not on loopback, with what Ray's methods answered it
    without a token (cluster/control/raytoken.py); probed on 127.0.0.1, where a wildcard listener answers too."""
    return [(ls, unauthenticated_answers(f"127.0.0.1:{ls.port}"))
            for ls in listeners([p for r in roots for p in tree(r)]) if not ls.loopback]


def open_ones(found: list[tuple[Listener, dict[str, str]]]) -> list[tuple[Listener, dict[str, str]]]:
    """Those that did not refuse (no UNAUTHENTICATED answer, or some call answered OK)."""
    return [(ls, got) for ls, got in found if not refuses_unauthenticated(got)]
