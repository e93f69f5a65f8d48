"""GPU path (skipped without CUDA): the quantization row of issue 15 on a GPU. One prefill + one decode engine
with FP8 weights (vLLM's dynamic `quantization: fp8`) and an FP8 KV cache share one GPU: KV moves over VRAM at
half the bf16 bytes per token, and the capitals task (benchmarks.taskeval, lm-eval) is scored against the same
model in bf16 on the same GPU. Run with scripts/gpu_check.sh."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from kvtransfer.config import free_port

pytestmark = pytest.mark.gpu


def _deploy(name: str, engine: dict, mode: str, pools: dict):
    from cluster.config import parse_config
    from cluster.control import lifecycle

    cfg = parse_config({
        "name": name, "mode": mode,
        "engine": {"model": os.environ.get("SAAF_GPU_TEST_MODEL", "smollm2"), "device": "cuda",
                   "gpu_memory_utilization": 0.2, "gpu_fraction": 0.3, "max_model_len": 2048, **engine},
        "pools": pools, "serve": {"port": free_port()}, "ray": {"namespace": "saaf-gpu-fp8"},
    })
    return lifecycle.start(cfg, ready_timeout_s=600)


def test_gpu_fp8_weights_and_kv_cache_transfer_over_vram_and_keep_task_accuracy():
    from benchmarks.taskeval import run_taskeval
    from cluster.control import lifecycle
    from cluster.control.runtime import connect
    from cluster.deploy import shutdown_embedded
    from engine.models import resolve_model

    connect(None, num_cpus=8, object_store_mib=512, namespace="saaf-gpu-fp8")
    model_dir = resolve_model(os.environ.get("SAAF_GPU_TEST_MODEL", "smollm2"))
    hf = json.loads((model_dir / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    bf16_per_token = 2 * hf["num_hidden_layers"] * hf.get("num_key_value_heads", hf["num_attention_heads"]) \
        * head_dim * 2
    scores = {}
    try:
        info = _deploy("gpufp8", {"quantization": "fp8", "kv_cache_dtype": "fp8"}, "disaggregated",
                       {"prefill": 1, "decode": 1})
        try:
            for n in (300, 1000):
                r = httpx.post(f"{info['endpoint']}/v1/completions", timeout=300, json={
                    "model": info["model"], "prompt": [1000 + i % 20000 for i in range(n)], "max_tokens": 16,
                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
            tel = httpx.get(f"{info['endpoint']}/v1/stats", timeout=10).json()["transfers"]
            assert tel and all(t["memory"] == "VRAM" and t["outcome"] == "ok" for t in tel), tel
            for t in tel:
                # an FP8 cache holds one byte per value: well under the bf16 bytes even rounded up to whole blocks
                assert t["kv_bytes"] < 0.75 * bf16_per_token * t["prompt_tokens"], (t, bf16_per_token)
            scores["fp8"] = run_taskeval(info["endpoint"], info["model"], model_dir)
        finally:
            lifecycle.stop(info["config"])
        base = _deploy("gpubf16", {"dtype": "bfloat16"}, "colocated", {"colocated": 1})
        try:
            scores["bf16"] = run_taskeval(base["endpoint"], base["model"], model_dir)
        finally:
            lifecycle.stop(base["config"])
    finally:
        shutdown_embedded()
    print("capitals bf16 -> fp8:", scores)
    for k, v in scores["bf16"].items():
        # round-to-nearest FP8 may cost a capital or two of 20, not the task
        assert scores["fp8"][k] >= v - 0.15, (k, scores)
