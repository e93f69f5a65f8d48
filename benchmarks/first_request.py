"""The first requests after start: sent the moment the deploy CLI prints its endpoint, on a fresh deployment.

    python -m benchmarks.first_request [--runs 10] [--requests 4] [--profile-dir DIR] [--out FILE]

Each run starts `python -m cluster.deploy --no-demo` (the embedded default) as a user does and, as soon as
it prints the endpoint, sends `--requests` streamed chats one after the other ("Hello there", 16 tokens),
so they land while the router's calibration would run. The first run starts with an empty calibration
cache (a fresh `SAAF_PROFILE_DIR`), so the engines are measured; later runs reuse what it cached. Per
request: status, TTFT, TPOT and whether it met the deployment's SLO; per run: seconds until ready, where
the router's latency model came from and whether any process outlived SIGTERM. Prints measured figures;
asserts nothing (tests/integration/test_first_request.py runs one run and asserts).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import httpx

from benchmarks.client import RequestRecord, first_model, make_client, request_body, send_request
from benchmarks.compare.provenance import Provenance, write_artefact
from benchmarks.compare.runner import wait_calibrated
from benchmarks.deployproc import DeployProcess
from cluster.config import SLOConfig

ENDPOINT = "http://127.0.0.1:8000"
TTFT_SLO_S, TPOT_SLO_S = SLOConfig().ttft_ms / 1e3, SLOConfig().tpot_ms / 1e3  # the embedded default's


async def _send(model: str, n: int) -> list[RequestRecord]:
    out = []
    async with make_client(60.0) as client:
        for i in range(n):
            rec = RequestRecord(index=i, input_len=0, output_len=16, scheduled_s=0.0)
            body = request_body(model, "Hello there", 16, "chat", ignore_eos=True)
            out.append(await send_request(client, f"{ENDPOINT}/v1/chat/completions", body, "chat", rec, 60.0, 0.0))
    return out


def _row(r: RequestRecord) -> dict:
    tpot = sum(r.itl_s) / len(r.itl_s) if r.itl_s else None
    met = r.ok and r.ttft_s <= TTFT_SLO_S and (tpot is None or tpot <= TPOT_SLO_S)
    return {"status": r.status, "ttft_s": r.ttft_s and round(r.ttft_s, 3), "tpot_s": tpot and round(tpot, 4),
            "tokens": r.completion_tokens, "met_slo": bool(met), "error": r.error}


def run_once(profile_dir: str, requests: int) -> dict:
    """One fresh deployment with its calibration cache in `profile_dir`; the figures of one run."""
    dp = DeployProcess(env={"SAAF_PROFILE_DIR": profile_dir})  # NOTE: this process's environment is left as is
    res: dict = {"cache_files_before": len(os.listdir(profile_dir)) if os.path.isdir(profile_dir) else 0}
    try:
        res["ready_s"] = round(dp.start(600), 1)
        t0 = time.monotonic()
        res["requests"] = [_row(r) for r in asyncio.run(_send(first_model(ENDPOINT, None), requests))]
        res["requests_s"] = round(time.monotonic() - t0, 2)
        res["calibration_final_after_s"] = wait_calibrated(ENDPOINT, 180.0)
        cal = httpx.get(f"{ENDPOINT}/v1/stats", timeout=10, trust_env=False).json().get("calibration") or {}
        res["calibration_source"] = cal.get("source")
    finally:
        res["left_running_after_sigterm"] = dp.stop(90)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="fresh deployments, one after the other")
    ap.add_argument("--requests", type=int, default=4, help="requests per run, sent back to back at ready")
    ap.add_argument("--profile-dir", help="calibration cache to start from (default: a fresh, empty one)")
    ap.add_argument("--out", help="also write the figures as JSON here")
    a = ap.parse_args(argv)
    if not 1 <= a.runs <= 50 or not 1 <= a.requests <= 64:
        ap.error(f"--runs {a.runs} --requests {a.requests}: give --runs 1..50 and --requests 1..64")
    prov = Provenance.start(["python", "-m", "benchmarks.first_request"], sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="saaf-profiles-") as fresh:
        profiles = a.profile_dir or fresh
        runs = []
        for i in range(a.runs):
            runs.append(run_once(profiles, a.requests))
            r = runs[-1]
            print(f"run {i + 1}: ready {r.get('ready_s')} s, statuses {[q['status'] for q in r.get('requests', [])]}, "
                  f"TTFT {[q['ttft_s'] for q in r.get('requests', [])]}, calibration {r.get('calibration_source')}")
    reqs = [q for r in runs for q in r.get("requests", [])]
    summary = {"runs": len(runs), "requests": len(reqs), "refused_429": sum(q["status"] == 429 for q in reqs),
               "met_slo": sum(q["met_slo"] for q in reqs),
               "first_requests_met": sum(bool(r.get("requests")) and r["requests"][0]["met_slo"] for r in runs),
               "ready_s": [r.get("ready_s") for r in runs], "left_running": sum(r["left_running_after_sigterm"] for r in runs)}
    print(summary)
    if a.out:
        write_artefact(a.out, prov, {"slo": {"ttft_s": TTFT_SLO_S, "tpot_s": TPOT_SLO_S}, "summary": summary,
                                     "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
