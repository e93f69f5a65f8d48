"""The optimisation benchmark (benchmarks/optimizations.py) end to end at its smallest: two colocated
deployments of tiny-llama (vLLM's chunked prefill off and on), two requests of the workload chunked prefill is
for (mixed), the eval set's first prompts, no repeats of disturbed steps, its own Ray in a child process.
CI does not run the 28-minute measurement; this keeps its code from rotting: deploy, the workload steps, the
eval-set greedy outputs, the option's row, the report files. Chunked prefill promises identical greedy
outputs, and on these engines (CPU, fp32) it keeps that promise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

TIMEOUT_S = 900
EVAL_PROMPTS = 6  # NOTE: of the eval set's 20 (each ~3 s per deployment here); enough to exercise the comparison


def test_the_optimisation_benchmark_runs_end_to_end(tmp_path) -> None:
    out = tmp_path / "opt"
    # NOTE: tiny-llama (what is measured does not matter here, only that every part runs) and no waits for a quiet
    # box or repeats of disturbed steps (a shared VM's steal made this test repeat steps for a minute)
    cmd = [sys.executable, "-m", "benchmarks.optimizations", "--model", "tiny-llama", "--only",
           "colocated,colocated+chunked-prefill", "--workloads", "mixed", "--num-requests", "2", "--eval-prompts", str(EVAL_PROMPTS),
           "--quiet-wait", "0", "--retries", "0", "--out", str(out)]
    # NOTE: a session of its own, so a timeout ends its whole group (its Ray included) and nothing else
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # NOTE: the benchmark tears its deployments and Ray down on SIGTERM
        try:
            text, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate(timeout=30)
        pytest.fail(f"the benchmark ran past {TIMEOUT_S} s:\n{text[-4000:]}")
    assert proc.returncode == 0, text[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["failure"] is None
    rows = {(r["option"], r["workload"]): r for r in report["rows"]}
    assert set(rows) == {("chunked prefill (256 tokens)", "mixed")}
    for r in rows.values():
        for side in ("base", "opt"):
            assert r[side]["ttft_p50"] > 0 and r[side]["tpot_p50"] > 0 and r[side]["goodput_rps"] >= 0
    q = report["quality"]["chunked prefill (256 tokens)"]
    assert q["prompts"] == EVAL_PROMPTS and q["identical"] == q["prompts"], q
    assert {d["name"] for d in report["deploys"]} == {"colocated", "colocated+chunked-prefill"}
    assert (out / "report.md").read_text().startswith("# Serving optimisations")
