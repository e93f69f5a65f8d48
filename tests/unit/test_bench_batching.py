"""benchmarks.batching without an engine: the knee rule and the CLI's refusals (the measurement itself
runs in the committed report, benchmarks/results/batching-cpu)."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.batching import knee


def test_knee_is_the_first_batch_at_one_and_a_half_times_the_single_sequence_tpot() -> None:
    rows = [{"batch": b, "tpot_ms": t} for b, t in ((1, 10.0), (2, 10.5), (4, 12.0), (8, 15.0), (16, 24.0))]
    assert knee(rows) == 8
    assert knee(rows[:3]) is None


def test_bad_arguments_are_refused_by_name() -> None:
    for args, needle in ((["--batches", "1,x"], "--batches must be comma-separated integers, got '1,x'"),
                         (["--batches", "0,2"], "--batches must be >= 1")):
        r = subprocess.run([sys.executable, "-m", "benchmarks.batching", "--out", "/tmp/never", *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and needle in r.stderr, r.stderr
