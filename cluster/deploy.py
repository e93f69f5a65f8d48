"""Deploy a configuration onto Ray: resolve the device and pool sizes, check resources, start pools,
check the KV fabric, start the Serve app, and wait until it answers."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

from cluster.config import ConfigError, DeployConfig

logger = logging.getLogger(__name__)


def controller_name(cfg: DeployConfig) -> str:
    return f"{cfg.name}-controller"


def resolve_device(cfg: DeployConfig, nodes: list[dict[str, Any]]) -> DeployConfig:
    device = cfg.engine.device
    if device == "auto":
        device = "cuda" if any(n["gpus"] for n in nodes) else "cpu"
    engine = cfg.engine.model_copy(update={"device": device})
    return cfg.model_copy(update={"engine": engine})


def pool_sizes(cfg: DeployConfig) -> dict[str, int]:
    if cfg.pools == "auto":
        raise ConfigError("pools: auto must be resolved by the planner before starting pools")
    if cfg.mode == "colocated":
        return {"colocated": cfg.pools.colocated}
    return {"prefill": cfg.pools.prefill, "decode": cfg.pools.decode}


def check_resources(cfg: DeployConfig, sizes: dict[str, int], nodes: list[dict[str, Any]]) -> None:
    """Fail before starting anything when the cluster cannot hold the pools."""
    if cfg.engine.device != "cuda":
        return
    per = cfg.engine.gpus_per_engine
    need = sum(sizes.values()) * per
    have = sum(n["gpus"] for n in nodes)
    fit = sum(n["gpus"] // per for n in nodes)
    if need > have or sum(sizes.values()) > fit:
        shape = ", ".join(f"{n['gpus']} GPUs" for n in nodes) or "no GPU nodes"
        raise ConfigError(
            f"plan needs {need} GPUs ({sum(sizes.values())} engines x {per} GPUs each, each engine on one "
            f"node); cluster has {len(nodes)} node(s) with {shape}. Lower the pool sizes or add nodes."
        )


def wait_http(url: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last: Exception | str = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = e
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready within {timeout_s:.0f}s: {last}")


def ask(endpoint: str, model: str, question: str, max_tokens: int = 48, timeout_s: float = 120) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{endpoint}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def start(cfg: DeployConfig, *, ready_timeout_s: float = 600) -> dict[str, Any]:
    """Start pools and the Serve app on the connected Ray cluster. Returns a description."""
    import ray
    from ray import serve

    from cluster.ingress import Ingress
    from cluster.pools import PoolController
    from cluster.runtime import cluster_gpus
    from engine.models import resolve_model, served_name

    nodes = cluster_gpus()
    cfg = resolve_device(cfg, nodes)
    sizes = pool_sizes(cfg)
    check_resources(cfg, sizes, nodes)
    t0 = time.monotonic()
    resolve_model(cfg.engine.model)  # NOTE: prepare once here, not racing in every worker
    if cfg.mode == "disaggregated" and cfg.transfer.fabric_check:
        fabric_check(cfg)
    name = controller_name(cfg)
    controller = ray.remote(PoolController).options(
        name=name, namespace=cfg.ray.namespace, lifetime="detached", num_cpus=0, max_restarts=0,
    ).remote(cfg.model_dump())
    try:
        infos = ray.get(controller.start.remote(sizes), timeout=cfg.engine.startup_timeout_s + 30)
    except Exception:
        _kill_controller(controller)
        raise
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    serve.run(Ingress.bind(cfg.model_dump(), name), name=cfg.name, route_prefix="/", blocking=False)
    endpoint = f"http://{cfg.serve.host}:{cfg.serve.port}"
    wait_until_healthy(endpoint, ready_timeout_s)
    return {"endpoint": endpoint, "model": cfg.engine.served_model_name or served_name(cfg.engine.model),
            "workers": infos, "startup_s": time.monotonic() - t0, "config": cfg}


def wait_until_healthy(endpoint: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{endpoint}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{endpoint}/health not ready within {timeout_s:.0f}s")
        time.sleep(0.25)


def fabric_check(cfg: DeployConfig) -> list[Any]:
    try:
        from kvtransfer.fabric import fabric_pairs_from_cluster, require_fabric, run_fabric_check
    except ImportError:
        logger.warning("kvtransfer.fabric not available; skipping the fabric check")
        return []
    memory = "VRAM" if cfg.engine.device == "cuda" else "DRAM"
    results = run_fabric_check(fabric_pairs_from_cluster(), nbytes=cfg.transfer.fabric_check_mib << 20,
                               memory=memory)
    require_fabric(results)
    return results


def _kill_controller(controller: Any) -> None:
    import ray

    try:
        ray.get(controller.shutdown.remote(), timeout=60)
    except Exception:  # noqa: BLE001
        pass
    ray.kill(controller, no_restart=True)


def stop(cfg: DeployConfig) -> None:
    """Remove the Serve app and every worker of the deployment; the Ray cluster stays up."""
    import ray
    from ray import serve

    try:
        serve.delete(cfg.name)
    except Exception as e:  # noqa: BLE001
        logger.warning("serve.delete(%s): %s", cfg.name, e)
    try:
        controller = ray.get_actor(controller_name(cfg), namespace=cfg.ray.namespace)
    except ValueError:
        return
    _kill_controller(controller)


def pool_table(workers: list[dict[str, Any]]) -> str:
    rows = ["role       worker        engine id               node          side-channel  KV tokens"]
    for w in workers:
        rows.append(f"{w['role']:<10} {w['worker_id']:<13} {w['engine_id']:<23} {w['node_id'][:12]:<13} "
                    f"{str(w['side_channel_port']):<13} {w['kv_capacity_tokens']}")
    return "\n".join(rows)


if __name__ == "__main__":
    from cluster.cli import main

    raise SystemExit(main())
