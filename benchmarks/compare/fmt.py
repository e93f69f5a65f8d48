"""Formatting of report cells: milliseconds, percentages, ratios, step keys, and Markdown tables."""

from __future__ import annotations

import math
from collections.abc import Sequence


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def fmt_dollars(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def fmt_ratio(v: float | None, baseline: str = "colocated") -> str:
    """``1.50x``; ``inf (<baseline> 0)`` when only the denominator was 0; ``n/a (both 0)``."""
    if v is None:
        return "n/a (both 0)"
    if math.isinf(v):
        return f"inf ({baseline} 0)"
    return f"{v:.2f}x"


def fmt_rel(v: float | None) -> str:
    return "-" if v is None else ("inf" if math.isinf(v) else f"{v:+.0%}")


def fmt_key(key: float | str | None) -> str:
    """A step key as a table cell: a rate as ``0.5``, anything else as it is."""
    if isinstance(key, int | float):
        return f"{key:g}"
    return "trace" if key is None else str(key)


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
