"""The measured-profile YAML: what `python -m benchmarks.profile` writes and the planner reads.

Format (version 1), all times in milliseconds like DistServe's coefficients:

    kind: saaf-placement-profile
    version: 1
    created: "2025-01-01T12:00:00+00:00"
    machine: {hostname, platform, processor, cpu_count, python, torch, vllm, device}
    model: {spec, path, name, layers, hidden, heads, kv_heads, head_dim, params}
    engine: {dtype, tp, block_size, kv_cache_mib, max_model_len, threads}
    coefficients: {prefill_a, prefill_b, prefill_c, decode_a, decode_b, decode_c}
    fit: {prefill_r2, decode_r2, prefill_samples: [[tokens, sum_sq, ms], ...], decode_samples: [[batch, ctx, ms], ...]}
    kv_bytes_per_token: int      # K+V bytes per token, all layers
    kv_capacity_tokens: int      # tokens the engine's KV cache holds
    transfer: {same_node_gbps, cross_node_gbps, latency_ms}
    gpu_hour_usd: float          # price of one "GPU" of this machine (a CPU box: its hourly price)
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from placement.config import Coefficients
from placement.errors import PlacementError

logger = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MachineInfo(_Strict):
    hostname: str = Field(description="host the profile was measured on")
    platform: str = Field(description="platform.platform()")
    processor: str = Field("", description="CPU model or GPU name")
    cpu_count: int = Field(description="logical CPUs")
    python: str = Field(description="Python version")
    torch: str = Field("", description="torch version")
    vllm: str = Field("", description="vLLM version")
    device: str = Field("cpu", description="cpu or cuda")


class ProfiledModel(_Strict):
    spec: str = Field(description="the model spec given to the profiler")
    path: str = Field(description="resolved model folder")
    name: str = Field(description="model name")
    layers: int = Field(ge=1, description="decoder layers")
    hidden: int = Field(ge=1, description="hidden size")
    heads: int = Field(ge=1, description="attention heads")
    kv_heads: int = Field(ge=1, description="KV heads")
    head_dim: int = Field(ge=1, description="head dimension")
    params: int = Field(ge=1, description="parameter count")


class EngineInfo(_Strict):
    dtype: str = Field(description="engine dtype")
    tp: int = Field(1, ge=1, description="tensor-parallel degree the profile was measured at")
    block_size: int = Field(description="KV block size in tokens")
    kv_cache_mib: int = Field(description="KV cache memory given to the engine")
    max_model_len: int = Field(description="engine max_model_len")
    threads: int = Field(1, description="OMP threads per engine")


class FitInfo(_Strict):
    prefill_r2: float = Field(description="R^2 of the prefill fit")
    decode_r2: float = Field(description="R^2 of the decode fit")
    prefill_samples: list[list[float]] = Field(description="[tokens, sum of squares, ms] per measurement")
    decode_samples: list[list[float]] = Field(description="[batch, total context, ms] per measurement")


class TransferInfo(_Strict):
    same_node_gbps: float = Field(3.0, gt=0, description="KV transfer GB/s between engines on this machine")
    cross_node_gbps: float = Field(1.0, gt=0, description="KV transfer GB/s between machines")
    latency_ms: float = Field(2.0, ge=0, description="fixed cost per KV handoff")


class ProfileData(_Strict):
    kind: Literal["saaf-placement-profile"] = Field("saaf-placement-profile", description="file type tag")
    version: Literal[1] = Field(1, description="format version")
    created: str = Field(description="ISO-8601 time of measurement")
    machine: MachineInfo = Field(description="where it was measured")
    model: ProfiledModel = Field(description="what was measured")
    engine: EngineInfo = Field(description="engine settings")
    coefficients: Coefficients = Field(description="fitted DistServe-form coefficients (ms)")
    fit: FitInfo = Field(description="fit quality and raw samples")
    kv_bytes_per_token: int = Field(ge=1, description="KV bytes per token")
    kv_capacity_tokens: int = Field(ge=1, description="tokens the KV cache holds")
    transfer: TransferInfo = Field(TransferInfo(), description="KV handoff link model")
    gpu_hour_usd: float = Field(0.1, ge=0, description="price of one device-hour")


def load_profile(path: str | Path) -> ProfileData:
    p = Path(path)
    if not p.is_file():
        raise PlacementError(f"profile {str(p)!r} does not exist; create it with "
                             f"`python -m benchmarks.profile --model MODEL --out {p}`")
    try:
        return ProfileData.model_validate(yaml.safe_load(p.read_text()))
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise PlacementError(f"profile {p} is not a valid placement profile: {msgs}") from None


def save_profile(profile: ProfileData, path: str | Path) -> Path:
    """Write atomically: a temp file in the same folder, then rename over the target."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False, width=120)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    logger.info("wrote profile %s", p)
    return p
