"""The ideal decode ceiling: every step reads all weights and the batch's KV once from HBM at peak
bandwidth (or does its FLOPs at peak, whichever is slower), with no overheads. Real engines land below."""

from __future__ import annotations

import logging
from typing import NamedTuple

from placement.catalog import GIB, HardwareArch, ModelArch

logger = logging.getLogger(__name__)


class RooflinePoint(NamedTuple):
    batch: int
    bytes_per_step: int
    tpot_s: float
    user_tok_s: float
    total_tok_s: float
    cost_per_m_usd: float
    bound: str  # "memory" | "compute"
    fits: bool  # weights + KV of the batch fit the group's HBM

    def as_dict(self) -> dict[str, object]:
        d = self._asdict()
        for k in ("tpot_s", "user_tok_s", "total_tok_s", "cost_per_m_usd"):
            d[k] = round(float(d[k]), 9)
        return d


def decode_roofline(model: ModelArch, hw: HardwareArch, *, gpus: int, weight_dtype: str, kv_dtype: str,
                    context: int, batches: list[int], gpu_hour_usd: float | None = None) -> list[RooflinePoint]:
    """One point per batch size: `batch` sequences of `context` tokens each, on `gpus` GPUs."""
    if gpus < 1 or context < 1 or any(b < 1 for b in batches):
        raise ValueError(f"gpus ({gpus}), context ({context}) and batches ({batches}) must be >= 1")
    price = hw.gpu_hour_usd if gpu_hour_usd is None else gpu_hour_usd
    weights = model.weight_bytes(weight_dtype)
    kvb = model.kv_bytes_per_token(kv_dtype)
    peak = hw.peak_flops(hw.compute_dtype(weight_dtype)) * gpus
    bw = hw.hbm_tbps * 1e12 * gpus
    out = []
    for b in batches:
        nbytes = weights + b * context * kvb
        flops = b * model.linear_flops_per_token() + model.decode_attention_flops(b * context)
        t_mem, t_comp = nbytes / bw, flops / peak
        tpot = max(t_mem, t_comp)
        total = b / tpot
        cost = gpus * price / (total * 3600) * 1e6
        fits = nbytes <= gpus * hw.hbm_gib * GIB
        out.append(RooflinePoint(b, int(nbytes), tpot, 1 / tpot, total, cost,
                                 "memory" if t_mem >= t_comp else "compute", fits))
    return out


def format_roofline(points: list[RooflinePoint], header: str) -> str:
    lines = [header, f"{'batch':>6} {'GB/step':>9} {'TPOT ms':>9} {'tok/s/user':>11} {'tok/s total':>12} "
                     f"{'$/M tok':>9}  bound   fits"]
    for p in points:
        lines.append(f"{p.batch:>6} {p.bytes_per_step / 1e9:>9.2f} {p.tpot_s * 1e3:>9.3f} {p.user_tok_s:>11.1f} "
                     f"{p.total_tok_s:>12.0f} {p.cost_per_m_usd:>9.4f}  {p.bound:<7} {'yes' if p.fits else 'NO'}")
    return "\n".join(lines)
