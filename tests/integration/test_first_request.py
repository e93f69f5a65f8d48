"""The first requests after start are served, not refused: a fresh embedded default (empty calibration
cache, so the router's calibration runs right after ready), requests sent the moment the endpoint prints."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import first_request


def test_requests_at_ready_are_served_within_the_slo_and_calibration_still_lands(tmp_path: Path) -> None:
    out, profiles = tmp_path / "first.json", tmp_path / "profiles"
    profiles.mkdir()
    assert first_request.main(["--runs", "1", "--requests", "4", "--profile-dir", str(profiles),
                               "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["cache_files_before"] == 0
    rows = run["requests"]
    assert [r["status"] for r in rows] == [200] * 4, rows
    assert all(r["met_slo"] and r["tokens"] == 16 for r in rows), rows
    # NOTE: the measurement ran once the requests were done (it yields to them), and was cached
    assert run["calibration_source"] and "measured" in run["calibration_source"], run
    assert len(list(profiles.glob("*.json"))) >= 1
    assert run["left_running_after_sigterm"] == 0
