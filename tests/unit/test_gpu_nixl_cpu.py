"""benchmarks.gpu_nixl, the script of issue 17's GPU run, works here on DRAM before it goes to the GPU box.

The runs happen as that box would run them: pydantic, PyYAML, Ray and vLLM unimportable, and no `nixl`
shim package (only a backend wheel), so a missing-import surprise shows up here, not in device time.
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
import torch

from benchmarks import gpu_nixl_xfer as xfer
from benchmarks.gpu_nixl_report import render_markdown
from kvtransfer.nixl_agent import pattern
from placement.catalog import get_model

ROOT = Path(__file__).resolve().parents[2]
ABSENT_ON_GPU_BOX = ("pydantic", "yaml", "ray", "vllm", "nixl")
# NOTE: ~15 s each on an idle 2-core box; the limits leave room for other sessions' load (seen: 3x slower).
SMALL = ["--device", "cpu", "--target-mib", "1", "--repeats", "2", "--budget-s", "45", "--first-row-timeout-s", "60"]


def run_script(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    blockers = tmp_path / "absent"
    blockers.mkdir()
    for name in ABSENT_ON_GPU_BOX:
        (blockers / f"{name}.py").write_text(
            f"raise ModuleNotFoundError({name!r} + ' is absent on the GPU box (test blocker)', name={name!r})\n"
        )
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{blockers}{os.pathsep}{ROOT}", "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_nixl", "--out", str(out), *SMALL, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=100,
    )
    doc = json.loads((out / "gpu_nixl.json").read_text())
    assert (out / "gpu_nixl.md").is_file()
    why = json.dumps({"steps": doc["steps"], "attempts": doc.get("nixl", {}).get("attempts")}, default=str)
    return proc.returncode, doc, proc.stderr[-2000:] + "\n" + why[-3000:]


def test_cpu_run_measures_everything_and_verifies_every_transfer(tmp_path: Path) -> None:
    rc, doc, err = run_script(
        tmp_path, "--slab-kib", "16,64", "--memory-mib", "16", "--matmul-n", "128",
        "--chain-layers", "1", "--chain-batches", "1",
    )
    assert rc == 0, err
    assert doc["status"] == "complete"
    assert {k: v["status"] for k, v in doc["steps"].items()} == dict.fromkeys(
        ["env", "memory", "matmul", "decode_chain", "nixl"], "ok")
    assert doc["env"]["memory_kind"] == "DRAM"
    assert doc["catalog"] == {"hardware": "h200", "hbm_tbps": 4.8, "bf16_tflops": 989, "hbm_gib": 131.3}

    mem, mm = doc["memory"], doc["matmul"]
    assert mem["copy_rw_tbps"] > 0 and mem["read_tbps"] > 0 and mem["copy_vs_catalog"] > 0
    assert mm["tflops"] > 0 and mm["catalog_tflops"] == 989 and mm["vs_catalog"] > 0
    chain = doc["decode_chain"]
    assert chain["model"] == "smollm2-135m" and chain["layers_run"] == 1
    (row,) = chain["rows"]
    assert row["roofline_tpot_ms"] > 0 and row["measured_eager_ms"] > 0 and row["roofline_bound"] == "memory"

    nixl = doc["nixl"]
    assert nixl["mode_ran"] == "two_process"
    assert nixl["attempts"][0]["ready"]["nixl_module"].startswith("nixl_cu12")  # no shim: the wheel itself
    rows = nixl["rows"]
    assert {(r["model"], r["slab_kib"]) for r in rows} == {
        (m, k) for m in ("llama-3.1-8b", "llama-3.1-70b") for k in (16, 64)}
    for r in rows:
        assert r["verified"] and r["verified_nixl"] and r["verified_copy"] and r["verified_gather"], r
        assert r["descriptors"] == r["blocks"] * 2 * r["layers"]
        assert r["total_bytes"] == r["descriptors"] * r["slab_kib"] * 1024
        for key in ("nixl_gbps", "copy_gbps", "gather_gbps", "ratio", "ratio_gather", "nixl_prep_ms"):
            assert r[key] > 0, (key, r)
        assert r["ratio"] == pytest.approx(r["nixl_gbps"] / r["copy_gbps"])
    assert doc["summary"]["all_verified"] and doc["summary"]["nixl_rows"] == 4
    md = (tmp_path / "out" / "gpu_nixl.md").read_text()
    assert "NIXL / copy" in md and "**two_process**" in md and "**NO**" not in md


def test_two_agents_in_one_process_when_two_processes_fail(tmp_path: Path) -> None:
    rc, doc, err = run_script(
        tmp_path, "--fault", "source", "--skip", "memory,matmul,decode_chain", "--slab-kib", "16",
        "--models", "llama-3.1-8b",
    )
    assert rc == 0, err
    nixl = doc["nixl"]
    assert nixl["mode_ran"] == "one_process"
    first, second = nixl["attempts"]
    assert first["mode"] == "two_process" and "injected fault 'source'" in first["error"] and first["rows"] == 0
    assert second["mode"] == "one_process" and second["error"] is None
    assert [r["mode"] for r in nixl["rows"]] == ["one_process"] and nixl["rows"][0]["verified"]


def test_torch_pattern_is_the_agent_pattern() -> None:
    buf = torch.zeros(4096 + 8, dtype=torch.uint8)
    xfer.fill_pattern(buf, seed=0x5AAF)
    assert np.array_equal(buf.numpy(), pattern(buf.numel(), 0x5AAF))
    other = torch.zeros_like(buf)
    xfer.fill_pattern(other, seed=0x5AAF)
    assert xfer.checksum(other) == xfer.checksum(buf)
    xfer.fill_pattern(other, seed=1)
    assert xfer.checksum(other) != xfer.checksum(buf)
    with pytest.raises(ValueError, match="multiple of 8"):
        xfer.fill_pattern(torch.zeros(12, dtype=torch.uint8), 0)


def test_kv_layouts_of_the_catalog_models() -> None:
    l8 = xfer.layout_for(get_model("llama-3.1-8b"), 16 * 1024)
    assert (l8.layers, l8.kv_heads, l8.head_dim, l8.block_tokens) == (32, 8, 128, 8)
    l70 = xfer.layout_for(get_model("llama-3.1-70b"), 2 * 2**20)
    assert (l70.layers, l70.block_tokens, l70.block_bytes) == (80, 1024, 160 * 2 * 2**20)
    ids = l8.descriptor_ids(np.array([3, 0]), num_blocks=10)
    assert ids.tolist()[:4] == [3, 0, 13, 10] and ids.size == 2 * 32 * 2
    assert xfer.blocks_per_transfer(l70, 2**30) == 3
    assert xfer.region_bytes_for([l8, l70], 2**30) == 2 * 1024 * l8.block_bytes  # > 2 * 3 * l70.block_bytes
    with pytest.raises(ValueError, match="not a whole number of tokens"):
        xfer.layout_for(get_model("llama-3.1-8b"), 3 * 1024)


def test_report_renders_a_cut_run() -> None:
    md = render_markdown({"status": "cut", "steps": {"env": {"status": "ok", "seconds": 0.1},
                                                     "nixl": {"status": "cut", "seconds": 3.0}}})
    assert "status **cut**" in md and "(not measured)" in md and "| nixl | cut |" in md
