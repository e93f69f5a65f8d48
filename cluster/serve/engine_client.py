"""Our `EngineClient` (vllm/engine/protocol.py): vLLM's serving layer talks to it as to one engine, and
each `generate()` runs across the pools (cluster/serve/job.py, leg.py).

vLLM's serving classes use only part of the protocol (configs, renderer, input processor, errored /
dead_error, check_admission, generate, abort, get_supported_tasks, do_log_stats); the rest answers what
a disaggregated deployment can (health) or says plainly that it is not offered here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, Iterable
from http import HTTPStatus
from typing import Any

from vllm.engine.protocol import EngineClient
from vllm.exceptions import GracefulHTTPError, VLLMValidationError
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

from cluster.errors import ServeError, rate_limited, shutting_down, too_many
from cluster.serve.context import CURRENT, RequestContext
from cluster.serve.frontend import Frontend
from cluster.serve.job import Job
from cluster.serve.leg import Services

logger = logging.getLogger(__name__)
TASKS = ("generate",)


class StreamError(GracefulHTTPError):
    """A ServeError inside a started stream: vLLM's stream generators turn it into an error event that
    carries its HTTP status, followed by [DONE]."""

    def __init__(self, e: ServeError) -> None:
        super().__init__(e.message, HTTPStatus(e.status))
        self.error = e


def _not_offered(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not offered by a disaggregated Saaf Infer deployment")


class PDEngineClient(EngineClient):
    def __init__(self, frontend: Frontend, svc: Services) -> None:
        self.vllm_config = frontend.vllm_config
        self.model_config = frontend.vllm_config.model_config
        self.renderer = frontend.renderer
        self.input_processor = frontend.input_processor
        self.svc = svc
        self.jobs: dict[str, Job] = {}
        self.draining = False  # shutdown began: new requests get 503
        self.aborting = False  # the drain grace period is over: in-flight requests end with an error

    # ---- state -----------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return not self.draining

    @property
    def is_stopped(self) -> bool:
        return self.aborting

    @property
    def errored(self) -> bool:
        return False  # NOTE: a worker's failure is retried or answered per request; the ingress lives on

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError("the ingress is not errored")

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        if self.draining:
            raise shutting_down("the server is shutting down and takes no new requests; retry shortly")

    @property
    def inflight(self) -> int:
        return len(self.jobs)

    @property
    def legs_inflight(self) -> int:
        """Completions in flight (each its own prefill, KV transfer and decode): what serve.max_inflight caps."""
        return sum(len(job.legs) for job in self.jobs.values())

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str, *,
                 prompt_text: str | None = None, lora_request: Any = None,
                 tokenization_kwargs: dict[str, Any] | None = None, trace_headers: Any = None,
                 priority: int = 0, data_parallel_rank: int | None = None, session_id: str | None = None,
                 kv_hints: Any = None, reasoning_ended: bool | None = None,
                 reasoning_parser_kwargs: dict[str, Any] | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Validate now (errors become HTTP 4xx before any stream), register the job with the request's
        context (so a stream can be admitted before it starts), and return its outputs."""
        if self.draining:
            raise shutting_down("the server is shutting down and takes no new requests; retry shortly")
        if lora_request is not None:
            raise VLLMValidationError("LoRA adapters are not served by this deployment", parameter="model")
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
            raise VLLMValidationError("only token prompts (text, chat or token ids) are served here; "
                                      "embeddings and multimodal inputs are not", parameter="prompt")
        if (sampling_params.extra_args or {}).get("kv_transfer_params") is not None:
            raise VLLMValidationError("kv_transfer_params is set by this server's own prefill/decode split; "
                                      "remove it from the request", parameter="kv_transfer_params")
        # NOTE: the same checks vLLM's engine makes before accepting a request (logprobs, structured
        # output, prompt length, ...), so a bad request is a 400 here and never reaches a worker.
        ctx = CURRENT.get() or RequestContext.from_headers({}, self.svc.cfg.slo)
        n = sampling_params.n or 1
        sc = self.svc.cfg.serve
        if ctx.completions + n > sc.max_completions_per_request:
            raise too_many(ctx.completions + n, sc.max_completions_per_request)
        if self.legs_inflight + n > sc.max_inflight:
            raise rate_limited(f"{sc.max_inflight} completions in flight on this replica (serve.max_inflight); "
                               "retry shortly", code="overloaded")
        # NOTE: every id inside the system is ours (job, legs, engine requests, KV handoffs); the client's
        # (its X-Request-Id, or vLLM's default) is only echoed back, so two clients sending one id cannot
        # collide in an engine or cancel each other.
        internal = f"saaf-{uuid.uuid4().hex}"
        self.input_processor.process_inputs(internal, prompt, sampling_params, TASKS, priority=priority)
        ctx.completions += n
        job = Job(self.svc, internal, list(prompt["prompt_token_ids"]), prompt.get("prompt") or prompt_text,
                  sampling_params, ctx.ttft_slo_s, ctx.tpot_slo_s, client_id=request_id)
        ctx.jobs.append(job)
        self.jobs[internal] = job
        job.on_close = lambda: self.jobs.pop(internal, None)
        self.svc.members.wake()
        return self._outputs(job, sampling_params.output_kind == RequestOutputKind.DELTA)

    async def _outputs(self, job: Job, streaming: bool) -> AsyncGenerator[RequestOutput, None]:
        try:
            async for out in job.outputs():
                if self.aborting:
                    raise shutting_down("the server shut down before this request finished; retry it")
                yield out
        except ServeError as e:
            if streaming:
                raise StreamError(e) from None
            raise
        finally:
            self.jobs.pop(job.request_id, None)
            job.close()

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Our own ids abort their job; a client's id only the jobs of the request this call runs in (its
        context), never another client's request that happens to carry the same id."""
        ctx = CURRENT.get()
        mine = {job.client_id: job for job in ctx.jobs} if ctx is not None else {}
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            job = self.jobs.get(rid) or mine.get(rid)
            if job is not None:
                job.close()

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return TASKS

    async def check_health(self) -> None:
        if not self.svc.members.ready():
            raise RuntimeError("no healthy prefill and decode workers")

    async def do_log_stats(self) -> None:
        return None

    async def is_tracing_enabled(self) -> bool:
        return False

    async def notify_kv_transfer_request_rejected(self, request_id: str, kv_transfer_params: dict[str, Any], *,
                                                  data_parallel_rank: int | None = None) -> None:
        return None  # NOTE: clients never pass kv_transfer_params here (generate() refuses them)

    async def is_paused(self) -> bool:
        return False

    async def is_sleeping(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        for job in list(self.jobs.values()):
            job.close()

    # ---- not offered through the OpenAI surface of a P/D deployment ------------------------------
    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise _not_offered("pooling (embeddings, scores)")

    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        raise _not_offered("profiling")

    async def stop_profile(self) -> None:
        raise _not_offered("profiling")

    async def reset_mm_cache(self) -> None:
        return None

    async def reset_encoder_cache(self) -> None:
        return None

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        raise _not_offered("resetting the prefix cache from the ingress")

    async def sleep(self, level: int = 1, mode: Any = "abort") -> None:
        raise _not_offered("sleep mode")

    async def release_kv_cache_memory(self) -> None:
        raise _not_offered("releasing KV cache memory")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        raise _not_offered("sleep mode")

    async def add_lora(self, lora_request: Any) -> bool:
        raise _not_offered("LoRA adapters")

    async def pause_generation(self, *, mode: Any = "abort", clear_cache: bool = True) -> None:
        raise _not_offered("pausing generation (use `python -m cluster.deploy shutdown` to drain)")

    async def resume_generation(self) -> None:
        raise _not_offered("pausing generation")
