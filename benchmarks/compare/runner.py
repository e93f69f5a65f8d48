"""Running variants: one variant = deploy, wait ready, (affinity, quality, idle probe), replay the given
steps, write its plain benchmark report, tear down; several variants = one after another, keeping what
finished when one fails.

    opts = RunOptions(slo=SLO(2.0, 0.1), out_dir=Path("out"), say=print)
    budget = QuietBudget(wait_left=120, retries_left=2)
    steps = rate_steps(Traffic(ChatWorkload(256, 0.6, 64, 0.6), 20, None, seed=0), [0.5, 1.0])
    with embedded_ray("saaf-compare"):
        parts, failure = run_in_turn(variants, lambda v: run_variant(
            v.name, InProcessDeployment(v.config(base)), steps, opts, budget))
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from benchmarks.compare.affinity import check_affinity
from benchmarks.compare.deployment import Deployment
from benchmarks.compare.options import RunOptions
from benchmarks.compare.probe import idle_probe
from benchmarks.compare.quality_check import endpoint_outputs
from benchmarks.compare.quiet import QuietBudget
from benchmarks.compare.step import replay_steps
from benchmarks.compare.traffic import Step
from benchmarks.compare.variant import Variant

logger = logging.getLogger(__name__)


CALIBRATION_WAIT_S = 180.0


def final_calibration(endpoint: str, timeout_s: float) -> dict[str, Any] | None:
    """The goodput router's calibration from GET /v1/stats once it is final (measured on these engines, or
    the cache of an earlier measurement on this machine with this engine configuration: engine/calibrate.py
    machine_key); None if this router does not calibrate, the calibration failed or it did not finish."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            body = httpx.get(endpoint.rstrip("/") + "/v1/stats", timeout=5.0, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            body = {}
        cal = body.get("calibration")
        router = body.get("router") or {}
        if router.get("policy") != "goodput" or (cal and "error" in cal):
            return None
        if cal and cal.get("final"):
            return cal
        time.sleep(1.0)
    return None


def wait_calibrated(endpoint: str, timeout_s: float) -> float | None:
    """Seconds until the goodput router's calibration is final (final_calibration), so the steps measure the
    deployment as it serves from then on; None if this router does not calibrate (or it did not finish)."""
    t0 = time.monotonic()
    return None if final_calibration(endpoint, timeout_s) is None else round(time.monotonic() - t0, 1)


def run_variant(name: str, deployment: Deployment, steps: Sequence[Step], opts: RunOptions,
                budget: QuietBudget) -> dict[str, Any]:
    """Deploy, measure every step, stop. Returns the variant's part of the raw report: config,
    startup_s, workers, affinity, quality_outputs, idle_probe, steps (summaries), resources and records
    (by step key), discarded_attempts, benchmark_config, environment, left_after_stop, mode_s."""
    from benchmarks.report import write_report

    if not steps:
        raise ValueError(f"variant {name!r}: no steps to run; give at least one Step (e.g. rate_steps)")
    t0 = time.monotonic()
    opts.say(f"[{name}] deploying {deployment.config.get('pools')} ...")
    dep = deployment.start(opts.ready_timeout_s)
    part: dict[str, Any] = {"config": deployment.config, "startup_s": round(dep.startup_s, 1),
                            "workers": dep.workers}
    try:
        part.update(check_affinity(dep.engines, opts.reset_affinity))
        if part.get("affinity_reset_threads"):
            opts.say(f"[{name}] engine CPU affinity reset to all CPUs on {part['affinity_reset_threads']} "
                     "threads (see --engine-affinity)")
        opts.say(f"[{name}] ready in {dep.startup_s:.1f} s at {dep.endpoint} (model {dep.model!r})")
        if opts.quality:
            tq = time.monotonic()
            part["quality_outputs"] = endpoint_outputs(dep.endpoint, dep.model, opts.request_timeout_s,
                                                         opts.quality_prompts)
            part["quality_s"] = round(time.monotonic() - tq, 1)
            opts.say(f"[{name}] greedy eval set done in {part['quality_s']} s")
        if opts.extra is not None:
            tx = time.monotonic()
            part["extra"] = opts.extra(dep.endpoint, dep.model)
            opts.say(f"[{name}] {part['extra']} in {time.monotonic() - tx:.0f} s")
        settled = wait_calibrated(dep.endpoint, CALIBRATION_WAIT_S)
        if settled is not None:
            part["calibration_wait_s"] = settled
            opts.say(f"[{name}] router latency model calibrated on this machine {settled:.1f} s after ready")
        if opts.probe_requests:
            part["idle_probe"] = idle_probe(dep.endpoint, dep.model, opts.probe_requests, opts.request_timeout_s,
                                            input_len=opts.probe_input_len)
            opts.say(f"[{name}] idle probe: {part['idle_probe']['summary']}")
        engines = {pid: f"engine {wid}" for pid, wid in dep.engines.items()}
        done = replay_steps(dep.endpoint, dep.model, steps, engines, opts, budget, name)
        part["discarded_attempts"] = done.discarded
        assert done.result is not None  # NOTE: steps is not empty
        done.result.config["rates"] = [s.rate for s in steps]
        done.result.command = f"{opts.prog} (mode {name}; see ../report.md)"
        if opts.out_dir is not None:
            write_report(done.result, opts.out_dir / name)
        part.update(steps=done.summaries, resources=done.resources, endpoint=dep.endpoint, model=dep.model,
                    records=done.records, benchmark_config=done.result.config,
                    environment=done.result.environment)
    finally:
        opts.say(f"[{name}] stopping ...")
        part["left_after_stop"] = deployment.stop()
        if part["left_after_stop"]:
            logger.warning("%s: %d process(es) still running after stop", name, part["left_after_stop"])
        part["mode_s"] = round(time.monotonic() - t0, 1)
    return part


class InTurn(NamedTuple):
    parts: dict[str, dict[str, Any]]
    """Variant name -> ``run_variant``'s part, for every variant that finished."""
    failure: str | None
    """``Type: message`` of the error (or interrupt) that ended the run early; None if all ran."""


def run_in_turn(variants: Sequence[Variant], run_one: Callable[[Variant], dict[str, Any]]) -> InTurn:
    """``run_one`` for each variant in order; the first error or interrupt stops the run, and what
    finished before it is kept (a raw report can still be written)."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique, got {names}")
    parts: dict[str, dict[str, Any]] = {}
    try:
        for v in variants:
            parts[v.name] = run_one(v)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - reported; the raw file keeps what finished
        logger.exception("comparison failed")
        return InTurn(parts, f"{type(exc).__name__}: {exc}")
    return InTurn(parts, None)
