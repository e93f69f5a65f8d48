"""`make_plan(cfg)`: choose prefill/decode parallelism and pool sizes, verify by simulation, add the
colocated baseline and costs. See search.py for the algorithms and docs/placement.md for the model."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import numpy as np

from placement.config import PlannerConfig
from placement.context import PlanContext
from placement.dispatch import InstanceView
from placement.errors import PlacementError
from placement.latency import LatencyModel
from placement.packing import pack_nodes, unit_packing
from placement.plan import Colocated, PlacementPlan, PoolShape
from placement.search import (
    PhaseChoice,
    Unit,
    best_by_per_gpu,
    best_units,
    colocated_goodput,
    decode_goodput,
    prefill_goodput,
)
from placement.sim_result import SimResult
from placement.simulator import simulate_disaggregated
from placement.workload import Workload

logger = logging.getLogger(__name__)

MAX_VERIFY_REQUESTS = 4000
AFFINITY_THRESHOLD = 0.1  # NIC transfer of a p90 prompt above this share of its latency budget: low affinity


class GroupedDispatch:
    """Round robin over prefill instances; the decode instance is taken round robin from the same group
    (node or algorithm-2 unit) as the prefill instance, so the KV moves over NVLink."""

    def __init__(self, p_group: list[int], d_group: list[int]) -> None:
        self.p_group = p_group
        self.members: dict[int, list[int]] = {}
        for d, g in enumerate(d_group):
            self.members.setdefault(g, []).append(d)
        self._p = 0
        self._d: dict[int, int] = {}
        self._any = 0

    def choose(self, now_s: float, prompt_len: int, output_len: int, prefill: Sequence[InstanceView],
               decode: Sequence[InstanceView]) -> tuple[int, int] | None:
        p = self._p % len(prefill)
        self._p += 1
        group = self.members.get(self.p_group[p])
        if not group:
            self._any += 1
            return p, (self._any - 1) % len(decode)
        k = self._d.get(self.p_group[p], 0)
        self._d[self.p_group[p]] = k + 1
        return p, group[k % len(group)]


def choose_algorithm(ctx: PlanContext, wl: Workload) -> str:
    algo = ctx.cfg.search.algorithm
    if algo != "auto":
        return algo
    if ctx.nodes == 1:
        return "low-affinity"
    lat = ctx.latency(min(ctx.cfg.search.tp_options), 1)
    p90 = int(np.percentile(wl.inputs, 90))
    # NOTE: the budget the transfer eats: the TTFT target, or where the prefill's first token streams at once
    # (search.first_token_from_prefill) the TPOT target over the output it is spread across
    slo = ctx.cfg.slo
    budget = slo.tpot_s * max(wl.mean_output - 1.0, 1.0) if ctx.cfg.search.first_token_from_prefill else slo.ttft_s
    slow = lat.kv_transfer_time_s(p90, same_node=False) > AFFINITY_THRESHOLD * budget
    return "low-affinity" if slow else "high-affinity"


def _verify(ctx: PlanContext, p: PhaseChoice, d: PhaseChoice, n: int, m: int, p_group: list[int],
            d_group: list[int], rate: float) -> SimResult:
    nreq = min(MAX_VERIFY_REQUESTS, max(ctx.cfg.search.requests, 40 * (n + m)))
    wl = Workload.from_spec(ctx.cfg.workload, nreq, ctx.cfg.search.seed + 1, ctx.max_context)
    local = ctx.cfg.workload.local_prefill_tokens if d.lat.pp == 1 else 0
    return simulate_disaggregated(p.lat, d.lat, n, m, wl.at_rate(rate), dispatch=GroupedDispatch(p_group, d_group),
                                  same_node=lambda a, b: p_group[a] == d_group[b],
                                  max_prefill_tokens=ctx.cfg.search.max_prefill_tokens, local_prefill_tokens=local,
                                  first_token_from_prefill=ctx.cfg.search.first_token_from_prefill)


def _phase_shortfall(res: SimResult, ttft: float, tpot: float) -> str:
    ok = [r for r in res.records if not r.rejected]
    miss_p = sum(1 for r in ok if r.ttft_s > ttft)
    miss_d = sum(1 for r in ok if r.tpot_s > tpot)
    return "prefill" if miss_p >= miss_d else "decode"


def make_plan(cfg: PlannerConfig) -> PlacementPlan:
    """Search, size and verify a disaggregated plan for `cfg` (raises PlacementError on bad input)."""
    t0 = time.perf_counter()
    ctx = PlanContext.from_config(cfg)
    wl = ctx.workload()
    algo = choose_algorithm(ctx, wl)
    cands = ctx.candidates(wl)
    s, slo = cfg.search, cfg.slo
    near = algo == "low-affinity"
    # NOTE: prefix-cache hits cut prefill work (prefill and colocated candidates; decode steps are untouched)
    hit = cfg.workload.prefix_hit_rate
    cands = [lat.with_prefix_hits(hit) for lat in cands]
    local = cfg.workload.local_prefill_tokens
    pre = [PhaseChoice(lat, prefill_goodput(lat, wl, slo, s.max_prefill_tokens, near, local,
                                            s.first_token_from_prefill)) for lat in cands]
    sizes: dict[int, Workload] = {}

    def workload_for(n: int) -> Workload:
        if n not in sizes:
            sizes[n] = Workload.from_spec(cfg.workload, n, s.seed, ctx.max_context)
        return sizes[n]

    sp = cfg.speculation
    # NOTE: speculation changes decode steps only (prefill emits one token): decode and colocated candidates

    def speculating(lat: LatencyModel) -> LatencyModel:
        return lat.with_speculation(sp.tokens, sp.acceptance) if sp is not None else lat

    decs = [speculating(lat) for lat in cands]
    dec = [PhaseChoice(lat, decode_goodput(lat, wl, slo, workload_for, local)) for lat in decs]
    for c in pre + dec:
        logger.info("%s: prefill/decode goodput %.3f req/s (%.3f per GPU)", c.lat, c.goodput.rate_rps,
                    c.goodput.per_gpu)
    colo = colo_alt = None
    if s.colocated_baseline:
        colos = [lat for lat in decs if lat.pp == 1]
        if cfg.colocated_latency is not None:  # NOTE: another engine than the pools': its own coefficients
            colos = [speculating(ctx.latency(lat.tp, 1, colocated=True).with_prefix_hits(hit)) for lat in colos]

        def colocated(chunked: bool) -> list[PhaseChoice]:
            return [PhaseChoice(lat, colocated_goodput(lat, wl, slo, s.max_prefill_tokens, chunked))
                    for lat in colos] or [PhaseChoice(cands[0], pre[0].goodput)]

        # NOTE: both engine versions, the configured one first: the ratio against each is printed
        colo = colocated(s.colocated_chunked_prefill)
        colo_alt = colocated(not s.colocated_chunked_prefill)
    w = cfg.workload
    rates: list[float | None]
    if w.rate_sweep is not None:
        lo, hi, steps = w.rate_sweep
        rates = [float(r) for r in np.linspace(lo, hi, int(steps))]
    else:
        rates = [w.rate_rps]
    plans = [_size(ctx, wl, algo, pre, dec, colo, r, colo_alt) for r in rates]
    if hit:
        for p in plans:
            p.notes.append(f"prefill planned with {hit:.0%} of prompt tokens in the prefix cache "
                           "(workload.prefix_hit_rate)")
    if local:
        share = 1.0 - wl.remote_share(local)
        for p in plans:
            p.notes.append(f"prompts of at most {local} tokens ({share:.0%} of requests) planned as prefilled on "
                           "their decode worker (workload.local_prefill_tokens; pp=1 decode instances only)")
    if sp is not None:
        for p in plans:
            p.notes.append(f"decode speculates {sp.tokens} tokens per step at acceptance {sp.acceptance:g} "
                           f"({decs[0].tokens_per_step:.2f} tokens per step)")
    if cfg.colocated_latency is not None and colo is not None:
        for p in plans:
            p.notes.append("colocated engines modelled with colocated_latency (their own coefficients, "
                           "not the pools')")
    plan = plans[-1]
    plan.candidates = [_cand(role, c) for role, cs in (("prefill", pre), ("decode", dec)) for c in cs]
    if colo is not None:
        plan.candidates.append(_cand("colocated", best_by_per_gpu(colo)))
    if len(plans) > 1:
        plan.sweep = plans
    plan.search_s = time.perf_counter() - t0
    return plan


def _cand(role: str, c: PhaseChoice) -> dict[str, object]:
    g = c.goodput
    return {"role": role, "tp": c.lat.tp, "pp": c.lat.pp, "goodput_rps": round(g.rate_rps, 4),
            "per_gpu": round(g.per_gpu, 4), "light_load_attainment": round(g.best_attainment, 4)}


def _size(ctx: PlanContext, wl: Workload, algo: str, pre: list[PhaseChoice], dec: list[PhaseChoice],
          colo: list[PhaseChoice] | None, rate: float | None,
          colo_alt: list[PhaseChoice] | None = None) -> PlacementPlan:
    slo = ctx.cfg.slo
    gpn, total = ctx.gpus_per_node, ctx.total_gpus
    notes: list[str] = []
    unit: Unit | None = None
    if algo == "low-affinity":
        ranked = best_units(pre, dec, gpn, ctx.cfg.search.node_ratios)
        unit = ranked[0] if ranked else None
    if unit is not None:
        bp, bd = unit.prefill, unit.decode
        cap = unit.goodput_rps
        feasible = cap > 0
        units = (math.ceil(rate / cap - 1e-9) if rate else ctx.nodes) if feasible else 1
    else:
        if algo == "low-affinity":
            notes.append("no prefill/decode pair fits in one node; used algorithm 1 (cross-node KV transfer)")
            algo = "high-affinity"
        bp, bd = best_by_per_gpu(pre), best_by_per_gpu(dec)
        feasible = bp.goodput.rate_rps > 0 and bd.goodput.rate_rps > 0
        units = 0
    gp, gd = bp.goodput.rate_rps, bd.goodput.rate_rps
    if not feasible:
        notes.append(f"no configuration meets TTFT<={slo.ttft_s}s and TPOT<={slo.tpot_s}s for "
                     f"{slo.attainment:.0%} of requests even at light load; best light-load attainment: prefill "
                     f"{bp.goodput.best_attainment:.1%} (TP{bp.lat.tp} PP{bp.lat.pp}), decode "
                     f"{bd.goodput.best_attainment:.1%} (TP{bd.lat.tp} PP{bd.lat.pp})")
    for _round in range(8):
        if unit is not None:
            n, m = units * unit.n_prefill, units * unit.n_decode
            goodput = units * unit.goodput_rps
            packing, p_group, d_group = unit_packing(unit.n_prefill, unit.n_decode, unit.gpus, units, gpn)
        else:
            n, m = _pool_counts(feasible, rate, gp, gd, bp.lat.gpus, bd.lat.gpus, total)
            goodput = min(n * gp, m * gd)
            packing, p_group, d_group = pack_nodes(n, bp.lat.gpus, m, bd.lat.gpus, gpn)
        gpus = n * bp.lat.gpus + m * bd.lat.gpus
        if gpus > total or len(packing) > ctx.nodes:
            if _round == 0:
                raise PlacementError(
                    f"rate {rate:g} req/s needs {gpus} GPUs on {len(packing)} node(s) ({n} prefill x TP{bp.lat.tp} "
                    f"PP{bp.lat.pp}, {m} decode x TP{bd.lat.tp} PP{bd.lat.pp}), but the cluster has {total} GPUs "
                    f"({ctx.nodes} nodes x {gpn}); lower workload.rate_rps or add cluster.nodes")
            notes.append("attainment below target at the cluster's size; shown with one pool step less")
            break
        plan_n, plan_m, plan_goodput, plan_packing = n, m, goodput, packing
        sim_rate = rate if rate else max(goodput, 1e-6)
        res = _verify(ctx, bp, bd, n, m, p_group, d_group, sim_rate)
        att = res.attainment(slo.ttft_s, slo.tpot_s)
        if not (rate and feasible and att < slo.attainment):
            break
        if unit is not None:
            units += 1
        elif _phase_shortfall(res, slo.ttft_s, slo.tpot_s) == "prefill":
            gp = min(gp, rate / (n + 1))
        else:
            gd = min(gd, rate / (m + 1))
        notes.append(f"joint attainment {att:.1%} at {n}P/{m}D below target; added capacity")
    price = ctx.gpu_hour_usd
    served = plan_goodput if plan_goodput > 0 else 0.0
    p_cost = plan_n * bp.lat.gpus * price
    d_cost = plan_m * bd.lat.gpus * price
    cost_in = p_cost / (served * wl.mean_input * 3600) * 1e6 if served else math.inf
    cost_out = d_cost / (served * wl.mean_output * 3600) * 1e6 if served else math.inf
    plan_gpus = plan_n * bp.lat.gpus + plan_m * bd.lat.gpus
    chunked = ctx.cfg.search.colocated_chunked_prefill

    def baseline(cs: list[PhaseChoice] | None, chunked_prefill: bool) -> Colocated | None:
        if not cs:
            return None
        # NOTE: on the plan's own GPUs: the best engine shape that fits them (the best overall where none does)
        c = best_by_per_gpu([c for c in cs if c.lat.gpus <= plan_gpus] or cs)
        inst = plan_gpus // c.lat.gpus
        return Colocated(plan_gpus, inst, c.lat.tp, inst * c.goodput.rate_rps, c.goodput.per_gpu, chunked_prefill)

    colocated, colocated_alt = baseline(colo, chunked), baseline(colo_alt, not chunked)
    pct = slo.percentile
    return PlacementPlan(
        prefill=PoolShape(plan_n, bp.lat.tp, bp.lat.pp), decode=PoolShape(plan_m, bd.lat.tp, bd.lat.pp),
        algorithm=algo, rate_rps=rate, goodput_rps=plan_goodput, ttft_s=res.ttft().at(pct),
        tpot_s=res.tpot().at(pct), attainment=att, percentile=pct, cost_per_m_input_usd=cost_in,
        cost_per_m_output_usd=cost_out, prefill_instance_goodput_rps=bp.goodput.rate_rps,
        decode_instance_goodput_rps=bd.goodput.rate_rps, node_packing=plan_packing, colocated=colocated,
        colocated_alt=colocated_alt,
        feasible=feasible, notes=notes, cluster_gpus=total, gpu_hour_usd=price)


def _pool_counts(feasible: bool, rate: float | None, gp: float, gd: float, gpus_p: int, gpus_d: int,
                 total: int) -> tuple[int, int]:
    if not feasible:
        return 1, 1
    if rate:
        return math.ceil(rate / gp - 1e-9), math.ceil(rate / gd - 1e-9)
    best = (1, 1)
    best_rate = -1.0
    for n in range(1, total // gpus_p + 1):
        m = (total - n * gpus_p) // gpus_d
        if m >= 1 and min(n * gp, m * gd) > best_rate:
            best, best_rate = (n, m), min(n * gp, m * gd)
    return best


