"""The no-load latency of a deployment: a few sequential requests with fresh prompts on the idle endpoint."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.client import RequestRecord, endpoint_url, make_client, request_body, send_request
from benchmarks.compare.procstat import Steal
from benchmarks.stats import LatencySummary
from benchmarks.stats import tpot as tpot_of
from benchmarks.workload import make_prompt


def idle_probe(endpoint: str, model: str, n: int, timeout_s: float, input_len: int = 512,
               output_len: int = 32) -> dict[str, Any]:
    """``n`` sequential requests of ``input_len`` tokens (fresh random prompts) on the idle deployment:
    the no-load TTFT and TPOT of this shape. ``summary`` holds the rounded headline figures."""
    import numpy as np

    async def go() -> list[RequestRecord]:
        rng = np.random.default_rng(987654)  # NOTE: not the workload's seed: prompts no step sends
        url = endpoint_url(endpoint, "completions")
        recs = []
        async with make_client(timeout_s) as client:
            for i in range(n):
                rec = RequestRecord(index=i, input_len=input_len, output_len=output_len, scheduled_s=0.0)
                body = request_body(model, make_prompt(input_len, rng), output_len, "completions", True)
                recs.append(await send_request(client, url, body, "completions", rec, timeout_s, time.perf_counter()))
        return recs

    steal = Steal()
    recs = asyncio.run(go())
    ok = [r for r in recs if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [t for t in (tpot_of(r) for r in ok) if t is not None]
    summary = {"requests": n, "ok": len(ok), "input_tokens": input_len, "output_tokens": output_len,
               "ttft_p50_s": LatencySummary.of(ttfts).p50, "tpot_p50_s": LatencySummary.of(tpots).p50,
               "ttft_s": [round(t, 3) for t in ttfts], "tpot_s": [round(t, 4) for t in tpots],
               "machine_steal_cores": steal.cores()}
    return {"summary": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()
                        if k in ("ok", "ttft_p50_s", "tpot_p50_s")}, **summary}
