"""Fitting DistServe's latency form to measured engine samples (pure; used by the offline profiler and by
the live calibration of a deployment's workers).

    prefill_ms = prefill_a * tokens + prefill_b * sum(len^2) + prefill_c      (one prefill batch)
    decode_ms  = decode_a * context_tokens + decode_b * batch + decode_c       (one decode step)

Coefficients are non-negative (a small active-set least squares), R^2 reported per phase.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from placement.config import Coefficients


def nnls_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares with non-negative coefficients (small active-set loop); returns (coef, R^2)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    pred = x @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1e-12
    return coef, 1.0 - float(((y - pred) ** 2).sum()) / ss_tot


def fit_coefficients(prefill: Sequence[Sequence[float]], decode: Sequence[Sequence[float]]
                     ) -> tuple[Coefficients, float, float]:
    """`prefill` rows: (tokens, sum of squared lengths, ms); `decode` rows: (batch, context tokens, ms).
    Returns the coefficients and R^2 of each phase."""
    if len(prefill) < 3 or len(decode) < 3:
        raise ValueError(f"need >= 3 samples per phase to fit, got {len(prefill)} prefill and {len(decode)} decode")
    p = np.asarray(prefill, dtype=float)
    (pa, pb, pc), p_r2 = nnls_fit(np.column_stack([p[:, 0], p[:, 1], np.ones(len(p))]), p[:, 2])
    d = np.asarray(decode, dtype=float)
    (da, db, dc), d_r2 = nnls_fit(np.column_stack([d[:, 1], d[:, 0], np.ones(len(d))]), d[:, 2])
    return (Coefficients(prefill_a=float(pa), prefill_b=float(pb), prefill_c=float(pc), decode_a=float(da),
                         decode_b=float(db), decode_c=float(dc)), p_r2, d_r2)
