"""Check `predict` against measured serving results: read the points, split them into a fit part and a
held-out part, fit each engine's efficiencies on the fit part (placement.fitting), predict every point
and report the error per engine and model.

Input: the CSV of NVIDIA aiconfigurator's silicon validation set (Apache-2.0; columns `backend`,
`model_path`, `system`, `gemm_quant_mode`, `mode`, `isl`, `osl`, `batch_size`, `tp_size`, `prefill_*`,
`decode_*`, `silicon_ttft_ms`, `silicon_tpot_ms`). A row the catalog cannot model (MoE models, int4
weights, pipeline parallelism, attention data parallelism) is counted under its skip reason.

Split: a row is held out when the SHA-256 of its *series* (engine, model, GPU, precision, mode, lengths,
parallel shape; every concurrency of one sweep together) falls in the last third, so a held-out point
never has a neighbour at another concurrency in the fit part.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from placement.config import LatencySpec
from placement.errors import PlacementError

logger = logging.getLogger(__name__)

# NOTE: dense models only; the catalog has no MoE arithmetic (expert routing, MLA, attention DP).
MODEL_NAMES = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "nvidia/Llama-3.1-8B-Instruct-FP8": "llama-3.1-8b",
    "meta-llama/Llama-3.1-70B": "llama-3.1-70b",
    "Qwen/Qwen3-32B": "qwen3-32b",
    "nvidia/Qwen3-32B-NVFP4": "qwen3-32b",
}
MODEL_LABELS = {"llama-3.1-8b": "Llama-3.1-8B", "llama-3.1-70b": "Llama-3.1-70B", "qwen3-32b": "Qwen3-32B"}
MOE_FAMILIES = {"DeepSeek": "DeepSeek-V3/R1 (MoE)", "Kimi": "Kimi-K2.5 (MoE)", "MiniMax": "MiniMax-M2.5 (MoE)",
                "gpt-oss": "gpt-oss-120b (MoE)", "Qwen3.5": "Qwen3.5-397B-A17B (MoE)",
                "Qwen3-235B": "Qwen3-235B-A22B (MoE)", "GLM": "GLM-5 (MoE)"}
SYSTEMS = {"h100_sxm": "h100-sxm", "h200_sxm": "h200", "b200_sxm": "b200", "b300_sxm": "b300", "gb200": "gb200",
           "gb300": "gb300"}
WEIGHT_DTYPES = {"": "bf16", "fp8": "fp8", "fp8_block": "fp8", "nvfp4": "fp4"}
HELD_OUT_BUCKETS = 3  # 1 in 3 series held out


class ServingPoint(NamedTuple):
    """One measured run: a deployment shape, a fixed-length closed-loop workload and its TTFT/TPOT."""

    id: str
    backend: str
    model: str
    hardware: str
    weight_dtype: str
    kv_dtype: str
    mode: str  # "colocated" | "disaggregated"
    isl: int
    osl: int
    concurrency: int
    tp: int
    prefill_instances: int
    prefill_tp: int
    decode_instances: int
    decode_tp: int
    ttft_ms: float
    tpot_ms: float

    @property
    def series(self) -> str:
        shape = (f"tp{self.tp}" if self.mode == "colocated" else
                 f"{self.prefill_instances}xtp{self.prefill_tp}/{self.decode_instances}xtp{self.decode_tp}")
        return "|".join([self.backend, self.model, self.hardware, self.weight_dtype, self.mode,
                         f"{self.isl}x{self.osl}", shape])

    @property
    def held_out(self) -> bool:
        return int(hashlib.sha256(self.series.encode()).hexdigest()[:8], 16) % HELD_OUT_BUCKETS == 0

    @property
    def group(self) -> str:
        """Calibration key: engine/hardware/precision."""
        return f"{self.backend}/{self.hardware}/{self.weight_dtype}"


def kv_dtype_for(backend: str, weight_dtype: str) -> str:
    """The KV cache dtype the engines pick with default flags: quantised (ModelOpt FP8/NVFP4) checkpoints
    declare an FP8 KV cache, which all three engines honour; bf16 checkpoints keep a bf16 cache."""
    return "fp8" if weight_dtype in ("fp8", "fp4") else "bf16"


def _int(row: dict[str, str], key: str, default: int = 0) -> int:
    v = row.get(key, "")
    return int(float(v)) if v not in ("", None) else default


def parse_row(row: dict[str, str]) -> ServingPoint | str:
    """The point of one CSV row, or the reason it cannot be modelled."""
    path = row["model_path"]
    model = MODEL_NAMES.get(path)
    if model is None:
        return next((f"{fam}: not modelled (no MoE in the catalog)" for k, fam in MOE_FAMILIES.items() if k in path),
                    f"{path}: not in the catalog")
    hw = SYSTEMS.get(row["system"])
    if hw is None:
        return f"system {row['system']}: not in the catalog"
    wd = WEIGHT_DTYPES.get(row["gemm_quant_mode"])
    if wd is None:
        return f"{row['gemm_quant_mode']} weights: no such dtype in the catalog"
    backend = row["backend"]
    ttft, tpot = float(row["silicon_ttft_ms"]), float(row["silicon_tpot_ms"])
    if not (ttft > 0 and tpot > 0 and math.isfinite(ttft) and math.isfinite(tpot)):
        return "no measured TTFT/TPOT"
    isl, osl = _int(row, "isl"), _int(row, "osl")
    base = dict(id=row["id"], backend=backend, model=model, hardware=hw, weight_dtype=wd,
                kv_dtype=kv_dtype_for(backend, wd), isl=isl, osl=osl, ttft_ms=ttft, tpot_ms=tpot)
    if row["mode"] == "agg":
        if _int(row, "pp_size", 1) != 1:
            return "pipeline parallelism: not validated"
        if _int(row, "attention_dp_size", 1) > 1:
            return "attention data parallelism: not modelled"
        return ServingPoint(mode="colocated", concurrency=_int(row, "batch_size"), tp=_int(row, "tp_size", 1),
                            prefill_instances=0, prefill_tp=0, decode_instances=0, decode_tp=0, **base)  # type: ignore[arg-type]
    if _int(row, "prefill_pp_size", 1) != 1 or _int(row, "decode_pp_size", 1) != 1:
        return "pipeline parallelism: not validated"
    if _int(row, "decode_attention_dp_size", 1) > 1 or _int(row, "prefill_attention_dp_size", 1) > 1:
        return "attention data parallelism: not modelled"
    dn = _int(row, "decode_num_workers", 1)
    conc = _int(row, "decode_batch_size") * dn
    return ServingPoint(mode="disaggregated", concurrency=conc, tp=0,
                        prefill_instances=_int(row, "prefill_num_workers", 1),
                        prefill_tp=_int(row, "prefill_tp_size", 1), decode_instances=dn,
                        decode_tp=_int(row, "decode_tp_size", 1), **base)  # type: ignore[arg-type]


def load_points(path: str | Path) -> tuple[list[ServingPoint], Counter[str]]:
    p = Path(path)
    if not p.is_file():
        raise PlacementError(f"measured results {str(p)!r} do not exist; give the CSV of measured serving points")
    points: list[ServingPoint] = []
    skipped: Counter[str] = Counter()
    with p.open(newline="") as fh:
        for row in csv.DictReader(fh):
            got = parse_row(row)
            if isinstance(got, str):
                skipped[got] += 1
            else:
                points.append(got)
    return points, skipped


class Prediction(NamedTuple):
    point: ServingPoint
    ttft_ms: float
    tpot_ms: float
    error: str = ""


def predict_point(p: ServingPoint, spec: LatencySpec, requests: int | None = None) -> Prediction:
    """`predict` for one point's shape with the given latency knobs: mean TTFT and TPOT over the steady
    state (the measured figures are one mean per run)."""
    from placement.predict import predict

    try:
        out = predict(model=p.model, hardware=p.hardware, weight_dtype=p.weight_dtype, kv_dtype=p.kv_dtype,
                      mode=p.mode, tp=p.tp or 1, prefill_instances=p.prefill_instances or 1,
                      prefill_tp=p.prefill_tp or 1, decode_instances=p.decode_instances or 1,
                      decode_tp=p.decode_tp or 1, isl=p.isl, osl=p.osl, concurrency=p.concurrency,
                      requests=requests, latency=spec, backend=p.backend)
    except PlacementError as exc:
        return Prediction(p, math.nan, math.nan, str(exc))
    return Prediction(p, out["ttft_s"]["mean"] * 1e3, out["tpot_s"]["mean"] * 1e3)


def ape(pred: float, meas: float) -> float:
    """Absolute percentage error."""
    return abs(pred - meas) / meas * 100.0


class ErrorRow(NamedTuple):
    backend: str
    label: str
    points: int
    ttft_mape: float
    tpot_mape: float
    failed: int


def error_table(preds: Iterable[Prediction], key: str = "model") -> list[ErrorRow]:
    """MAPE of TTFT and TPOT per (engine, model), per (engine, hardware/precision) or per engine (`key`
    "model", "hardware" or "engine": every model pooled) group."""
    groups: dict[tuple[str, str], list[Prediction]] = {}
    for pr in preds:
        p = pr.point
        label = {"model": MODEL_LABELS[p.model], "engine": "every model"}.get(key, f"{p.hardware} {p.weight_dtype}")
        if p.mode == "disaggregated":
            label += " (disagg)"
        groups.setdefault((p.backend, label), []).append(pr)
    rows = []
    for (backend, label), prs in sorted(groups.items()):
        ok = [pr for pr in prs if not pr.error]
        tt = [ape(pr.ttft_ms, pr.point.ttft_ms) for pr in ok]
        tp = [ape(pr.tpot_ms, pr.point.tpot_ms) for pr in ok]
        rows.append(ErrorRow(backend, label, len(prs), _mean(tt), _mean(tp), len(prs) - len(ok)))
    return rows


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan
