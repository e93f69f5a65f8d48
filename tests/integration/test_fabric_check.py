"""Fabric check on the session's local loopback Ray: a verified NIXL READ between two actor processes,
and failures (corrupted bytes, bad agent metadata, a stalled peer) reported with the pair named, within
the timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvtransfer.fabric import (
    FabricCheckError,
    fabric_pairs_from_cluster,
    require_fabric,
    run_fabric_check,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# NOTE: the session's Ray may have started without it; the check's actors get it explicitly.
ACTOR_ENV = {"UCX_NET_DEVICES": "lo"}
NBYTES = 8 * 2**20


@pytest.fixture(scope="module")
def local_ray(ray_session: Any) -> str:
    """The integration session's loopback Ray (tests/integration/conftest.py); its GCS address."""
    return ray_session.get_runtime_context().gcs_address


def test_check_moves_verified_bytes(local_ray: str) -> None:
    pairs = fabric_pairs_from_cluster()
    assert len(pairs) == 1 and pairs[0][0] == pairs[0][1]
    results = run_fabric_check(pairs, nbytes=NBYTES, timeout_s=45, env=ACTOR_ENV)
    print(f"\nfabric check, {NBYTES >> 20} MiB: {results[0].gbps:.2f} GB/s ({results[0].seconds * 1e3:.1f} ms)")
    require_fabric(results)
    assert results[0].ok and results[0].gbps > 0 and results[0].error == ""


@pytest.mark.parametrize(
    ("fault", "timeout_s", "expect"),
    [
        ("corrupt", 45.0, "data corrupted in transit: byte 4194304"),
        ("bad_metadata", 45.0, "cannot load the prefill agent's metadata (nixlMismatchError"),
        ("stall", 6.0, "timed out after 6 s"),
    ],
)
def test_failure_names_the_pair(local_ray: str, fault: str, timeout_s: float, expect: str) -> None:
    node = fabric_pairs_from_cluster()[0][0]
    start = time.monotonic()
    results = run_fabric_check([(node, node)], nbytes=NBYTES, timeout_s=timeout_s, env=ACTOR_ENV, fault=fault)
    elapsed = time.monotonic() - start
    assert not results[0].ok and expect in results[0].error, results[0]
    assert elapsed < timeout_s + 5, f"{fault}: reported after {elapsed:.1f} s, timeout was {timeout_s} s"
    with pytest.raises(FabricCheckError) as info:
        require_fabric(results)
    assert f"prefill {node} -> decode {node}" in str(info.value)


def test_cli_against_running_cluster_over_tcp(local_ray: str) -> None:
    """The CLI on an existing cluster, forcing UCX's TCP fallback (containers that block CMA)."""
    cmd = [sys.executable, "-m", "kvtransfer.check", "--address", local_ray, "--mib", "8", "--timeout", "30"]
    proc = subprocess.run(
        [*cmd, "--env", "UCX_NET_DEVICES=lo", "--env", "UCX_TLS=tcp"],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "OK" in proc.stdout and "fabric check OK: 1 pair(s)" in proc.stderr
