"""benchmarks.kvtransfer runs end to end (two processes, scattered blocks, verified) in a few seconds."""

from __future__ import annotations

import json

import pytest

from benchmarks import kvtransfer as bench


def test_small_run_verifies_every_block_size(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    assert bench.main(["--block-kib", "16,256", "--blocks", "8", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["results"]
    assert [r["block_kib"] for r in rows] == [16, 256]
    assert all(r["verified"] and r["nixl_gbps"] > 0 and r["memcpy_gbps"] > 0 for r in rows)
    assert rows[1]["total_bytes"] == 8 * 256 * 1024


def test_blocks_default_moves_64_mib_with_a_floor() -> None:
    assert bench.blocks_for(16 * 1024, None) == 4096
    assert bench.blocks_for(2048 * 1024, None) == 32
    assert bench.blocks_for(4096 * 1024, None) == bench.MIN_BLOCKS
    assert bench.blocks_for(64 * 1024, 10) == 10


def test_bad_block_sizes_are_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--block-kib", "16,zero"])
    assert "--block-kib '16,zero'" in capsys.readouterr().err
