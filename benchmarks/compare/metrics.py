"""Flat numbers from benchmark summaries, ratios between variants, and the highest sustained rate.

Pure functions over ``RateSummary.to_dict()`` dicts, shared by every comparison of variants."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den; ``inf`` when only den is 0; None when both are 0 or either is missing."""
    if num is None or den is None:
        return None
    if den == 0:
        return None if num == 0 else math.inf
    return num / den


def metrics_of(summary: dict[str, Any]) -> dict[str, Any]:
    """The numbers a comparison shows, from a ``RateSummary.to_dict()``."""
    def lat(name: str, p: str) -> float | None:
        return (summary.get(name) or {}).get(p)

    cost = summary.get("cost") or {}  # NOTE: None unless the run was given a CostModel
    return {
        "rate": summary["rate"], "sent": summary["sent"], "succeeded": summary["succeeded"],
        "errors": sum(summary.get("errors", {}).values()) + summary.get("rejected_429", 0),
        "ttft_p50": lat("ttft", "p50"), "ttft_p90": lat("ttft", "p90"), "ttft_p99": lat("ttft", "p99"),
        "itl_p50": lat("itl", "p50"), "itl_p90": lat("itl", "p90"), "itl_p99": lat("itl", "p99"),
        "tpot_p50": lat("tpot", "p50"), "tpot_p90": lat("tpot", "p90"), "tpot_p99": lat("tpot", "p99"),
        "e2e_p50": lat("e2e", "p50"), "attainment": summary["attainment"], "slo_met": summary["slo_met"],
        "goodput_rps": summary["goodput_rps"], "goodput_tok_s": summary["goodput_tok_s"],
        "output_tok_s": summary["output_tok_s"], "duration_s": summary["duration_s"],
        "max_send_lag_s": summary["max_send_lag_s"],
        "dollars_per_m_input": cost.get("dollars_per_m_input"),
        "dollars_per_m_output": cost.get("dollars_per_m_output"),
    }


def slo_capacity(rates: Sequence[float], attainments: Sequence[float], target: float) -> float | None:
    """The highest rate up to which every tested rate (ascending) met ``target`` attainment; None if
    even the lowest missed it."""
    best = None
    for rate, att in sorted(zip(rates, attainments, strict=True)):
        if att + 1e-12 < target:
            break
        best = rate
    return best
