"""What the HTTP ingress + router add over the full prefill -> KV transfer -> decode path.

    python -m benchmarks.ingress_overhead [--model tiny-llama] [--n 40] [--prompt-tokens 64]
                                          [--max-tokens 16] [--out FILE.json]

Deploys a disaggregated deployment (in this process, local Ray; `router.disaggregation: always` so every
request takes the remote-prefill path, calibration off so no background engine work runs), then alternates,
for the same token-id prompt and `max_tokens` (greedy, ignore_eos): (a) a streamed HTTP completion through
the endpoint (the ingress replica's own HTTP server, `serve.direct`, the default; routed; prefill worker ->
NIXL -> decode worker), (b) the same through Ray Serve's proxy (the path with `serve.direct: false`), and
(c) the same two actor calls the ingress makes, called directly: the prefill worker's `prefill` (its
first token is the client's) and the decode worker's `decode_stream` from prompt + that token. TTFT = send
-> first token; E2E = send -> last token. Prints p50/p90 of each and the p50 differences to (c), and for
(a) and (b) where the time to first token went, from each response's own `x-saaf-served` stage times
(render, admit, prefill worker, routed -> first token; the hops and the client's HTTP by difference); with
--out, writes them with date, commit and machine. Measured figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx

STAGES = ("render_ms", "admit_ms", "prefill_ms", "first_ms")


def _http(client: httpx.Client, url: str, model: str, prompt: list[int], max_tokens: int
          ) -> tuple[float, float, dict[str, float]]:
    """(TTFT, E2E, the response's own x-saaf-served stage times in ms)."""
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        r.raise_for_status()
        served = dict(kv.strip().split("=", 1) for kv in r.headers.get("x-saaf-served", "").split(";") if "=" in kv)
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - t0
    return first or float("nan"), time.perf_counter() - t0, {k: float(served[k]) for k in STAGES if k in served}


def _stages(rows: list[dict[str, float]], ttft_s: list[float]) -> dict[str, float]:
    """p50 of each stage of the time to first token, and of what the stages leave out: the hops to and
    from the prefill worker (first - prefill) and the client's side (TTFT - render - admit - first: the HTTP
    request and the first chunk's way back)."""
    out = {f"{k}_p50": statistics.median(r[k] for r in rows) for k in STAGES if rows and all(k in r for r in rows)}
    if len(out) == len(STAGES):
        out["hops_ms_p50"] = statistics.median(r["first_ms"] - r["prefill_ms"] for r in rows)
        out["client_http_ms_p50"] = statistics.median(
            t * 1e3 - r["render_ms"] - r["admit_ms"] - r["first_ms"] for r, t in zip(rows, ttft_s, strict=True))
        # NOTE: issue 39's measure of what is ours: the client's TTFT less the prefill worker's own time
        out["ttft_minus_prefill_ms_p50"] = statistics.median(
            t * 1e3 - r["prefill_ms"] for r, t in zip(rows, ttft_s, strict=True))
    return out


def _actors(prefill, decode, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    import ray
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    t0 = time.perf_counter()
    pre = ray.get(prefill.prefill.remote(rid, prompt, params, True), timeout=60)
    ttft = time.perf_counter() - t0
    first = list(pre.output.outputs[0].token_ids)
    rest = params.clone()
    rest.max_tokens = max_tokens - len(first)
    for ref in decode.decode_stream.options(num_returns="streaming").remote(rid, prompt + first, rest, pre.handoff):
        ray.get(ref, timeout=60)
    return ttft, time.perf_counter() - t0


def _q(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="smollm2, tiny-llama or a model dir")
    ap.add_argument("--n", type=int, default=40, help="requests per path (1..1000)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (2..512)")
    ap.add_argument("--out", help="also write the figures, with date, commit and machine, as JSON here")
    a = ap.parse_args()
    if not 1 <= a.n <= 1000:
        ap.error(f"--n {a.n}: give 1..1000")
    if not 2 <= a.max_tokens <= 512:
        ap.error(f"--max-tokens {a.max_tokens}: give 2..512 (the full prefill -> decode path)")
    import ray

    from benchmarks.compare.provenance import Provenance, write_artefact
    from cluster.config import parse_config
    from cluster.control import lifecycle
    from cluster.control.runtime import connect
    from cluster.deploy import shutdown_embedded
    from kvtransfer.config import free_port

    prov = Provenance.start(["python", "-m", "benchmarks.ingress_overhead"], sys.argv[1:])
    proxy = free_port()
    cfg = parse_config({"name": "overhead", "engine": {"model": a.model, "max_model_len": 1024},
                        "router": {"disaggregation": "always", "calibrate": False},
                        "serve": {"port": free_port(), "proxy_port": proxy}, "transfer": {"fabric_check": False}})
    connect(None, num_cpus=None, object_store_mib=256, namespace=cfg.ray.namespace)
    try:
        info = lifecycle.start(cfg)
        ctl = ray.get_actor(lifecycle.controller_name(cfg), namespace=cfg.ray.namespace)
        _, members = ray.get(ctl.members.remote(), timeout=30)
        prefill = next(h for _, role, h, _ in members if role == "prefill")
        decode = next(h for _, role, h, _ in members if role == "decode")
        prompt = [100 + (i * 31) % 5000 for i in range(a.prompt_tokens)]
        paths = {"endpoint (direct ingress)": info["endpoint"], "Serve proxy": f"http://127.0.0.1:{proxy}"}
        got: dict[str, list[tuple]] = {k: [] for k in [*paths, "actors called directly"]}
        with httpx.Client(timeout=60) as client:
            for i in range(a.n + 3):
                for path, url in paths.items():
                    t = _http(client, url, info["model"], prompt, a.max_tokens)
                    if i >= 3:  # warm-up excluded
                        got[path].append(t)
                t = _actors(prefill, decode, f"direct-{i}", prompt, a.max_tokens)
                if i >= 3:
                    got["actors called directly"].append(t)
        figures: dict[str, dict[str, float]] = {}
        base = got["actors called directly"]
        for path, xs in got.items():
            ttft, e2e = [x[0] for x in xs], [x[1] for x in xs]
            figures[path] = {"ttft_p50_ms": _q(ttft, .5) * 1e3, "ttft_p90_ms": _q(ttft, .9) * 1e3,
                             "e2e_p50_ms": _q(e2e, .5) * 1e3, "e2e_p90_ms": _q(e2e, .9) * 1e3,
                             "ttft_p50_added_ms": (statistics.median(ttft) - statistics.median(x[0] for x in base)) * 1e3,
                             "e2e_p50_added_ms": (statistics.median(e2e) - statistics.median(x[1] for x in base)) * 1e3}
            if path in paths:
                figures[path]["stages"] = _stages([x[2] for x in xs], ttft)
        print(f"model {info['model']}, prompt {a.prompt_tokens} tokens, {a.max_tokens} output tokens, "
              f"{a.n} requests per path (prefill -> NIXL -> decode)")
        for path, f in figures.items():
            print(f"{path:<27} TTFT p50 {f['ttft_p50_ms']:8.2f} ms  p90 {f['ttft_p90_ms']:8.2f} ms   "
                  f"E2E p50 {f['e2e_p50_ms']:8.2f} ms  p90 {f['e2e_p90_ms']:8.2f} ms   added p50: TTFT "
                  f"{f['ttft_p50_added_ms']:+7.2f} ms, E2E {f['e2e_p50_added_ms']:+7.2f} ms")
            if f.get("stages"):
                print(f"{'':<27} TTFT by stage, p50 ms: " + ", ".join(f"{k} {v:.1f}" for k, v in f["stages"].items()))
        if a.out:
            write_artefact(a.out, prov, {"settings": {"model": info["model"], "n": a.n,
                                                      "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens},
                                         "figures": figures})
        lifecycle.stop(info["config"])
    finally:
        shutdown_embedded()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
