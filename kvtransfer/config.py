"""Per-role NIXL connector configuration and the UCX environment."""

from __future__ import annotations

import socket
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["prefill", "decode"]
FailurePolicy = Literal["recompute", "fail"]


class TransferConfig(BaseModel):
    """How KV moves from prefill to decode engines, and what happens when it does not."""

    model_config = ConfigDict(extra="forbid")

    connector: Literal["NixlConnector"] = Field("NixlConnector", description="vLLM KV connector")
    failure_policy: FailurePolicy = Field(
        "recompute",
        description="On transfer failure/timeout: 'recompute' the prompt on the decode engine, or 'fail'",
    )
    transfer_timeout_s: float = Field(
        20.0, gt=0, description="Max seconds from handing a request to decode until its first token"
    )
    kv_lease_s: int = Field(
        15, ge=6, description="Seconds the prefill engine pins a finished prompt's KV waiting for decode"
    )
    backends: list[str] | None = Field(
        None, description="NIXL backends; None = the nodes' saaf.io/nixl-backend label (manifests), else UCX")
    ucx_tls: str | None = Field(None, description="UCX_TLS for the engines; None keeps UCX's choice")
    ucx_net_devices: str | None = Field(
        None, description="UCX_NET_DEVICES; None = 'lo' on a single CPU host, UCX's choice elsewhere"
    )
    side_channel_host: str | None = Field(
        None, description="Address the NIXL side channel binds to; None = the node's Ray IP address"
    )
    fabric_check: bool | Literal["auto"] = Field(
        "auto", description="Run the NIXL fabric check before serving: true, false, or auto (on clusters of "
                            "more than one node)")
    fabric_check_mib: int = Field(16, gt=0, description="Bytes moved per pair by the fabric check, MiB")
    integrity: bool = Field(
        False, description="Check every pulled KV block against a digest the prefill engine took as it wrote it; "
                           "mismatched blocks follow failure_policy (recompute, or fail the request). Costs a hash "
                           "of the KV on both sides (kvtransfer/integrity.py)")
    fault_injection: bool = Field(
        False, description="Tests only: lets the decode workers' inject_kv_corruption(n) corrupt their next n "
                           "pulls, to exercise the integrity check")


def kv_transfer_kwargs(role: Role, engine_id: str, device: str, cfg: TransferConfig) -> dict[str, Any]:
    """Keyword arguments for ``vllm.config.KVTransferConfig`` for one engine."""
    return {
        "kv_connector": cfg.connector,
        # NOTE: vLLM's NixlConnector with the decode side's pull capped at what the prefill computed
        # (kvtransfer/connector.py), so decoding can continue from prompt + the prefill's first token.
        "kv_connector_module_path": "kvtransfer.connector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": engine_id,
        # NOTE: on CPU the KV cache itself is DRAM, registered with NIXL directly; on GPU it is VRAM.
        "kv_buffer_device": "cpu" if device == "cpu" else "cuda",
        "kv_load_failure_policy": cfg.failure_policy,
        "kv_connector_extra_config": {
            "backends": backend_list(cfg),
            "kv_lease_duration": cfg.kv_lease_s,
            # NOTE: vLLM skips the pull (and silently recomputes on decode) below 64 prompt tokens by
            # default; we always pull so that every disaggregated request really moves its KV.
            "kv_recompute_threshold": 0,
            "saaf_integrity": cfg.integrity,
            "saaf_fault_injection": cfg.fault_injection,
        },
    }


DEFAULT_BACKENDS = ("UCX",)
NODE_LABEL = "saaf.io/nixl-backend"


def backend_list(cfg: TransferConfig) -> list[str]:
    return list(cfg.backends or DEFAULT_BACKENDS)


def backends_from_labels(labels: list[dict[str, str]]) -> list[str] | None:
    """The NIXL backend the cluster's nodes are labelled with (saaf.io/nixl-backend, set by the ray up
    manifests for their fabric), or None when no node says. Nodes that disagree are an error: the engines
    of one deployment must share a backend."""
    found = {lb[NODE_LABEL].strip().upper() for lb in labels if lb.get(NODE_LABEL, "").strip()}
    if len(found) > 1:
        raise ValueError(f"nodes disagree on {NODE_LABEL} ({', '.join(sorted(found))}); set transfer.backends "
                         "in the deploy config, or relabel the nodes")
    return sorted(found) or None


def transfer_env(cfg: TransferConfig, side_channel_port: int, device: str, node_ip: str) -> dict[str, str]:
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": cfg.side_channel_host or node_ip,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
    }
    if cfg.ucx_tls:
        env["UCX_TLS"] = cfg.ucx_tls
    net = cfg.ucx_net_devices or ("lo" if node_ip.startswith("127.") else None)
    if net:
        env["UCX_NET_DEVICES"] = net
    return env


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port free right now on ``host``, below the kernel's ephemeral range where one is free (else any):
    for a socket bound later by another process or library (an engine's NIXL side channel, a Serve
    endpoint). Each engine picks its own at start (and again on restart), so workers sharing a node never
    collide and a restarted worker never reuses a stale assignment.

    NOTE: not an ephemeral port (bind to port 0): between our choice and the bind (seconds later, during
    engine or Serve start) the kernel may hand the same port to any socket bound to port 0 or connecting out:
    vLLM's own ZMQ sockets ("Address already in use" killed an engine's handshake listener and hung it),
    or a `vllm serve` starting beside a deployment (a CI run lost the session's Serve port so). Ports below
    that range are never handed out that way; the range used (up to 12,000 ports
    below it, from 20,768 on Linux's default) stays above Ray's worker ports (10002-19999)."""
    import random

    high = _ephemeral_low() - 1
    low = max(1024, high - 12000)
    rng = random.Random()
    for _ in range(tries if high > low else 0):
        port = rng.randint(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
