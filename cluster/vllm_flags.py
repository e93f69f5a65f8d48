"""vLLM server flags that `serve.vllm_args` may not carry: the ingress runs vLLM's serving layer, not vLLM's
server, so each of these would be silently ignored (or is ours to set). Refused at validation, naming the
setting that does it."""

from __future__ import annotations

# vLLM server flags the ingress does not run vLLM's server for: each is ours to set (or not offered), so
# passing one would be silently ignored. NOTE: refused rather than ignored, naming the setting that does it.
VLLM_ARGS_REFUSED = {
    "--api-key": "serve.api_keys",
    "--allowed-origins": "serve.cors_origins",
    "--allowed-methods": "serve.cors_origins (methods: GET, POST, OPTIONS)",
    "--allowed-headers": "serve.cors_origins (any header)",
    "--allow-credentials": "serve.cors_origins (no credentials: keys travel in Authorization)",
    "--disable-fastapi-docs": "serve.docs (off by default)",
    "--middleware": "nothing: the ingress runs only its own middleware",
    "--host": "serve.host",
    "--port": "serve.port",
    "--uds": "serve.host",
    "--root-path": "serve.route_prefix",
    "--ssl-keyfile": "TLS in front of the endpoint (a load balancer or proxy)",
    "--ssl-certfile": "TLS in front of the endpoint (a load balancer or proxy)",
    "--ssl-ca-certs": "TLS in front of the endpoint (a load balancer or proxy)",
    "--ssl-cert-reqs": "TLS in front of the endpoint (a load balancer or proxy)",
    "--enable-ssl-refresh": "TLS in front of the endpoint (a load balancer or proxy)",
}


def refused_vllm_args(argv: list[str]) -> list[str]:
    """One message per vLLM server flag in `argv` that the ingress would not honour (VLLM_ARGS_REFUSED)."""
    out = []
    for a in argv:
        flag = a.split("=", 1)[0]
        flag = "--" + flag.lstrip("-").replace("_", "-") if flag.startswith("-") else flag
        if flag in VLLM_ARGS_REFUSED:
            out.append(f"{flag} is vLLM's own server's, not used by this ingress; use {VLLM_ARGS_REFUSED[flag]}")
    return out
