"""status / scale / shutdown of a running deployment (found by name through its PoolController)."""

from __future__ import annotations

import json
import sys
from typing import Any


def _connect(args) -> Any:
    import os

    import ray

    from cluster.control.runtime import check_reachable, join_auth, use_loopback

    use_loopback()  # NOTE: also what "auto" resolves 127.0.0.1 to (runtime.use_loopback)
    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    check_reachable(address)
    join_auth(address, allow_unauthenticated=True)  # NOTE: the embedded cluster's token is found by its address
    ray.init(address=address, namespace=args.namespace, logging_level="WARNING", log_to_driver=False)
    try:
        return ray.get_actor(f"{args.name}-controller", namespace=args.namespace)
    except ValueError:
        raise LookupError(f"no deployment '{args.name}' in namespace '{args.namespace}' on {address}; "
                          "check --name/--namespace/--address") from None


def run_subcommand(cmd: str, args) -> int:
    import ray

    try:
        ctl = _connect(args)
    except (LookupError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        if cmd == "status":
            return _status(ctl, args)
        if cmd == "scale":
            return _scale(ctl, args)
        return _shutdown(ctl)
    finally:
        ray.shutdown()


def _status(ctl, args) -> int:
    import ray

    from cluster.config import DeployConfig

    cfg = DeployConfig.model_validate(ray.get(ctl.config.remote(), timeout=30))
    rows = []
    _, members = ray.get(ctl.members.remote(), timeout=30)
    for w in ray.get(ctl.describe.remote(), timeout=30):
        handle = next((h for wid, _, h, _ in members if wid == w["worker_id"]), None)
        stats, healthy = None, False
        if handle is not None:
            try:
                stats = ray.get(handle.stats.remote(), timeout=10)._asdict()
                healthy = stats["healthy"]
            except Exception:  # noqa: BLE001 - reported as unhealthy
                pass
        info = w["info"] or {}
        rows.append({"worker_id": w["worker_id"], "role": w["role"], "state": w["state"], "healthy": healthy,
                     "node_id": info.get("node_id"), "pinned_node": w["pinned_node"],
                     "placement_group": w["placement_group"], "bundles": w["bundles"], "stats": stats})
    from cluster.control.lifecycle import endpoint_url

    endpoint = endpoint_url(cfg) + "/v1"
    planner = ray.get(ctl.planner_status.remote(), timeout=30)
    if args.json:
        print(json.dumps({"name": cfg.name, "mode": cfg.mode, "endpoint": endpoint, "workers": rows,
                          "planner": planner}, default=str))
        return 0
    print(f"deployment '{cfg.name}' ({cfg.mode}) endpoint {endpoint}")
    print("worker        role       state     healthy  node          waiting  running  kv_usage")
    for r in rows:
        s = r["stats"] or {}
        print(f"{r['worker_id']:<13} {r['role']:<10} {r['state']:<9} {str(r['healthy']):<8} "
              f"{(r['node_id'] or '-')[:12]:<13} {s.get('waiting', '-'):<8} {s.get('running', '-'):<8} "
              f"{s.get('kv_usage', '-')}")
    d = (planner or {}).get("decision")
    if d:
        print(f"planner loop ({planner['mode']}): saw {d['observed_rps']} req/s, forecast {d['forecast_rps']}; sets "
              f"prefill {d['target']['prefill']} decode {d['target']['decode']} (predicted attainment "
              f"{d['predicted_attainment']}); {d['reason']}")
    return 0


def _scale(ctl, args) -> int:
    import ray

    targets = {r: n for r, n in (("prefill", args.prefill), ("decode", args.decode),
                                  ("colocated", args.colocated)) if n is not None}
    if not targets:
        print("error: give at least one of --prefill N, --decode N, --colocated N", file=sys.stderr)
        return 2
    bad = {r: n for r, n in targets.items() if n < 1}
    if bad:
        print(f"error: pool sizes must be >= 1, got {bad}; use 'shutdown' to remove a deployment",
              file=sys.stderr)
        return 2
    for role, n in targets.items():
        res = ray.get(ctl.scale.remote(role, n, args.drain_timeout), timeout=args.drain_timeout + 600)
        print(f"{role}: now {n} (added {res['added'] or 'none'}, removed {res['removed'] or 'none'})")
    return 0


def _shutdown(ctl) -> int:
    import ray

    from cluster.config import DeployConfig
    from cluster.control.lifecycle import drain_summary, stop

    cfg = DeployConfig.model_validate(ray.get(ctl.config.remote(), timeout=30))
    print(drain_summary(stop(cfg)))
    print(f"deployment '{cfg.name}' removed; the Ray cluster stays up")
    return 0
