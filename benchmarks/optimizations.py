"""`python -m benchmarks.optimizations`: each serving optimisation against its baseline on this box, the same
traffic for both, on a workload where it should help and one where it should not; one report.

    python -m benchmarks.optimizations --out benchmarks/results/optimizations-cpu [--num-requests 12]

Eight deployments run in turn on one embedded Ray (the bundled model, fp32 on CPU, least_loaded routing so
every variant routes alike and nothing is refused, but where routing is the option), each replaying its
workloads' requests open-loop:

  disaggregated                 1 prefill + 1 decode engine, prefix caching off (the baseline of the next three)
  + prefix caching              both pools cache prefixes: multi-turn chat (helps) vs unique chat prompts
  + n-gram speculation          the decode pool speculates (vLLM prompt lookup): templated vs open text (eval set)
  + int8 W8A8                   both pools run engine/quantize.py's int8 copy: chat (decode) vs multi-turn (prefill)
  2 prefill + 1 decode          both cache prefixes; goodput routing (prices a cached prefix, serves all)
                                against least_loaded: multi-turn chat vs unique chat prompts
  colocated                     1 engine, chunked prefill off: a long prefill stalls every running stream
  + chunked prefill             1 engine, 256-token budget per step: long prompts among chat vs chat alone

Per row: TTFT p50/p99, ITL p50/p99, TPOT p50, goodput against the stated SLO, $/M input and output tokens at
a stated price for the box, and quality: the committed eval set's greedy outputs from the variant's endpoint
against its baseline's, token for token, and for the baseline and the int8 copy task accuracy with known answers
(benchmarks.taskeval: lm-eval on 20 capitals, loglikelihood and generation). Engine-level figures of speculation (near-ties) and of batching are benchmarks.speculation
and benchmarks.batching."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.compare.deployment import InProcessDeployment, embedded_ray
from benchmarks.compare.fmt import fmt_ms, md_table
from benchmarks.compare.metrics import metrics_of
from benchmarks.compare.options import RunOptions
from benchmarks.compare.outcomes import cost_model
from benchmarks.compare.provenance import Provenance, header_lines
from benchmarks.compare.quality_check import quality_comparisons
from benchmarks.compare.quiet import QuietBudget, add_budget_flags
from benchmarks.compare.runner import run_in_turn, run_variant
from benchmarks.compare.traffic import Step, Traffic
from benchmarks.compare.variant import Variant
from benchmarks.compare.writer import write_raw, write_report_files
from benchmarks.speculation import open_prompts, templated_prompts
from benchmarks.stats import SLO, CostModel
from benchmarks.taskeval import run_taskeval
from benchmarks.workload import ChatWorkload, MixedWorkload, MultiTurnWorkload, PromptSetWorkload, Workload

PROG = ("python", "-m", "benchmarks.optimizations")
NAMESPACE = "saaf-optimizations"

WORKLOADS: dict[str, tuple[Workload, float, str]] = {  # name: (workload, requests/s, what it is)
    "chat": (ChatWorkload(128, 0.5, 32, 0.5), 0.5, "unique chat prompts (median 128 in / 32 out)"),
    "multiturn": (MultiTurnWorkload(4, 384, 24, 24), 0.4,
                  "4 interleaved conversations, 384-word system prompt + 24 words per turn, 24 out"),
    "templated": (PromptSetWorkload.labelled(templated_prompts(), "templated"), 0.5,
                  "code, JSON, CSV, HTML, repetitions (continuations the prompt holds)"),
    "mixed": (MixedWorkload(128, 32, 0.5, 1536, 32, 0.25), 0.3, "chat with 25% 1536-token documents among it"),
    # NOTE: the synthetic chat prompts are lists of words whose continuations the prompt often holds (n-gram
    # speculation accepted 0.78 of its drafts there), so speculation's "should not help" is open text
    "open": (PromptSetWorkload.labelled(open_prompts(20), "open"), 0.5,
             "the committed eval set's 20 prompts: questions, prose, a little code (open text)"),
}
DISAGG = {"mode": "disaggregated", "pools": {"prefill": 1, "decode": 1}}
COLO = {"mode": "colocated", "pools": {"colocated": 1}}
DISAGG2 = {"mode": "disaggregated", "pools": {"prefill": 2, "decode": 1}, "engine": {"enable_prefix_caching": True}}


@dataclass(frozen=True)
class Deploy:
    variant: Variant
    workloads: tuple[str, ...]
    accuracy: bool = False
    """Also task accuracy (benchmarks.taskeval) on the ready deployment."""


DEPLOYS = (
    Deploy(Variant("disaggregated", {**DISAGG, "name": "opt-d"}), ("chat", "multiturn", "templated", "open"), True),
    Deploy(Variant("disaggregated+prefix-caching", {**DISAGG, "name": "opt-dp", "engine": {
        "enable_prefix_caching": True}}), ("chat", "multiturn")),
    Deploy(Variant("disaggregated+speculation", {**DISAGG, "name": "opt-ds", "pool_engines": {"decode": {
        "speculative": {"num_speculative_tokens": 4}}}}), ("open", "templated")),
    Deploy(Variant("disaggregated+w8a8", {**DISAGG, "name": "opt-dq", "engine": {"model": "smollm2-w8a8"}}),
           ("chat", "multiturn"), True),
    # NOTE: routing with two prefill engines that cache prefixes: the goodput router prices a follow-up turn's
    # cached prefix on the engine that prefilled the last turn (best_effort: it serves every request, so
    # only the routing differs); least_loaded knows nothing of prefixes
    Deploy(Variant("disaggregated-2p+prefix-caching", {**DISAGG2, "name": "opt-dp2", "router": {
        "policy": "goodput", "admission": "best_effort", "disaggregation": "always"}}), ("multiturn", "chat")),
    Deploy(Variant("disaggregated-2p+prefix-caching+least-loaded", {**DISAGG2, "name": "opt-dp2l"}),
           ("multiturn", "chat")),
    Deploy(Variant("colocated", {**COLO, "name": "opt-c", "engine": {
        "enable_chunked_prefill": False, "max_num_batched_tokens": 2048}}), ("chat", "mixed")),
    Deploy(Variant("colocated+chunked-prefill", {**COLO, "name": "opt-cc", "engine": {
        "enable_chunked_prefill": True, "max_num_batched_tokens": 256}}), ("chat", "mixed")),
)


@dataclass(frozen=True)
class Option:
    name: str
    variant: str
    baseline: str
    helps: str
    neutral: str
    promise: str


OPTIONS = (
    Option("prefix caching", "disaggregated+prefix-caching", "disaggregated", "multiturn", "chat", "identical"),
    Option("n-gram speculation (4 tokens)", "disaggregated+speculation", "disaggregated", "templated", "open",
           "identical up to near-ties"),
    Option("int8 W8A8 (round to nearest)", "disaggregated+w8a8", "disaggregated", "chat", "multiturn",
           "may differ: task accuracy"),
    Option("prefix-aware routing (2 prefill engines, prefix caching)", "disaggregated-2p+prefix-caching",
           "disaggregated-2p+prefix-caching+least-loaded", "multiturn", "chat", "identical"),
    Option("chunked prefill (256 tokens)", "colocated+chunked-prefill", "colocated", "mixed", "chat", "identical"),
)
FIELDS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50", "goodput_rps", "attainment",
          "dollars_per_m_input", "dollars_per_m_output")


def base_config(args: argparse.Namespace, port: int) -> dict[str, Any]:
    return {"engine": {"model": args.model, "max_model_len": 2048, "kv_cache_mib": 256,
                       "enable_prefix_caching": False},
            "serve": {"port": port, "request_timeout_s": 300.0}, "router": {"policy": "least_loaded"},
            "slo": {"ttft_ms": args.ttft_slo * 1000.0, "tpot_ms": args.tpot_slo * 1000.0},
            "ray": {"namespace": NAMESPACE}}


def steps_of(deploy: Deploy, num_requests: int, seed: int) -> list[Step]:
    return [Step(w, WORKLOADS[w][1], Traffic(WORKLOADS[w][0], num_requests, None, seed, max_total_len=2048))
            for w in deploy.workloads]


def caches_prefixes(config: dict[str, Any]) -> bool:
    """Whether any engine of the deployment caches prefixes (engine, or a pool's own options)."""
    pools = config.get("pool_engines") or {}
    return any(bool(e.get("enable_prefix_caching")) for e in (config.get("engine") or {}, *pools.values()))


def cost_of(deploy: Deploy, dollars_per_hour: float) -> CostModel:
    return cost_model(deploy.variant.overrides["pools"], dollars_per_hour)


def step_metrics(part: dict[str, Any], workloads: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{workload: metrics_of(its step)} of one deployment's part (steps in the order they ran)."""
    out = {}
    for w, summary in zip(workloads, part.get("steps", []), strict=False):
        m = metrics_of(summary)
        load = (part.get("resources", {}).get(w) or {}).get("workers") or {}
        acc = [v["spec_acceptance"] for v in load.values() if v.get("spec_acceptance") is not None]
        m["spec_acceptance"] = acc[0] if acc else None
        counts = (part.get("resources", {}).get(w) or {}).get("router_counts") or {}
        m["prefix_hit_tokens"] = counts.get("prefix_hit_tokens")
        m["input_tokens"] = round(summary.get("input_tok_s", 0.0) * summary["duration_s"])
        out[w] = m
    return out


def rows_of(metrics: dict[str, dict[str, dict[str, Any]]], quality: dict[str, dict[str, Any]],
            accuracy: dict[str, dict[str, float]] | None = None) -> list[dict]:
    """One row per option and workload: the baseline's and the option's figures side by side."""
    accuracy = accuracy or {}
    rows = []
    for o in OPTIONS:
        for kind, w in (("helps", o.helps), ("should not help", o.neutral)):
            base, opt = metrics.get(o.baseline, {}).get(w), metrics.get(o.variant, {}).get(w)
            if base is None or opt is None:
                continue
            rows.append({"option": o.name, "workload": w, "expect": kind, "baseline": o.baseline,
                         "variant": o.variant, "base": {k: base[k] for k in FIELDS},
                         "opt": {k: opt[k] for k in FIELDS}, "spec_acceptance": opt.get("spec_acceptance"),
                         "prefix_hits": {side: _hit_share(m) for side, m in (("base", base), ("opt", opt))},
                         "quality": quality.get(o.name), "promise": o.promise,
                         "accuracy": ({"base": accuracy[o.baseline], "opt": accuracy[o.variant]}
                                      if o.baseline in accuracy and o.variant in accuracy else None)})
    return rows


def _hit_share(m: dict[str, Any]) -> float | None:
    """Share of a step's prompt tokens the goodput router sent to the prefill worker it predicted holds them
    cached (follow-up turns routed to their prefix); None where the router did not say (least_loaded)."""
    hits, tokens = m.get("prefix_hit_tokens"), m.get("input_tokens")
    return round(hits / tokens, 3) if hits is not None and tokens else None


def quality_of(outputs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per option: its variant's eval-set greedy outputs against its baseline's."""
    out = {}
    for o in OPTIONS:
        if o.variant in outputs and o.baseline in outputs:
            (c,) = quality_comparisons({o.baseline: outputs[o.baseline], o.variant: outputs[o.variant]})
            diffs = [p for p in c["prompts"] if not p["match"]]
            out[o.name] = {"identical": len(c["prompts"]) - len(diffs), "prompts": len(c["prompts"]),
                           "first_divergences": [(p["id"], p["first_divergence"]) for p in diffs]}
    return out


def _arrow(a: float | None, b: float | None, fmt: Callable[[float], str] = fmt_ms) -> str:
    return " -> ".join("-" if v is None else fmt(v) for v in (a, b))


def _dec(digits: int) -> Callable[[float], str]:
    return lambda v: f"{v:.{digits}f}"


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        b, o, q = r["base"], r["opt"], r["quality"]
        qual = f"{q['identical']}/{q['prompts']} identical" if q else "-"
        if r.get("accuracy"):
            # NOTE: lm-eval's results also hold each task's sample count (`.../sample_len`): not a score
            qual += "; " + ", ".join(f"{k.split('/')[0].removeprefix('saaf_capitals_')} "
                                     f"{r['accuracy']['base'][k]:.2f} -> {r['accuracy']['opt'].get(k, math.nan):.2f}"
                                     for k in sorted(r["accuracy"]["base"]) if not k.endswith("/sample_len"))
        name = r["option"] + (f" (acceptance {r['spec_acceptance']:.2f})" if r.get("spec_acceptance") else "")
        hits = r.get("prefix_hits") or {}
        if hits.get("opt") is not None:
            name += f" (prompt tokens routed to their cached prefix {hits['opt']:.0%})"
        body.append([name, f"{r['workload']} ({r['expect']})", _arrow(b["ttft_p50"], o["ttft_p50"]),
                     _arrow(b["ttft_p99"], o["ttft_p99"]), _arrow(b["itl_p50"], o["itl_p50"]),
                     _arrow(b["itl_p99"], o["itl_p99"]), _arrow(b["tpot_p50"], o["tpot_p50"]),
                     _arrow(b["goodput_rps"], o["goodput_rps"], _dec(3)),
                     _arrow(b["dollars_per_m_input"], o["dollars_per_m_input"], _dec(2)),
                     _arrow(b["dollars_per_m_output"], o["dollars_per_m_output"], _dec(2)), qual])
    return md_table(["optimisation", "workload", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                     "TPOT p50 ms", "goodput req/s", "$/M in", "$/M out", "greedy eval set"], body)


def plot(rows: Sequence[dict[str, Any]], out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    labels = [f"{r['option'].split(' (')[0]}\n{r['workload']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, title) in zip(axes, (("ttft_p50", "TTFT p50 (ms)"), ("itl_p99", "ITL p99 (ms)"),
                                       ("goodput_rps", "goodput (req/s)")), strict=True):
        scale = 1.0 if key == "goodput_rps" else 1000.0
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [(r["base"][key] or 0) * scale for r in rows], 0.4, label="baseline")
        ax.bar([x + 0.2 for x in xs], [(r["opt"][key] or 0) * scale for r in rows], 0.4, label="with the option")
        ax.set_xticks(list(xs), labels, fontsize=7, rotation=35, ha="right")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out_dir / "optimizations.png", dpi=110)
    plt.close(fig)
    return ["optimizations.png"]


def to_markdown(report: dict[str, Any], plots: Sequence[str]) -> str:
    md = ["# Serving optimisations against their baselines", "", *header_lines(report), "",
          f"SLO: TTFT {report['slo']['ttft_s']} s, TPOT {report['slo']['tpot_s']} s; price "
          f"${report['dollars_per_hour']}/h for the box; {report['num_requests']} requests per workload, "
          "open-loop Poisson arrivals, the same requests for the baseline and the option.", "",
          summary_table(report["rows"]), "", "Workloads:", ""]
    md += [f"- `{w}` at {WORKLOADS[w][1]} req/s: {WORKLOADS[w][2]}" for w in WORKLOADS]
    md += ["", "Deployments: " + "; ".join(f"`{d['name']}` ready in {d['startup_s']} s" for d in report["deploys"]),
           ""]
    md += [f"![optimisations]({p})" for p in plots]
    if report.get("failure"):
        md += ["", f"**The run did not complete:** {report['failure']}"]
    return "\n".join(md) + "\n"


def accuracy(config: dict[str, Any], endpoint: str, model: str) -> dict[str, float]:
    """Task accuracy of one ready deployment (its own model directory gives the tokenizer)."""
    from engine.models import resolve_model

    return run_taskeval(endpoint, model, resolve_model(config["engine"]["model"]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=" ".join(PROG), description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-requests", type=int, default=12, help="requests per workload step")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT target, seconds")
    p.add_argument("--tpot-slo", type=float, default=0.15, help="TPOT target, seconds per output token")
    p.add_argument("--dollars-per-hour", type=float, default=0.10, help="price of the box")
    p.add_argument("--only", help="comma list of deployments to run (default: all)")
    p.add_argument("--workloads", help="comma list of workloads to run on them (default: each one's own)")
    p.add_argument("--seed", type=int, default=0)
    add_budget_flags(p)
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="greedy-compare only the eval set's first N prompts (default: all 20)")
    p.add_argument("--out", help="directory for report.md, report.json, raw.json and optimizations.png")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from kvtransfer.config import free_port

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    evalp = 1 if args.eval_prompts is None else args.eval_prompts
    for flag, v in (("--num-requests", args.num_requests), ("--ttft-slo", args.ttft_slo),
                    ("--tpot-slo", args.tpot_slo), ("--eval-prompts", evalp)):
        if not v > 0:
            parser.error(f"{flag} {v} must be > 0")
    if args.quiet_wait < 0 or args.retries < 0:
        parser.error(f"--quiet-wait {args.quiet_wait:g} and --retries {args.retries} must be >= 0")
    names = [d.variant.name for d in DEPLOYS]
    only = [n.strip() for n in (args.only or ",".join(names)).split(",") if n.strip()]
    if not only or any(n not in names for n in only):
        parser.error(f"--only {args.only!r}: a comma list from {', '.join(names)}")
    deploys = [d for d in DEPLOYS if d.variant.name in only]
    if args.workloads is not None:
        keep = [w.strip() for w in args.workloads.split(",") if w.strip()]
        if not keep or any(w not in WORKLOADS for w in keep):
            parser.error(f"--workloads {args.workloads!r}: a comma list from {', '.join(WORKLOADS)}")
        deploys = [replace(d, workloads=tuple(w for w in d.workloads if w in keep)) for d in deploys]
        if empty := [d.variant.name for d in deploys if not d.workloads]:
            parser.error(f"--workloads {args.workloads!r}: none of them runs on {', '.join(empty)}")
    prov = Provenance.start(PROG, argv)
    out_dir = Path(args.out) if args.out else None
    slo = SLO(args.ttft_slo, args.tpot_slo)
    opts = RunOptions(slo=slo, probe_requests=0, out_dir=out_dir, prog=" ".join(PROG), quality_prompts=args.eval_prompts,
                      say=lambda s: print(s, flush=True))
    budget = QuietBudget(args.quiet_wait, args.retries)
    base = base_config(args, free_port())
    by_name = {d.variant.name: d for d in deploys}

    def run_one(v: Variant) -> dict[str, Any]:
        config, d = v.config(base), by_name[v.name]
        # NOTE: a step repeated on an engine that caches prefixes would replay prompts it has cached (every
        # turn a hit): such a variant measures each step once, disturbed or not (the report shows how much)
        own = QuietBudget(budget.wait_left, 0) if caches_prefixes(config) else budget
        part = run_variant(v.name, InProcessDeployment(config), steps_of(d, args.num_requests, args.seed),
                           replace(opts, cost=cost_of(d, args.dollars_per_hour),
                                   extra=partial(accuracy, config) if d.accuracy else None), own)
        budget.wait_left = min(budget.wait_left, own.wait_left)
        return part

    with embedded_ray(NAMESPACE):
        parts, failure = run_in_turn([d.variant for d in deploys], run_one)
    outputs = {n: p.pop("quality_outputs") for n, p in parts.items() if "quality_outputs" in p}
    metrics = {n: step_metrics(p, by_name[n].workloads) for n, p in parts.items()}
    report = {**prov.start_fields(), "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
              "dollars_per_hour": args.dollars_per_hour, "num_requests": args.num_requests, "seed": args.seed,
              "eval_prompts": args.eval_prompts,
              "workloads": {w: {"rate": r, "about": a, "spec": dict(vars(wl)) if not isinstance(wl, PromptSetWorkload)
                                else {"prompts": len(wl.items)}} for w, (wl, r, a) in WORKLOADS.items()},
              "deploys": [{"name": n, "config": p.get("config"), "startup_s": p.get("startup_s")}
                          for n, p in parts.items()],
              "metrics": metrics, "quality": quality_of(outputs), **prov.end_fields(), "failure": failure}
    report["accuracy"] = {n: p["extra"] for n, p in parts.items() if "extra" in p}
    report["rows"] = rows_of(metrics, report["quality"], report["accuracy"])
    print(summary_table(report["rows"]))
    if out_dir is not None:
        write_raw(out_dir, {"report": report, "parts": parts, "quality_outputs": outputs})
        paths = write_report_files(out_dir, report, lambda plots: to_markdown(report, plots),
                                   lambda d: plot(report["rows"], d))
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if failure is None else 3


if __name__ == "__main__":
    sys.exit(main())
