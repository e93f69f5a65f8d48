"""python -m cluster.deploy [CONFIG] [--address ADDR] [--plan-only] [--detach]
python -m cluster.deploy status|scale|shutdown [--name NAME] [--address ADDR] ...

Deploy: connects to the running Ray cluster (--address, $RAY_ADDRESS) or, with neither, starts an
embedded local one (loopback, CPU) and serves until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from cluster.config import ConfigError, load_config

DEMO_QUESTION = "What is the capital of France?"
SUBCOMMANDS = ("status", "scale", "shutdown")


def _deploy_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cluster.deploy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="deploy YAML (default: embedded CPU demo)")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else embedded local Ray)")
    p.add_argument("--plan-only", action="store_true", help="print the planned pools; touch no cluster")
    p.add_argument("--detach", action="store_true", help="exit after deploying (always so with --address)")
    p.add_argument("--no-demo", action="store_true", help="skip the demo question after start")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _sub_parser(cmd: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m cluster.deploy {cmd}")
    p.add_argument("--name", default="saaf", help="deployment name (deploy config 'name')")
    p.add_argument("--namespace", default="saaf-infer", help="Ray namespace (deploy config ray.namespace)")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else 'auto')")
    if cmd == "scale":
        p.add_argument("--prefill", type=int, help="target prefill workers")
        p.add_argument("--decode", type=int, help="target decode workers")
        p.add_argument("--colocated", type=int, help="target colocated workers")
        p.add_argument("--drain-timeout", type=float, default=120, help="seconds to drain a removed worker")
    p.add_argument("--json", action="store_true", help="machine-readable output (status)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        from cluster.control.manage import run_subcommand

        cmd = argv[0]
        return run_subcommand(cmd, _sub_parser(cmd).parse_args(argv[1:]))
    args = _deploy_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, check_paths=not args.plan_only)
        if args.plan_only:
            return _plan_only(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from cluster.control import supervise

    if not (args.address or cfg.ray.address or os.environ.get("RAY_ADDRESS")) and not supervise.is_child():
        return supervise.supervise(argv)  # NOTE: an embedded Ray: see cluster/control/supervise.py
    if supervise.is_child():
        supervise.become_child()
    return _deploy(cfg, args)


def _plan_only(cfg) -> int:
    if cfg.pools != "auto":
        sizes = {k: v for k, v in cfg.pools.model_dump().items() if v is not None}
        print(f"mode={cfg.mode}; pools from the config (no planner run): {sizes}")
        return 0
    from cluster.control.planning import plan_for

    plan, text = plan_for(cfg)
    print(text)
    return 0 if plan.feasible else 1


def _deploy(cfg, args) -> int:

    from cluster.control import lifecycle
    from cluster.control.runtime import connect

    address = args.address or cfg.ray.address
    try:
        embedded = connect(address, num_cpus=cfg.ray.num_cpus, object_store_mib=cfg.ray.object_store_mib,
                           namespace=cfg.ray.namespace, allow_unauthenticated=cfg.ray.allow_unauthenticated)
    except ConnectionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # NOTE: after ray.init, which installs its own SIGTERM handler in the driver. Once serving, the handler
    # only records the signal (threading.Event.set() inside a signal handler can deadlock on the Event's own
    # lock when the signal lands while the main thread waits on it); the serving loop below polls the record.
    # Before that, a signal aborts the start-up (KeyboardInterrupt) and everything started so far is stopped.
    stopped: list[int] = []
    serving = [False]

    def on_signal(signum: int, _frame) -> None:
        stopped.append(signum)
        if not serving[0] and len(stopped) == 1:
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        if cfg.pools == "auto":
            from cluster.control.planning import apply_plan

            cfg = apply_plan(cfg)
        where = "an embedded local Ray" if embedded else f"the Ray cluster at {address or 'RAY_ADDRESS'}"
        print(f"starting {cfg.mode} deployment '{cfg.name}' of {cfg.engine.model} on {where} ...", flush=True)
        info = lifecycle.start(cfg)
        print(lifecycle.pool_table(info["workers"]))
        print(f"ready in {info['startup_s']:.1f}s")
        if not args.no_demo:
            answer = lifecycle.ask(info["endpoint"], info["model"], DEMO_QUESTION, api_key=info["api_key"])
            print(f"Q: {DEMO_QUESTION}\nA: {answer.strip()}")
        print(f"OpenAI-compatible endpoint: {info['endpoint']}/v1  (model '{info['model']}')", flush=True)
        if args.detach or not embedded:
            return 0
        print("serving; press Ctrl-C to stop", flush=True)
        serving[0] = True
        while not stopped:
            time.sleep(0.2)  # NOTE: a signal interrupts the sleep; its handler has run by the next check
        print(f"shutting down: new requests get 503; in-flight ones get up to "
              f"{info['config'].serve.drain_timeout_s:.0f}s ...", flush=True)
        print(lifecycle.drain_summary(lifecycle.stop(info["config"])), flush=True)
        return 0
    except (ConfigError, TimeoutError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        if not embedded:
            lifecycle.stop(cfg, drain_timeout_s=0)
        return 1
    except KeyboardInterrupt:
        print(f"stopped during start-up ({signal.Signals(stopped[0]).name if stopped else 'SIGINT'}); "
              "stopping what was started ...", file=sys.stderr, flush=True)
        if not embedded:
            lifecycle.stop(cfg, drain_timeout_s=0)
        return 130
    finally:
        if embedded:
            shutdown_embedded()


def shutdown_embedded() -> None:
    """Stop the embedded Ray, then any process of ours that outlived it.

    NOTE: no serve.shutdown() first: the apps are deleted already, the whole cluster goes, and its
    controller's graceful shutdown only raced ray.kill and printed Ray errors."""
    import ray

    from cluster.control.runtime import forget_embedded
    from engine.procs import descendants, reap

    ours = descendants(os.getpid())
    t0 = time.monotonic()
    ray.shutdown()
    reap(ours, grace_s=10)
    forget_embedded()
    logging.getLogger(__name__).info("embedded Ray stopped in %.1fs", time.monotonic() - t0)


if __name__ == "__main__":
    raise SystemExit(main())
