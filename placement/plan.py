"""PlacementPlan: the planner's answer, its JSON form (the `--json` contract) and the human table."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)


class PoolShape(NamedTuple):
    instances: int
    tp: int
    pp: int

    @property
    def gpus(self) -> int:
        return self.instances * self.tp * self.pp

    def as_dict(self) -> dict[str, int]:
        return {"instances": self.instances, "tp": self.tp, "pp": self.pp}


class Colocated(NamedTuple):
    gpus: int
    instances: int
    tp: int
    goodput_rps: float
    goodput_per_gpu: float
    chunked_prefill: bool = False

    @property
    def engine(self) -> str:
        """Which colocated engine the baseline models."""
        if self.chunked_prefill:
            return "chunked prefill, today's vLLM: prompt chunks share each step's token budget with the decodes"
        return "no chunked prefill, the 2024 vLLM of DistServe's runs: a prefill batch stalls every running decode"


@dataclass
class PlacementPlan:
    """Pool sizes and predictions. Rates in req/s, latencies in s at `percentile`, costs in USD."""

    prefill: PoolShape
    decode: PoolShape
    algorithm: str
    rate_rps: float | None
    goodput_rps: float
    ttft_s: float
    tpot_s: float
    attainment: float
    percentile: str
    cost_per_m_input_usd: float
    cost_per_m_output_usd: float
    prefill_instance_goodput_rps: float
    decode_instance_goodput_rps: float
    node_packing: list[list[str]]
    colocated: Colocated | None
    feasible: bool = True
    colocated_alt: Colocated | None = None  # the other colocated engine (chunked prefill or not)
    notes: list[str] = field(default_factory=list)
    cluster_gpus: int = 0
    gpu_hour_usd: float = 0.0
    search_s: float = 0.0
    sweep: list[PlacementPlan] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.prefill.gpus + self.decode.gpus

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rps / self.gpus if self.gpus else 0.0

    @property
    def colocated_ratio(self) -> float | None:
        """Disaggregated over colocated goodput per GPU. NOTE: per GPU, not in total: the colocated
        engines rarely tile the plan's GPUs exactly (3 GPUs hold one TP2 engine and an idle GPU)."""
        return self.ratio_to(self.colocated)

    def ratio_to(self, c: Colocated | None) -> float | None:
        if c is None or c.goodput_per_gpu <= 0:
            return None
        return self.goodput_per_gpu / c.goodput_per_gpu

    def to_json_dict(self) -> dict[str, Any]:
        def num(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else round(float(x), 6)

        out: dict[str, Any] = {
            "feasible": self.feasible,
            "algorithm": self.algorithm,
            "rate_rps": num(self.rate_rps),
            "prefill": self.prefill.as_dict(),
            "decode": self.decode.as_dict(),
            "gpus": self.gpus,
            "cluster_gpus": self.cluster_gpus,
            "nodes_used": len(self.node_packing),
            "node_packing": self.node_packing,
            "goodput_rps": num(self.goodput_rps),
            "goodput_per_gpu": num(self.goodput_per_gpu),
            "prefill_instance_goodput_rps": num(self.prefill_instance_goodput_rps),
            "decode_instance_goodput_rps": num(self.decode_instance_goodput_rps),
            "percentile": self.percentile,
            "ttft_s": num(self.ttft_s),
            "tpot_s": num(self.tpot_s),
            "attainment": num(self.attainment),
            "gpu_hour_usd": num(self.gpu_hour_usd),
            "cost_per_m_input_usd": num(self.cost_per_m_input_usd),
            "cost_per_m_output_usd": num(self.cost_per_m_output_usd),
            "colocated": None,
            "colocated_ratio": num(self.colocated_ratio),
            "search_s": num(self.search_s),
            "notes": list(self.notes),
            "candidates": self.candidates,
        }
        def baseline(c: Colocated) -> dict[str, Any]:
            return {"gpus": c.gpus, "instances": c.instances, "tp": c.tp, "goodput_rps": num(c.goodput_rps),
                    "goodput_per_gpu": num(c.goodput_per_gpu), "chunked_prefill": c.chunked_prefill,
                    "engine": c.engine, "ratio": num(self.ratio_to(c))}

        if self.colocated is not None:
            out["colocated"] = baseline(self.colocated)
        out["colocated_baselines"] = [baseline(c) for c in (self.colocated, self.colocated_alt) if c is not None]
        if self.sweep:
            out["sweep"] = [{k: v for k, v in p.to_json_dict().items() if k not in ("node_packing", "sweep")}
                            for p in self.sweep]
        return out


def _fmt(x: float, unit: str = "", digits: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.{digits}g}{unit}"


def format_plan(plan: PlacementPlan) -> str:
    """A human-readable table of the plan (what `python -m placement plan` prints without --json)."""
    p, d = plan.prefill, plan.decode
    lines = []
    if not plan.feasible:
        lines.append("NO CONFIGURATION MEETS THE SLO; best attainable numbers below.")
    lines += [
        f"algorithm          {plan.algorithm}" + (f"   rate {plan.rate_rps:g} req/s" if plan.rate_rps else
                                                  "   rate: fill the cluster"),
        f"prefill pool       {p.instances} x (TP{p.tp} x PP{p.pp}) = {p.gpus} GPUs   "
        f"[{_fmt(plan.prefill_instance_goodput_rps)} req/s per instance]",
        f"decode pool        {d.instances} x (TP{d.tp} x PP{d.pp}) = {d.gpus} GPUs   "
        f"[{_fmt(plan.decode_instance_goodput_rps)} req/s per instance]",
        f"GPUs               {plan.gpus} of {plan.cluster_gpus} on {len(plan.node_packing)} node(s)",
        f"goodput            {_fmt(plan.goodput_rps)} req/s   ({_fmt(plan.goodput_per_gpu)} req/s per GPU)",
        f"TTFT {plan.percentile}           {_fmt(plan.ttft_s, ' s')}",
        f"TPOT {plan.percentile}           {_fmt(plan.tpot_s, ' s')}",
        f"SLO attainment     {_fmt(plan.attainment * 100, '%', 4)}",
        f"cost               ${_fmt(plan.cost_per_m_input_usd)} per M input tokens, "
        f"${_fmt(plan.cost_per_m_output_usd)} per M output tokens (at ${plan.gpu_hour_usd:g}/GPU-h)",
    ]
    for c in (plan.colocated, plan.colocated_alt):
        if c is None:
            continue
        ratio = plan.ratio_to(c)
        lines.append(f"colocated baseline {c.instances} x TP{c.tp} on {c.gpus} GPUs: {_fmt(c.goodput_rps)} req/s "
                     f"({_fmt(c.goodput_per_gpu)} per GPU); disaggregated/colocated per GPU = "
                     f"{_fmt(ratio, 'x') if ratio else 'inf (colocated meets no SLO)'}")
        lines.append(f"  ({c.engine})")
    packing = plan.node_packing
    shown = packing if len(packing) <= 8 else packing[:6]
    lines.append("node packing")
    for i, node in enumerate(shown):
        lines.append(f"  node {i:<3} {' '.join(node)}")
    if len(packing) > len(shown):
        lines.append(f"  ... {len(packing) - len(shown)} more node(s)")
    for s in plan.sweep:
        lines.append(f"sweep rate {s.rate_rps:g}: prefill {s.prefill.instances}xTP{s.prefill.tp}PP{s.prefill.pp}, "
                     f"decode {s.decode.instances}xTP{s.decode.tp}PP{s.decode.pp}, {s.gpus} GPUs, "
                     f"attainment {_fmt(s.attainment * 100, '%', 4)}")
    for role in ("prefill", "decode", "colocated"):
        ranked = sorted((c for c in plan.candidates if c["role"] == role), key=lambda c: -c["per_gpu"])[:3]
        if ranked:
            lines.append(f"top {role} configs (req/s per GPU): " + ", ".join(
                f"TP{c['tp']}xPP{c['pp']} {c['per_gpu']:.3g}" for c in ranked))
    for note in plan.notes:
        lines.append(f"note: {note}")
    lines.append(f"(search took {plan.search_s:.2f} s)")
    return "\n".join(lines)
