"""The Ray Serve ingress: OpenAI-compatible HTTP API in front of the pools.

Request path (disaggregated): tokenize -> router picks (prefill p, decode d) -> p.prefill() returns the
KV handoff -> d.decode_stream() pulls the KV over NIXL and streams tokens -> SSE to the client.
Colocated: one worker's generate_stream(). Every remote call is bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException

from cluster.config import DeployConfig
from cluster.metrics import Metrics
from cluster.openai_api import APIError, ChatRequest, CompletionRequest
from cluster.router import RouteRequest
from cluster.routing_state import RoutingState

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
app = FastAPI(title="Saaf Infer", version="0.1.0")


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """FastAPI's own 404/405 (unknown path, wrong method) in the OpenAI error shape, not {"detail": ...}."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


# A \u escape of a UTF-16 surrogate in the raw body; only then can the parsed JSON hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def shutting_down(message: str) -> APIError:
    return APIError(503, message, type_="service_unavailable", code="shutting_down", headers={"Retry-After": "5"})


def _has_lone_surrogate(data: Any) -> bool:
    """True when a string (key or value) anywhere in ``data`` is not encodable as UTF-8. Iterative: the
    body can be nested as deep as the JSON parser allows."""
    todo = [data]
    while todo:
        x = todo.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
    return False


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown field '{loc}'", loc
    if err["type"] == "missing":
        return f"missing required field '{loc}'", loc
    return f"invalid '{loc}': {err['msg']}", loc


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=512)
@serve.ingress(app)
class Ingress:
    def __init__(self, deploy_cfg: dict[str, Any], controller_name: str) -> None:
        from cluster.fasttok import load_tokenizer
        from engine.models import resolve_model, served_name

        logging.basicConfig(level=logging.INFO)
        self.cfg = DeployConfig.model_validate(deploy_cfg)
        model_dir = resolve_model(self.cfg.engine.model)
        self.model_name = self.cfg.engine.served_model_name or served_name(self.cfg.engine.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.max_model_len = self.cfg.engine.max_model_len
        self.metrics = Metrics()
        controller = ray.get_actor(controller_name, namespace=self.cfg.ray.namespace)
        self.state = RoutingState(self.cfg, controller, self.metrics)
        self.state.start()
        self._direct = None
        if self.cfg.serve.direct:
            from cluster.direct import bind, serve_forever

            sc = self.cfg.serve
            sock = bind(sc.host, sc.port)
            self._direct = asyncio.get_event_loop().create_task(serve_forever(app, sock, sc.route_prefix))
        self.draining = False  # shutdown began: new requests get 503
        self.aborting = False  # the drain grace period is over: in-flight requests end with an error

    # ---- request parsing -------------------------------------------------------------------------
    async def _parse(self, request: Request, model_cls: type) -> Any:
        if "application/json" not in request.headers.get("content-type", "application/json"):
            raise APIError(415, "Content-Type must be application/json")
        declared = request.headers.get("content-length")
        limit = self.cfg.serve.max_body_bytes
        if declared and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
        body = await request.body()
        if len(body) > limit:
            raise APIError(413, f"request body of {len(body)} bytes exceeds the {limit}-byte limit")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise APIError(400, "request body is not valid UTF-8") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise APIError(400, f"malformed JSON: {e.msg} at position {e.pos}") from None
        except RecursionError:
            raise APIError(400, "malformed JSON: nested too deeply") from None
        except ValueError as e:  # NOTE: e.g. an integer literal over Python's 4300-digit limit
            raise APIError(400, f"malformed JSON: {e}") from None
        if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(data):
            raise APIError(400, "request body has a \\u escape of a lone UTF-16 surrogate; send valid Unicode")
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            msg, param = _validation_message(e)
            raise APIError(400, msg, param=param) from None
        if req.model != self.model_name:
            raise APIError(404, f"model '{req.model}' does not exist; this endpoint serves "
                           f"'{self.model_name}'", param="model", code="model_not_found")
        return req

    def _prompt_ids(self, req: Any) -> list[int]:
        if isinstance(req, ChatRequest):
            import jinja2

            try:
                return self.tokenizer.chat([m.model_dump(exclude_none=True) for m in req.messages])
            except jinja2.exceptions.TemplateError as e:
                raise APIError(400, f"messages do not fit this model's chat template: {e}",
                               param="messages") from None
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, "batched prompts are not supported; send one prompt per request",
                               param="prompt")
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt must not be empty", param="prompt")
            return self.tokenizer.encode(p)
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        vocab = len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in p):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(p)

    def _max_tokens(self, req: Any, n_prompt: int) -> int:
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
        room = self.max_model_len - n_prompt
        if room < 1:
            raise APIError(400, f"prompt has {n_prompt} tokens; this model's context is "
                           f"{self.max_model_len} tokens. Shorten the prompt.", param="prompt",
                           code="context_length_exceeded")
        if asked is None:
            return min(self.cfg.serve.default_max_tokens, room)
        if asked > room:
            raise APIError(400, f"prompt ({n_prompt} tokens) + max_tokens ({asked}) exceeds the model's "
                           f"context of {self.max_model_len} tokens; lower max_tokens to <= {room}",
                           param="max_tokens", code="context_length_exceeded")
        return asked

    def _slo(self, request: Request) -> tuple[float, float]:
        def hdr(name: str, default_ms: float) -> float:
            v = request.headers.get(name)
            if v is None:
                return default_ms / 1000
            try:
                f = float(v)
            except ValueError:
                raise APIError(400, f"header {name} must be a number of milliseconds, got {v!r}") from None
            if not 0 < f < 3.6e6:
                raise APIError(400, f"header {name} must be in (0, 3600000) ms, got {v}")
            return f / 1000

        return hdr("x-slo-ttft-ms", self.cfg.slo.ttft_ms), hdr("x-slo-tpot-ms", self.cfg.slo.tpot_ms)

    # ---- routes ----------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        ready = self.state.ready() and not self.draining
        status = "draining" if self.draining else "ok" if ready else "starting"
        body = {"status": status, "workers": self.state.summary()}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "saaf-infer", "max_model_len": self.max_model_len}]}

    @app.get("/metrics")
    async def metrics_endpoint(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/stats")
    async def stats(self) -> dict[str, Any]:
        return {"workers": self.state.summary(), "transfers": self.state.transfer_log()}

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._serve(request, ChatRequest, chat=True)

    async def _serve(self, request: Request, model_cls: type, chat: bool) -> Response:
        if self.draining:
            raise shutting_down("the server is shutting down and takes no new requests; retry shortly")
        req = await self._parse(request, model_cls)
        ids = self._prompt_ids(req)
        max_tokens = self._max_tokens(req, len(ids))
        ttft_slo, tpot_slo = self._slo(request)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        route = RouteRequest(len(ids), max_tokens, ttft_slo, tpot_slo, hash(tuple(ids[:64])))
        run = self._abortable(self.state.run(rid, ids, req.sampling(max_tokens), route))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            first = await self.state.first_or_error(run)  # errors before the first token become HTTP errors
            return StreamingResponse(self._sse(rid, chat, first, run, len(ids), include_usage),
                                     media_type="text/event-stream")
        whole = await self._unless_disconnected(request, self._whole(rid, chat, run, len(ids),
                                                                     req.return_token_ids))
        return JSONResponse(whole) if whole is not None else Response(status_code=499)

    @staticmethod
    async def _unless_disconnected(request: Request, work: Any) -> Any:
        """Await ``work``; if the client hangs up first, cancel it (the engine request is aborted and its KV
        freed) and return None. Streams need no help: the server cancels them on a disconnect."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, APIError):
                    await task
                return None

    async def _abortable(self, run: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """The request's output, ended with a 503 error once the shutdown grace period is over."""
        try:
            async for d in run:
                if self.aborting:
                    raise shutting_down("the server shut down before this request finished; retry it")
                yield d
        finally:
            await run.aclose()

    # ---- graceful shutdown (called through the app's Serve handle by cluster.deploy.stop) ----------
    async def begin_drain(self) -> int:
        """Stop admitting: new requests get 503 and /health says draining. Returns requests in flight."""
        self.draining = True
        return self.state.active

    async def inflight_requests(self) -> int:
        """Requests between arrival and their last token (RoutingState.run counts them)."""
        return self.state.active

    async def abort_inflight(self) -> int:
        """The grace period is over: every request still running ends at its next token with an error."""
        self.aborting = True
        return self.state.active

    async def _whole(self, rid: str, chat: bool, run: AsyncIterator[dict], n_prompt: int,
                     with_ids: bool) -> dict[str, Any]:
        text, token_ids, finish = [], [], None
        async for d in run:
            text.append(d["text"])
            token_ids.extend(d["token_ids"])
            finish = d["finish_reason"] or finish
        content, n_out = "".join(text), len(token_ids)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if with_ids:
            choice["token_ids"] = token_ids
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                          "total_tokens": n_prompt + n_out}}

    async def _sse(self, rid: str, chat: bool, first: dict | None, run: AsyncIterator[dict], n_prompt: int,
                   include_usage: bool) -> AsyncIterator[str]:
        created, obj = int(time.time()), "chat.completion.chunk" if chat else "text_completion"
        n_out = 0

        def chunk(d: dict | None, role: bool = False) -> str:
            c: dict[str, Any] = {"index": 0, "finish_reason": d["finish_reason"] if d else None}
            if chat:
                c["delta"] = {"role": "assistant", "content": ""} if role else {"content": d["text"]}
            else:
                c["text"], c["logprobs"] = d["text"], None
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                          "model": self.model_name, "choices": [c]}) + "\n\n"

        try:
            if chat:
                yield chunk(None, role=True)
            if first is not None:
                n_out += len(first["token_ids"])
                yield chunk(first)
                async for d in run:
                    n_out += len(d["token_ids"])
                    yield chunk(d)
        except APIError as e:
            yield "data: " + json.dumps(e.body()) + "\n\n"
        finally:
            await run.aclose()
        if include_usage:
            yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                         "choices": [], "usage": {"prompt_tokens": n_prompt,
                                                                  "completion_tokens": n_out,
                                                                  "total_tokens": n_prompt + n_out}}) + "\n\n"
        yield "data: [DONE]\n\n"
