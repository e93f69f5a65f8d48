"""The HTTP app of an ingress replica: vLLM's own OpenAI routers over our EngineClient, set up the way
vLLM sets up its server (`init_app_state` with arguments from its arg parser), plus our own /health
(draining), /metrics, /v1/stats and /v1/models/{id}, and the Guard (and, with serve.api_keys, Auth)
middleware in front, and ServedHeader (how each request was served: cluster/serve/served.py) inside them.

vLLM's routers mounted: chat completions, completions, responses, Anthropic messages, models, tokenize /
detokenize. Not mounted: vLLM's /health and /metrics (ours answer there), LoRA, profiling, sleep, pooling.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.errors import ServeError
from cluster.serve import preflight
from cluster.serve.auth import Auth
from cluster.serve.engine_client import TASKS, PDEngineClient
from cluster.serve.guard import Guard
from cluster.serve.served import HEADER as SERVED_HEADER
from cluster.serve.served import ServedHeader

VLLM_ROUTERS = (
    "vllm.entrypoints.openai.chat_completion.api_router",
    "vllm.entrypoints.openai.completion.api_router",
    "vllm.entrypoints.openai.responses.api_router",
    "vllm.entrypoints.anthropic.api_router",
    "vllm.entrypoints.openai.models.api_router",
    "vllm.entrypoints.serve.tokenize.api_router",
)


async def _serve_error(_: Request, exc: ServeError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path 404, wrong method 405, a body FastAPI could not parse 400) in
    the shape of vLLM's other errors, not {"detail": ...}."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        message = "malformed JSON: nested too deeply"
    elif isinstance(cause, ValueError):  # NOTE: e.g. an integer literal over Python's 4300-digit limit
        message = f"malformed JSON: {cause}"
    body = {"error": {"message": message, "type": HTTPStatus(exc.status_code).phrase, "param": None,
                      "code": exc.status_code}}
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def build_app(client: PDEngineClient, args: Any, *, health: Callable[[], tuple[int, dict]],
                    metrics: Callable[[], bytes], stats: Callable[[], dict]) -> FastAPI:
    import importlib

    from vllm.entrypoints.openai.api_server import init_app_state
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    sc = client.svc.cfg.serve
    # NOTE: /docs, /redoc and /openapi.json describe every route to anyone who reaches the port: off
    # unless serve.docs (vLLM serves them unless --disable-fastapi-docs).
    docs = {} if sc.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Saaf Infer", version="0.1.0", **docs)
    app.state.args = args
    await init_app_state(client, app.state, args, supported_tasks=TASKS)
    wrapped = preflight.install(app.state, client.svc.cfg.slo, sc.max_completions_per_request)
    if "openai_serving_chat_batch.create_batch_chat_completion" not in wrapped:  # NOTE: never outside admission
        app.state.openai_serving_chat_batch = None
    # NOTE: vLLM's engine-error handler reads state.server (the uvicorn server its launcher sets).
    app.state.server = types.SimpleNamespace(should_exit=False)
    for name in VLLM_ROUTERS:
        module = importlib.import_module(name)
        if hasattr(module, "attach_router"):
            module.attach_router(app)
        else:
            app.include_router(module.router)
    init_exception_handler(app)
    app.add_exception_handler(ServeError, _serve_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)

    @app.get("/health")
    async def _health() -> JSONResponse:
        # NOTE: open to load balancers by default, so it says only ok / starting / draining; the workers'
        # stats are in /v1/stats, behind the keys.
        status, body = health()
        return JSONResponse({"status": body["status"]}, status_code=status)

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/stats")
    async def _stats() -> dict:
        return stats()

    @app.get("/v1/models/{model_id:path}")
    async def _model(model_id: str, raw_request: Request) -> JSONResponse:
        models = await raw_request.app.state.openai_serving_models.show_available_models()
        for card in models.data:
            if card.id == model_id:
                return JSONResponse(card.model_dump())
        raise ServeError(404, f"The model `{model_id}` does not exist.", type_="NotFoundError", param="model",
                         code="model_not_found")

    if sc.served_header:  # NOTE: innermost: it sees the serving calls' contexts, not the guard's own errors
        app.add_middleware(ServedHeader, colocated=client.svc.cfg.mode == "colocated")
    if sc.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=sc.cors_origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["*"], allow_credentials=False, expose_headers=[SERVED_HEADER])
    app.add_middleware(Guard, max_body_bytes=sc.max_body_bytes, max_inflight=sc.max_inflight,
                       draining=lambda: client.draining, body_timeout_s=sc.body_timeout_s)
    if sc.api_key_sha256:  # NOTE: added last, so outermost: a request without a key costs no in-flight slot
        app.add_middleware(Auth, digests=sc.api_key_sha256, auth_health=sc.auth_health,
                           auth_metrics=sc.auth_metrics)
    return app
