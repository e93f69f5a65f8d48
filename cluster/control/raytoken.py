"""Ray's own token authentication (Ray 2.60, RAY_AUTH_MODE=token) for the clusters we start and join.

With token auth every Ray listener (GCS, raylets, core workers, agents, and Ray Serve's replica gRPC server,
which binds `[::]` and unpickles what it is sent) refuses a caller without the cluster's token. Ray reads the
token from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token; its processes
inherit the environment of the process that starts them.

- The embedded cluster gets a fresh token at every start, in a file only its owner can read
  (`new_token_file`), and `remember`ed under the cluster's GCS address so that `status`, `scale` and
  `shutdown` in another shell find it (`token_for`); `forget` removes both when the cluster stops.
- A cluster we join: `requires_token` asks its GCS, unauthenticated, before `ray.init`, so a deploy onto a
  cluster without auth can refuse with a reason instead of serving from an open cluster.

NOTE: ours, not Ray's `ray get-auth-token --generate`: that writes ~/.ray/auth_token readable by everyone
(0644) and shared by every cluster of the user; an embedded cluster's token is its own and lives as long
as it does.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from pathlib import Path

TOKEN_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
REQUIRES_TIMEOUT_S = 5.0


def token_dir() -> Path:
    """Where our token files live (owner-only): $SAAF_CACHE_DIR/ray-auth, default ~/.cache/saaf-infer/ray-auth."""
    d = Path(os.environ.get("SAAF_CACHE_DIR") or "~/.cache/saaf-infer").expanduser() / "ray-auth"
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    return d


def _write_private(path: Path, token: str) -> None:
    """The token into ``path``, created 0600 (never readable by others, not even for a moment)."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    tmp.replace(path)


def new_token_file() -> Path:
    """A fresh random token (256 bits, as Ray makes its own) in a new owner-only file."""
    path = token_dir() / f"embedded-{os.getpid()}-{secrets.token_hex(4)}.token"
    _write_private(path, secrets.token_hex(32))
    return path


def refresh() -> None:
    """Make this process's Ray see the auth settings now in its environment.

    NOTE: Ray reads RAY_AUTH_MODE into its cached config, and the token into a cached loader, when it is first
    imported; the deploy CLI imports it before it connects. Ray's own token set-up refreshes both the same way
    (ray/_private/authentication/authentication_token_setup.py, authentication_test_utils.py)."""
    if "ray._raylet" not in sys.modules:
        return
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def use_token(path: Path) -> dict[str, str]:
    """This process (and every Ray process it starts) authenticates with the token in ``path``."""
    os.environ.pop("RAY_AUTH_TOKEN", None)  # NOTE: Ray prefers it to the file
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(path))
    refresh()
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


def _address_file(gcs_address: str) -> Path:
    return token_dir() / (gcs_address.replace(":", "_").replace("/", "_") + ".token")


def remember(gcs_address: str, path: Path) -> Path:
    """Keep the embedded cluster's token findable by its GCS address (for `status` / `scale` / `shutdown`)."""
    out = _address_file(gcs_address)
    _write_private(out, path.read_text().strip())
    return out


def token_for(gcs_address: str) -> Path | None:
    """The token file an embedded cluster of ours left for ``gcs_address``, if any."""
    p = _address_file(gcs_address)
    return p if p.is_file() else None


def forget(gcs_address: str | None, path: Path | None) -> None:
    for p in (path, _address_file(gcs_address) if gcs_address else None):
        if p is not None:
            with contextlib.suppress(OSError):
                p.unlink()


# Ray gRPC methods one of which each Ray server has (Serve replica, core worker, GCS, raylet node manager and
# object manager, dashboard agent, Ray Client server)
RAY_METHODS = ("/ray.serve.ASGIService/HandleRequest", "/ray.rpc.CoreWorkerService/NumPendingTasks",
               "/ray.rpc.NodeInfoGcsService/GetClusterId", "/ray.rpc.NodeManagerService/GetNodeStats",
               "/ray.rpc.ObjectManagerService/Pull", "/ray.rpc.ReporterService/HealthCheck",
               "/ray.rpc.RayletDriver/ClusterInfo")


def unauthenticated_answers(address: str, timeout_s: float = REQUIRES_TIMEOUT_S) -> dict[str, str]:
    """What each of RAY_METHODS that ``address`` (host:port) serves answers a call without a token: a gRPC
    status name ("UNAUTHENTICATED" where Ray's token is checked, "OK" where it is not, "UNAVAILABLE" when it
    is no gRPC server). Methods it does not serve (UNIMPLEMENTED) are left out."""
    import grpc

    out = {}
    ch = grpc.insecure_channel(address)
    try:
        for m in RAY_METHODS:
            try:
                ch.unary_unary(m, request_serializer=lambda b: b, response_deserializer=lambda b: b)(b"", timeout=timeout_s)
                out[m] = "OK"
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    out[m] = e.code().name
    finally:
        ch.close()
    return out


def refuses_unauthenticated(answers: dict[str, str]) -> bool:
    return "UNAUTHENTICATED" in answers.values() and "OK" not in answers.values()


def requires_token(gcs_address: str, timeout_s: float = REQUIRES_TIMEOUT_S) -> bool:
    """Does the GCS at host:port refuse an unauthenticated call? (A call with a token succeeds either way,
    so only one without tells.) Raises ConnectionError when it cannot be asked."""
    import grpc

    ch = grpc.insecure_channel(gcs_address)
    try:
        ch.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId", request_serializer=lambda b: b,
                       response_deserializer=lambda b: b)(b"", timeout=timeout_s)
        return False
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            return True
        raise ConnectionError(f"cannot ask the Ray cluster at {gcs_address!r} whether it needs a token "
                              f"({e.code().name}); is it a Ray GCS address (head:6379)?") from None
    finally:
        ch.close()
