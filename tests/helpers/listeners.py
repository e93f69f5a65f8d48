"""What the sockets of a process tree let in: each listener on loopback, or refusing a caller without Ray's token.

Probed on 127.0.0.1 only (tests talk to loopback only): a wildcard listener (0.0.0.0, ::) answers there; one
bound to a specific non-loopback address cannot be reached from loopback and is reported as not probed."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import NamedTuple

from cluster.control.raytoken import refuses_unauthenticated, unauthenticated_answers
from engine.procs import Listener, listeners, tree

WILDCARD = ("0.0.0.0", "::")


class Exposed(NamedTuple):
    listener: Listener
    guard: str  # "ray-token" (gRPC refuses), "ray-token-http" (401), "metrics" (read-only Prometheus text),
    #             "not-probed" (bound to a non-loopback address), "OPEN"
    detail: str


def _http(port: int) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:  # noqa: S310 - loopback
            return r.status, r.read(200)
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (OSError, ValueError):
        return None, b""


def classify(ls: Listener) -> Exposed:
    if ls.host not in WILDCARD:
        return Exposed(ls, "not-probed", f"bound to {ls.host}")
    answers = unauthenticated_answers(f"127.0.0.1:{ls.port}")
    if refuses_unauthenticated(answers):
        return Exposed(ls, "ray-token", str(answers))
    status, body = _http(ls.port)
    if status == 401:
        return Exposed(ls, "ray-token-http", "HTTP 401 without the token")
    if status == 200 and body.startswith(b"# HELP"):
        return Exposed(ls, "metrics", "Prometheus metrics, read-only, no auth")
    return Exposed(ls, "OPEN", f"gRPC {answers}, HTTP {status}")


def exposed(roots: list[int]) -> list[Exposed]:
    """Every listener of the trees under ``roots`` not on loopback, classified."""
    return [classify(ls) for ls in listeners([p for r in roots for p in tree(r)]) if not ls.loopback]


def open_ones(found: list[Exposed], allow: tuple[str, ...] = ()) -> list[Exposed]:
    """Those that let a caller without the token in (guards other than ray-token*, unless allowed)."""
    return [e for e in found if not e.guard.startswith("ray-token") and e.guard not in allow]
