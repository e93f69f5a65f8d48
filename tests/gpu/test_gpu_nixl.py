"""benchmarks.gpu_nixl on CUDA (skipped without it): NIXL VRAM->VRAM through kvtransfer's agent, verified.

A short version of issue 17's run (scripts/gpu_nixl.sh does the full one): two slab sizes, both models.
Needs a nixl wheel for the box's CUDA importable (nixl-cu13 on the H200 box).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_vram_transfers_verified_with_ratios(tmp_path: Path) -> None:
    if not any(importlib.util.find_spec(n) for n in ("nixl", "nixl_cu13", "nixl_cu12")):
        pytest.skip("no nixl wheel importable (carry nixl-cu13, see scripts/gpu_nixl.sh)")
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_nixl", "--device", "cuda", "--out", str(tmp_path), "--slab-kib",
         "16,2048", "--target-mib", "256", "--repeats", "3", "--memory-mib", "1024", "--chain-layers", "4",
         "--budget-s", "120"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    doc = json.loads((tmp_path / "gpu_nixl.json").read_text())
    print(json.dumps({"steps": doc["steps"], "summary": doc.get("summary"),
                      "attempts": doc.get("nixl", {}).get("attempts")}, indent=1, default=str))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert doc["env"]["memory_kind"] == "VRAM" and doc["nixl"]["memory"] == "VRAM"
    assert doc["nixl"]["mode_ran"] in ("two_process", "one_process")
    rows = doc["nixl"]["rows"]
    assert len(rows) == 4 and all(r["verified"] and r["ratio"] > 0 for r in rows)
    assert doc["memory"]["copy_rw_tbps"] > 0.5 and doc["matmul"]["tflops"] > 10
