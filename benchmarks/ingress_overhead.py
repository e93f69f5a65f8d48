"""What the HTTP ingress + router add to TTFT, against calling the prefill actor directly.

    python -m benchmarks.ingress_overhead [--model tiny-llama] [--n 40] [--prompt-tokens 64]

Deploys the embedded disaggregated default (in this process, local Ray), then alternates, for the same
token-id prompt: (a) a streamed HTTP completion with max_tokens=1 through the endpoint (the ingress
replica's own HTTP server, `serve.direct`, the default; tokenize skipped: the prompt is token ids; routed;
served by the prefill worker), (b) the same through Ray Serve's proxy (the path with `serve.direct: false`),
and (c) the prefill worker's ``generate_stream`` called directly as a Ray actor. TTFT = send -> first
token. Prints p50/p90 of each and the p50 differences to (c). Measured figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="smollm2, tiny-llama or a model dir")
    ap.add_argument("--n", type=int, default=40, help="requests per path (1..1000)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8011)
    a = ap.parse_args()
    if not 1 <= a.n <= 1000:
        ap.error(f"--n {a.n}: give 1..1000")
    import ray

    from cluster.config import parse_config
    from cluster.control import deploy
    from cluster.control.cli import shutdown_embedded
    from cluster.control.runtime import connect
    from kvtransfer.config import free_port

    proxy = free_port()
    cfg = parse_config({"name": "overhead", "engine": {"model": a.model, "max_model_len": 1024},
                        "serve": {"port": a.port, "proxy_port": proxy}, "transfer": {"fabric_check": False}})
    connect(None, num_cpus=None, object_store_mib=256, namespace=cfg.ray.namespace)
    try:
        info = deploy.start(cfg)
        ctl = ray.get_actor(deploy.controller_name(cfg), namespace=cfg.ray.namespace)
        _, members = ray.get(ctl.members.remote(), timeout=30)
        prefill = next(h for _, role, h, _ in members if role == "prefill")
        prompt = [100 + (i * 31) % 5000 for i in range(a.prompt_tokens)]
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0)
        urls = {"endpoint (direct ingress)": info["endpoint"], "Serve proxy": f"http://127.0.0.1:{proxy}"}
        http: dict[str, list[float]] = {k: [] for k in urls}
        direct: list[float] = []
        with httpx.Client(timeout=60) as client:
            for i in range(a.n + 3):
                for path, url in urls.items():
                    t0 = time.perf_counter()
                    with client.stream("POST", f"{url}/v1/completions", json={
                            "model": info["model"], "prompt": prompt, "max_tokens": 1, "temperature": 0,
                            "stream": True}) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                                break
                    if i >= 3:  # warm-up excluded
                        http[path].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                gen = prefill.generate_stream.options(num_returns="streaming").remote(f"direct-{i}", prompt, params)
                first = next(iter(gen))
                ray.get(first, timeout=60)
                t_direct = time.perf_counter() - t0
                for ref in gen:  # drain the rest so the request ends cleanly
                    ray.get(ref, timeout=60)
                if i >= 3:
                    direct.append(t_direct)
        q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
        print(f"model {info['model']}, prompt {a.prompt_tokens} tokens, {a.n} requests per path")
        for path, xs in http.items():
            print(f"HTTP via {path:<26} TTFT p50 {q(xs, .5) * 1e3:8.2f} ms   p90 {q(xs, .9) * 1e3:8.2f} ms")
        print(f"prefill actor called directly       TTFT p50 {q(direct, .5) * 1e3:8.2f} ms   "
              f"p90 {q(direct, .9) * 1e3:8.2f} ms")
        for path, xs in http.items():
            added = (statistics.median(xs) - statistics.median(direct)) * 1e3
            print(f"added by ingress + router, {path:<26} p50 {added:8.2f} ms")
        deploy.stop(info["config"])
    finally:
        shutdown_embedded()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
