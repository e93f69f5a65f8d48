"""Footprint of the embedded default, measured the way a user runs it.

    python -m benchmarks.footprint [--requests 16] [--idle-s 10] [--out FILE]

Starts `python -m cluster.deploy --no-demo` (1 prefill + 1 decode SmolLM2 on CPU) as a subprocess,
measures time until it is ready, the PSS of its whole process tree (Ray included) idle and under load,
idle CPU (after the router's calibration), TTFT and the KV-transfer share of it for a ~1,000-token prompt
(or its 429 when the default SLO cannot be met), TTFT of a ~250-token one, then SIGTERMs it and checks
that no process of the tree is left. Prints measured figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.compare.provenance import Provenance, write_artefact
from benchmarks.deployproc import DeployProcess, pss_bytes
from engine.procs import cpu_seconds


def chat(endpoint: str, model: str, content: str, max_tokens: int) -> dict:
    """One streamed chat: TTFT and e2e, or the status and error body of a refusal (the default router
    admits only what it predicts meets the SLO)."""
    t0 = time.monotonic()
    first = None
    with httpx.stream("POST", f"{endpoint}/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True}) as r:
        if r.status_code == 429:
            return {"ttft_s": None, "e2e_s": time.monotonic() - t0, "status": 429, "error": r.read().decode()[:300]}
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = time.monotonic() - t0
    return {"ttft_s": first, "e2e_s": time.monotonic() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="concurrent requests for the load phase")
    ap.add_argument("--idle-s", type=float, default=10.0, help="seconds to measure idle CPU")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--out", help="also write the figures as JSON here")
    a = ap.parse_args()
    if not 1 <= a.requests <= 256:
        ap.error(f"--requests {a.requests}: give 1..256")
    prov = Provenance.start(["python", "-m", "benchmarks.footprint"], sys.argv[1:])
    dp = DeployProcess()
    res: dict = {}
    try:
        res["ready_s"] = round(dp.start(600), 1)
        endpoint = f"http://127.0.0.1:{a.port}"
        model = httpx.get(f"{endpoint}/v1/models", timeout=10).json()["data"][0]["id"]
        # NOTE: the goodput router calibrates its latency model on the engines once the endpoint is ready
        # (~1 min of engine work on this box); idle is measured after that, and the time is reported.
        from benchmarks.compare.runner import wait_calibrated

        res["calibration_after_ready_s"] = wait_calibrated(endpoint, 300.0)
        time.sleep(2)
        pids = dp.pids()
        res["processes"] = len(pids)
        res["pss_idle_gib"] = round(pss_bytes(pids) / 2**30, 2)
        c0 = cpu_seconds(pids)
        time.sleep(a.idle_s)
        res["idle_cpu_cores"] = round((cpu_seconds(dp.pids()) - c0) / a.idle_s, 3)
        long_prompt = " ".join(f"item{i}" for i in range(260))  # ~1,000 tokens with the chat template
        n_tel = len(httpx.get(f"{endpoint}/v1/stats", timeout=10).json()["transfers"])
        single = chat(endpoint, model, long_prompt + " Summarise.", 8)
        stats = httpx.get(f"{endpoint}/v1/stats", timeout=10).json()
        res["ttft_1k_s"] = None if single["ttft_s"] is None else round(single["ttft_s"], 3)
        if single.get("status") == 429:
            res["ttft_1k_refused"] = single["error"]
        res["placements"] = (stats.get("router") or {}).get("placements")
        new = stats["transfers"][n_tel:]
        if new and single["ttft_s"]:  # NOTE: none when the router prefilled it on the decode worker (auto)
            tel = new[-1]
            res["ttft_1k_prompt_tokens"] = tel["prompt_tokens"]
            res["kv_transfer_wait_1k_s"] = round(tel["transfer_wait_s"], 4)
            res["kv_transfer_share_of_ttft"] = round(tel["transfer_wait_s"] / single["ttft_s"], 3)
        short = chat(endpoint, model, " ".join(f"item{i}" for i in range(60)) + " Summarise.", 8)
        res["ttft_256_s"] = None if short["ttft_s"] is None else round(short["ttft_s"], 3)
        peak = [0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], pss_bytes(dp.pids()))
                time.sleep(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t1 = time.monotonic()
        with ThreadPoolExecutor(a.requests) as pool:
            runs = list(pool.map(lambda i: chat(endpoint, model, f"Tell me a fact about the number {i}.", 32),
                                 range(a.requests)))
        stop.set()
        sampler.join(5)
        ttfts = sorted(r["ttft_s"] for r in runs if r["ttft_s"] is not None)
        res["load_requests"] = a.requests
        res["load_refused_429"] = sum(r.get("status") == 429 for r in runs)
        res["load_wall_s"] = round(time.monotonic() - t1, 2)
        res["load_ttft_p50_s"] = round(ttfts[len(ttfts) // 2], 3) if ttfts else None
        res["pss_load_peak_gib"] = round(peak[0] / 2**30, 2)
    finally:
        res["left_running_after_sigterm"] = dp.stop(90)
    for k, v in res.items():
        print(f"{k:32} {v}")
    if a.out:
        write_artefact(a.out, prov, {"figures": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
