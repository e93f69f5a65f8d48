"""Connecting to Ray (embedded local on loopback, or an existing cluster) and cluster facts."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

logger = logging.getLogger(__name__)

# NOTE: without these Ray binds the host's interface address, asks for an auth token, and phones home.
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


REACH_TIMEOUT_S = 5.0


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Fail in seconds, naming the address, when nothing listens at a `host:port` (or `ray://host:port`) Ray
    address; "auto" and other forms are Ray's to resolve.

    NOTE: ray.init(address=...) retries an unreachable GCS for minutes before it raises; the CLI's
    users mistype an address far more often than a cluster takes minutes to come up."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConnectionError(
            f"cannot reach the Ray cluster at {address!r} ({e.strerror or e}); start one there "
            "(`ray start --head --port=...`, or `ray up`) or fix --address / ray.address / RAY_ADDRESS") from None


def use_loopback() -> dict[str, str]:
    """Set LOOPBACK_ENV in this process (values already set win) and return it, for an embedded Ray's processes.

    NOTE: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when it is first imported, and the deploy and
    benchmark paths import it (cluster/control/pools.py) before they connect: with the variable set only then,
    ray.init(_node_ip_address="127.0.0.1") still resolved "127.0.0.1" to the host's interface address, and
    the GCS and Ray's agents bound it (seen 2026-12-06: --node-ip-address=192.0.2.2). The constant is set
    again here for a Ray imported earlier."""
    os.environ.update({k: os.environ.get(k, v) for k, v in LOOPBACK_ENV.items()})
    import sys

    consts = sys.modules.get("ray._private.ray_constants")
    if consts is not None:
        consts.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"].lower() in ("1", "true")
    return {k: os.environ[k] for k in LOOPBACK_ENV}


def connect(address: str | None, *, num_cpus: int | None, object_store_mib: int, namespace: str) -> bool:
    """Connect to Ray. Returns True when this process started an embedded local cluster."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        # NOTE: a user's cluster: its auth mode (RAY_AUTH_MODE, token) is its owner's to set, never ours
        # (issue 14); only usage stats stay off unless the user's environment says otherwise.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        check_reachable(address)
        ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)
        return False
    env_vars = use_loopback()
    cpus = num_cpus or max(4, (os.cpu_count() or 2) + 2)
    # NOTE: address="local" always starts a new cluster; without it ray.init() attaches to whatever
    # `ray start` last left in /tmp/ray/ray_current_cluster, even a stale one.
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, object_store_memory=object_store_mib << 20,
             _node_ip_address="127.0.0.1", namespace=namespace, runtime_env={"env_vars": env_vars},
             logging_level=logging.WARNING, log_to_driver=False)
    return True


def cluster_gpus() -> list[dict[str, Any]]:
    """[{node_id, address, gpus, cpus, memory, labels}] of alive nodes."""
    import ray

    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        r = n.get("Resources", {})
        out.append({"node_id": n["NodeID"], "address": n.get("NodeManagerAddress"), "gpus": int(r.get("GPU", 0)),
                    "cpus": r.get("CPU", 0), "memory": r.get("memory", 0),
                    "labels": dict(n.get("Labels") or {})})
    return out
