"""python -m cluster.deploy [CONFIG] [--address ADDR] [--plan-only] | status | scale | shutdown"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from cluster.config import ConfigError, load_config

DEMO_QUESTION = "What is the capital of France?"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cluster.deploy", description=__doc__)
    p.add_argument("config", nargs="?", help="deploy YAML (default: embedded CPU demo)")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else embedded local Ray)")
    p.add_argument("--plan-only", action="store_true", help="print the planned pools; touch no cluster")
    p.add_argument("--detach", action="store_true", help="exit after deploying (default when --address)")
    p.add_argument("--no-demo", action="store_true", help="skip the demo question after start")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plan_only:
        return _plan_only(cfg)
    return _deploy(cfg, args)


def _plan_only(cfg) -> int:
    if cfg.pools != "auto":
        print(f"pools (from config): {cfg.pools.model_dump()} mode={cfg.mode}")
        return 0
    from cluster.planning import plan_for

    plan, text = plan_for(cfg)
    print(text)
    return 0


def _deploy(cfg, args) -> int:
    import ray

    from cluster import deploy
    from cluster.runtime import connect

    address = args.address or cfg.ray.address
    embedded = connect(address, num_cpus=cfg.ray.num_cpus, object_store_mib=cfg.ray.object_store_mib,
                       namespace=cfg.ray.namespace)
    stop_event = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop_event.set())
    try:
        if cfg.pools == "auto":
            from cluster.planning import apply_plan

            cfg = apply_plan(cfg)
        print(f"starting {cfg.mode} deployment '{cfg.name}' of {cfg.engine.model} on "
              f"{'an embedded local Ray' if embedded else address} ...", flush=True)
        info = deploy.start(cfg)
        print(deploy.pool_table(info["workers"]))
        print(f"ready in {info['startup_s']:.1f}s")
        if not args.no_demo:
            answer = deploy.ask(info["endpoint"], info["model"], DEMO_QUESTION)
            print(f"Q: {DEMO_QUESTION}\nA: {answer.strip()}")
        print(f"OpenAI-compatible endpoint: {info['endpoint']}/v1  (model '{info['model']}')", flush=True)
        if args.detach or not embedded:
            return 0
        print("serving; press Ctrl-C to stop", flush=True)
        stop_event.wait()
        print("shutting down ...", flush=True)
        deploy.stop(info["config"])
        return 0
    except (ConfigError, TimeoutError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if embedded:
            from ray import serve

            try:
                serve.shutdown()
            finally:
                ray.shutdown()
