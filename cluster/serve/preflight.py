"""What runs before vLLM's serving classes answer: the fan-out cap, the request's SLO context, and admission
(the router's, cluster/router/admission.py) before a stream starts.

vLLM's serving methods (create_chat_completion, create_completion, create_responses, create_messages)
render the request, call `EngineClient.generate()` for each prompt, and for `stream: true` return an
async generator that the route hands to a StreamingResponse: by then a 200 is promised. Wrapping the
method, we set the request's context (its SLO headers) around the call, and when it returns a stream we
route every job it created first: a refusal is then an HTTP 429 (or 503) with `Retry-After`, never an
error event inside a 200. Non-streamed requests are admitted inside generate() and raise the same error.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
from collections.abc import Callable
from typing import Any

from cluster.config import SLOConfig
from cluster.errors import too_many
from cluster.serve.context import CURRENT, SERVED, RequestContext
from cluster.serve.engine_client import StreamError

# The serving objects vLLM's init_app_state creates, and their request methods that may return streams.
GENERATE_METHODS = {
    "openai_serving_chat": "create_chat_completion",
    "openai_serving_completion": "create_completion",
    "openai_serving_responses": "create_responses",
    "anthropic_serving_messages": "create_messages",
    # NOTE: the batch route too: its entries are completions of one request, capped and admitted as such
    "openai_serving_chat_batch": "create_batch_chat_completion",
}


# NOTE: vLLM's renderer names its own CLI flags when a request needs a tool-call parser; our users configure
# the deployment, not vLLM's CLI, so the 400 names our setting and an example instead.
TOOL_PARSER_FIX = ("needs a tool-call parser for this model's tool-call format: set it in the deploy config, e.g. "
                   "serve: {vllm_args: [--enable-auto-tool-choice, --tool-call-parser, hermes]} (vLLM's parser "
                   "names are accepted); the bundled SmolLM2's chat template has no tool format of its own")


def our_setting_named(result: Any) -> Any:
    """vLLM's error response for a tools request it cannot parse, with our setting named instead of vLLM's flags."""
    err = getattr(result, "error", None)
    msg = getattr(err, "message", None)
    if isinstance(msg, str) and "--tool-call-parser to be set" in msg:
        err.message = f"{msg.split(' requires ')[0]} {TOOL_PARSER_FIX}"  # type: ignore[union-attr]
        err.param = err.param or "tool_choice"  # type: ignore[union-attr]
    return result


async def _until_disconnect(raw_request: Any) -> None:
    from vllm.entrypoints.serve.utils.api_utils import listen_for_disconnect

    await listen_for_disconnect(raw_request)


async def admit_all(ctx: RequestContext, raw_request: Any) -> None:
    """Route every job of the request; stop waiting (and leave) if the client hangs up meanwhile."""
    if not ctx.jobs:
        return
    admitting = asyncio.ensure_future(asyncio.gather(*(job.admit() for job in ctx.jobs)))
    watch = asyncio.ensure_future(_until_disconnect(raw_request)) if raw_request is not None else None
    try:
        waits = {admitting} | ({watch} if watch else set())
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if admitting not in done:
            admitting.cancel()
            raise asyncio.CancelledError("client disconnected while queued for admission")
        admitting.result()
    finally:
        if watch is not None:
            watch.cancel()


def asked_completions(request: Any) -> int:
    """Completions a parsed request asks for before it is rendered: n x (prompts of a completions list, or
    conversations of a batch). EngineClient.generate() counts them again as they come (the authority)."""
    n = getattr(request, "n", None) or 1
    prompts = 1
    p = getattr(request, "prompt", None)
    if isinstance(p, list) and p and not isinstance(p[0], int):
        prompts = len(p)
    m = getattr(request, "messages", None)
    if isinstance(m, list) and m and isinstance(m[0], list):
        prompts = len(m)
    return n * prompts


def admit_streams_first(method: Callable[..., Any], slo: SLOConfig, cap: int = 16) -> Callable[..., Any]:
    @functools.wraps(method)
    async def wrapper(request: Any, raw_request: Any = None, *args: Any, **kwargs: Any) -> Any:
        if asked_completions(request) > cap:  # NOTE: before thousands of prompts are rendered for nothing
            raise too_many(asked_completions(request), cap)
        ctx = RequestContext.from_headers(raw_request.headers if raw_request is not None else {}, slo)
        token = CURRENT.set(ctx)
        served = SERVED.get()
        if served is not None:
            served.append(ctx)
        try:
            result = await method(request, raw_request, *args, **kwargs)
        except BaseException:
            for job in ctx.jobs:  # NOTE: e.g. the fan-out cap hit at a later prompt: earlier ones never run
                job.close()
            raise
        finally:
            CURRENT.reset(token)
        result = our_setting_named(result)
        if inspect.isasyncgen(result):
            try:
                await admit_all(ctx, raw_request)
            except BaseException:
                for job in ctx.jobs:
                    job.close()
                with contextlib.suppress(Exception):
                    await result.aclose()
                raise
        return result

    return wrapper


def our_stream_errors(method: Callable[..., str]) -> Callable[..., str]:
    """vLLM's stream generators render an exception as an error event with `create_streaming_error_response`;
    ours keep their OpenAI-style body (type and machine-readable code, e.g. `shutting_down`)."""

    @functools.wraps(method)
    def wrapper(message: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(message, StreamError):
            return json.dumps(message.error.body())
        return method(message, *args, **kwargs)

    return wrapper


def install(state: Any, slo: SLOConfig, cap: int = 16) -> list[str]:
    """Wrap the serving objects vLLM created on `state`; returns the methods wrapped."""
    wrapped = []
    for attr, name in GENERATE_METHODS.items():
        obj = getattr(state, attr, None)
        if obj is not None and hasattr(obj, name):
            setattr(obj, name, admit_streams_first(getattr(obj, name), slo, cap))
            if hasattr(obj, "create_streaming_error_response"):
                obj.create_streaming_error_response = our_stream_errors(obj.create_streaming_error_response)
            wrapped.append(f"{attr}.{name}")
    return wrapped
