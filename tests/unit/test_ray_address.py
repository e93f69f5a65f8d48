"""A Ray address where nothing listens is a clear CLI error in seconds (ray.init retries it for minutes)."""

from __future__ import annotations

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
