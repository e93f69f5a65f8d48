"""What `transfer.integrity` costs: TTFT, time to the second token and the KV transfer, check off and on.

    python -m benchmarks.kv_integrity [--rounds 2] [--requests 10] [--lengths 256,1000] [--out FILE]

Fresh deployments of the embedded default, started as a user does (`python -m cluster.deploy CONFIG
--no-demo`), alternating integrity off and on for `--rounds` rounds (off, on, off, on: drift on a shared box
falls on both). Every prompt goes prefill -> KV -> decode (`router.policy: least_loaded`, which never prefills
locally and does not calibrate in the background). Each deployment gets, one at a time, `--requests` streamed
completions per prompt length (random token ids, new to both prefix caches; 8 output tokens, greedy).

Where the check runs: the prefill engine hashes the blocks as the prompt finishes, before its first token
leaves (so it is in TTFT); the decode engine hashes what it pulled before the request is scheduled (so it is
in the transfer time, `kv_ms` of usage.saaf_served: pull + the check + one step, and in the time to token 2).
Prints medians per length and setting; asserts nothing. Writes the figures with provenance to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from benchmarks.client import RequestRecord, first_model, make_client, send_request
from benchmarks.compare.provenance import Provenance, write_artefact
from benchmarks.deployproc import DeployProcess

ENDPOINT = "http://127.0.0.1:8000"
DEMO = Path(__file__).resolve().parents[1] / "manifests" / "deploy-cpu-demo.yaml"


def config(integrity: bool, directory: str) -> str:
    cfg = yaml.safe_load(DEMO.read_text())
    cfg["transfer"]["integrity"] = integrity
    cfg["router"] = {"policy": "least_loaded"}
    path = Path(directory) / f"integrity-{'on' if integrity else 'off'}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


async def _drive(lengths: list[int], n: int, seed: int) -> dict[int, list[RequestRecord]]:
    rng = random.Random(seed)
    model = first_model(ENDPOINT, None)
    out: dict[int, list[RequestRecord]] = {}
    async with make_client(120.0) as client:
        for length in lengths:
            out[length] = []
            for i in range(n):
                prompt = [rng.randrange(200, 40000) for _ in range(length)]
                body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                rec = RequestRecord(index=i, input_len=length, output_len=8, scheduled_s=0.0)
                out[length].append(await send_request(client, f"{ENDPOINT}/v1/completions", body, "completions",
                                                      rec, 120.0, 0.0))
    return out


def _row(r: RequestRecord) -> dict:
    s = (r.served or [{}])[0]
    return {"status": r.status, "ttft_s": r.ttft_s, "token2_s": (r.ttft_s + r.itl_s[0]) if r.itl_s else None,
            "kv": s.get("kv"), "kv_integrity": s.get("kv_integrity"), "kv_bytes": s.get("kv_bytes"),
            "kv_ms": s.get("kv_ms"), "kv_gbps": s.get("kv_gbps")}


def _median(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(xs), 4) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs of fresh deployments")
    ap.add_argument("--requests", type=int, default=10, help="requests per prompt length per deployment")
    ap.add_argument("--lengths", default="256,1000", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--out", help="also write the figures as JSON here")
    a = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths {a.lengths!r}: give prompt lengths in tokens, e.g. 256,1000")
    if not 1 <= a.rounds <= 10 or not 1 <= a.requests <= 100 or not all(1 <= n <= 1900 for n in lengths):
        ap.error(f"--rounds {a.rounds} --requests {a.requests} --lengths {a.lengths}: give --rounds 1..10, "
                 "--requests 1..100 and lengths 1..1900 (the demo's max_model_len is 2048)")
    prov = Provenance.start(["python", "-m", "benchmarks.kv_integrity"], sys.argv[1:] if argv is None else argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="saaf-integrity-") as tmp:
        for rnd in range(a.rounds):
            for integrity in (False, True):
                dp = DeployProcess(config(integrity, tmp))
                run: dict = {"round": rnd, "integrity": integrity}
                try:
                    run["ready_s"] = round(dp.start(600), 1)
                    recs = asyncio.run(_drive(lengths, a.requests, seed=100 + rnd))
                    run["requests"] = {str(n): [_row(r) for r in rs] for n, rs in recs.items()}
                finally:
                    run["left_running_after_sigterm"] = dp.stop(90)
                runs.append(run)
    summary = {}
    for integrity in (False, True):
        for n in lengths:
            rows = [r for run in runs if run["integrity"] == integrity for r in run.get("requests", {}).get(str(n), [])]
            summary[f"{'on' if integrity else 'off'}/{n}"] = {
                "requests": len(rows), "ok": sum(r["status"] == 200 for r in rows),
                "checked_ok": sum(r["kv_integrity"] == "ok" for r in rows),
                **{f"{k}_p50": _median(rows, k) for k in ("ttft_s", "token2_s", "kv_ms", "kv_gbps")}}
    for key, s in summary.items():
        print(f"integrity {key:>9} tokens: TTFT p50 {s['ttft_s_p50']} s, token 2 p50 {s['token2_s_p50']} s, "
              f"KV {s['kv_ms_p50']} ms ({s['kv_gbps_p50']} GB/s), {s['ok']}/{s['requests']} ok, "
              f"{s['checked_ok']} checked ok")
    if a.out:
        write_artefact(a.out, prov, {"lengths": lengths, "summary": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
