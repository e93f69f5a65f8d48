"""Typed engine configuration: one model, CPU or GPU settings, turned into vLLM engine arguments."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Device = Literal["cpu", "cuda"]


class SpeculativeConfig(BaseModel):
    """vLLM speculative decoding. `ngram` (prompt lookup) needs no draft model and runs on CPU."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["ngram"] = Field("ngram", description="ngram: propose the continuation of an earlier match "
                                                           "of the last tokens in the prompt + output")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Tokens proposed per step")
    prompt_lookup_min: int = Field(2, ge=1, description="Shortest n-gram matched")
    prompt_lookup_max: int = Field(4, ge=1, description="Longest n-gram matched")

    @model_validator(mode="after")
    def _lookup(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} > prompt_lookup_max={self.prompt_lookup_max}")
        return self

    def vllm(self) -> dict[str, Any]:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}


class EngineConfig(BaseModel):
    """How each vLLM engine of a deployment is built. CPU-only settings live here and nowhere else."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        "smollm2",
        description="'smollm2' (bundled SmolLM2-135M-Instruct), 'tiny-llama' (tests), or a local HF model dir",
    )
    served_model_name: str | None = Field(None, description="Name clients use; default derived from model")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto' picks cuda when the cluster has GPUs, else cpu"
    )
    dtype: str = Field("auto", description="Weights/activations dtype; 'auto' = float32 on CPU, model's on GPU")
    max_model_len: int = Field(2048, gt=0, description="Max prompt + output tokens per request")
    max_num_seqs: int = Field(64, gt=0, description="Max requests in one engine's running batch")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="Token budget of one engine step")
    kv_cache_mib: int | None = Field(
        None, gt=0, description="KV cache size per engine in MiB (CPU default 256; GPU: use memory fraction)"
    )
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="GPU memory fraction per engine")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine (tensor parallel)")
    gpu_fraction: float = Field(
        1.0, gt=0, le=1, description="Ray GPU share of a TP1 engine; < 1 lets engines share one GPU"
    )
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages per engine")
    enforce_eager: bool | None = Field(None, description="Disable CUDA graphs; always on for CPU")
    enable_prefix_caching: bool = Field(True, description="vLLM automatic prefix caching")
    enable_chunked_prefill: bool | None = Field(None, description="vLLM chunked prefill (None: vLLM's default, on); "
                                                                  "its token budget is max_num_batched_tokens")
    kv_cache_dtype: str = Field("auto", description="KV cache dtype ('auto' = the model's dtype; fp8 on GPU)")
    quantization: str | None = Field(None, description="vLLM quantization method (None: what the checkpoint "
                                                       "declares; e.g. fp8 on GPU)")
    speculative: SpeculativeConfig | None = Field(None, description="Speculative decoding (decode pool only in "
                                                                     "disaggregated mode)")
    cpu_threads: int = Field(1, ge=1, description="OMP threads per CPU engine (1 is best on small boxes)")
    seed: int = Field(0, description="Engine seed")
    startup_timeout_s: float = Field(300, gt=0, description="Max seconds for one engine to become ready")
    engine_core: Literal["auto", "thread", "process"] = Field(
        "auto", description="Where vLLM's EngineCore runs: a thread of the worker actor (auto on CPU: one Python "
                            "process per engine, engine/inproc.py) or its own process (auto on GPU)")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.device == "cpu" and self.pipeline_parallel_size > 1:
            raise ValueError("pipeline parallelism needs device 'cuda'; on CPU set pipeline_parallel_size to 1 "
                             "(tensor parallelism runs on CPU, one process per rank)")
        return self

    def core_in_thread(self) -> bool:
        if self.engine_core == "auto":
            return self.resolved_device() == "cpu"
        return self.engine_core == "thread"

    @property
    def gpus_per_engine(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def with_device(self, device: Device) -> EngineConfig:
        return self if self.device == device else self.model_copy(update={"device": device})

    def resolved_device(self) -> Device:
        if self.device == "auto":
            raise ValueError("engine device is still 'auto'; the deployer resolves it from cluster resources")
        return self.device

    def engine_kwargs(self, model_dir: str, served_name: str) -> dict[str, Any]:
        """Keyword arguments for ``vllm.AsyncEngineArgs``."""
        device = self.resolved_device()
        kw: dict[str, Any] = {
            "model": model_dir,
            "served_model_name": served_name,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "enable_prefix_caching": self.enable_prefix_caching,
            "seed": self.seed,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "disable_log_stats": True,  # NOTE: our own stat logger is passed explicitly
        }
        if self.max_num_batched_tokens:
            kw["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.enable_chunked_prefill is not None:
            kw["enable_chunked_prefill"] = self.enable_chunked_prefill
        if self.kv_cache_dtype != "auto":
            kw["kv_cache_dtype"] = self.kv_cache_dtype
        if self.quantization:
            kw["quantization"] = self.quantization
        if self.speculative is not None:
            kw["speculative_config"] = self.speculative.vllm()
        if device == "cpu":
            kw.update(
                dtype="float32" if self.dtype == "auto" else self.dtype,
                enforce_eager=True,
                # NOTE: TP > 1 on CPU: vLLM's multiprocessing executor, one process per rank (gloo); its
                # Ray executor has no CPU device key, and `uni` starts rank 0 only
                distributed_executor_backend="mp" if self.tensor_parallel_size > 1 else "uni",
                kv_cache_memory_bytes=(self.kv_cache_mib or 256) << 20,
            )
        else:
            kw.update(dtype=self.dtype, gpu_memory_utilization=self.gpu_memory_utilization)
            if self.kv_cache_mib:
                kw["kv_cache_memory_bytes"] = self.kv_cache_mib << 20
            if self.enforce_eager is not None:
                kw["enforce_eager"] = self.enforce_eager
            if self.gpus_per_engine > 1:
                kw["distributed_executor_backend"] = "ray"
        return kw

    def process_env(self, node_ip: str) -> dict[str, str]:
        """Environment each engine process (and vLLM's EngineCore child) needs."""
        # NOTE: without VLLM_HOST_IP vLLM binds its internal queues to the host's interface address.
        env = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": node_ip, "TOKENIZERS_PARALLELISM": "false"}
        if self.resolved_device() == "cpu":
            env.update(
                VLLM_CPU_OMP_THREADS_BIND="nobind",
                OMP_NUM_THREADS=str(self.cpu_threads),
                VLLM_ENABLE_V1_MULTIPROCESSING="0",
                # NOTE: oneDNN caches kernels per input shape (1,024 by default); every new prompt length
                # adds some, so a prefill engine grew ~430 MiB over a 2,000-request soak. 16 keeps it
                # flat at the same throughput (benchmarks/soak.py).
                ONEDNN_PRIMITIVE_CACHE_CAPACITY="16",
            )
        return env
