"""The router's latency model, fitted on the machine that serves.

Once an ingress replica serves and no request is in flight, the PoolController asks one prefill (or
colocated) worker and one decode worker for calibration samples: first from their nodes' caches
(~/.cache/saaf-infer/profiles, one file per CPU or GPU model, model files, engine settings, dtype, threads
and vLLM version), used as they are if both have one (a restart on the same machine measures nothing);
else measured on their own engines (engine/calibrate.py), published and cached. The controller fits
DistServe's form (placement.profile_fit); every ingress replica picks each version up with its membership
refresh and swaps its policy's latency model, whose online corrections (EWMA of observed/predicted) then
start from a model that fits the hardware. Until then the bundled profile serves, so readiness never waits
for this, and a request never waits for it either: a measurement's own requests do not count as load in
the workers' stats, and it gives way to the first serving request that reaches its engine.

A measurement that serving traffic or another process's load overlapped is too slow, and a model fitted on
it would refuse requests the engines can serve (a refused request teaches the online corrections nothing):
it is never published. The controller tries again (often at first, then every RETRY_EVERY_S, until one is
clean) and meanwhile keeps what serves (the bundled profile, corrected online).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NamedTuple

from placement.config import Coefficients
from placement.profile_fit import fit_coefficients

logger = logging.getLogger(__name__)
TIMEOUT_S = 300.0
# NOTE: a try on a busy box costs a worker one second of looking (engine/calibrate.py), so tries are frequent
# at first (the box is busy only while something else starts or a burst runs), then sparse.
RETRY_DELAYS_S = (10.0,) * 60  # after measurements that load overlapped (10 minutes), then every RETRY_EVERY_S
RETRY_EVERY_S = 120.0


class Calibration(NamedTuple):
    coefficients: Coefficients
    prefill_r2: float
    decode_r2: float
    source: str  # where the samples came from: "measured on <worker>" or "cache", per pool
    key: str
    at: float  # wall clock


async def _samples(handle: Any, cached: bool) -> tuple[Any, str, str] | None:
    return await asyncio.wait_for(handle.calibration_samples.remote(cached), timeout=TIMEOUT_S)


async def calibrate(prefill: Any, decode: Any | None, cached: bool = False) -> Calibration | None:
    """Prefill samples from `prefill`, decode samples from `decode`; `decode=None` (colocated): both from
    `prefill`. ``cached``: from the workers' caches only; else measured now. None: a cache missed, or load
    overlapped a measurement (logged)."""
    # NOTE: one engine after the other: each is measured alone, as the latency model describes one engine
    # (what the engines do to each other on a shared box is left to the online corrections).
    p = await _samples(prefill, cached)
    d = p if decode is None or p is None or not p[0].clean else await _samples(decode, cached)
    if p is None or d is None:
        return None
    for s, (samples, source, _) in (("prefill", p), ("decode", d)):
        if not samples.clean:
            logger.info("router latency model: %s samples %s overlapped traffic or other load (other processes "
                        "%.2f cores): unused", s, source, samples.foreign_cores)
            return None
    coeffs, p_r2, d_r2 = fit_coefficients(p[0].prefill, d[0].decode)
    source = p[1] if decode is None else f"prefill {p[1]}, decode {d[1]}"
    logger.info("router latency model calibrated (%s; %s): prefill R^2 %.3f, decode R^2 %.3f: %s", source, p[2],
                p_r2, d_r2, coeffs)
    return Calibration(coeffs, round(p_r2, 4), round(d_r2, 4), source, p[2], time.time())


async def calibrations(prefill: Any, decode: Any | None, publish: Any, delays_s: tuple[float, ...] = RETRY_DELAYS_S,
                       every_s: float = RETRY_EVERY_S, tries: int | None = None) -> Calibration | None:
    """The cached model if the nodes have one (the key covers the machine, the engine settings, the model
    files and vLLM's version, so what it fits is what serves); else a measurement on these engines. A
    measurement that load overlapped is tried again after each of `delays_s`, then every `every_s` (`tries`
    in all; None: until one is clean; a try on a busy worker costs it a second of looking, not a
    measurement). Returns what it published last."""
    early = await calibrate(prefill, decode, cached=True)
    if early is not None:
        publish(early)
        return early
    n = 0
    while tries is None or n < tries:
        cal = await calibrate(prefill, decode)
        if cal is not None:
            publish(cal)
            return cal
        n += 1
        wait = delays_s[n - 1] if n <= len(delays_s) else every_s
        if n in (1, len(delays_s) + 1):
            logger.warning("no clean calibration after %d tries (traffic or other load overlapped each); the router "
                           "keeps its %s latency model and online corrections; next try in %.0f s", n,
                           "bundled", wait)
        await asyncio.sleep(wait)
    return early
