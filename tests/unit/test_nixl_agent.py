"""kvtransfer.nixl_agent on a box that differs from ours: only a backend wheel installed, stuck transfers.

Reproduces two bugs found preparing the GPU run (issue 17):
- a machine given only the `nixl-cu13` wheel (the GPU box: no `nixl` shim package) could not create an
  agent at all, because the wrapper imported `nixl._api` only;
- a READ that timed out raised NIXL's "cannot release an active transfer" error from the cleanup
  instead of the TimeoutError naming the peer and the limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtransfer import nixl_agent
from kvtransfer.nixl_agent import NixlRegion, RegionInfo

ROOT = Path(__file__).resolve().parents[2]

# A fresh process in which the `nixl` shim does not exist, as on a box with only `nixl-cu13` installed.
NO_SHIM_PROBE = """
import json, sys
sys.modules["nixl"] = None  # `import nixl` now raises ModuleNotFoundError, as when it is not installed
from kvtransfer.nixl_agent import NixlRegion, nixl_module, pattern
src, dst = NixlRegion("no-shim-src", 1 << 16), NixlRegion("no-shim-dst", 1 << 16)
src.write_host(pattern(1 << 16, 7))
dst.read_blocks(src.info(), 4096, [0, 1, 2], [5, 9, 3], 10.0)
ok = bool((dst.read_host()[:4096] == src.read_host()[5 * 4096 : 6 * 4096]).all())
dst.close(); src.close()
print(json.dumps({"module": nixl_module(), "ok": ok}))
"""


def test_agent_works_with_only_a_backend_wheel_installed() -> None:
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}
    proc = subprocess.run(
        [sys.executable, "-c", NO_SHIM_PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"]
    assert report["module"].startswith("nixl_cu1") and report["module"].endswith("._api")


def test_missing_nixl_names_the_wheels_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl", "nixl._api", *(f"{b}{s}" for b in nixl_agent.NIXL_BACKEND_MODULES for s in ("", "._api"))):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(RuntimeError, match="nixl-cu13"):
        nixl_agent._import_nixl()


class _StuckAgent:
    """A NIXL agent whose READ never completes and whose handle cannot be released while active."""

    def __init__(self) -> None:
        self.released: list[Any] = []

    def make_prepped_xfer(self, *args: Any) -> str:
        return "handle"

    def transfer(self, handle: str) -> str:
        return "PROC"

    def check_xfer_state(self, handle: str) -> str:
        return "PROC"

    def release_xfer_handle(self, handle: str) -> None:
        raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT: transfer still active")


def _stuck_region() -> NixlRegion:
    region = NixlRegion.__new__(NixlRegion)
    region.name, region.nbytes, region.memory, region.device_id = "stuck", 8192, "DRAM", 0
    region.buffer = np.zeros(8192, dtype=np.uint8)
    region.addr = int(region.buffer.ctypes.data)
    region.agent = _StuckAgent()
    region._reg = None
    region._dlists = {}
    region._remotes = {"peer": RegionInfo("peer", b"", 0, 8192, 0, "DRAM")}
    region._dlist = lambda owner, info, block: owner  # type: ignore[method-assign]
    return region


def test_timed_out_read_raises_timeout_not_the_release_error() -> None:
    region = _stuck_region()
    peer = region._remotes["peer"]
    with pytest.raises(TimeoutError, match="'peer' not done after 0.1 s"):
        region.read_blocks(peer, 4096, [0], [1], timeout_s=0.1)
