"""EngineHost: one vLLM AsyncLLM engine inside a Ray actor, shared by the prefill, decode and
colocated workers. Streams DELTA outputs, tracks what the router needs (WorkerStats) cheaply."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from engine.calibrate import REQUEST_PREFIX, own_requests
from engine.config import EngineConfig
from engine.contract import WorkerStats

logger = logging.getLogger(__name__)


class EngineError(Exception):
    """An engine-side failure the caller should report to the client (message is client-safe)."""


def delta_params(params: Any, **changes: Any) -> Any:
    """A copy of vLLM ``SamplingParams`` that streams DELTA outputs, with ``changes`` applied."""
    from vllm.sampling_params import RequestOutputKind

    p = params.clone()
    p.output_kind = RequestOutputKind.DELTA
    for k, v in changes.items():
        setattr(p, k, v)
    return p


class EngineHost:
    """Base of the worker actors. ``role`` is prefill, decode or colocated."""

    role = "colocated"
    tp = 1  # tensor-parallel ranks of its engine (set once the engine is up)

    def __init__(
        self,
        worker_id: str,
        engine_cfg: dict[str, Any],
        transfer_cfg: dict[str, Any] | None = None,
    ) -> None:
        logging.basicConfig(level=logging.INFO)
        self.worker_id = worker_id
        self.cfg = EngineConfig.model_validate(engine_cfg)
        self.device = self.cfg.resolved_device()
        self.engine_id = f"{worker_id}-{uuid.uuid4().hex[:8]}"
        self.side_channel_port: int | None = None
        self._pending: dict[str, int] = {}  # request id -> prompt tokens this engine computes, until first output
        # NOTE: request id -> prompt tokens whose KV a prefill engine computed and this one pulls over NIXL, until
        # first output: no compute here, so not a prefill queue the router may put a local prompt behind
        self._pulling: dict[str, int] = {}
        self._running_ctx: dict[str, int] = {}  # request id -> context tokens, while decoding
        self._started = time.monotonic()
        self._calib_lock = asyncio.Lock()
        import ray

        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""

        node_ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        env = self.cfg.process_env(node_ip)
        kv_kwargs = None
        if transfer_cfg is not None and self.role in ("prefill", "decode"):
            from kvtransfer.config import TransferConfig, free_port, kv_transfer_kwargs, transfer_env

            tcfg = TransferConfig.model_validate(transfer_cfg)
            self.transfer_cfg = tcfg
            self.side_channel_port = free_port(tcfg.side_channel_host or node_ip)
            env.update(transfer_env(tcfg, self.side_channel_port, self.device, node_ip))
            kv_kwargs = kv_transfer_kwargs(self.role, self.engine_id, self.device, tcfg)
        # NOTE: vLLM's EngineCore is a spawned child; it inherits os.environ at spawn time.
        os.environ.update(env)
        from engine.models import resolve_model, served_name

        # NOTE: before vLLM's import (15-40 s on a busy 2-core box): a model directory missing on this node fails
        # the worker at once, not after the import
        model_dir = resolve_model(self.cfg.model)
        t_import = time.monotonic()
        from vllm import AsyncEngineArgs
        from vllm.config import KVTransferConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        from engine.statlog import EngineTotals, make_stat_logger_factory

        self.model_name = self.cfg.served_model_name or served_name(self.cfg.model)
        kwargs = self.cfg.engine_kwargs(str(model_dir), self.model_name)
        if kv_kwargs is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(**kv_kwargs)
        self.totals = EngineTotals()
        t_engine = time.monotonic()
        with self._core_placement():
            self.engine = AsyncLLM.from_engine_args(
                AsyncEngineArgs(**kwargs), stat_loggers=[make_stat_logger_factory(self.totals)]
            )
        if self.device == "cpu" and kv_kwargs is not None:
            from engine.procs import reset_affinity

            n = reset_affinity(os.getpid(), set(os.sched_getaffinity(0)))
            logger.info("re-allowed %d EngineCore threads on all CPUs (NixlConnector pins them to one)", n)
        vc = self.engine.vllm_config
        self.block_size = vc.cache_config.block_size
        self.num_gpu_blocks = vc.cache_config.num_gpu_blocks or 0
        self.block_bytes = self._block_bytes(vc)
        self.tp = vc.parallel_config.tensor_parallel_size
        self.max_model_len = vc.model_config.max_model_len
        now = time.monotonic()
        self.startup_s = {"before_vllm": round(t_import - self._started, 2), "vllm_import": round(t_engine - t_import, 2),
                          "engine": round(now - t_engine, 2), "total": round(now - self._started, 2)}
        logger.info(
            "%s %s ready: engine %s, %d KV blocks of %d tokens (%d bytes each), side channel %s; startup %s",
            self.role, worker_id, self.engine_id, self.num_gpu_blocks, self.block_size, self.block_bytes,
            self.side_channel_port, self.startup_s,
        )

    def _core_placement(self) -> Any:
        """Where vLLM's EngineCore runs: a thread of this actor (CPU default, engine/inproc.py) or a process."""
        import contextlib

        if self.cfg.core_in_thread():
            from engine.inproc import engine_core_in_thread

            return engine_core_in_thread()
        return contextlib.nullcontext()

    @staticmethod
    def _block_bytes(vc: Any) -> int:
        mc = vc.model_config
        import torch

        dtype = vc.cache_config.cache_dtype
        elem = torch.tensor([], dtype=mc.dtype).element_size() if dtype == "auto" else 1
        # NOTE: the whole engine's block, every rank's share: vLLM's counts are per TP rank and PP stage, and
        # a decode engine of another TP size pulls all of it (from one rank or several)
        pc = vc.parallel_config
        layers = mc.get_num_layers(pc) * pc.pipeline_parallel_size
        kv_heads = mc.get_num_kv_heads(pc) * pc.tensor_parallel_size
        return 2 * layers * kv_heads * mc.get_head_size() * vc.cache_config.block_size * elem

    async def info(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "engine_id": self.engine_id,
            "node_id": self.node_id,
            "pid": os.getpid(),
            "side_channel_port": self.side_channel_port,
            "model": self.model_name,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            # NOTE: the engine's own step budget (vLLM picks one where the config leaves it unset)
            "max_num_batched_tokens": self.engine.vllm_config.scheduler_config.max_num_batched_tokens,
            "chunked_prefill": self.engine.vllm_config.scheduler_config.enable_chunked_prefill,
            "kv_capacity_tokens": self.num_gpu_blocks * self.block_size,
            "device": self.device,
            "startup_s": self.startup_s,
            "started_at": time.time() - (time.monotonic() - self._started),
        }

    def stats(self) -> WorkerStats:
        t = self.totals
        calibrating = own_requests(self)
        pending = {r: n for r, n in self._pending.items() if not r.startswith(REQUEST_PREFIX)}
        running_ctx = {r: n for r, n in self._running_ctx.items() if not r.startswith(REQUEST_PREFIX)}
        # NOTE: a measurement's requests are not load: it gives way to the first serving request that
        # reaches the engine, so a router that counted them would queue (or refuse) the very request the
        # measurement is waiting to yield to. While it runs, our own ledger is the serving load.
        return WorkerStats(
            worker_id=self.worker_id,
            role=self.role,
            node_id=self.node_id,
            waiting=len(pending) if calibrating else max(t.waiting, len(pending)),
            running=len(running_ctx) if calibrating else max(t.running, len(running_ctx)),
            queued_prompt_tokens=sum(pending.values()),
            pulling=len(self._pulling),
            pulling_tokens=sum(self._pulling.values()),
            running_context_tokens=sum(running_ctx.values()),
            kv_usage=t.kv_usage,
            kv_capacity_tokens=self.num_gpu_blocks * self.block_size,
            recent_step_times_s=() if calibrating else t.recent_steps(),
            healthy=not self.engine.errored,
            timestamp_s=time.time(),
            spec_acceptance=round(t.spec_accepted / t.spec_drafted, 4) if t.spec_drafted else None,
            calibrating=calibrating,
            step_tokens=self.engine.vllm_config.scheduler_config.max_num_batched_tokens or 0,
            spec_drafted=t.spec_drafted,
            spec_accepted=t.spec_accepted,
            prefix_caching=bool(self.engine.vllm_config.cache_config.enable_prefix_caching),
        )

    def totals_snapshot(self) -> dict[str, Any]:
        return self.totals.snapshot()

    async def calibration_samples(self, cached: bool = True) -> tuple[Any, str, str] | None:
        """(Samples, source, cache key) for the router's latency model. ``cached``: from this node's cache
        for this CPU/GPU model, engine and vLLM version (None if there is none); otherwise measured on
        this engine now (engine/calibrate.py) and cached if no serving traffic or other load overlapped it. One
        measurement at a time per worker."""
        from engine import calibrate

        vc = self.engine.vllm_config
        # NOTE: a quantized copy served under the same name has latencies of its own
        quant = vc.model_config.quantization
        key = calibrate.machine_key(self.model_name + (f"-{quant}" if quant else ""),
                                    str(vc.model_config.dtype).removeprefix("torch."),
                                    self.cfg.cpu_threads if self.device == "cpu" else vc.parallel_config.tensor_parallel_size,
                                    self.device, calibrate.engine_fingerprint(vc))
        if cached:
            hit = calibrate.load_cached(key)
            return None if hit is None else (hit, "cache", key)
        limit = calibrate.foreign_limit(self.cfg.cpu_threads) if self.device == "cpu" else None
        async with self._calib_lock:
            samples = await calibrate.measure(self, vc.model_config.get_vocab_size(), foreign_max=limit)
            if samples.clean:  # NOTE: samples that traffic or other load overlapped are neither used nor cached
                calibrate.store(key, samples)
            logger.info("%s: latency samples measured in %.1fs (other processes: %.2f cores; %s)", self.worker_id,
                        samples.seconds, samples.foreign_cores,
                        f"cached as {key}" if samples.clean else "traffic or other load overlapped them: unused")
            return samples, f"measured on {self.worker_id}", key

    async def check_health(self) -> bool:
        await asyncio.wait_for(self.engine.check_health(), timeout=10)
        return True

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def _generate(self, request_id: str, prompt_token_ids: list[int], params: Any,
                        pulled: int = 0) -> AsyncIterator[Any]:
        """Yield vLLM RequestOutputs (as ``params`` asks); abort the engine request if the consumer goes away.
        ``pulled``: prompt tokens whose KV comes from a prefill engine (the rest this engine computes)."""
        from vllm.inputs import TokensPrompt

        n = len(prompt_token_ids)
        pulled = max(0, min(pulled, n - 1))
        self._pending[request_id] = n - pulled
        if pulled:
            self._pulling[request_id] = pulled
        finished = False
        try:
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_token_ids), params,
                                                  request_id):
                if request_id in self._pending:
                    del self._pending[request_id]
                    self._pulling.pop(request_id, None)
                    self._running_ctx[request_id] = n
                self._running_ctx[request_id] += sum(len(c.token_ids) for c in out.outputs)
                finished = out.finished
                yield out
        finally:
            self._pending.pop(request_id, None)
            self._pulling.pop(request_id, None)
            self._running_ctx.pop(request_id, None)
            if not finished:
                await self.engine.abort(request_id)

    async def generate_stream(self, request_id: str, prompt_token_ids: list[int],
                              params: Any) -> AsyncIterator[Any]:
        """A whole request on this engine (colocated mode, 1-token requests, recompute fallbacks): DELTA
        RequestOutputs for vLLM ``SamplingParams`` ``params``."""
        async for out in self._generate(request_id, prompt_token_ids, delta_params(params)):
            yield out

    async def shutdown(self) -> None:
        self.engine.shutdown()
