"""GPU path (skipped without CUDA): 1 prefill + 1 decode engine sharing one GPU, NIXL over VRAM,
disaggregated == colocated greedy output, TTFT/ITL printed. Run with scripts/gpu_check.sh."""

from __future__ import annotations

import os
import random

import httpx
import pytest

from kvtransfer.config import free_port

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_deployment():
    import ray

    from cluster.config import parse_config
    from cluster.control import lifecycle
    from cluster.control.runtime import connect
    from cluster.deploy import shutdown_embedded

    connect(None, num_cpus=8, object_store_mib=512, namespace="saaf-gpu-test")
    cfg = parse_config({
        "name": "gputest", "mode": "disaggregated",
        "engine": {"model": os.environ.get("SAAF_GPU_TEST_MODEL", "smollm2"), "device": "cuda",
                   "gpu_memory_utilization": 0.25, "gpu_fraction": 0.3, "max_model_len": 2048},
        "pools": {"prefill": 1, "decode": 1},
        "serve": {"port": free_port()},
        "ray": {"namespace": "saaf-gpu-test"},
    })
    info = lifecycle.start(cfg, ready_timeout_s=600)
    yield info, ray
    lifecycle.stop(info["config"])
    shutdown_embedded()


def test_gpu_disaggregated_equals_colocated_and_kv_moves_over_vram(gpu_deployment):
    info, ray = gpu_deployment
    from engine.colocated import ColocatedWorker
    from tests.helpers.engines import generate, params, token_ids

    ecfg = info["config"].engine.model_dump()
    colo = ray.remote(ColocatedWorker).options(num_gpus=0.3).remote("colo-gpu", ecfg, None)
    ray.get(colo.info.remote(), timeout=600)
    rng = random.Random(3)
    sp = params(32, ignore_eos=True)
    for n in (1, 15, 16, 17, 300, 1000):
        prompt = [rng.randrange(200, 40000) for _ in range(n)]
        r = httpx.post(f"{info['endpoint']}/v1/completions", timeout=300, json={
            "model": info["model"], "prompt": prompt, "max_tokens": 32, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["token_ids"]
        want = token_ids(generate(colo, f"c{n}", prompt, sp, timeout=300))
        assert got == want, n
    tel = httpx.get(f"{info['endpoint']}/v1/stats", timeout=10).json()["transfers"]
    assert tel and all(t["memory"] == "VRAM" and t["outcome"] == "ok" for t in tel)
    print("transfers:", [(t["prompt_tokens"], t["kv_bytes"], round(t["transfer_wait_s"], 4)) for t in tel])


def test_gpu_latency_report(gpu_deployment):
    info, _ = gpu_deployment
    from benchmarks.serve import run_benchmark
    from benchmarks.stats import SLO
    from benchmarks.workload import ChatWorkload

    res = run_benchmark(info["endpoint"], info["model"], ChatWorkload(256, 0.5, 64, 0.5, 1024, 256), [4.0],
                        num_requests=64, slo=SLO(0.5, 0.05))
    s = res.steps[0].summary
    print("GPU 1P+1D:", s)
    assert s.succeeded == 64
