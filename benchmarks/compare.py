"""Colocated vs disaggregated serving on the same resources: one tool deploys each shape in turn,
replays the same traffic against both and writes one side-by-side report.

    python -m benchmarks.compare [--model smollm2] [--rates 0.25,0.5,1,2] [--num-requests N | --duration S]
        [--workload chat|longdoc] [--input-len L --output-len L] [--ttft-slo S --tpot-slo S] [--out DIR]

On CPU the default shapes are 2 colocated engines vs 1 prefill + 1 decode engine. For each mode the
tool starts an embedded local Ray once, deploys (``cluster.deploy.start``), runs the greedy quality
check on the committed eval set, runs one benchmark step per rate (same seed, so the same arrivals,
lengths and prompts in both modes), samples the workers' batch sizes and every process's CPU time
while it runs, and stops the deployment. Offline vLLM (the quality reference) runs first, in a child
process. The placement planner's prediction for each shape, from the measured CPU profile and on
exactly the requests that were sent, is printed next to the measurement.

Outputs under ``--out``: ``report.json`` (everything, summaries only), ``report.md``, ``compare.png``
(if matplotlib), ``raw.json`` (what was measured, written before any report logic; ``--from-raw``
rebuilds the report from it), and ``colocated/``, ``disaggregated/`` (the plain benchmark reports,
with every per-request record). Exit status: 0; 1 when greedy outputs differ between any two sources (a bug);
2 bad arguments; 3 a deployment or benchmark failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = REPO / "manifests" / "profiles" / "cpu-smollm2.yaml"
MODES = ("colocated", "disaggregated")
SHORT = {"colocated": "colo", "disaggregated": "disagg"}
QUALITY_SOURCES = ("disaggregated", "colocated", "offline")


# ---------------------------------------------------------------------------------------------------
# Pure logic: parsing, side-by-side rows, ratios, errors, tables (unit-tested, no Ray)
# ---------------------------------------------------------------------------------------------------

def parse_rates(values: Sequence[str]) -> list[float]:
    """``["0.25,0.5", "1"]`` -> ``[0.25, 0.5, 1.0]``; every rate must be a number > 0."""
    out: list[float] = []
    for item in (v.strip() for value in values for v in value.split(",")):
        if not item:
            continue
        try:
            rate = float(item)
        except ValueError:
            raise ValueError(f"--rates {item!r} is not a number; give requests/s, e.g. --rates 0.25,0.5,1") from None
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"--rates {item!r} must be a finite number > 0 requests/s")
        out.append(rate)
    if not out:
        raise ValueError("--rates is empty; give at least one rate in requests/s, e.g. --rates 0.25,0.5,1")
    return out


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den; ``inf`` when only den is 0; None when both are 0 or either is missing."""
    if num is None or den is None:
        return None
    if den == 0:
        return None if num == 0 else math.inf
    return num / den


def prediction_error(predicted: float | None, measured: float | None) -> dict[str, float | None]:
    """Absolute (predicted - measured) and relative ((predicted - measured) / measured) error."""
    if predicted is None or measured is None:
        return {"abs": None, "rel": None}
    return {"abs": predicted - measured, "rel": ratio(predicted - measured, measured) if measured else None}


def metrics_of(summary: dict[str, Any]) -> dict[str, Any]:
    """The numbers the comparison shows, from a ``RateSummary.to_dict()``."""
    def lat(name: str, p: str) -> float | None:
        return (summary.get(name) or {}).get(p)

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
    }


def side_by_side(colocated: Sequence[dict[str, Any]], disaggregated: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per rate (in colocated's order) from two lists of ``RateSummary`` dicts matched by rate.

    Each row: ``rate``, ``colocated`` and ``disaggregated`` (``metrics_of``), ``goodput_ratio``
    (disaggregated / colocated goodput), ``attainment_delta`` (disaggregated - colocated) and
    ``winner`` ("disaggregated", "colocated" or "tie" on goodput)."""
    by_rate = {d["rate"]: d for d in disaggregated}
    if len(by_rate) != len(disaggregated) or len({c["rate"] for c in colocated}) != len(colocated):
        raise ValueError("each rate must appear once per mode")
    if set(by_rate) != {c["rate"] for c in colocated}:
        raise ValueError(f"the modes ran different rates: colocated {[c['rate'] for c in colocated]}, "
                         f"disaggregated {[d['rate'] for d in disaggregated]}")
    rows = []
    for c in colocated:
        mc, md = metrics_of(c), metrics_of(by_rate[c["rate"]])
        gc, gd = mc["goodput_rps"], md["goodput_rps"]
        winner = "tie" if math.isclose(gc, gd, rel_tol=1e-9, abs_tol=1e-12) else (
            "disaggregated" if gd > gc else "colocated")
        rows.append({"rate": c["rate"], "colocated": mc, "disaggregated": md, "goodput_ratio": ratio(gd, gc),
                     "attainment_delta": md["attainment"] - mc["attainment"], "winner": winner})
    return rows


def slo_capacity(rates: Sequence[float], attainments: Sequence[float], target: float) -> float | None:
    """The highest rate up to which every tested rate (ascending) met ``target`` attainment; None if
    even the lowest missed it."""
    best = None
    for rate, att in sorted(zip(rates, attainments, strict=True)):
        if att + 1e-12 < target:
            break
        best = rate
    return best


def nearest_rank(values: Sequence[float], p: float) -> float | None:
    from benchmarks.stats import percentile

    return percentile(values, p) if values else None


def sim_summary(records: Sequence[Any], ttft_slo: float, tpot_slo: float) -> dict[str, Any]:
    """Predicted figures from simulator records (``placement.sim_result.RequestRecord``), with the
    benchmark's definitions: nearest-rank percentiles, attainment over all requests, goodput = met
    requests / (first arrival to last finish)."""
    done = [r for r in records if not r.rejected]
    ttfts = [r.ttft_s for r in done]
    tpots = [r.tpot_s for r in done]
    met = [r for r in done if r.ttft_s <= ttft_slo and r.tpot_s <= tpot_slo]
    span = (max(r.finish_s for r in done) - min(r.arrival_s for r in records)) if done else 0.0
    return {
        "requests": len(records), "rejected": len(records) - len(done),
        "ttft_p50": nearest_rank(ttfts, 50), "ttft_p90": nearest_rank(ttfts, 90), "ttft_p99": nearest_rank(ttfts, 99),
        "tpot_p50": nearest_rank(tpots, 50), "tpot_p90": nearest_rank(tpots, 90), "tpot_p99": nearest_rank(tpots, 99),
        "attainment": len(met) / len(records) if records else 0.0,
        "goodput_rps": len(met) / span if span > 0 else 0.0,
    }


PLANNER_KEYS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "attainment", "goodput_rps")


def planner_rows(predicted: dict[str, dict[float, dict[str, Any]]], measured: dict[str, dict[float, dict[str, Any]]]
                 ) -> list[dict[str, Any]]:
    """Per (rate, mode): predicted, measured and error of each of ``PLANNER_KEYS``.

    ``predicted[mode][rate]`` is a ``sim_summary``, ``measured[mode][rate]`` a ``metrics_of`` dict."""
    rows = []
    for mode in MODES:
        for rate in sorted(set(predicted.get(mode, {})) & set(measured.get(mode, {}))):
            p, m = predicted[mode][rate], measured[mode][rate]
            rows.append({"rate": rate, "mode": mode,
                         "predicted": {k: p.get(k) for k in PLANNER_KEYS},
                         "measured": {k: m.get(k) for k in PLANNER_KEYS},
                         "error": {k: prediction_error(p.get(k), m.get(k)) for k in PLANNER_KEYS}})
    return sorted(rows, key=lambda r: (r["rate"], MODES.index(r["mode"])))


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def fmt_ratio(v: float | None) -> str:
    if v is None:
        return "n/a (both 0)"
    if math.isinf(v):
        return "inf (colocated 0)"
    return f"{v:.2f}x"


def fmt_rel(v: float | None) -> str:
    return "-" if v is None else ("inf" if math.isinf(v) else f"{v:+.0%}")


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def goodput_table(rows: Sequence[dict[str, Any]], flagged: Sequence[float] = ()) -> str:
    """The headline table: attainment and goodput of both modes per rate, and the ratio; rates in
    ``flagged`` (foreign CPU load during a step) are marked with (!)."""
    body = []
    for r in rows:
        c, d = r["colocated"], r["disaggregated"]
        body.append([f"{r['rate']:g}" + (" (!)" if r["rate"] in flagged else ""), fmt_pct(c["attainment"]), fmt_pct(d["attainment"]),
                     f"{c['goodput_rps']:.3f}", f"{d['goodput_rps']:.3f}", fmt_ratio(r["goodput_ratio"]),
                     r["winner"]])
    return md_table(["rate req/s", "attain colo", "attain disagg", "goodput colo req/s", "goodput disagg req/s",
                     "ratio disagg/colo", "better"], body)


def latency_table(rows: Sequence[dict[str, Any]]) -> str:
    """TTFT and ITL p50/p90/p99, TPOT p50/p90 (ms) per rate and mode."""
    body = []
    for r in rows:
        for mode in MODES:
            m = r[mode]
            body.append([f"{r['rate']:g}", mode,
                         f"{fmt_ms(m['ttft_p50'])} / {fmt_ms(m['ttft_p90'])} / {fmt_ms(m['ttft_p99'])}",
                         f"{fmt_ms(m['itl_p50'])} / {fmt_ms(m['itl_p90'])} / {fmt_ms(m['itl_p99'])}",
                         f"{fmt_ms(m['tpot_p50'])} / {fmt_ms(m['tpot_p90'])}", fmt_ms(m["e2e_p50"]),
                         f"{m['succeeded']}/{m['sent']}", f"{m['output_tok_s']:.1f}", fmt_ms(m["max_send_lag_s"])])
    return md_table(["rate", "mode", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "TPOT p50/p90 ms", "e2e p50 ms",
                     "ok/sent", "out tok/s", "max send lag ms"], body)


def planner_table(rows: Sequence[dict[str, Any]]) -> str:
    """Predicted vs measured, with the relative error (attainment: the difference in points)."""
    body = []
    for r in rows:
        p, m, e = r["predicted"], r["measured"], r["error"]
        cells = [f"{r['rate']:g}", r["mode"]]
        for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"):
            cells.append(f"{fmt_ms(p[k])} vs {fmt_ms(m[k])} ({fmt_rel(e[k]['rel'])})")
        att = e["attainment"]["abs"]
        cells.append(f"{fmt_pct(p['attainment'])} vs {fmt_pct(m['attainment'])} "
                     f"({'-' if att is None else f'{att * 100:+.0f} pt'})")
        cells.append(f"{p['goodput_rps']:.3f} vs {m['goodput_rps']:.3f} ({fmt_rel(e['goodput_rps']['rel'])})")
        body.append(cells)
    return md_table(["rate", "mode", "TTFT p50 ms pred vs meas (err)", "TTFT p90", "TPOT p50", "TPOT p90",
                     "attainment", "goodput req/s"], body)


def quality_table(comparisons: Sequence[dict[str, Any]]) -> str:
    body = []
    for c in comparisons:
        diffs = [p for p in c["prompts"] if not p["match"]]
        first = ", ".join(f"{p['id']}@{p['unit']} {p['first_divergence']}" for p in diffs[:6]) or "-"
        if len(diffs) > 6:
            first += f", ... ({len(diffs)} in all)"
        body.append([f"{c['a']} vs {c['b']}", f"{c['exact_match_rate']:.0%} "
                     f"({sum(p['match'] for p in c['prompts'])}/{len(c['prompts'])})", first])
    return md_table(["comparison", "exact match", "first divergent token (prompt@index)"], body)


def parse_cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown"


def parse_mem_total_gib(meminfo: str) -> float | None:
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return None


def classify_process(cmdline: str, pid: int, self_pid: int) -> str:
    """Component name of one of our processes (workers are attributed separately, by PID tree)."""
    if pid == self_pid:
        return "driver + load client"
    if "ServeReplica" in cmdline or "ProxyActor" in cmdline or "ServeController" in cmdline:
        return "serve (ingress, proxy, controller)"
    if "PoolController" in cmdline:
        return "pool controller"
    return "ray system (gcs, raylet, agents, idle workers)"


def cpu_breakdown(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                  wall_s: float) -> dict[str, float]:
    """Cores used per component over ``wall_s``: sum of CPU-second deltas / wall. Processes that
    appear only in ``after`` count from 0 (started during the step)."""
    used: dict[str, float] = {}
    for pid, (group, cpu) in after.items():
        prev = before.get(pid)
        delta = cpu - (prev[1] if prev and prev[0] == group else 0.0)
        used[group] = used.get(group, 0.0) + max(0.0, delta)
    return {g: round(v / wall_s, 3) for g, v in sorted(used.items())} if wall_s > 0 else {}


def worker_load(samples: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per worker from ``/v1/stats`` samples: mean/max running batch over samples where it was busy,
    busy fraction of samples, mean waiting, median recent step time."""
    by: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        for w in s.get("workers", []):
            by.setdefault(w["worker_id"], []).append(w)
    out = {}
    for wid, ws in sorted(by.items()):
        busy = [w for w in ws if w.get("running", 0) > 0]
        steps = sorted(t for w in busy for t in w.get("recent_step_times_s", []) or [])
        out[wid] = {
            "role": ws[0].get("role"), "samples": len(ws), "busy_fraction": len(busy) / len(ws),
            "mean_running_when_busy": (sum(w["running"] for w in busy) / len(busy)) if busy else 0.0,
            "max_running": max((w.get("running", 0) for w in ws), default=0),
            "mean_waiting": sum(w.get("waiting", 0) for w in ws) / len(ws),
            "median_step_s": steps[len(steps) // 2] if steps else None,
            "mean_kv_usage": sum(w.get("kv_usage", 0.0) for w in ws) / len(ws),
            "max_kv_usage": max((w.get("kv_usage", 0.0) for w in ws), default=0.0),
        }
    return out


FOREIGN_LIMIT = 0.25  # default --foreign-limit: cores of other processes' CPU during a step above which the step is flagged


def foreign_load(resources: dict[str, dict[float, dict[str, Any]]], limit: float) -> dict[str, Any]:
    """Steps during which processes that are not ours used more than ``limit`` cores (shared box)."""
    flagged = sorted({rate for m in resources for rate, res in resources[m].items()
                      if (res.get("machine_other_cores") or 0.0) > limit})
    worst = {f"{m} {rate:g}": res.get("machine_other_cores") for m in MODES for rate, res in
             sorted(resources.get(m, {}).items()) if (res.get("machine_other_cores") or 0.0) > limit}
    return {"limit_cores": limit, "rates": flagged, "steps": worst}


def json_safe(obj: Any) -> Any:
    """inf/nan -> strings so report.json stays valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def findings(rows: Sequence[dict[str, Any]], resources: dict[str, dict[float, dict[str, Any]]],
             slo: dict[str, float], target: float) -> list[str]:
    """Plain statements computed from the measurements: where each mode won, where colocated
    missed the SLO and disaggregated did not, and the mechanisms (batch per engine, CPU per role)."""
    out = []
    rates = [r["rate"] for r in rows]
    caps = {m: slo_capacity(rates, [r[m]["attainment"] for r in rows], target) for m in MODES}
    out.append("highest rate with every tested rate up to it at >= "
               f"{target:.0%} attainment: colocated {caps['colocated'] if caps['colocated'] is not None else 'none'}"
               f" req/s, disaggregated {caps['disaggregated'] if caps['disaggregated'] is not None else 'none'} req/s")
    wins = [r for r in rows if r["winner"] == "disaggregated"]
    losses = [r for r in rows if r["winner"] == "colocated"]
    def listing(rs: Sequence[dict[str, Any]]) -> str:
        return ", ".join(f"{r['rate']:g}" for r in rs) or "none"

    out.append(f"goodput: disaggregated higher at {len(wins)} of {len(rows)} rates ({listing(wins)}), "
               f"colocated higher at {len(losses)} ({listing(losses)})")
    for r in rows:
        c, d = r["colocated"], r["disaggregated"]
        parts = [f"rate {r['rate']:g}: goodput ratio {fmt_ratio(r['goodput_ratio'])}; "
                 f"TTFT p90 {fmt_ms(c['ttft_p90'])} -> {fmt_ms(d['ttft_p90'])} ms, "
                 f"TPOT p90 {fmt_ms(c['tpot_p90'])} -> {fmt_ms(d['tpot_p90'])} ms, "
                 f"ITL p99 {fmt_ms(c['itl_p99'])} -> {fmt_ms(d['itl_p99'])} ms (colocated -> disaggregated)"]
        if c["tpot_p90"] is not None and c["tpot_p90"] > slo["tpot_s"] and (
                d["tpot_p90"] is not None and d["tpot_p90"] <= slo["tpot_s"]):
            parts.append(f"colocated misses the {slo['tpot_s'] * 1000:g} ms TPOT target at p90, disaggregated meets it")
        if c["ttft_p90"] is not None and d["ttft_p90"] is not None and d["ttft_p90"] > slo["ttft_s"] >= c["ttft_p90"]:
            parts.append(f"disaggregated misses the {slo['ttft_s']:g} s TTFT target at p90, colocated meets it")
        for mode in MODES:
            res = resources.get(mode, {}).get(r["rate"])
            if not res:
                continue
            loads = res.get("workers", {})
            batch = ", ".join(f"{w} {v['mean_running_when_busy']:.1f} (busy {v['busy_fraction']:.0%})"
                              for w, v in loads.items())
            cores = res.get("cpu_cores", {})
            eng = sum(v for k, v in cores.items() if k.startswith("engine "))
            other = res.get("machine_other_cores")
            parts.append(f"{SHORT[mode]}: mean running batch when busy {batch or '-'}; cores: engines {eng:.2f} ("
                         + ", ".join(f"{k[7:]} {v:.2f}" for k, v in cores.items() if k.startswith("engine "))
                         + f"), rest of ours {sum(cores.values()) - eng:.2f}"
                         + ("" if other is None else f", not ours {other:.2f}"))
        out.append("; ".join(parts))
    return out


# ---------------------------------------------------------------------------------------------------
# Environment facts
# ---------------------------------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""

    mem = parse_mem_total_gib(read("/proc/meminfo"))
    return {"nproc": os.cpu_count(), "memory_gib": None if mem is None else round(mem, 1),
            "cpu_model": parse_cpu_model(read("/proc/cpuinfo")), "loadavg": read("/proc/loadavg").split()[:3],
            "platform": sys.platform}


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                                  check=False).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    status = git("status", "--porcelain")
    return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(status),
            "dirty_files": len(status.splitlines())}


# ---------------------------------------------------------------------------------------------------
# Process CPU accounting and worker sampling
# ---------------------------------------------------------------------------------------------------

_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_table() -> dict[int, tuple[int, float, str]]:
    """pid -> (ppid, cpu seconds, cmdline) of every readable process."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except (OSError, IndexError):
            continue
        out[int(d.name)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / _TCK, cmd)
    return out


def _machine_busy_s() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    v = [int(x) for x in fields]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / _TCK


def cpu_snapshot(workers: dict[int, str]) -> tuple[dict[int, tuple[str, float]], float]:
    """({pid: (component, cpu seconds)} of this process and its descendants, machine busy seconds).

    ``workers`` maps a worker actor's PID to its component name; its descendants (vLLM's EngineCore)
    count toward it."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    me = os.getpid()
    owner: dict[int, str] = {}
    for wpid, name in workers.items():
        todo = [wpid]
        while todo:
            p = todo.pop()
            owner[p] = name
            todo.extend(children.get(p, []))
    out: dict[int, tuple[str, float]] = {}
    todo = [me]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        if p in table:
            out[p] = (owner.get(p) or classify_process(table[p][2], p, me), table[p][1])
    return out, _machine_busy_s()


class StatsSampler:
    """Polls ``GET /v1/stats`` every ``interval_s`` in a thread (bounded: each call times out)."""

    def __init__(self, endpoint: str, interval_s: float = 1.0) -> None:
        self.url = endpoint.rstrip("/") + "/v1/stats"
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self.last: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stats-sampler", daemon=True)

    def _loop(self) -> None:
        with httpx.Client(timeout=3.0, trust_env=False) as client:
            while not self._stop.is_set():
                try:
                    body = client.get(self.url).json()
                    self.samples.append({"t": time.monotonic(), "workers": body.get("workers", [])})
                    self.last = body
                except (httpx.HTTPError, ValueError) as exc:
                    logger.debug("stats sample failed: %s", exc)
                self._stop.wait(self.interval_s)

    def __enter__(self) -> StatsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def transfers(self) -> list[dict[str, Any]]:
        try:
            return httpx.get(self.url, timeout=5.0, trust_env=False).json().get("transfers", [])
        except (httpx.HTTPError, ValueError):
            return []


def transfer_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if not records:
        return {"count": 0}
    waits = [r["transfer_wait_s"] for r in records]
    hand = [r["handoff_latency_s"] for r in records]
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r.get("outcome", "?")] = outcomes.get(r.get("outcome", "?"), 0) + 1
    return {"count": len(records), "outcomes": outcomes, "transfer_wait_p50_s": nearest_rank(waits, 50),
            "transfer_wait_p90_s": nearest_rank(waits, 90), "handoff_p50_s": nearest_rank(hand, 50),
            "kv_bytes_mean": sum(r["kv_bytes"] for r in records) / len(records),
            "decode_computed_prompt_tokens_max": max(r.get("decode_computed_prompt_tokens", 0) for r in records)}


def process_affinity(workers: dict[int, str]) -> dict[str, list[dict[str, Any]]]:
    """CPUs each engine's processes (the Ray actor and its EngineCore child) may run on."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[str, list[dict[str, Any]]] = {}
    for wpid, name in workers.items():
        todo, procs = [wpid], []
        while todo:
            p = todo.pop()
            todo.extend(children.get(p, []))
            try:
                cpus = sorted(os.sched_getaffinity(p))
            except OSError:
                continue
            procs.append({"pid": p, "cmd": table.get(p, (0, 0, ""))[2][:60].strip(), "cpus": cpus})
        out[name] = procs
    return out


def reset_affinity(pids: Sequence[int], cpus: set[int]) -> int:
    """Allow every thread of ``pids`` and their descendants to run on ``cpus``; returns threads changed.
    (EngineHost already does this at start; kept so runs against older deployments compare like for like.)"""
    from engine.procs import reset_affinity as reset_one

    return sum(reset_one(p, cpus) for p in pids)


def idle_probe(endpoint: str, model: str, n: int, timeout_s: float, input_len: int = 512,
               output_len: int = 32) -> dict[str, Any]:
    """``n`` sequential requests of ``input_len`` tokens (fresh random prompts) on the idle deployment:
    the no-load TTFT and TPOT of this shape."""
    import asyncio

    import numpy as np

    from benchmarks.client import RequestRecord, endpoint_url, make_client, request_body, send_request
    from benchmarks.stats import tpot as tpot_of
    from benchmarks.workload import make_prompt

    async def go() -> list[RequestRecord]:
        rng = np.random.default_rng(987654)
        url = endpoint_url(endpoint, "completions")
        recs = []
        async with make_client(timeout_s) as client:
            for i in range(n):
                rec = RequestRecord(index=i, input_len=input_len, output_len=output_len, scheduled_s=0.0)
                body = request_body(model, make_prompt(input_len, rng), output_len, "completions", True)
                recs.append(await send_request(client, url, body, "completions", rec, timeout_s, time.perf_counter()))
        return recs

    recs = asyncio.run(go())
    ok = [r for r in recs if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [t for t in (tpot_of(r) for r in ok) if t is not None]
    summary = {"requests": n, "ok": len(ok), "input_tokens": input_len, "output_tokens": output_len,
               "ttft_p50_s": nearest_rank(ttfts, 50), "tpot_p50_s": nearest_rank(tpots, 50),
               "ttft_s": [round(t, 3) for t in ttfts], "tpot_s": [round(t, 4) for t in tpots]}
    return {"summary": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()
                        if k in ("ok", "ttft_p50_s", "tpot_p50_s")}, **summary}


SERVER_HISTOGRAMS = {"saaf_ttft_seconds": "ttft", "saaf_prefill_seconds": "prefill",
                     "saaf_kv_transfer_seconds": "kv_transfer", "saaf_queue_wait_seconds": "queue_wait"}


def parse_metrics(text: str) -> dict[str, float]:
    """``{name_sum: v, name_count: v}`` of the unlabelled histograms in ``SERVER_HISTOGRAMS``."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        base = name.rsplit("_", 1)[0]
        if base in SERVER_HISTOGRAMS and name.endswith(("_sum", "_count")):
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def metric_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Server-side mean of each histogram over the interval between two scrapes."""
    out: dict[str, float | None] = {}
    for base, short in SERVER_HISTOGRAMS.items():
        n = after.get(f"{base}_count", 0.0) - before.get(f"{base}_count", 0.0)
        total = after.get(f"{base}_sum", 0.0) - before.get(f"{base}_sum", 0.0)
        out[short] = total / n if n > 0 else None
    return out


def scrape_metrics(endpoint: str) -> dict[str, float]:
    try:
        return parse_metrics(httpx.get(endpoint.rstrip("/") + "/metrics", timeout=5.0, trust_env=False).text)
    except httpx.HTTPError:
        return {}


def slo_sweep(records: dict[str, dict[float, list[dict[str, Any]]]], durations: dict[str, dict[float, float]],
              ttft_s: float, tpot_targets: Sequence[float]) -> list[dict[str, Any]]:
    """Attainment and goodput of every (rate, mode) re-judged at each TPOT target (TTFT target fixed),
    from the stored per-request records (``RequestRecord`` dicts)."""
    from benchmarks.client import RequestRecord
    from benchmarks.stats import SLO, meets_slo

    out = []
    rates = sorted(set.intersection(*(set(records[m]) for m in MODES)))
    for tpot in tpot_targets:
        slo = SLO(ttft_s, tpot)
        for rate in rates:
            row: dict[str, Any] = {"tpot_s": tpot, "rate": rate}
            for mode in MODES:
                recs = [RequestRecord(**r) for r in records[mode][rate]]
                met = sum(meets_slo(r, slo) for r in recs)
                row[mode] = {"attainment": met / len(recs) if recs else 0.0,
                             "goodput_rps": met / durations[mode][rate]}
            row["goodput_ratio"] = ratio(row["disaggregated"]["goodput_rps"], row["colocated"]["goodput_rps"])
            out.append(row)
    return out


def sweep_table(rows: Sequence[dict[str, Any]]) -> str:
    rates = sorted({r["rate"] for r in rows})
    tpots = sorted({r["tpot_s"] for r in rows})
    by = {(r["tpot_s"], r["rate"]): r for r in rows}
    body = []
    for t in tpots:
        cells = [f"{t * 1000:g}"]
        for rate in rates:
            r = by.get((t, rate))
            cells.append("-" if r is None else f"{fmt_pct(r['colocated']['attainment'])} / "
                         f"{fmt_pct(r['disaggregated']['attainment'])} ({fmt_ratio(r['goodput_ratio'])})")
        body.append(cells)
    return md_table(["TPOT target ms", *(f"rate {r:g}: attain colo / disagg (goodput ratio)" for r in rates)], body)


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="smollm2", help="engine.model: smollm2, tiny-llama or a local HF dir")
    a("--rates", nargs="+", default=["0.25,0.5,1,2"], help="requests/s, e.g. 0.25,0.5,1,2")
    a("--num-requests", type=int, help="requests per rate step (upper bound)")
    a("--duration", type=float, help="seconds of arrivals per rate step (upper bound)")
    a("--workload", default="chat", choices=("chat", "longdoc"))
    a("--input-len", type=int, help="chat: median input tokens (256); longdoc: input tokens (1536)")
    a("--output-len", type=int, help="chat: median output tokens (64); longdoc: output tokens (32)")
    a("--sigma", type=float, default=0.6, help="chat: lognormal sigma of both lengths")
    a("--ttft-slo", type=float, default=2.0, help="TTFT target, seconds")
    a("--tpot-slo", type=float, default=0.1, help="TPOT target, seconds per output token")
    a("--attainment-target", type=float, default=0.9, help="attainment a rate must reach to count as sustained")
    a("--tpot-sweep", default="0.06,0.07,0.08,0.09,0.1,0.125,0.15",
      help="TPOT targets (s) to re-judge the same records at (TTFT target fixed), for the SLO-sweep table")
    a("--colocated", type=int, default=2, help="colocated engines")
    a("--prefill", type=int, default=1, help="prefill engines (disaggregated)")
    a("--decode", type=int, default=1, help="decode engines (disaggregated)")
    a("--max-model-len", type=int, default=2048)
    a("--kv-cache-mib", type=int, default=256, help="KV cache per engine (the profile was measured at 256)")
    a("--prefix-caching", action="store_true",
      help="keep vLLM's prefix caching on (off by default: every rate step replays the same prompts, which "
           "would turn later steps' prefills into cache hits)")
    a("--engine-affinity", default="all", choices=("all", "keep"),
      help="all: let every engine thread use every CPU after deploy (undoes vLLM's NIXL connector pinning "
           "P/D engines to one core on CPU, should the engine not have done it itself); keep: measure the "
           "deployment exactly as it starts")
    a("--foreign-limit", type=float, default=0.25,
      help="cores other processes may use during a step before it counts as disturbed (shared machines)")
    a("--quiet-wait", type=float, default=120.0,
      help="seconds in all the run may wait, before steps, for other processes to drop under --foreign-limit")
    a("--retries", type=int, default=2, help="disturbed steps the run may repeat in all (the cleanest attempt is kept)")
    a("--probe-requests", type=int, default=3, help="sequential requests on the idle deployment before the sweep")
    a("--policy", default="least_loaded", choices=("least_loaded", "round_robin", "goodput"), help="router policy")
    a("--port", type=int, help="Serve HTTP port for both modes (default: a free port)")
    a("--modes", default="colocated,disaggregated", help="modes to run, in order")
    a("--profile", default=str(DEFAULT_PROFILE), help="measured profile for the planner check")
    a("--seed", type=int, default=0)
    a("--request-timeout", type=float, default=120.0, help="seconds per request")
    a("--no-quality", action="store_true", help="skip the greedy-output comparison")
    a("--no-offline", action="store_true", help="quality: skip offline vLLM (endpoints only)")
    a("--offline-timeout", type=float, default=420.0, help="seconds for the offline vLLM quality run")
    a("--out", help="directory for report.json, report.md, compare.png and the per-mode reports")
    a("--no-progress", action="store_true")
    a("--from-raw", metavar="RAW_JSON", help="rebuild report.md/json/png from a run's raw.json (no deployment)")
    a("-v", "--verbose", action="store_true")
    return p


def check_args(args: argparse.Namespace) -> tuple[list[float], list[str]]:
    rates = parse_rates(args.rates)
    if args.num_requests is None and args.duration is None:
        raise ValueError("give --num-requests N and/or --duration S to bound each rate step")
    for flag, v in (("--num-requests", args.num_requests), ("--duration", args.duration),
                    ("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo),
                    ("--request-timeout", args.request_timeout), ("--input-len", args.input_len),
                    ("--output-len", args.output_len)):
        if v is not None and not v > 0:
            raise ValueError(f"{flag} {v} must be > 0")
    if not 0 < args.attainment_target <= 1:
        raise ValueError(f"--attainment-target {args.attainment_target} must be in (0, 1]")
    for flag, v in (("--colocated", args.colocated), ("--prefill", args.prefill), ("--decode", args.decode)):
        if v < 1:
            raise ValueError(f"{flag} {v} must be >= 1")
    if args.colocated != args.prefill + args.decode:
        logger.warning("--colocated %d != --prefill %d + --decode %d: the shapes do not use the same resources",
                       args.colocated, args.prefill, args.decode)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"--modes {args.modes!r}: a comma list of distinct modes from {', '.join(MODES)}")
    try:
        args.tpot_targets = sorted(float(v) for v in args.tpot_sweep.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--tpot-sweep {args.tpot_sweep!r}: a comma list of seconds, e.g. 0.08,0.1") from None
    if any(not t > 0 for t in args.tpot_targets):
        raise ValueError(f"--tpot-sweep {args.tpot_sweep!r}: every target must be > 0")
    if not Path(args.profile).is_file():
        raise ValueError(f"--profile {args.profile!r} does not exist")
    return rates, modes


def make_workload(args: argparse.Namespace):
    from benchmarks.workload import ChatWorkload, LongDocWorkload

    if args.workload == "longdoc":
        return LongDocWorkload(args.input_len or 1536, args.output_len or 32)
    return ChatWorkload(args.input_len or 256, args.sigma, args.output_len or 64, args.sigma)


def deploy_config(args: argparse.Namespace, mode: str, port: int) -> dict[str, Any]:
    pools = {"colocated": args.colocated} if mode == "colocated" else {"prefill": args.prefill, "decode": args.decode}
    return {"name": f"cmp-{SHORT[mode]}", "mode": mode,
            "engine": {"model": args.model, "max_model_len": args.max_model_len, "kv_cache_mib": args.kv_cache_mib,
                       "enable_prefix_caching": args.prefix_caching},
            "pools": pools, "serve": {"port": port, "request_timeout_s": max(300.0, args.request_timeout)},
            "router": {"policy": args.policy}, "ray": {"namespace": "saaf-compare"}}


def predict_all(args: argparse.Namespace, rates: Sequence[float], workload: Any) -> tuple[dict, dict]:
    """The planner's prediction for each shape and rate on exactly the requests the benchmark sends."""
    from benchmarks.workload import build_requests
    from placement.latency import LatencyModel
    from placement.simulator import simulate_colocated, simulate_disaggregated
    from placement.workload import Request

    lat = LatencyModel.from_profile(args.profile)
    pred: dict[str, dict[float, dict[str, Any]]] = {m: {} for m in MODES}
    lens: dict[float, dict[str, float]] = {}
    for rate in rates:
        specs = build_requests(workload, rate, args.num_requests, args.duration, 1.0, args.seed, args.max_model_len)
        reqs = [Request(s.arrival_s, s.input_len, s.output_len) for s in specs]
        lens[rate] = {"requests": len(specs), "mean_input": sum(s.input_len for s in specs) / len(specs),
                      "mean_output": sum(s.output_len for s in specs) / len(specs),
                      "arrivals_s": round(specs[-1].arrival_s, 2)}
        colo = simulate_colocated(lat, args.colocated, reqs)
        dis = simulate_disaggregated(lat, lat, args.prefill, args.decode, reqs, same_node=True)
        pred["colocated"][rate] = sim_summary(colo.records, args.ttft_slo, args.tpot_slo)
        pred["disaggregated"][rate] = sim_summary(dis.records, args.ttft_slo, args.tpot_slo)
    return pred, lens


def offline_quality(model: str, max_model_len: int, timeout_s: float, scratch: Path) -> list[dict[str, Any]]:
    """Offline vLLM greedy outputs of the eval set, in a child process (bounded, its memory freed after)."""
    out = scratch / "offline-greedy.json"
    code = ("import json, sys; from dataclasses import asdict; from benchmarks.quality import load_evalset, "
            "offline_greedy; from engine.models import resolve_model; "
            f"r = offline_greedy(resolve_model({model!r}), load_evalset(), max_model_len={max_model_len}); "
            f"open({str(out)!r}, 'w').write(json.dumps([asdict(o) for o in r]))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        raise RuntimeError(f"offline vLLM did not finish within {timeout_s:.0f} s") from None
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"offline vLLM failed (exit {proc.returncode}): {err[-800:]}")
    data = json.loads(out.read_text())
    out.unlink()
    return data


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_step(args: argparse.Namespace, endpoint: str, model: str, workload: Any, rate: float,
              workers: dict[int, str], warmup: bool, progress: Callable | None) -> tuple[Any, dict[str, Any]]:
    """One rate step with its resource accounting."""
    from benchmarks.serve import run_benchmark
    from benchmarks.stats import SLO

    with StatsSampler(endpoint) as sampler:
        seen = {t.get("request_id") for t in sampler.transfers()}
        m0 = scrape_metrics(endpoint)
        before, busy0 = cpu_snapshot(workers)
        w0 = time.monotonic()
        res = run_benchmark(endpoint, model, workload, [rate], num_requests=args.num_requests,
                            duration_s=args.duration, slo=SLO(args.ttft_slo, args.tpot_slo),
                            seed=args.seed, request_timeout_s=args.request_timeout,
                            max_total_len=args.max_model_len, warmup_requests=2 if warmup else 0,
                            progress=progress)
        wall = time.monotonic() - w0
        after, busy1 = cpu_snapshot(workers)
        m1 = scrape_metrics(endpoint)
    cores = cpu_breakdown(before, after, wall)
    tel = [t for t in sampler.transfers() if t.get("request_id") not in seen]
    return res, {"wall_s": round(wall, 2), "cpu_cores": cores,
                 "machine_busy_cores": round((busy1 - busy0) / wall, 3),
                 "machine_other_cores": round(max(0.0, (busy1 - busy0) / wall - sum(cores.values())), 3),
                 "workers": worker_load(sampler.samples), "transfers": transfer_summary(tel),
                 "server_means_s": metric_means(m0, m1),
                 "samples": [{"t": round(x["t"] - w0, 2),
                              "w": [[w["worker_id"], w.get("running"), w.get("waiting"),
                                     round(w.get("kv_usage", 0.0), 3)] for w in x["workers"]]}
                             for x in sampler.samples]}


def _attempt_note(rate: float, attempt: tuple[Any, dict[str, Any]]) -> dict[str, Any]:
    s = attempt[0].steps[0].summary
    return {"rate": rate, "machine_other_cores": attempt[1]["machine_other_cores"], "attainment": s.attainment,
            "goodput_rps": s.goodput_rps, "ttft_p90": s.ttft.p90, "tpot_p90": s.tpot.p90}


def foreign_now(window_s: float = 3.0) -> float:
    """Cores used by processes outside this run's process tree over the next ``window_s`` seconds."""
    before, busy0 = cpu_snapshot({})
    time.sleep(window_s)
    after, busy1 = cpu_snapshot({})
    ours = sum(cpu_breakdown(before, after, window_s).values())
    return max(0.0, (busy1 - busy0) / window_s - ours)


def wait_quiet(budget: dict[str, float], limit: float, window_s: float = 3.0) -> dict[str, Any]:
    """Wait (from the run's shared ``budget["wait_left"]`` seconds) until other processes use at most
    ``limit`` cores; returns how long it waited and the last reading. Bounded by the budget."""
    t0 = time.monotonic()
    reading = foreign_now(window_s)
    while reading > limit and budget["wait_left"] > 0:
        budget["wait_left"] -= window_s
        reading = foreign_now(window_s)
    waited = time.monotonic() - t0 - window_s
    return {"waited_s": round(max(0.0, waited), 1), "foreign_cores_at_start": round(reading, 3)}


def run_mode(args: argparse.Namespace, mode: str, port: int, rates: Sequence[float], workload: Any,
             out_dir: Path | None, progress: Callable | None, budget: dict[str, float]) -> dict[str, Any]:
    """Deploy one shape, check quality, run every rate, stop it. Returns its part of the report."""
    from benchmarks.quality import endpoint_greedy, load_evalset
    from benchmarks.report import write_report
    from cluster import deploy
    from cluster.config import parse_config

    cfg = parse_config(deploy_config(args, mode, port), f"{mode} config")
    t0 = time.monotonic()
    print(f"[{mode}] deploying {deploy_config(args, mode, port)['pools']} ...", flush=True)
    info = deploy.start(cfg, ready_timeout_s=300)
    part: dict[str, Any] = {"config": deploy_config(args, mode, port), "startup_s": round(info["startup_s"], 1),
                            "workers": [{k: w.get(k) for k in ("worker_id", "role", "engine_id", "pid",
                                                               "kv_capacity_tokens")} for w in info["workers"]]}
    wpids = {w["pid"]: w["worker_id"] for w in info["workers"] if w.get("pid")}
    part["affinity"] = process_affinity(wpids)
    if args.engine_affinity == "all":
        n = reset_affinity(list(wpids), set(os.sched_getaffinity(0)))
        part["affinity_reset_threads"] = n
        part["affinity_after_reset"] = process_affinity(wpids)
        if n:
            print(f"[{mode}] engine CPU affinity reset to all CPUs on {n} threads (see --engine-affinity)", flush=True)
    try:
        endpoint, model = info["endpoint"], info["model"]
        print(f"[{mode}] ready in {info['startup_s']:.1f} s at {endpoint} (model {model!r})", flush=True)
        if not args.no_quality:
            tq = time.monotonic()
            outs = endpoint_greedy(endpoint, model, load_evalset(), timeout_s=args.request_timeout,
                                   transport=TokenIdsOnly())
            part["quality_outputs"] = [asdict(o) for o in outs]
            part["quality_s"] = round(time.monotonic() - tq, 1)
            print(f"[{mode}] greedy eval set done in {part['quality_s']} s", flush=True)
        if args.probe_requests:
            part["idle_probe"] = idle_probe(endpoint, model, args.probe_requests, args.request_timeout)
            print(f"[{mode}] idle probe: {part['idle_probe']['summary']}", flush=True)
        workers = {w["pid"]: f"engine {w['worker_id']}" for w in info["workers"] if w.get("pid")}
        steps, resources = [], {}
        records: dict[float, list[dict[str, Any]]] = {}
        discarded: list[dict[str, Any]] = []
        result = None
        for i, rate in enumerate(rates):
            best = None
            while True:
                gate = wait_quiet(budget, args.foreign_limit)
                res, info_step = _one_step(args, endpoint, model, workload, rate, workers, i == 0 and best is None,
                                           progress)
                info_step["quiet_gate"] = gate
                foreign = info_step["machine_other_cores"]
                if best is None or foreign < best[1]["machine_other_cores"]:
                    if best is not None:
                        discarded.append(_attempt_note(rate, best))
                    best = (res, info_step)
                else:
                    discarded.append(_attempt_note(rate, (res, info_step)))
                s = res.steps[0].summary
                print(f"[{mode}] rate {rate:g}: attainment {s.attainment:.0%}, goodput {s.goodput_rps:.3f} req/s, "
                      f"TTFT p90 {fmt_ms(s.ttft.p90)} ms, TPOT p90 {fmt_ms(s.tpot.p90)} ms, engine cores "
                      f"{ {k[7:]: v for k, v in info_step['cpu_cores'].items() if k.startswith('engine ')} }, "
                      f"not ours {foreign:.2f}", flush=True)
                if foreign <= args.foreign_limit or budget["retries_left"] <= 0:
                    break
                budget["retries_left"] -= 1
                print(f"[{mode}] rate {rate:g}: other processes used {foreign:.2f} cores; running the step again",
                      flush=True)
            res, info_step = best
            resources[rate] = info_step
            records[rate] = [asdict(r) for r in res.steps[0].records]
            if result is None:
                result = res
            else:
                result.steps += res.steps
                result.finished_at = res.finished_at
            steps.append(res.steps[0].summary.to_dict())
        part["discarded_attempts"] = discarded
        assert result is not None
        result.config["rates"] = list(rates)
        result.command = f"python -m benchmarks.compare (mode {mode}; see ../report.md)"
        if out_dir is not None:
            write_report(result, out_dir / mode)
        part.update(steps=steps, resources=resources, endpoint=endpoint, model=model, records=records,
                    benchmark_config=result.config, environment=result.environment)
    finally:
        print(f"[{mode}] stopping ...", flush=True)
        deploy.stop(info["config"])
        part["mode_s"] = round(time.monotonic() - t0, 1)
    return part


class TokenIdsOnly(httpx.BaseTransport):
    """httpx transport for ``benchmarks.quality.endpoint_greedy`` against our ingress: keeps
    ``return_token_ids`` and drops ``return_tokens_as_token_ids`` and ``logprobs``, which our API
    rejects with 400 (endpoint_greedy would then drop every option and compare text only)."""

    DROP = ("return_tokens_as_token_ids", "logprobs", "top_logprobs")

    def __init__(self) -> None:
        self._inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            body = json.loads(request.content)
        except ValueError:
            return self._inner.handle_request(request)
        if isinstance(body, dict) and any(k in body for k in self.DROP):
            body = {k: v for k, v in body.items() if k not in self.DROP}
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            request = httpx.Request(request.method, request.url, headers=headers, json=body)
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


def quality_comparisons(outputs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    from benchmarks.quality import GreedyOutput, compare

    srcs = {k: [GreedyOutput(o["id"], o["text"], o["token_ids"]) for o in v] for k, v in outputs.items()}
    names = [n for n in QUALITY_SOURCES if n in srcs]
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    return [asdict(compare(srcs[a], srcs[b], a, b)) for a, b in pairs]


def plot(rows: Sequence[dict[str, Any]], slo: dict[str, float], out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: skipping compare.png")
        return []
    xs = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode, style in (("colocated", "o-"), ("disaggregated", "s--")):
        axes[0].plot(xs, [r[mode]["attainment"] * 100 for r in rows], style, label=mode)
        axes[1].plot(xs, [r[mode]["goodput_rps"] for r in rows], style, label=mode)
        axes[2].plot(xs, [(r[mode]["tpot_p90"] or 0) * 1000 for r in rows], style, label=f"{mode} TPOT p90")
        axes[2].plot(xs, [(r[mode]["ttft_p90"] or 0) * 1000 for r in rows], style, alpha=0.4,
                     label=f"{mode} TTFT p90")
    axes[0].set_ylabel("SLO attainment %")
    axes[0].set_ylim(0, 105)
    axes[1].set_ylabel("goodput req/s")
    axes[2].set_ylabel("ms (log)")
    axes[2].set_yscale("log")
    axes[2].axhline(slo["tpot_s"] * 1000, color="grey", lw=0.8, ls=":")
    axes[2].axhline(slo["ttft_s"] * 1000, color="grey", lw=0.8, ls="-.")
    for ax in axes:
        ax.set_xlabel("offered rate req/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"colocated vs disaggregated (TTFT <= {slo['ttft_s']:g} s, TPOT <= {slo['tpot_s'] * 1000:g} ms)")
    fig.tight_layout()
    fig.savefig(out_dir / "compare.png", dpi=100)
    plt.close(fig)
    return ["compare.png"]


def resources_table(rows: Sequence[dict[str, Any]], resources: dict[str, dict[float, dict[str, Any]]],
                    limit: float = FOREIGN_LIMIT) -> str:
    body = []
    for r in rows:
        for mode in MODES:
            res = resources.get(mode, {}).get(r["rate"])
            if not res:
                continue
            cores = res["cpu_cores"]
            eng = {k[7:]: v for k, v in cores.items() if k.startswith("engine ")}
            rest = {k: v for k, v in cores.items() if not k.startswith("engine ")}
            loads = res["workers"]
            tr = res["transfers"]
            sm = res.get("server_means_s") or {}
            body.append([
                f"{r['rate']:g}", mode,
                ", ".join(f"{k} {v:.2f}" for k, v in eng.items()),
                ", ".join(f"{k.split(' ')[0]} {v:.2f}" for k, v in rest.items()),
                f"{res['machine_other_cores']:.2f}" + (" (!)" if res["machine_other_cores"] > limit else ""),
                ", ".join(f"{w} {v['mean_running_when_busy']:.1f}/{v['max_running']} ({v['busy_fraction']:.0%}), "
                          f"waiting {v['mean_waiting']:.1f}" for w, v in loads.items()),
                ", ".join(f"{w} {fmt_ms(v['median_step_s'])}" for w, v in loads.items()),
                ", ".join(f"{w} {v.get('mean_kv_usage', 0):.0%}/{v.get('max_kv_usage', 0):.0%}" for w, v in loads.items()),
                "-" if not tr.get("count") else
                f"{tr['count']} ({tr['outcomes']}), wait p50/p90 {fmt_ms(tr['transfer_wait_p50_s'])}/"
                f"{fmt_ms(tr['transfer_wait_p90_s'])} ms",
                " / ".join(fmt_ms(sm.get(k)) for k in ("ttft", "prefill", "kv_transfer")),
            ])
    return md_table(["rate", "mode", "engine cores (worker+EngineCore)", "other cores of ours", "cores not ours",
                     "running batch mean-when-busy/max (busy %), mean waiting", "median step ms", "KV cache use mean/max",
                     "KV transfers",
                     "server mean ms: TTFT / prefill / KV wait"], body)


def to_markdown(report: dict[str, Any], plots: Sequence[str]) -> str:
    mach, slo, w = report["machine"], report["slo"], report["workload"]
    md = [f"# Colocated vs disaggregated: {report['model']} on {mach['nproc']} CPU cores", "",
          "Reproduce with:", "", "```", report["command"], "```", "",
          f"- date: {report['started_at']} to {report['finished_at']} (UTC), {report['runtime_s']:.0f} s in all",
          f"- machine: {mach['nproc']} cores ({mach['cpu_model']}), {mach['memory_gib']} GiB RAM, load average at "
          f"start {' '.join(mach['loadavg'])}, at end {' '.join(report['machine_end']['loadavg'])}; shared with "
          "other work (see `cores not ours` below)",
          f"- git commit: `{report['git']['commit']}`" + (" (working tree had uncommitted changes)"
                                                         if report["git"]["dirty"] else ""),
          f"- shapes on the same {report['shapes']['colocated']['engines']} engines: colocated "
          f"{report['shapes']['colocated']['pools']} vs disaggregated {report['shapes']['disaggregated']['pools']}; "
          f"router `{report['policy']}`; engine: max_model_len {report['engine']['max_model_len']}, "
          f"KV {report['engine']['kv_cache_mib']} MiB, 1 OMP thread",
          f"- workload: `{json.dumps(w)}`, Poisson arrivals, seed {report['seed']}, at most "
          f"{report['num_requests'] or 'unbounded'} requests / {report['duration_s'] or 'unbounded'} s of arrivals "
          "per rate; the same requests (lengths, prompts, scaled arrival times) in both modes",
          f"- SLO: TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s'] * 1000:g} ms per request; attainment = "
          "met / sent; goodput = met requests / step duration",
          "", "## Goodput", "", goodput_table(report["rows"], report["foreign_load"]["rates"]), ""]
    fl = report["foreign_load"]
    if fl["steps"]:
        md += [f"(!) other people's processes used more than {fl['limit_cores']:g} cores of this 2-core box during "
               "these steps (cores: " + ", ".join(f"{k} {v:.2f}" for k, v in fl["steps"].items())
               + "); read those rows with care.", ""]
    redo = [f"{m} {d['rate']:g} (not ours {d['machine_other_cores']:.2f} cores, attainment {d['attainment']:.0%})"
            for m in MODES for d in report["modes"][m].get("discarded_attempts", [])]
    if redo:
        md += ["Attempts discarded for a cleaner repeat of the same step: " + "; ".join(redo) + ".", ""]
    probes = {m: report["modes"][m].get("idle_probe") for m in MODES}
    if all(probes.values()):
        md += ["Idle probe (before the sweep, one request at a time, fresh 512-token prompts, 32 output tokens): "
               + "; ".join(f"{m} TTFT p50 {fmt_ms(p['ttft_p50_s'])} ms, TPOT p50 {fmt_ms(p['tpot_p50_s'])} ms"
                           for m, p in probes.items()) + ".", ""]
    aff = {m: report["modes"][m].get("affinity") for m in MODES}
    if all(aff.values()):
        md += ["CPU affinity of the engine processes as deployed: " + "; ".join(
            f"{w}: " + ", ".join(f"{pr['cmd'].split(' ')[0]} {pr['cpus']}" for pr in procs)
            for m in MODES for w, procs in aff[m].items()) + "."]
        resets = {m: report["modes"][m].get("affinity_reset_threads") for m in MODES}
        if any(v is not None for v in resets.values()):
            md += ["`--engine-affinity all`: threads re-allowed on every CPU after deploy: "
                   + ", ".join(f"{m} {v}" for m, v in resets.items()) + " (vLLM's NixlConnector pins each P/D "
                   "EngineCore to the last core of its NUMA node; colocated engines have no connector)."]
        else:
            md += ["`--engine-affinity keep`: measured with the affinity as deployed."]
        md += [""]
    caps = report["slo_capacity"]
    md += [f"Highest rate sustained at >= {report['attainment_target']:.0%} attainment (every tested rate up to "
           f"it): colocated {caps['colocated']} req/s, disaggregated {caps['disaggregated']} req/s; "
           f"ratio {fmt_ratio(ratio(caps['disaggregated'], caps['colocated']))}.", "",
           "## The same requests judged at other TPOT targets", "",
           f"TTFT target {slo['ttft_s']:g} s; each cell: attainment colocated / disaggregated (goodput ratio "
           "disaggregated / colocated).", "", sweep_table(report["slo_sweep"]["rows"]), "",
           "## Latency (ms; nearest-rank percentiles)", "", latency_table(report["rows"]), "",
           "## Planner check", "",
           f"The placement simulator with the measured profile `{report['planner']['profile']}` on exactly the "
           "requests sent (same arrivals and lengths), predicted vs measured, error = (predicted - measured) / "
           "measured (attainment: predicted - measured, in points).", "",
           planner_table(report["planner"]["rows"]), ""]
    q = report.get("quality")
    md += ["## Quality: greedy outputs", ""]
    if not q:
        md += ["Not run (--no-quality).", ""]
    else:
        md += [f"The {q['prompts']} prompts of `benchmarks/evalset/prompts.jsonl`, temperature 0, one at a time, "
               "token ids compared.", "", quality_table(q["comparisons"]), ""]
        md += ["**All sources agree token for token.**" if q["all_match"] else
               "**DIFFERENCE: greedy outputs differ between sources. This is a bug to report to the lead.**", ""]
        if q.get("offline_error"):
            md += [f"Offline vLLM could not run: {q['offline_error']}", ""]
    md += ["## Where the CPU went", "",
           "Per rate step: cores used (CPU-seconds / step wall time) by each engine (Ray actor + its vLLM "
           "EngineCore), by the rest of this run's processes (driver = load client, Serve, Ray), and by "
           "processes not ours (other work on the box); the workers' running batch from `/v1/stats` sampled "
           "every second (mean over samples where it was > 0 / max, busy % of samples; a prefill worker counts its "
           "prompt as waiting until the prompt is done, so its running count stays 0: read its load from its "
           "cores); median engine step (as the engine's stat logger records it: for a mostly idle engine this "
           "includes idle gaps); "
           "KV transfer telemetry; the ingress's own means from `/metrics` over the step (TTFT as the server "
           "sees it; prefill on the prefill worker; KV wait = decode submit to first decode output).", "", resources_table(report["rows"], report["resources"], report["foreign_load"]["limit_cores"]), "",
           "## Findings (computed from the numbers above)", ""]
    md += [f"- {f}" for f in report["findings"]]
    if plots:
        md += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    md += ["", "Per-mode benchmark reports with every request: `colocated/report.md`, `disaggregated/report.md`. "
           "Definitions: docs/benchmarks.md.", ""]
    return "\n".join(md)


def _rekey(d: dict) -> dict[float, Any]:
    """JSON turned float keys (rates) into strings; turn them back."""
    return {float(k): v for k, v in d.items()}


def load_raw(path: Path) -> dict[str, Any]:
    raw = json.loads(path.read_text())
    raw["pred"] = {m: _rekey(v) for m, v in raw["pred"].items()}
    raw["records"] = {m: _rekey(v) for m, v in raw["records"].items()}
    for part in raw["parts"].values():
        if "resources" in part:
            part["resources"] = _rekey(part["resources"])
    return raw


def assemble(raw: dict[str, Any]) -> dict[str, Any]:
    """The full report from what the run measured (``raw``: header, parts, records, predictions,
    quality outputs). Pure: ``--from-raw`` rebuilds a report from a saved raw.json without rerunning."""
    report = dict(raw["report"])
    parts, records, pred = raw["parts"], raw["records"], raw["pred"]
    rates, slo = report["rates"], report["slo"]
    rows = side_by_side(parts["colocated"]["steps"], parts["disaggregated"]["steps"])
    report["rows"] = rows
    measured = {m: {r["rate"]: r[m] for r in rows} for m in MODES}
    report["planner"] = {"profile": report["profile"], "rows": planner_rows(pred, measured)}
    parts = {m: dict(p, resources={r: {k: v for k, v in res.items() if k != "samples"}
                                   for r, res in p.get("resources", {}).items()}) for m, p in parts.items()}
    report["resources"] = {m: parts[m]["resources"] for m in MODES}
    report["foreign_load"] = foreign_load(report["resources"], report.get("foreign_limit", FOREIGN_LIMIT))
    report["slo_capacity"] = {m: slo_capacity(rates, [r[m]["attainment"] for r in rows], report["attainment_target"])
                              for m in MODES}
    report["findings"] = findings(rows, report["resources"], slo, report["attainment_target"])
    durations = {m: {r["rate"]: r[m]["duration_s"] for r in rows} for m in MODES}
    report["slo_sweep"] = {"ttft_s": slo["ttft_s"],
                           "rows": slo_sweep(records, durations, slo["ttft_s"], report["tpot_targets"])}
    report["modes"] = parts
    q = raw.get("quality_outputs") or {}
    if q:
        comps = quality_comparisons(q)
        report["quality"] = {"prompts": len(next(iter(q.values()))), "sources": list(q), "comparisons": comps,
                             "all_match": all(c["exact_match_rate"] == 1.0 for c in comps),
                             "offline_error": raw.get("offline_error"), "outputs": q}
    return report


def write_outputs(report: dict[str, Any], out_dir: Path | None) -> int:
    rows = report["rows"]
    print()
    print(goodput_table(rows))
    print()
    print(planner_table(report["planner"]["rows"]))
    if report.get("quality"):
        print()
        print(quality_table(report["quality"]["comparisons"]))
        if not report["quality"]["all_match"]:
            print("DIFFERENCE between greedy outputs: a bug to report to the lead", file=sys.stderr)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        plots = plot(rows, report["slo"], out_dir)
        (out_dir / "report.json").write_text(json.dumps(json_safe(report), indent=1))
        (out_dir / "report.md").write_text(to_markdown(report, plots))
        print(f"wrote {out_dir / 'report.md'}, {out_dir / 'report.json'}"
              + "".join(f", {out_dir / p}" for p in plots))
    return 0 if not report.get("quality") or report["quality"]["all_match"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.from_raw:
        out = Path(args.out) if args.out else Path(args.from_raw).parent
        return write_outputs(assemble(load_raw(Path(args.from_raw))), out)
    try:
        rates, modes = check_args(args)
        workload = make_workload(args)
    except ValueError as exc:
        parser.error(str(exc))
    started = datetime.now(UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "benchmarks.compare", *argv]), "started_at": started,
        "machine": machine_info(), "git": git_commit(), "model": args.model, "rates": rates,
        "num_requests": args.num_requests, "duration_s": args.duration, "seed": args.seed, "policy": args.policy,
        "workload": {k: v for k, v in vars(workload).items()},
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo}, "attainment_target": args.attainment_target,
        "tpot_targets": args.tpot_targets, "profile": os.path.relpath(args.profile, REPO),
        "foreign_limit": args.foreign_limit, "engine_affinity": args.engine_affinity,
        "prefix_caching": args.prefix_caching,
        "engine": {"max_model_len": args.max_model_len, "kv_cache_mib": args.kv_cache_mib},
        "shapes": {"colocated": {"engines": args.colocated, "pools": {"colocated": args.colocated}},
                   "disaggregated": {"engines": args.prefill + args.decode,
                                     "pools": {"prefill": args.prefill, "decode": args.decode}}},
    }
    pred, lens = predict_all(args, rates, workload)
    report["requests_per_rate"] = lens
    print("planner predictions ready; requests per rate:", {r: v["requests"] for r, v in lens.items()}, flush=True)

    quality_outputs: dict[str, list[dict[str, Any]]] = {}
    offline_error = None
    if not args.no_quality and not args.no_offline:
        tq = time.monotonic()
        scratch = out_dir or Path("/tmp")
        try:
            # NOTE: offline_greedy's fixed 64 MiB KV cache holds ~1280 SmolLM2 tokens; the eval prompts are
            # short and greedy outputs do not depend on max_model_len.
            quality_outputs["offline"] = offline_quality(args.model, min(args.max_model_len, 1024),
                                                         args.offline_timeout, scratch)
            print(f"offline vLLM greedy eval set done in {time.monotonic() - tq:.0f} s", flush=True)
        except RuntimeError as exc:
            offline_error = str(exc)
            print(f"offline vLLM failed: {exc}", file=sys.stderr, flush=True)

    from benchmarks.report import ProgressLine
    from cluster.cli import shutdown_embedded
    from cluster.config import parse_config
    from cluster.runtime import connect

    ns = parse_config(deploy_config(args, modes[0], 8000)).ray.namespace
    port = args.port or _free_port()
    parts: dict[str, dict[str, Any]] = {}
    failure = None
    budget = {"wait_left": float(args.quiet_wait), "retries_left": args.retries}

    def _term(*_: object) -> None:
        raise KeyboardInterrupt

    connect(None, num_cpus=None, object_store_mib=256, namespace=ns)
    old = signal.signal(signal.SIGTERM, _term)
    try:
        for mode in modes:
            parts[mode] = run_mode(args, mode, port, rates, workload, out_dir,
                                   None if args.no_progress else ProgressLine(), budget)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - reported, the raw file keeps what finished
        failure = f"{type(exc).__name__}: {exc}"
        logger.exception("comparison failed")
    finally:
        signal.signal(signal.SIGTERM, old)
        shutdown_embedded()

    records: dict[str, dict[float, list[dict[str, Any]]]] = {}
    for mode, part in parts.items():
        if "quality_outputs" in part:
            quality_outputs[mode] = part.pop("quality_outputs")
        if "records" in part:
            records[mode] = part.pop("records")
    report["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    report["runtime_s"] = round(time.monotonic() - t0, 1)
    report["machine_end"] = {"loadavg": machine_info()["loadavg"]}
    report["failure"] = failure
    report["quiet_budget_left"] = budget
    raw = {"report": report, "parts": parts, "records": records, "pred": pred, "quality_outputs": quality_outputs,
           "offline_error": offline_error}
    if out_dir is not None:
        # NOTE: everything measured, before any report logic: `--from-raw` rebuilds the report from it.
        (out_dir / "raw.json").write_text(json.dumps(json_safe(raw)))
    if failure is not None or set(parts) != set(MODES) or any("steps" not in p for p in parts.values()):
        if failure is None and set(parts) == set(modes):
            print(f"ran {', '.join(modes)} only: no side-by-side report"
                  + (f"; measurements in {out_dir / 'raw.json'}" if out_dir else ""))
            return 0
        print(f"error: the comparison did not complete ({failure or 'modes missing'})"
              + (f"; what finished is in {out_dir / 'raw.json'}" if out_dir else ""), file=sys.stderr)
        return 3
    return write_outputs(assemble(raw), out_dir)


if __name__ == "__main__":
    sys.exit(main())
