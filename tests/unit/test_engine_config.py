"""EngineConfig: CPU-only settings stay in the CPU branch; GPU gets vLLM's defaults plus TP/PP."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.config import EngineConfig


def test_cpu_settings():
    kw = EngineConfig(device="cpu", kv_cache_mib=64).engine_kwargs("/m", "m")
    assert kw["dtype"] == "float32" and kw["enforce_eager"] is True
    assert kw["distributed_executor_backend"] == "uni"
    assert kw["kv_cache_memory_bytes"] == 64 << 20
    env = EngineConfig(device="cpu", cpu_threads=1).process_env("127.0.0.1")
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"  # bounded kernel cache: no growth per prompt length


def test_gpu_settings_have_no_cpu_only_keys():
    kw = EngineConfig(device="cuda", tensor_parallel_size=4, dtype="bfloat16").engine_kwargs("/m", "m")
    assert kw["tensor_parallel_size"] == 4 and kw["distributed_executor_backend"] == "ray"
    assert "kv_cache_memory_bytes" not in kw and kw["gpu_memory_utilization"] == 0.85
    assert kw["dtype"] == "bfloat16" and "enforce_eager" not in kw
    env = EngineConfig(device="cuda").process_env("198.51.100.5")
    assert "OMP_NUM_THREADS" not in env and env["VLLM_HOST_IP"] == "198.51.100.5"


def test_auto_device_must_be_resolved_first():
    with pytest.raises(ValueError, match="auto"):
        EngineConfig().engine_kwargs("/m", "m")


def test_bad_values_name_the_field():
    with pytest.raises(ValidationError, match="max_model_len"):
        EngineConfig(max_model_len=0)
    with pytest.raises(ValidationError, match="pipeline parallelism needs device 'cuda'"):
        EngineConfig(device="cpu", pipeline_parallel_size=2)


def test_cpu_tensor_parallelism_runs_one_process_per_rank():
    """vLLM's CPU backend runs TP across processes (its mp executor, gloo); `uni` would start rank 0 only."""
    assert EngineConfig(device="cpu", tensor_parallel_size=2).engine_kwargs("/m", "m")[
        "distributed_executor_backend"] == "mp"
    assert EngineConfig(device="cpu").engine_kwargs("/m", "m")["distributed_executor_backend"] == "uni"
