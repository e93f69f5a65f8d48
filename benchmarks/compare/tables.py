"""The Markdown tables of the colocated vs disaggregated report: goodput, latency, the TPOT-target
sweep and where the CPU went."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.compare.analysis import Resources
from benchmarks.compare.fmt import fmt_dollars, fmt_ms, fmt_pct, fmt_ratio, md_table
from benchmarks.compare.quiet import FOREIGN_LIMIT
from benchmarks.compare.shapes import MODES


def goodput_table(rows: Sequence[dict[str, Any]], flagged: Sequence[float] = ()) -> str:
    """The headline table: attainment and goodput of both modes per rate, and the ratio; rates in
    ``flagged`` (foreign CPU load during a step) are marked with (!)."""
    body = []
    for r in rows:
        c, d = r["colocated"], r["disaggregated"]
        body.append([f"{r['rate']:g}" + (" (!)" if r["rate"] in flagged else ""), fmt_pct(c["attainment"]),
                     fmt_pct(d["attainment"]), f"{c['goodput_rps']:.3f}", f"{d['goodput_rps']:.3f}",
                     fmt_ratio(r["goodput_ratio"]), r["winner"]])
    return md_table(["rate req/s", "attain colo", "attain disagg", "goodput colo req/s", "goodput disagg req/s",
                     "ratio disagg/colo", "better"], body)


def outcome_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per rate and mode: what admission made of the requests (met / served late / refused, and how
    fast the refusals came) and the cost per million tokens."""
    body = []
    for r in rows:
        for mode in MODES:
            m = r[mode]
            refusal = "-" if not m.get("refused") else (
                f"{m['refused']} ({fmt_ms(m.get('refusal_p50_s'))} / {fmt_ms(m.get('refusal_max_s'))} ms)")
            body.append([f"{r['rate']:g}", mode, f"{m['slo_met']}/{m['sent']}", str(m.get("late", "-")), refusal,
                         str(m["errors"] - (m.get("refused") or 0)), fmt_dollars(m.get("dollars_per_m_input")),
                         fmt_dollars(m.get("dollars_per_m_output")), fmt_dollars(m.get("dollars_per_m_tokens"))])
    return md_table(["rate", "mode", "met both targets", "served late", "refused 429 (send -> 429 p50 / max)",
                     "failed", "$/M input", "$/M output", "$/M tokens (in + out)"], body)


def router_table(rows: Sequence[dict[str, Any]]) -> str:
    """The router's predictions against the measurements: predicted / measured at p50 and p90."""
    body = []
    for r in rows:
        cells = [f"{r['rate']:g}", r["mode"], str(r["count"])]
        for name in ("ttft", "tpot"):
            v = r[name]
            cells += [f"{fmt_ms(v['p50_predicted'])} / {fmt_ms(v['p50_measured'])} ({_ratio(v['p50_ratio'])})",
                      f"{fmt_ms(v['p90_predicted'])} / {fmt_ms(v['p90_measured'])} ({_ratio(v['p90_ratio'])})",
                      f"{_signed(v.get('log_error_mean'))} / {_ratio(v.get('log_error_sd'))}"]
        body.append(cells)
    return md_table(["rate", "mode", "routed", "TTFT p50 ms predicted / measured (ratio)", "TTFT p90",
                     "TTFT ln(measured/predicted) mean / sd", "TPOT p50", "TPOT p90", "TPOT ln error mean / sd"],
                    body)


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _signed(v: float | None) -> str:
    return "-" if v is None else f"{v:+.2f}"


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


def sweep_table(rows: Sequence[dict[str, Any]]) -> str:
    """``analysis.slo_sweep`` rows: one line per TPOT target, one column per rate."""
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


def resources_table(rows: Sequence[dict[str, Any]], resources: Resources, limit: float = FOREIGN_LIMIT) -> str:
    """Per rate and mode: cores per engine and per other component, foreign cores, batch, step time,
    KV use, KV transfers and the server's own TTFT / prefill / KV-wait means."""
    body = []
    for r in rows:
        for mode in MODES:
            res = resources.get(mode, {}).get(r["rate"])
            if res:
                body.append([f"{r['rate']:g}", mode, *_resource_cells(res, limit)])
    return md_table(["rate", "mode", "engine cores (worker+EngineCore)", "other cores of ours", "cores not ours (host steal)",
                     "running batch mean-when-busy/max (busy %), mean waiting", "median step ms", "KV cache use mean/max",
                     "KV transfers",
                     "server mean ms: TTFT / prefill / KV wait"], body)


def _resource_cells(res: dict[str, Any], limit: float) -> list[str]:
    cores = res["cpu_cores"]
    eng = {k[7:]: v for k, v in cores.items() if k.startswith("engine ")}
    rest = {k: v for k, v in cores.items() if not k.startswith("engine ")}
    loads = res["workers"]
    tr = res["transfers"]
    sm = res.get("server_means_s") or {}
    return [
        ", ".join(f"{k} {v:.2f}" for k, v in eng.items()),
        ", ".join(f"{k.split(' ')[0]} {v:.2f}" for k, v in rest.items()),
        f"{res['machine_other_cores']:.2f}" + (" (!)" if res["machine_other_cores"] > limit else "")
        + ("" if res.get("machine_steal_cores") is None else f" ({res['machine_steal_cores']:.2f})"),
        ", ".join(f"{w} {v['mean_running_when_busy']:.1f}/{v['max_running']} ({v['busy_fraction']:.0%}), "
                  f"waiting {v['mean_waiting']:.1f}" for w, v in loads.items()),
        ", ".join(f"{w} {fmt_ms(v['median_step_s'])}" for w, v in loads.items()),
        ", ".join(f"{w} {v.get('mean_kv_usage', 0):.0%}/{v.get('max_kv_usage', 0):.0%}" for w, v in loads.items()),
        "-" if not tr.get("count") else
        f"{tr['count']} ({tr['outcomes']}), wait p50/p90 {fmt_ms(tr['transfer_wait_p50_s'])}/"
        f"{fmt_ms(tr['transfer_wait_p90_s'])} ms",
        " / ".join(fmt_ms(sm.get(k)) for k in ("ttft", "prefill", "kv_transfer")),
    ]
