"""`python -m benchmarks.profile` on the tiny random Llama: a real vLLM CPU engine, a few sizes; and
`python -m placement profile`, which now only names the new command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from placement import LatencyModel, load_profile

pytestmark = pytest.mark.integration
ROOT = Path(__file__).parents[2]


def test_profile_tiny_llama(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    out = tmp_path / "tiny.yaml"
    cmd = [sys.executable, "-m", "benchmarks.profile", "--model", "tiny-llama", "--out", str(out),
           "--kv-cache-mib", "32", "--max-model-len", "1024", "--prefill-lens", "32,128,256,512",
           "--decode-batches", "1,4,8", "--decode-contexts", "32,256", "--decode-steps", "4", "--repeats", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prof = load_profile(out)
    c = prof.coefficients
    assert c.prefill_a > 0 or c.prefill_b > 0, "prefill time must grow with prompt tokens"
    assert prof.kv_capacity_tokens > 1000 and prof.kv_bytes_per_token > 0
    assert len(prof.fit.prefill_samples) >= 4 and len(prof.fit.decode_samples) == 6
    lat = LatencyModel.from_profile(out)
    assert lat.prefill_time_s([512]) > lat.prefill_time_s([32])
    assert not list(tmp_path.glob(".*.tmp"))


def test_placement_profile_names_the_new_command(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "placement", "profile", "--model", "tiny-llama", "--out",
                           str(tmp_path / "x.yaml")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "python -m benchmarks.profile" in proc.stderr
    assert not (tmp_path / "x.yaml").exists()
