"""Deploy a configuration onto Ray: resolve the device and pool sizes, check resources, start pools,
check the KV fabric, start the Serve app, and wait until it answers."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from cluster.config import ConfigError, DeployConfig, resolve_api_keys
from placement.packing import first_fit

logger = logging.getLogger(__name__)


def controller_name(cfg: DeployConfig) -> str:
    return f"{cfg.name}-controller"


def resolve_device(cfg: DeployConfig, nodes: list[dict[str, Any]]) -> DeployConfig:
    device = cfg.engine.device
    if device == "auto":
        device = "cuda" if any(n["gpus"] for n in nodes) else "cpu"
    engine = cfg.engine.model_copy(update={"device": device})
    return cfg.model_copy(update={"engine": engine})


def resolve_backends(cfg: DeployConfig, nodes: list[dict[str, Any]]) -> DeployConfig:
    """transfer.backends unset: take the NIXL backend from the nodes' saaf.io/nixl-backend label."""
    from kvtransfer.config import DEFAULT_BACKENDS, backends_from_labels

    if cfg.transfer.backends:
        return cfg
    try:
        found = backends_from_labels([n.get("labels") or {} for n in nodes])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    backends = found or list(DEFAULT_BACKENDS)
    logger.info("NIXL backends %s (%s)", backends, "from node labels" if found else "default")
    return cfg.model_copy(update={"transfer": cfg.transfer.model_copy(update={"backends": backends})})


def pool_sizes(cfg: DeployConfig) -> dict[str, int]:
    if cfg.pools == "auto":
        raise ConfigError("pools: auto must be resolved by the planner before starting pools")
    if cfg.mode == "colocated":
        return {"colocated": cfg.pools.colocated}
    return {"prefill": cfg.pools.prefill, "decode": cfg.pools.decode}


def check_cpu_memory(cfg: DeployConfig, sizes: dict[str, int], nodes: list[dict[str, Any]]) -> None:
    """CPU engines: each engine's KV cache (engine.kv_cache_mib, allocated at start) must fit one node's
    memory and all of them the cluster's (Ray's `memory` resource: what it schedules with). NOTE: without
    this, vLLM's EngineCore dies at start and the user reads "Engine core initialization failed"."""
    per = {role: cfg.pool_engines.apply(role, cfg.engine).kv_cache_mib or 256 for role in sizes}
    mib = max(per.values(), default=256)
    engines = sum(sizes.values())
    total = sum(per[r] * n for r, n in sizes.items())
    node_mib = [int(n.get("memory", 0)) >> 20 for n in nodes if n.get("memory")]
    if not node_mib:
        return
    if mib > max(node_mib) or total > sum(node_mib):
        raise ConfigError(
            f"engine.kv_cache_mib {mib} MiB per engine x {engines} engine(s) = {total} MiB of KV cache, "
            f"but the cluster's nodes have {', '.join(f'{m} MiB' for m in node_mib)} of memory for Ray; lower "
            "engine.kv_cache_mib or the pool sizes, or add memory")


def check_resources(cfg: DeployConfig, sizes: dict[str, int], nodes: list[dict[str, Any]]) -> None:
    """Fail before starting anything when the cluster cannot hold the pools."""
    if cfg.engine.device != "cuda":
        check_cpu_memory(cfg, sizes, nodes)
        return
    pools = cfg.pools if cfg.pools != "auto" else None
    per_role = {}
    for role in sizes:
        tp = (getattr(pools, f"{role}_tp", None) if pools else None) or cfg.engine.tensor_parallel_size
        pp = (getattr(pools, f"{role}_pp", None) if pools else None) or cfg.engine.pipeline_parallel_size
        per_role[role] = tp * pp
    need = sum(n * per_role[r] for r, n in sizes.items())
    have = sum(n["gpus"] for n in nodes)
    # NOTE: each engine's GPUs on one node (its placement group is STRICT_PACK)
    engines = [per_role[r] for r, n in sizes.items() for _ in range(n)]
    fits = first_fit(engines, sorted((n["gpus"] for n in nodes), reverse=True)) is not None
    if need > have or not fits:
        biggest = max(per_role.values())
        nodes_needed = -(-need // max(biggest, max((n["gpus"] for n in nodes), default=biggest)))
        shape = ", ".join(f"{n['gpus']}" for n in nodes) or "none"
        raise ConfigError(
            f"plan needs {need} GPUs in {nodes_needed} node(s) (engines of "
            f"{', '.join(f'{r} {g} GPU(s)' for r, g in per_role.items())}, each engine on one node); "
            f"cluster has {len(nodes)} node(s) with GPUs per node: {shape}. "
            "Lower the pool sizes or add nodes."
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


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def ask(endpoint: str, model: str, question: str, max_tokens: int = 48, timeout_s: float = 120,
        api_key: str | None = None) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{endpoint}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", **_auth(api_key)})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def _ingress_failure(app: str, pools: Any, e: BaseException) -> str:
    """What to tell the user when the ingress failed to deploy: the pools' own error if they failed too (an
    engine's failure is the root cause more often: the same model directory, the same node), else Serve's
    error with the last line of the replica's message (the Python exception it died of)."""
    import ray

    try:
        ray.get(pools, timeout=15)
    except ray.exceptions.RayTaskError as pe:
        return str(getattr(pe, "cause", None) or pe)
    except Exception:  # noqa: BLE001 - still starting: Serve's error is the news
        pass
    why = ""
    try:
        from ray import serve

        status = serve.status().applications.get(app)
        msgs = [d.message for d in (status.deployments.values() if status else ()) if d.message]
        lines = [ln.strip() for m in msgs for ln in m.splitlines() if ln.strip() and not ln.startswith(" ")]
        why = f": {lines[-1][:400]}" if lines else ""
    except Exception:  # noqa: BLE001 - Serve's status unavailable: its error alone
        pass
    return f"the ingress (Ray Serve app {app!r}) failed to start: {str(e).strip().splitlines()[-1][:300]}{why}"


def _run_ingress(run: Any, app: str, started: Any, timeout_s: float) -> None:
    """Deploy the Serve app (`run`, blocking until its replica is up) while watching the pools' start
    (`started`): an engine that fails ends the wait at once with its own error, not once the ingress replica
    is up (~30 s on a busy 2-core box, while the engines load).

    NOTE: `run` goes to a daemon thread: after a failure here the caller deletes the app, and a thread still
    waiting in Serve for it must not keep the process alive."""
    import ray

    errors: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            errors.append(e)

    runner = threading.Thread(target=target, name="serve-run", daemon=True)
    runner.start()
    deadline, watching = time.monotonic() + timeout_s, True
    while runner.is_alive():
        runner.join(0.25)
        if watching and runner.is_alive() and ray.wait([started], timeout=0)[0]:
            watching = False  # NOTE: the pools finished first: their error now, their result later
            try:
                ray.get(started, timeout=10)
            except ray.exceptions.RayTaskError as e:
                raise RuntimeError(str(getattr(e, "cause", None) or e)) from None
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ingress (Ray Serve app {app!r}) did not start within {timeout_s:.0f}s")
    if errors:
        raise RuntimeError(_ingress_failure(app, started, errors[0])) from None


def start(cfg: DeployConfig, *, ready_timeout_s: float = 600) -> dict[str, Any]:
    """Start pools and the Serve app on the connected Ray cluster. Returns a description.

    The engines, the KV fabric check and the Serve app start concurrently; the endpoint reports healthy
    only when both pools are up, and a failed fabric check tears everything down before serving."""
    import concurrent.futures as cf

    import ray

    from cluster.control.pools import PoolController
    from cluster.control.runtime import cluster_gpus
    from engine.models import resolve_model, served_name

    cfg, api_key = resolve_api_keys(cfg)  # NOTE: the replicas get digests only
    nodes = cluster_gpus()
    cfg = resolve_backends(resolve_device(cfg, nodes), nodes)
    sizes = pool_sizes(cfg)
    check_resources(cfg, sizes, nodes)
    t0 = time.monotonic()
    resolve_model(cfg.engine.model)  # NOTE: prepare once here, not racing in every worker
    name = controller_name(cfg)
    controller = ray.remote(PoolController).options(
        name=name, namespace=cfg.ray.namespace, lifetime="detached", num_cpus=0, max_restarts=0,
    ).remote(cfg.model_dump())
    started = controller.start.remote(sizes)
    # NOTE: imported once the engines are on their way (the CPU is the bottleneck at startup).
    from ray import serve

    from cluster.serve.app import Ingress

    endpoint = endpoint_url(cfg)
    timings: dict[str, float] = {}
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            fabric = None
            if cfg.mode == "disaggregated" and wants_fabric_check(cfg, nodes):
                fabric = pool.submit(_timed, timings, "fabric_check_s", fabric_check, cfg)
            if cfg.serve.direct and not cfg.serve.proxy_port:
                serve.start(proxy_location="Disabled")  # NOTE: the ingress replica is the HTTP server
            else:
                serve.start(http_options={"host": cfg.serve.host, "port": proxy_port(cfg)})
            _run_ingress(lambda: serve.run(Ingress.bind(cfg.model_dump(), name), name=cfg.name,
                                           route_prefix=cfg.serve.route_prefix, blocking=False),
                         cfg.name, started, ready_timeout_s)
            timings["serve_s"] = time.monotonic() - t0
            if fabric is not None:
                fabric.result(timeout=cfg.engine.startup_timeout_s)
        try:
            infos = ray.get(started, timeout=cfg.engine.startup_timeout_s + 30)
        except ray.exceptions.RayTaskError as e:  # NOTE: the controller's own message, not its traceback
            raise RuntimeError(str(getattr(e, "cause", None) or e)) from None
        timings["pools_s"] = time.monotonic() - t0
        wait_until_healthy(endpoint, ready_timeout_s, api_key)
    except BaseException:
        stop(cfg, drain_timeout_s=0)
        try:  # NOTE: its error fetched, so Ray does not print it as unhandled
            ray.get(started, timeout=10)
        except Exception:  # noqa: BLE001
            pass
        raise
    logger.info("startup phases (s since start): %s", {k: round(v, 1) for k, v in timings.items()})
    return {"endpoint": endpoint, "model": cfg.engine.served_model_name or served_name(cfg.engine.model),
            "workers": infos, "startup_s": time.monotonic() - t0, "config": cfg, "timings": timings,
            "api_key": api_key}


def proxy_port(cfg: DeployConfig) -> int:
    """Ray Serve's proxy port: the endpoint's own port, unless the ingress serves it directly (then the
    proxy runs only where serve.proxy_port asks for it). Only the first Serve start on a cluster sets it."""
    return cfg.serve.proxy_port if cfg.serve.direct and cfg.serve.proxy_port else cfg.serve.port


def endpoint_url(cfg: DeployConfig) -> str:
    return f"http://{cfg.serve.host}:{cfg.serve.port}{cfg.serve.route_prefix.rstrip('/')}"


def _timed(timings: dict[str, float], key: str, fn: Any, *args: Any) -> Any:
    t = time.monotonic()
    try:
        return fn(*args)
    finally:
        timings[key] = time.monotonic() - t


def wait_until_healthy(endpoint: str, timeout_s: float, api_key: str | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            req = urllib.request.Request(f"{endpoint}/health", headers=_auth(api_key))
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{endpoint}/health not ready within {timeout_s:.0f}s")
        time.sleep(0.25)


def wants_fabric_check(cfg: DeployConfig, nodes: list[dict[str, Any]]) -> bool:
    """`transfer.fabric_check`: true, false, or auto (default): only where engines can sit on different
    nodes. NOTE: on one node the check would only repeat what the first request's transfer shows (any
    failure is counted and, with the default policy, recomputed), at the price of two NIXL processes
    competing with the engines for the CPU at startup."""
    fc = cfg.transfer.fabric_check
    return fc is True or (fc == "auto" and len(nodes) > 1)


def fabric_check(cfg: DeployConfig) -> list[Any]:
    try:
        from kvtransfer.fabric import fabric_pairs_from_cluster, require_fabric, run_fabric_check
    except ImportError:
        logger.warning("kvtransfer.fabric not available; skipping the fabric check")
        return []
    from kvtransfer.config import backend_list, transfer_env

    memory = "VRAM" if cfg.engine.device == "cuda" else "DRAM"
    node_ip = ray_node_ip()
    env = {k: v for k, v in transfer_env(cfg.transfer, 0, cfg.engine.device, node_ip).items()
           if k.startswith("UCX_")}
    results = run_fabric_check(fabric_pairs_from_cluster(), nbytes=cfg.transfer.fabric_check_mib << 20,
                               memory=memory, backends=tuple(backend_list(cfg.transfer)), env=env)
    for r in results:
        logger.info("fabric %s -> %s: %s %.2f GB/s", r.prefill_node[:8], r.decode_node[:8],
                    "ok" if r.ok else f"FAILED ({r.error})", r.gbps or 0.0)
    require_fabric(results)
    return results


def ray_node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _kill_controller(controller: Any) -> None:
    import ray

    try:
        ray.get(controller.shutdown.remote(), timeout=60)
    except Exception:  # noqa: BLE001
        pass
    ray.kill(controller, no_restart=True)


def drain(cfg: DeployConfig, timeout_s: float | None = None) -> dict[str, Any] | None:
    """Graceful stop of the app's admission: new requests get 503 at once; in-flight ones get up to
    ``timeout_s`` (serve.drain_timeout_s) to finish, then end with an error event / 503 at their next token.
    Returns {"inflight", "drained_s", "aborted"}, or None when the app is not running."""
    from ray import serve

    timeout_s = cfg.serve.drain_timeout_s if timeout_s is None else timeout_s
    try:
        handle = serve.get_app_handle(cfg.name)
        inflight = handle.begin_drain.remote().result(timeout_s=10)
    except Exception as e:  # noqa: BLE001 - no app, or its replica is gone: nothing to drain
        logger.info("drain %s: %s", cfg.name, e)
        return None
    t0 = time.monotonic()
    if inflight:
        logger.warning("draining %d in-flight request(s), up to %.0fs", inflight, timeout_s)
    left = _wait_inflight(handle, t0 + timeout_s)
    aborted = left
    if left:
        logger.warning("%d request(s) still running after %.0fs; ending them with an error", left, timeout_s)
        handle.abort_inflight.remote().result(timeout_s=10)
        left = _wait_inflight(handle, time.monotonic() + 10)
    return {"inflight": inflight, "drained_s": round(time.monotonic() - t0, 2), "aborted": aborted,
            "left": left}


def drain_summary(d: dict[str, Any] | None) -> str:
    if d is None:
        return "no running app to drain"
    return (f"drained {d['inflight']} in-flight request(s) in {d['drained_s']:.1f}s"
            + (f"; {d['aborted']} still running at the deadline ended with an error" if d["aborted"] else ""))


def _wait_inflight(handle: Any, deadline: float) -> int:
    left = -1
    while True:
        try:
            left = handle.inflight_requests.remote().result(timeout_s=10)
        except Exception as e:  # noqa: BLE001 - the replica died: its requests died with it
            logger.warning("in-flight count unavailable: %s", e)
            return 0
        if left <= 0 or time.monotonic() > deadline:
            return max(left, 0)
        time.sleep(0.2)


def stop(cfg: DeployConfig, *, drain_timeout_s: float | None = None) -> dict[str, Any] | None:
    """Drain (see drain()), then remove the Serve app and every worker of the deployment; the Ray
    cluster stays up. Returns the drain summary."""
    import ray
    from ray import serve

    t0 = time.monotonic()
    drained = drain(cfg, drain_timeout_s)
    t1 = time.monotonic()
    try:
        serve.delete(cfg.name)
    except Exception as e:  # noqa: BLE001
        logger.warning("serve.delete(%s): %s", cfg.name, e)
    t2 = time.monotonic()
    try:
        controller = ray.get_actor(controller_name(cfg), namespace=cfg.ray.namespace)
    except ValueError:
        return drained
    _kill_controller(controller)
    logger.info("stop: drain %.1fs, Serve app deleted %.1fs, pools stopped %.1fs", t1 - t0, t2 - t1,
                time.monotonic() - t2)
    return drained


def pool_table(workers: list[dict[str, Any]]) -> str:
    rows = ["role       worker        engine id               node          side-channel  KV tokens"]
    for w in workers:
        rows.append(f"{w['role']:<10} {w['worker_id']:<13} {w['engine_id']:<23} {w['node_id'][:12]:<13} "
                    f"{str(w['side_channel_port']):<13} {w['kv_capacity_tokens']}")
    return "\n".join(rows)
