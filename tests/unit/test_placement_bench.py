"""placement.bench: the planner's wall time per cluster size, written with its provenance."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from placement import bench


def test_bench_writes_rows_with_provenance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["placement.bench", "--nodes", "1", "--out", str(out)])
    bench.main()
    doc = json.loads(out.read_text())
    assert {"date", "git_commit", "cpu", "command"} <= doc.keys()
    assert doc["command"] == f"python -m placement.bench --nodes 1 --out {out}"
    (row,) = doc["rows"]
    assert row["gpus"] == 8 and row["plan_s"] > 0 and "prefill" in row["plan"]
    assert "   8 GPUs: plan in" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.tmp"))
