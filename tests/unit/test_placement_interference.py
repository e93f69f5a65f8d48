"""What colocation and pipelining cost: prefill-decode interference (stall and chunked prefill), pipeline
bubbles and hops, the per-GPU colocated ratio, and the closed-loop steady state."""

from __future__ import annotations

import pytest

from placement import (
    Coefficients,
    LatencyModel,
    LatencySpec,
    LengthDist,
    Request,
    WorkloadSpec,
    get_hardware,
    get_model,
    parse_planner_config,
    simulate_colocated,
    simulate_disaggregated,
)
from placement.latency import stage_shares
from placement.planner import make_plan
from placement.predict import predict
from placement.sim_instances import Pipeline
from placement.workload import Workload

OPT13B = Coefficients(prefill_a=0.0948, prefill_b=4.03e-6, prefill_c=18.89, decode_a=6.11e-4, decode_b=0.0682,
                      decode_c=19.88)


def llama8b(tp: int = 1, pp: int = 1, **spec: float) -> LatencyModel:
    return LatencyModel.from_catalog(get_model("llama-3.1-8b"), get_hardware("h100-sxm"), tp=tp, pp=pp,
                                     spec=LatencySpec(**spec))


def opt13b(tp: int = 1, pp: int = 1) -> LatencyModel:
    return LatencyModel.from_catalog(get_model("opt-13b"), get_hardware("a100-80gb"), tp=tp, pp=pp,
                                     weight_dtype="fp16", kv_dtype="fp16", spec=LatencySpec(coefficients={1: OPT13B}))


def long_prompts(rate: float, n: int = 300) -> list[Request]:
    spec = WorkloadSpec(input=LengthDist(kind="fixed", value=3000), output=LengthDist(kind="fixed", value=200))
    return Workload.from_spec(spec, n, seed=3).at_rate(rate)


@pytest.mark.parametrize("chunked", [False, True])
def test_colocated_tpot_grows_with_the_prefill_rate(chunked: bool) -> None:
    lat = llama8b()
    tpots = [simulate_colocated(lat, 1, long_prompts(rate), chunked_prefill=chunked, max_prefill_tokens=4096)
             .tpot().p50 for rate in (0.5, 2.0, 6.0)]
    assert tpots[0] < tpots[1] < tpots[2], tpots
    assert tpots[2] > 1.5 * tpots[0], tpots
    # The same requests on a decode instance of their own see no prefill at all.
    alone = simulate_disaggregated(lat, lat, 1, 1, long_prompts(6.0), mode="decode").tpot().p50
    assert tpots[2] > 1.3 * alone


def test_mixed_step_shares_one_pass_over_the_weights() -> None:
    lat = llama8b()
    dec = lat.decode_step_time_s(32, 32 * 2000)
    pre = lat.prefill_time_from_sums(2048, 2048 * 2048)
    mixed = lat.mixed_step_time_s(2048, 2048 * 2048, 32, 32 * 2000)
    assert max(dec, pre) < mixed < dec + pre  # slower than decode alone, cheaper than two steps
    assert lat.mixed_step_time_s(0, 0, 32, 32 * 2000) == dec and lat.mixed_step_time_s(2048, 2048**2, 0, 0) == pre
    reg = opt13b()  # DistServe's regression terms simply add up, minus one step's fixed cost
    got = reg.mixed_step_time_s(512, 512 * 512, 16, 16 * 600)
    want = reg.prefill_time_s([512]) + reg.decode_step_time_s(16, 16 * 600) - 18.89e-3
    assert got == pytest.approx(want)


def test_chunked_prefill_spreads_a_long_prompt_over_decode_steps() -> None:
    lat = llama8b()
    reqs = [Request(0.0, 100, 400) for _ in range(8)] + [Request(0.5, 16000, 2)]
    stall = simulate_colocated(lat, 1, reqs, max_prefill_tokens=16384)
    chunk = simulate_colocated(lat, 1, reqs, max_prefill_tokens=2048, chunked_prefill=True)
    # Without chunking the 16k prompt freezes the eight decodes for one long step; with 2k chunks
    # their worst step is far shorter, and the long prompt takes longer to its first token.
    gap_stall = max(r.tpot_s for r in stall.records[:8])
    gap_chunk = max(r.tpot_s for r in chunk.records[:8])
    assert gap_chunk < gap_stall
    assert chunk.records[8].ttft_s > stall.records[8].ttft_s
    assert chunk.completed == stall.completed == 9


def test_stage_shares_put_the_lm_head_on_the_last_stage() -> None:
    shares = stage_shares(get_model("llama-3.1-8b"), 4)
    assert sum(shares) == pytest.approx(1.0) and len(shares) == 4
    assert shares[-1] == max(shares) > 0.25 + 0.01
    assert stage_shares(get_model("llama-3.1-8b"), 1) == (1.0,)


def test_pipeline_driver_and_hops_leave_bubbles() -> None:
    lat = llama8b(pp=2)
    serial, stages, hop = lat.stage_split(0.010, 64)
    assert serial == pytest.approx(0.003) and hop > 0 and stages[1] > stages[0]
    assert serial + sum(stages) + hop == pytest.approx(0.010)
    # Ten 10 ms micro-batches on two stages; an even split with nothing serial would finish in 55 ms.
    free = Pipeline.of(2)
    assert [free.run(0.0, 0.010) for _ in range(10)][-1] == pytest.approx(0.055)
    # No driver cost: the last stage (it also holds the LM head) sets the pace.
    head = Pipeline.of(2, llama8b(pp=2, step_overhead_ms=0.0, pp_hop_latency_ms=0.0))
    assert [head.run(0.0, 0.010, 64) for _ in range(10)][-1] > 0.055 + 0.001
    # A driver that spends 6 ms of each step scheduling and sampling admits one micro-batch per 6 ms.
    busy = Pipeline.of(2, llama8b(pp=2, step_overhead_ms=6.0))
    assert [busy.run(0.0, 0.010, 64) for _ in range(10)][-1] >= 0.010 + 9 * 0.006 - 1e-9


def test_pp2_prefill_is_not_twice_the_throughput_for_free() -> None:
    spec = WorkloadSpec(input=LengthDist(kind="fixed", value=2048), output=LengthDist(kind="fixed", value=1))
    reqs = Workload.from_spec(spec, 400, seed=1).at_rate(1000.0)  # saturating: always a queue
    one = simulate_disaggregated(llama8b(), llama8b(), 1, 1, reqs, mode="prefill", max_prefill_tokens=2048)
    two = simulate_disaggregated(llama8b(pp=2), llama8b(), 1, 1, reqs, mode="prefill", max_prefill_tokens=2048)
    ratio = two.requests_per_s() / one.requests_per_s()
    assert 1.2 < ratio < 1.98, ratio  # the unequal stages and the hop cost even a full pipeline
    # One client (no second batch to overlap): PP2 is slower than PP1 per request, not twice as fast.
    one_c = simulate_disaggregated(llama8b(), llama8b(), 1, 1, reqs[:50], mode="prefill", clients=1, same_node=True)
    two_c = simulate_disaggregated(llama8b(pp=2), llama8b(), 1, 1, reqs[:50], mode="prefill", clients=1,
                                   same_node=True)
    assert two_c.requests_per_s() < one_c.requests_per_s()
    assert two_c.ttft().p50 > one_c.ttft().p50


def test_pp2_decode_pays_for_its_driver() -> None:
    reqs = [Request(0.0, 256, 200) for _ in range(64)]
    one = simulate_disaggregated(llama8b(), llama8b(), 1, 1, reqs, mode="decode")
    two = simulate_disaggregated(llama8b(), llama8b(pp=2), 1, 1, reqs, mode="decode")
    ratio = two.output_tok_s() / one.output_tok_s()
    assert ratio < 1.5, ratio  # twice the GPUs, far from twice the tokens
    assert two.tpot().p50 > 0.9 * one.tpot().p50  # and no faster per token


def test_decode_fast_path_matches_step_by_step_arithmetic() -> None:
    """Steps run back to back in one event give the times of one event per step, also when a request
    arrives in the middle of such a run (it joins at the next step boundary)."""
    lat = llama8b()
    res = simulate_disaggregated(lat, lat, 1, 1, [Request(0.0, 300, 50), Request(0.05, 200, 20)], mode="decode")
    t, batch, ctx, done, joined, k, start = 0.0, 1, 301, {}, False, 0, 0
    while len(done) < 2:
        t += lat.decode_step_time_s(batch, ctx)
        k += 1
        ctx += batch
        if k == 49:
            done[0] = t
            batch, ctx = batch - 1, ctx - (301 + 49)
        if joined and k - start == 19:
            done[1] = t
            batch, ctx = batch - 1, ctx - (201 + 19)
        if not joined and t >= 0.05:
            joined, start, batch, ctx = True, k, batch + 1, ctx + 201
    assert res.records[0].finish_s == pytest.approx(done[0], rel=1e-12)
    assert res.records[1].finish_s == pytest.approx(done[1], rel=1e-12)


def test_closed_loop_prediction_is_a_steady_state_not_a_burst() -> None:
    kw = dict(model="llama-3.1-70b", hardware="b200", weight_dtype="fp8", kv_dtype="fp8", mode="colocated",
              isl=1024, osl=256, requests=64, backend="none")
    steady = predict(concurrency=16, **kw)
    lat = LatencyModel.from_catalog(get_model("llama-3.1-70b"), get_hardware("b200"), weight_dtype="fp8",
                                    kv_dtype="fp8")
    reqs = [Request(0.0, 1024, 256)] * 80
    burst = simulate_colocated(lat, 1, reqs, clients=16, max_prefill_tokens=4096)
    assert steady["ttft_s"]["mean"] < 0.6 * burst.ttft().mean
    # One prefill of 1024 tokens plus the step it waits for, not four batches of four.
    assert steady["ttft_s"]["p50"] < 2.5 * lat.prefill_time_s([1024])
    assert steady["completed"] == 64


def test_colocated_ratio_is_per_gpu_and_tight_tpot_favours_disaggregation() -> None:
    cfg = {"model": {"name": "opt-13b", "weight_dtype": "fp16", "kv_dtype": "fp16"}, "hardware": {"name": "a100-80gb"},
           "cluster": {"nodes": 1},
           "workload": {"rate_rps": 4.0, "input": {"kind": "fixed", "value": 512},
                        "output": {"kind": "fixed", "value": 64}},
           "slo": {"ttft_s": 0.4, "tpot_s": 0.04}, "latency": {"coefficients": {1: OPT13B.model_dump()}},
           "search": {"tp_options": [1], "max_pp": 1, "requests": 300}}
    plan = make_plan(parse_planner_config(cfg))
    assert plan.colocated is not None and plan.colocated_ratio is not None
    assert plan.colocated_ratio == pytest.approx(plan.goodput_per_gpu / plan.colocated.goodput_per_gpu)
    # DistServe's Figure 1 setting (13B, 512/64, TPOT 40 ms): every prefill breaks the decodes' TPOT.
    assert plan.colocated_ratio > 1.5
