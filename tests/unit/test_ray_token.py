"""Ray token auth (cluster/control/raytoken.py, runtime.join_auth): token files only their owner can read,
found again by the cluster's address; a cluster's auth asked of its GCS (here a real gRPC server standing in
for one, with and without auth); a deploy onto a cluster without auth refused unless the config allows it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from cluster.control import raytoken
from cluster.control.runtime import join_auth

GET_CLUSTER_ID = "/ray.rpc.NodeInfoGcsService/GetClusterId"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("SAAF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for k in raytoken.TOKEN_ENV:
        monkeypatch.delenv(k, raising=False)


def _fake_gcs(authenticated: bool) -> tuple[grpc.Server, str]:
    """A gRPC server answering GetClusterId as a Ray GCS with (UNAUTHENTICATED without a token) or without auth."""
    def get_cluster_id(request: bytes, context: grpc.ServicerContext) -> bytes:
        if authenticated and not any(k == "authorization" for k, _ in context.invocation_metadata()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken")
        return b""

    handler = grpc.method_handlers_generic_handler("ray.rpc.NodeInfoGcsService", {
        "GetClusterId": grpc.unary_unary_rpc_method_handler(get_cluster_id, request_deserializer=lambda b: b,
                                                            response_serializer=lambda b: b)})
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_token_files_are_private_and_found_by_address():
    path = raytoken.new_token_file()
    token = path.read_text().strip()
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert raytoken.new_token_file().read_text() != path.read_text()  # fresh each start
    env = raytoken.use_token(path)
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)} and os.environ["RAY_AUTH_MODE"] == "token"
    assert raytoken.token_for("127.0.0.1:6379") is None
    kept = raytoken.remember("127.0.0.1:6379", path)
    assert raytoken.token_for("127.0.0.1:6379") == kept and kept.read_text().strip() == token
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    raytoken.forget("127.0.0.1:6379", path)
    assert raytoken.token_for("127.0.0.1:6379") is None and not path.exists()


def test_requires_token_asks_the_gcs():
    open_gcs, open_addr = _fake_gcs(authenticated=False)
    closed_gcs, closed_addr = _fake_gcs(authenticated=True)
    try:
        assert raytoken.requires_token(open_addr) is False
        assert raytoken.requires_token(closed_addr) is True
    finally:
        open_gcs.stop(0)
        closed_gcs.stop(0)
    with pytest.raises(ConnectionError, match="cannot ask the Ray cluster"):
        raytoken.requires_token(open_addr, timeout_s=2)  # nothing there any more


def test_a_cluster_without_auth_is_refused_unless_allowed():
    server, addr = _fake_gcs(authenticated=False)
    try:
        with pytest.raises(ConnectionError, match=r"runs without authentication.*ray.allow_unauthenticated: true"):
            join_auth(addr, allow_unauthenticated=False)
        assert join_auth(addr, allow_unauthenticated=True) is False
        assert "RAY_AUTH_MODE" not in os.environ
    finally:
        server.stop(0)


def test_a_cluster_with_auth_gets_a_token_or_a_clear_error():
    server, addr = _fake_gcs(authenticated=True)
    try:
        with pytest.raises(ConnectionError, match="requires its token and none is set here.*RAY_AUTH_TOKEN_PATH"):
            join_auth(addr, allow_unauthenticated=False)
        kept = raytoken.remember(addr, raytoken.new_token_file())  # an embedded cluster of ours at that address
        assert join_auth(addr, allow_unauthenticated=False) is True
        assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_AUTH_TOKEN_PATH"] == str(kept)
    finally:
        server.stop(0)


def test_the_deploy_cli_refuses_a_cluster_without_auth(tmp_path):
    server, addr = _fake_gcs(authenticated=False)
    try:
        env = {k: v for k, v in os.environ.items() if k not in raytoken.TOKEN_ENV and k != "RAY_ADDRESS"}
        r = subprocess.run([sys.executable, "-m", "cluster.deploy", "--address", addr, "--no-demo"],
                           capture_output=True, text=True, timeout=120, env=env)
    finally:
        server.stop(0)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "runs without authentication" in r.stderr and "Traceback" not in r.stderr, r.stderr
