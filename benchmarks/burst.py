"""Bursts at the embedded default's own SLO: the goodput router vs the best fixed "admit the first k".

    python -m benchmarks.burst [--burst 20] [--cycles 3] [--ks 2,4,6,8,10,12,16,20] [--out FILE]

Requests that arrive together are prefilled together and decode together, so admitting one too many can
make all of them late. Two deployments of the embedded default (manifests/deploy-cpu-demo.yaml, SLO
2 s / 200 ms), each started as a user does and measured once its router has calibrated:
1. `router.admission: best_effort` (everything served): one burst of k simultaneous streamed chats
   (~256-token prompts, each its own first words so no prefix-cache hit, 32 output tokens) per k of
   `--ks`: what "admit the first k, refuse the rest" meets.
2. the default router (goodput, `admission: queue`): `--cycles` bursts of `--burst`, each followed by
   `--lone` lone requests (a burst must not lock the deployment out); after each burst, the router's
   own prediction log for its requests (`/v1/stats` router.predictions: sequence, predicted and
   observed TTFT, predicted and observed TPOT, placement).
Met = 200, TTFT <= the TTFT target and mean inter-token gap <= the TPOT target. Prints measured figures;
asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from benchmarks.client import RequestRecord, first_model, make_client, request_body, send_request
from benchmarks.compare.provenance import Provenance, write_artefact
from benchmarks.compare.runner import wait_calibrated
from benchmarks.deployproc import DeployProcess

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "manifests" / "deploy-cpu-demo.yaml"
ENDPOINT = "http://127.0.0.1:8000"
PAUSE_S = 3.0  # between bursts: the previous one's streams are gone


def _prompt(i: int) -> str:
    return f"Request {i}: " + " ".join(f"item{(i * 7 + j) % 997}" for j in range(60)) + " Summarise."


async def _burst(model: str, ids: range, output_len: int) -> list[RequestRecord]:
    async with make_client(120.0) as client:
        t0 = time.perf_counter()
        recs = [RequestRecord(index=i, input_len=0, output_len=output_len, scheduled_s=0.0) for i in ids]
        return await asyncio.gather(*(
            send_request(client, f"{ENDPOINT}/v1/chat/completions",
                         request_body(model, _prompt(r.index), output_len, "chat", ignore_eos=True), "chat", r, 120.0, t0)
            for r in recs))


def _tally(recs: list[RequestRecord], ttft_s: float, tpot_s: float) -> dict:
    def met(r: RequestRecord) -> bool:
        tpot = sum(r.itl_s) / len(r.itl_s) if r.itl_s else 0.0
        return r.ok and r.ttft_s <= ttft_s and tpot <= tpot_s

    ok = [r for r in recs if r.ok]
    return {"sent": len(recs), "admitted": len(ok), "refused_429": sum(r.status == 429 for r in recs),
            "met": sum(met(r) for r in recs), "other_errors": sum(r.status not in (200, 429) or
                                                                  (r.status == 200 and not r.ok) for r in recs),
            "ttft_max_s": round(max((r.ttft_s for r in ok), default=0.0), 3),
            "refusal_max_s": round(max((r.e2e_s or 0.0 for r in recs if r.status == 429), default=0.0), 3)}


def _predictions() -> list:
    """The router's log: (sequence, predicted TTFT, observed TTFT, predicted TPOT, observed TPOT, placement)."""
    stats = httpx.get(f"{ENDPOINT}/v1/stats", timeout=10, trust_env=False).json()
    return (stats.get("router") or {}).get("predictions") or []


def _deployed(config: dict, work: Path, name: str) -> DeployProcess:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    dp = DeployProcess(str(path))
    dp.start(600)
    wait_calibrated(ENDPOINT, 300.0)
    return dp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst", type=int, default=20, help="simultaneous requests per goodput burst (2..64)")
    ap.add_argument("--cycles", type=int, default=3, help="goodput bursts (1..10)")
    ap.add_argument("--ks", default="2,4,6,8,10,12,16,20", help="fixed-k baseline burst sizes")
    ap.add_argument("--lone", type=int, default=5, help="lone requests after each goodput burst (0..20)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", help="also write the figures as JSON here")
    a = ap.parse_args(argv)
    try:
        ks = sorted({int(k) for k in a.ks.split(",")})
    except ValueError:
        ap.error(f"--ks {a.ks!r}: give comma-separated integers, e.g. 2,4,8")
    if not (2 <= a.burst <= 64 and 1 <= a.cycles <= 10 and 0 <= a.lone <= 20 and ks and 1 <= ks[0] and ks[-1] <= 64):
        ap.error("--burst 2..64, --cycles 1..10, --lone 0..20, --ks within 1..64")
    prov = Provenance.start(["python", "-m", "benchmarks.burst"], sys.argv[1:] if argv is None else argv)
    base = yaml.safe_load(DEMO.read_text())
    ttft_s, tpot_s = base["slo"]["ttft_ms"] / 1e3, base["slo"]["tpot_ms"] / 1e3
    res: dict = {"slo": {"ttft_s": ttft_s, "tpot_s": tpot_s}, "output_len": a.output_len}
    with tempfile.TemporaryDirectory(prefix="saaf-burst-") as tmp:
        fixed = {**base, "router": {**base["router"], "admission": "best_effort"}}
        dp = _deployed(fixed, Path(tmp), "best-effort")
        try:
            model, res["fixed_k"] = first_model(ENDPOINT, None), {}
            for n, k in enumerate(ks):
                res["fixed_k"][k] = _tally(asyncio.run(_burst(model, range(1000 * n, 1000 * n + k), a.output_len)),
                                           ttft_s, tpot_s)
                print(f"fixed k={k}: {res['fixed_k'][k]}")
                time.sleep(PAUSE_S)
        finally:
            res["left_after_best_effort"] = dp.stop(90)
        dp = _deployed(base, Path(tmp), "goodput")
        try:
            model, res["goodput"], res["lone_after"] = first_model(ENDPOINT, None), [], []
            for c in range(a.cycles):
                first, last_seq = 100_000 * (c + 1), max((p[0] for p in _predictions()), default=0)
                res["goodput"].append(_tally(asyncio.run(_burst(model, range(first, first + a.burst), a.output_len)),
                                             ttft_s, tpot_s))
                # NOTE: the router's own log of (predicted, observed) TTFT and TPOT per placement: why it erred
                res["goodput"][-1]["router_predictions"] = [p for p in _predictions() if p[0] > last_seq]
                print(f"goodput burst {c + 1}: {res['goodput'][-1]}")
                time.sleep(PAUSE_S)
                lone = [asyncio.run(_burst(model, range(first + 500 + i, first + 501 + i), a.output_len))[0]
                        for i in range(a.lone)]
                res["lone_after"].append(_tally(lone, ttft_s, tpot_s))
        finally:
            res["left_after_goodput"] = dp.stop(90)
    best_k = max(res["fixed_k"], key=lambda k: res["fixed_k"][k]["met"])
    g = res["goodput"]
    res["summary"] = {
        "best_fixed_k": best_k, "best_fixed_met": res["fixed_k"][best_k]["met"],
        "goodput_met_per_burst": [x["met"] for x in g], "goodput_admitted_per_burst": [x["admitted"] for x in g],
        "goodput_met_share_of_admitted": round(sum(x["met"] for x in g) / max(1, sum(x["admitted"] for x in g)), 3),
        "lone_met": f"{sum(x['met'] for x in res['lone_after'])}/{sum(x['sent'] for x in res['lone_after'])}"}
    print(res["summary"])
    if a.out:
        write_artefact(a.out, prov, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
