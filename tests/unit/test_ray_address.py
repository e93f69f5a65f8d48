"""A Ray address where nothing listens is a clear CLI error in seconds (ray.init retries it for minutes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from cluster.control.runtime import check_reachable
from kvtransfer.config import free_port


def test_an_address_nothing_listens_at_fails_fast_naming_it():
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"cannot reach the Ray cluster at '{address}'"):
        check_reachable(address)
    assert time.monotonic() - t0 < 6


def test_a_listening_address_and_the_forms_ray_resolves_pass():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_reachable(f"127.0.0.1:{s.getsockname()[1]}")
        check_reachable(f"ray://127.0.0.1:{s.getsockname()[1]}")
    for address in ("auto", "local", "localhost"):
        check_reachable(address)  # NOTE: no port to test: Ray resolves these itself


@pytest.mark.parametrize("cmd", [["status", "--name", "x"], ["manifests/deploy-cpu-demo.yaml", "--no-demo"]])
def test_the_cli_names_the_unreachable_address_and_exits_1(cmd):
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "cluster.deploy", *cmd, "--address", address], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"cannot reach the Ray cluster at '{address}'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert time.monotonic() - t0 < 60


def test_an_embedded_ray_stays_on_loopback_even_when_ray_was_imported_first():
    """Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import; the deploy path imports it before it connects. Then
    "127.0.0.1" still has to resolve to itself, not to the host's interface address (what Ray's GCS and agents
    bind). Run in a fresh interpreter with the variable unset, as a user's shell has it."""
    code = ("import ray\n"
            "from ray._private import services\n"
            "from cluster.control.runtime import use_loopback\n"
            "use_loopback()\n"
            "print(services.resolve_ip_for_localhost('127.0.0.1'))\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "127.0.0.1", out.stdout
