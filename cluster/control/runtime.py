"""Connecting to Ray (embedded local on loopback, or an existing cluster) and cluster facts."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# NOTE: without these Ray binds the host's interface address and phones home. Its token auth stays on: the
# embedded cluster gets a fresh token each start (connect, cluster/control/raytoken.py).
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}
EMBEDDED: dict[str, Any] = {}  # the embedded cluster this process started: its GCS address and token file


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
    the GCS and Ray's agents bound it (--node-ip-address=<the host's address>). The constant is set
    again here for a Ray imported earlier."""
    os.environ.update({k: os.environ.get(k, v) for k, v in LOOPBACK_ENV.items()})
    import sys

    consts = sys.modules.get("ray._private.ray_constants")
    if consts is not None:
        consts.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"].lower() in ("1", "true")
    return {k: os.environ[k] for k in LOOPBACK_ENV}


def gcs_address(address: str) -> str | None:
    """host:port of the GCS an address names ("auto": the cluster `ray start` last started here); None for
    Ray Client addresses (ray://), whose server is not the GCS."""
    if address.startswith("ray://"):
        return None
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address_or_die

        return canonicalize_bootstrap_address_or_die("auto")
    return address


def join_auth(address: str, allow_unauthenticated: bool) -> bool:
    """Before ray.init onto a cluster: make this process present the cluster's token if it asks for one
    (RAY_AUTH_MODE=token; the token from RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH, else the one an embedded
    cluster of ours left for that address, else Ray's ~/.ray/auth_token). A cluster without auth is refused
    unless ``allow_unauthenticated``. Returns whether the cluster requires a token."""
    from cluster.control import raytoken

    gcs = gcs_address(address)
    if gcs is None:
        return False
    if not raytoken.requires_token(gcs):
        if not allow_unauthenticated:
            raise ConnectionError(
                f"the Ray cluster at {address!r} runs without authentication (RAY_AUTH_MODE=disabled): anyone "
                "who reaches its ports can run code on every node, and on a Ray Serve replica's gRPC port "
                "(all interfaces). Restart it with token auth (docs/security.md: RAY_AUTH_MODE=token and the "
                "same token file on every node), or set ray.allow_unauthenticated: true to deploy anyway")
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        ours = raytoken.token_for(gcs)
        if ours is not None:
            os.environ["RAY_AUTH_TOKEN_PATH"] = str(ours)
        elif not (Path.home() / ".ray" / "auth_token").is_file():
            raise ConnectionError(
                f"the Ray cluster at {address!r} requires its token and none is set here: export "
                "RAY_AUTH_TOKEN_PATH=<the file with the token the cluster's nodes use> (docs/security.md)")
    raytoken.refresh()
    return True


def connect(address: str | None, *, num_cpus: int | None, object_store_mib: int, namespace: str,
            allow_unauthenticated: bool = True) -> bool:
    """Connect to Ray. Returns True when this process started an embedded local cluster.

    A cluster given by address: its auth mode is its owner's; we present its token, and refuse
    one without auth unless ``allow_unauthenticated`` (the deploy passes ray.allow_unauthenticated). The
    embedded cluster: loopback only, token auth with a fresh token."""
    import ray

    from cluster.control import raytoken

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        check_reachable(address)
        needs_token = join_auth(address, allow_unauthenticated)
        try:
            ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)
        except (ConnectionError, RuntimeError) as e:
            if needs_token:
                raise ConnectionError(f"the Ray cluster at {address!r} did not accept this token ({e}); set "
                                      "RAY_AUTH_TOKEN_PATH to the cluster's token file") from None
            raise
        return False
    env_vars = use_loopback()
    token = raytoken.new_token_file()
    env_vars.update(raytoken.use_token(token))
    cpus = num_cpus or max(4, (os.cpu_count() or 2) + 2)
    # NOTE: address="local" always starts a new cluster; without it ray.init() attaches to whatever
    # `ray start` last left in /tmp/ray/ray_current_cluster, even a stale one.
    try:
        ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                 object_store_memory=object_store_mib << 20, _node_ip_address="127.0.0.1", namespace=namespace,
                 runtime_env={"env_vars": env_vars}, logging_level=logging.WARNING, log_to_driver=False)
    except BaseException:
        raytoken.forget(None, token)
        raise
    gcs = ray.get_runtime_context().gcs_address
    EMBEDDED.update(gcs=gcs, token=token, by_address=raytoken.remember(gcs, token))
    return True


def forget_embedded() -> None:
    """The embedded cluster stopped: its token files go with it."""
    from cluster.control import raytoken

    if EMBEDDED:
        raytoken.forget(EMBEDDED.get("gcs"), EMBEDDED.get("token"))
        EMBEDDED.clear()


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
