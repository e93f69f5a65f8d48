"""The router's latency model, fitted on the machine that serves.

Once an ingress replica serves, the PoolController asks one prefill (or colocated) worker and one decode
worker for calibration samples: first from their nodes' caches (~/.cache/saaf-infer/profiles, one file per
CPU model, model, dtype, threads and vLLM version), published at once if both have one; then measured on
their own engines (engine/calibrate.py), published again and cached. The controller fits DistServe's form
(placement.profile_fit); every ingress replica picks each version up with its membership refresh and swaps
its policy's latency model, whose online corrections (EWMA of observed/predicted) then start from a model
that fits the hardware. Until then the bundled profile serves, so readiness never waits for this.
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
    `prefill`. ``cached``: from the workers' caches only (None if either has none); else measured now."""
    # NOTE: one engine after the other: each is measured alone, as the latency model describes one engine
    # (what the engines do to each other on a shared box is left to the online corrections).
    p = await _samples(prefill, cached)
    d = p if decode is None or p is None else await _samples(decode, cached)
    if p is None or d is None:
        return None
    coeffs, p_r2, d_r2 = fit_coefficients(p[0].prefill, d[0].decode)
    source = p[1] if decode is None else f"prefill {p[1]}, decode {d[1]}"
    logger.info("router latency model calibrated (%s; %s): prefill R^2 %.3f, decode R^2 %.3f: %s", source, p[2],
                p_r2, d_r2, coeffs)
    return Calibration(coeffs, round(p_r2, 4), round(d_r2, 4), source, p[2], time.time())


async def calibrations(prefill: Any, decode: Any | None, publish: Any) -> None:
    """The cached model at once (if the nodes have one), then a fresh measurement on these engines: a cache
    written on a busier day, or before an upgrade of the box, never outlives one start."""
    early = await calibrate(prefill, decode, cached=True)
    if early is not None:
        publish(early)
    publish(await calibrate(prefill, decode))
