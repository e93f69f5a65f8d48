"""The planner loop's pure core (placement/replan.py) and its feeds (cluster/serve/traffic.py,
cluster/control/autoplan.resource_bundles): forecasting, sizing against an independent simulation,
hysteresis, cooldown, online correction, bounded samples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cluster.control.autoplan import resource_bundles
from cluster.control.placer import engine_shape
from cluster.serve.traffic import TrafficLog
from placement.catalog import get_hardware, get_model
from placement.config import SLOSpec
from placement.latency import LatencyModel
from placement.peers import MIN_WORKER_SAMPLES, WORKER_MEMORY, WorkerRatio, WorkerWindow
from placement.replan import Forecaster, LoopSettings, Replanner, Sizes, TrafficWindow, merge_windows
from placement.simulator import simulate_disaggregated

SLO = SLOSpec(ttft_s=0.4, tpot_s=0.03, attainment=0.9)


@pytest.fixture(scope="module")
def lat() -> LatencyModel:
    return LatencyModel.from_catalog(get_model("llama-3.1-8b"), get_hardware("h100-sxm"), tp=1)


def window(i: int, rate: float, rng: np.random.Generator, prompt: tuple[int, int] = (200, 2000),
           length_s: float = 60.0, **kw) -> TrafficWindow:
    n = int(rate * length_s)
    return TrafficWindow(i * length_s, (i + 1) * length_s, n, tuple(int(x) for x in rng.integers(*prompt, 200)),
                         tuple(int(x) for x in rng.integers(50, 400, 200)), **kw)


def test_forecaster_follows_a_ramp_and_reports_its_error() -> None:
    f = Forecaster(0.5, 0.3)
    for r in range(1, 30):
        nxt = f.update(float(r))
    assert f.error is not None and f.error < 0.1  # the last forecast (for 29) was within 10%
    assert 29 < nxt < 31  # the trend is carried one step on


def test_fewest_matches_brute_force() -> None:
    for threshold in range(1, 40):
        for lo in (1, 3, 7):
            for hi in (lo, 10, 33):
                calls: list[int] = []

                def ok(k: int, t=threshold, calls=calls) -> bool:
                    calls.append(k)
                    return k >= t
                want = next((k for k in range(lo, hi + 1) if ok(k)), hi)
                calls.clear()
                assert Replanner._fewest(ok, lo, hi) == want
                assert len(calls) <= 2 * math.ceil(math.log2(hi + 1)) + 2


def test_sizes_meet_the_target_and_one_fewer_does_not(lat: LatencyModel) -> None:
    rp = Replanner(lat, lat, SLO, LoopSettings(max=Sizes(32, 32)))
    rng = np.random.default_rng(1)
    rp._windows.append(window(0, 40, rng))
    wl = rp._workload()
    for rate in (20.0, 60.0, 120.0):
        s = rp.size(wl, rate)
        reqs = rp._workload(rate).at_rate(rate)  # the sample size() plans on (spans 4 request lifetimes)
        # NOTE: an independent check, straight on the simulator
        assert simulate_disaggregated(lat, lat, s.prefill, s.decode, reqs).attainment(SLO.ttft_s, SLO.tpot_s) >= 0.9
        if s.prefill > 1:
            fewer = simulate_disaggregated(lat, lat, s.prefill - 1, s.decode, reqs, mode="prefill")
            assert fewer.attainment(SLO.ttft_s, math.inf) < 0.9 or fewer.attainment(SLO.ttft_s, SLO.tpot_s) < 0.9
    sizes = [rp.size(wl, r) for r in (10.0, 40.0, 160.0)]
    assert sizes[0].prefill <= sizes[1].prefill <= sizes[2].prefill and sizes[2].prefill > sizes[0].prefill


def test_grows_at_once_shrinks_after_down_after_windows_and_cooldown(lat: LatencyModel) -> None:
    rp = Replanner(lat, lat, SLO, LoopSettings(max=Sizes(16, 16), down_after=3, cooldown_s=200.0))
    rng = np.random.default_rng(2)
    cur = Sizes(1, 1)
    d = rp.step(window(0, 150, rng), cur)
    assert d.target.prefill > 1 and d.reason.endswith("grow")  # no waiting on the way up
    cur, peak = d.target, d.target
    held = []
    for i in range(1, 8):
        d = rp.step(window(i, 2, rng), cur)
        held.append(d.target == cur)
        cur = d.target
    # windows 1 and 2 cannot shrink (fewer than 3 windows wanting fewer); at 180 s the cooldown still holds
    assert held[:3] == [True, True, True]
    assert cur.prefill < peak.prefill  # and once both allow it, the pool shrinks
    assert cur.prefill >= 1 and cur.decode >= 1


def test_min_and_max_bound_every_target(lat: LatencyModel) -> None:
    rp = Replanner(lat, lat, SLO, LoopSettings(min=Sizes(2, 2), max=Sizes(3, 3), cooldown_s=0, down_after=1))
    rng = np.random.default_rng(3)
    cur = Sizes(2, 2)
    for i, rate in enumerate((0.5, 500, 500, 0.5, 0.5)):
        d = rp.step(window(i, rate, rng), cur)
        assert 2 <= d.target.prefill <= 3 and 2 <= d.target.decode <= 3
        cur = d.target
    assert rp.decisions[1].wanted.prefill == 3  # 500 req/s wants more than max: capped


def test_corrections_converge_on_how_much_slower_the_machine_is(lat: LatencyModel) -> None:
    rng = np.random.default_rng(4)
    truth = lat.scaled(2.0, 2.0)  # the serving machine: every prefill and decode step twice the model's
    plain = Replanner(lat, lat, SLO, LoopSettings(max=Sizes(32, 32)))
    slow = Replanner(lat, lat, SLO, LoopSettings(max=Sizes(32, 32)))
    w0 = window(0, 30, rng)
    base = plain.step(w0, Sizes(4, 4))
    probe = Replanner(lat, lat, SLO)
    probe._windows.append(w0)
    for i in range(10):
        reqs = probe._workload(30.0).at_rate(30.0)
        res = simulate_disaggregated(truth, truth, 4, 4, reqs)  # what the ingress would have measured
        done = [r for r in res.records if not r.rejected]
        d = slow.step(w0._replace(start_s=i * 60.0, end_s=(i + 1) * 60.0, ttft_s=tuple(r.ttft_s for r in done),
                                  tpot_s=tuple(r.tpot_s for r in done if r.output_len > 1)), Sizes(4, 4))
    assert 1.6 < d.ttft_correction < 2.5 and 1.6 < d.tpot_correction < 2.5
    assert d.wanted.prefill > base.wanted.prefill and d.wanted.decode >= base.wanted.decode


def test_merge_windows_and_prefix_hit_rate() -> None:
    a = TrafficWindow(0, 5, 10, (100,) * 10, (20,) * 8, (0.1,) * 8, (0.01,) * 8, 800, 200)
    b = TrafficWindow(0, 5, 30, (300,) * 30, (40,) * 20, (0.2,) * 20, (0.02,) * 20, 6000, 0)
    m = merge_windows([a, b], 0.0, 10.0)
    assert m.arrivals == 40 and m.rate_rps == 4.0
    assert len(m.prompt_lens) == 40 and m.prefix_hit_rate == pytest.approx(200 / 6800)
    big = merge_windows([b] * 100, 0.0, 10.0, cap=100)
    assert len(big.prompt_lens) <= 100 and big.arrivals == 3000


def test_traffic_log_counts_every_arrival_and_bounds_its_samples() -> None:
    log = TrafficLog(cap=50)
    for i in range(500):
        log.arrival(100 + i, n=2 if i % 10 == 0 else 1)
    for _ in range(300):
        log.finished(120, [30], 0.2, 0.02, cached_tokens=40)
    log.finished(120, [1], 0.3, 0.0, cached_tokens=500)  # one-token output: no TPOT; cached capped at prompt
    w = log.take()
    assert w.arrivals == 550 and len(w.prompt_lens) == 50 and min(w.prompt_lens) >= 100
    assert len(w.ttft_s) == 50 and len(w.tpot_s) == 50
    assert w.prompt_tokens == 301 * 120 and w.cached_tokens == 300 * 40 + 120
    assert w.finished == 301 and w.local_prefills == 0
    nxt = log.take()
    assert nxt.arrivals == 0 and nxt.start_s >= w.end_s
    log.finished(50, [8], 0.1, 0.01, cached_tokens=0, local=True)
    log.finished(900, [8], 0.3, 0.01, cached_tokens=0)
    last = log.take()
    assert (last.finished, last.local_prefills) == (2, 1)


def test_resource_bundles_keep_a_strict_pack_engine_on_one_node() -> None:
    one = engine_shape("cuda", 4, 1, 1.0, 1.0, gpus_per_node=8)
    assert resource_bundles(one, 2) == [{"CPU": 1.0, "GPU": 4.0}] * 2
    spans = engine_shape("cuda", 8, 2, 1.0, 1.0, gpus_per_node=8)
    assert len(resource_bundles(spans, 1)) == 16 and sum(b.get("GPU", 0) for b in resource_bundles(spans, 1)) == 16
    assert resource_bundles(engine_shape("cpu", 1, 1, 1.0, 2.0), 3) == [{"CPU": 2.0}] * 3


def test_the_study_runs_end_to_end_and_the_loop_spends_less_than_the_peak_plan(tmp_path) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "study"
    r = subprocess.run([sys.executable, "-m", "placement", "replan-study", "--out", str(out), "--intervals", "5",
                        "--sample-s", "10"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "results.json").read_text())
    st = res["strategies"]
    assert set(st) == {"fixed_peak", "fixed_mean", "planner_loop"}
    for s in st.values():  # every strategy served the same requests
        assert s["summary"]["requests"] == st["fixed_peak"]["summary"]["requests"] > 0
    assert st["planner_loop"]["summary"]["gpu_hours"] < st["fixed_peak"]["summary"]["gpu_hours"]
    assert len(st["planner_loop"]["decisions"]) == 5 and (out / "day.png").stat().st_size > 1000
    assert res["provenance"]["command"].startswith("python -m placement replan-study")
    bad = subprocess.run([sys.executable, "-m", "placement", "replan-study", "--out", str(out), "--intervals", "1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--intervals >= 2" in bad.stderr


def test_speculation_divides_a_memory_bound_step_by_the_tokens_it_yields(lat: LatencyModel) -> None:
    b, ctx = 1, 1000
    plain = lat.decode_step_time_s(b, ctx)
    none = lat.with_speculation(4, 0.0).decode_step_time_s(b, ctx)
    good = lat.with_speculation(4, 0.8).decode_step_time_s(b, ctx)
    tokens = (1 - 0.8 ** 5) / (1 - 0.8)  # 3.36 tokens per step on average
    assert none >= plain  # nothing accepted: every step pays for verifying 5 tokens and yields one
    assert plain / tokens <= good < plain / tokens * 1.2  # batch 1 is memory-bound: ~the full speed-up
    assert lat.with_speculation(4, 0.8).prefill_time_s([512]) == lat.prefill_time_s([512])
    # at a large batch the verification compute eats the gain
    big = 256
    gain_small = plain / good
    gain_big = lat.decode_step_time_s(big, big * ctx) / lat.with_speculation(4, 0.8).decode_step_time_s(big, big * ctx)
    assert gain_big < gain_small


def test_the_live_loop_plans_with_the_engines_own_step_budget() -> None:
    """engine.max_num_batched_tokens unset (the default): the loop sizes with the budget the engines report
    (vLLM picks one), and a window whose requests queue is sized (every such tick raised TypeError before)."""
    from cluster.config import parse_config
    from cluster.control.pools import PoolController

    cfg = parse_config({"name": "t", "mode": "disaggregated", "engine": {"model": "smollm2"},
                        "pools": {"prefill": 1, "decode": 1}, "slo": {"ttft_ms": 2000, "tpot_ms": 150},
                        "planner_loop": {"mode": "advisory", "max_prefill": 4, "max_decode": 4}})
    assert cfg.engine.max_num_batched_tokens is None
    ctl = PoolController(cfg.model_dump(mode="json"))
    for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        ctl.workers[wid] = {"role": role, "handle": None, "state": "ready", "info": {"max_num_batched_tokens": 2048}}
    rp = ctl.planner.replanner()
    assert rp.settings.max_prefill_tokens == 2048 and rp.settings.chunked_prefill  # unset: vLLM's default, on
    d = rp.step(window(0, 4.0, np.random.default_rng(0), prompt=(200, 600), length_s=10.0), Sizes(1, 1))
    assert d.target.prefill > 1  # 4 req/s of 200-600-token prompts queue on one CPU prefill engine


def test_the_live_loop_plans_a_speculating_pool_at_its_measured_acceptance() -> None:
    """pool_engines.decode.speculative: once the decode engines report an acceptance rate, the loop's decode
    model is LatencyModel.with_speculation at their mean (faster per output token), as the router's is."""
    from cluster.config import parse_config
    from cluster.control.pools import PoolController
    from engine.contract import WorkerStats

    cfg = parse_config({"name": "t", "mode": "disaggregated", "engine": {"model": "smollm2"},
                        "pool_engines": {"decode": {"speculative": {"num_speculative_tokens": 3}}},
                        "pools": {"prefill": 1, "decode": 2}, "planner_loop": {"mode": "advisory"}})
    ctl = PoolController(cfg.model_dump(mode="json"))

    # NOTE: the stats each worker's last health check fetched
    for wid, role, a in (("prefill-0", "prefill", None), ("decode-0", "decode", 0.5), ("decode-1", "decode", 0.7)):
        ctl.workers[wid] = {"role": role, "handle": None, "state": "ready", "info": {},
                            "stats": WorkerStats(wid, role, "", 0, 0, 0, 0, 0.0, 5760, (), True, 0.0, a)}
    loop = ctl.planner
    rp = loop.replanner()
    plain = rp.decode_lat
    rp.tpot_corr = 1.7  # learnt against the plain model
    loop._speculation(rp)
    assert loop.acceptance == 0.6 and rp.tpot_corr == 1.0 and rp.decode_lat.tokens_per_step > 1
    assert rp.decode_lat.decode_step_time_s(4, 1600) < plain.decode_step_time_s(4, 1600)
    assert rp.prefill_lat is not rp.decode_lat and loop.status()["speculative_acceptance"] == 0.6


def _two_windows(lat: LatencyModel, seed: int, prompt: tuple[int, int], edit) -> tuple:
    """The decision after two 40 req/s windows, each edited by `edit(window)`, and the loop's prompt sample."""
    rp = Replanner(lat, lat, SLO, LoopSettings(max=Sizes(32, 32), history=2))
    rng = np.random.default_rng(seed)
    d = None
    for i in range(2):
        d = rp.step(edit(window(i, 40.0, rng, prompt=prompt)), Sizes(1, 1))
    return d, sorted(n for w in rp._windows for n in w.prompt_lens)


def test_prefix_cache_hits_the_engines_report_shrink_the_prefill_pool(lat: LatencyModel) -> None:
    """Windows whose engines served 80% of the prompt tokens from their prefix caches: the loop plans fewer
    prefill engines for the same arrivals than with no hits, the decode pool is unchanged, and the
    decision reports the hit rate it planned with."""
    def plan(hit: float):
        def edit(w: TrafficWindow) -> TrafficWindow:
            tokens = sum(w.prompt_lens) * 12  # NOTE: the finished requests' totals (the lengths are a sample)
            return w._replace(prompt_tokens=tokens, cached_tokens=int(hit * tokens))
        return _two_windows(lat, 3, (2000, 6000), edit)[0]

    cold, warm = plan(0.0), plan(0.8)
    assert warm.prefix_hit_rate == pytest.approx(0.8, abs=1e-3) and cold.prefix_hit_rate == 0.0
    assert warm.wanted.prefill < cold.wanted.prefill, (warm.wanted, cold.wanted)
    assert warm.wanted.decode == cold.wanted.decode


def test_local_prefills_the_router_placed_move_prefill_work_to_the_decode_pool(lat: LatencyModel) -> None:
    """Windows where the router prefilled half the finished requests on their decode workers: the loop
    simulates the shortest half of the prompts as local prefills (the decision shows the length), so it
    wants no more prefill engines and no fewer decode engines than with every prompt prefilled remotely."""
    def plan(local: int):
        return _two_windows(lat, 5, (200, 2000), lambda w: w._replace(finished=100, local_prefills=local))

    (remote, _), (half, prompts) = plan(0), plan(50)
    assert remote.local_prefill_tokens == 0
    assert half.local_prefill_tokens == prompts[len(prompts) // 2 - 1]
    assert half.wanted.prefill <= remote.wanted.prefill and half.wanted.decode >= remote.wanted.decode
    assert half.wanted != remote.wanted, (half.wanted, remote.wanted)


def test_a_colocated_loop_simulates_the_chunked_prefill_its_engines_run() -> None:
    """A colocated pool whose engines report chunked prefill off is simulated with prefill batches that
    stall the decodes, one with it on with prompt chunks inside the decode steps: at the same traffic the
    stalling engines need at least as many instances, and the setting reaches the simulation."""
    from cluster.config import parse_config
    from cluster.control.pools import PoolController

    def loop(chunked: bool):
        cfg = parse_config({"name": "t", "mode": "colocated", "engine": {"model": "smollm2"},
                            "pools": {"colocated": 1}, "slo": {"ttft_ms": 3000, "tpot_ms": 120},
                            "planner_loop": {"mode": "advisory", "max_decode": 8}})
        ctl = PoolController(cfg.model_dump(mode="json"))
        ctl.workers["colocated-0"] = {"role": "colocated", "handle": None, "state": "ready",
                                      "info": {"max_num_batched_tokens": 512, "chunked_prefill": chunked}}
        return ctl.planner.replanner()

    stall, chunk = loop(False), loop(True)
    assert not stall.settings.chunked_prefill and chunk.settings.chunked_prefill
    w = window(0, 1.5, np.random.default_rng(5), prompt=(300, 1500), length_s=20.0)
    a, b = stall.step(w, Sizes(0, 1)), chunk.step(w, Sizes(0, 1))
    assert a.wanted.decode >= b.wanted.decode, (a.wanted, b.wanted)
    reqs = stall._workload(1.5).at_rate(1.5)
    assert stall._sim(reqs, Sizes(0, 2)).tpot().p90 > chunk._sim(reqs, Sizes(0, 2)).tpot().p90


def _served(rng: np.random.Generator, workers: dict[tuple[str, str], tuple[float, float]], n: int = 12
            ) -> tuple[WorkerWindow, ...]:
    """Each (worker, role) with `n` TTFT and TPOT samples around its given medians (+-5% noise)."""
    def around(x: float) -> tuple[float, ...]:
        return tuple(float(v) for v in x * rng.uniform(0.95, 1.05, n))
    return tuple(WorkerWindow(w, role, around(t), around(d)) for (w, role), (t, d) in workers.items())


def test_the_loop_finds_the_worker_slower_than_its_pool_and_drains_it_first(lat: LatencyModel) -> None:
    """Three decode workers, one decoding at twice the others' TPOT (a degraded node): after a few windows its
    TPOT ratio is ~2 and the others' ~1, the decision names it first to drain, a worker's samples gather
    over windows until there are enough to move its ratio, and one that stops reporting leaves the list."""
    rp = Replanner(lat, lat, SLO, LoopSettings(max=Sizes(8, 8)))
    rng = np.random.default_rng(7)
    served = {("p0", "prefill"): (0.2, 0.0), ("d0", "decode"): (0.1, 0.02), ("d1", "decode"): (0.1, 0.02),
              ("d2", "decode"): (0.1, 0.04)}
    for i in range(6):
        d = rp.step(window(i, 5, rng, workers=_served(rng, served)), Sizes(1, 3))
    ratios = {w.worker: w for w in d.workers}
    assert set(ratios) == {"p0", "d0", "d1", "d2"}
    assert 1.7 < ratios["d2"].tpot < 2.2 and all(0.85 < ratios[w].tpot < 1.15 for w in ("d0", "d1"))
    assert ratios["p0"].ttft == pytest.approx(1.0, abs=0.05)  # a pool of one is its own reference
    assert d.drain_order("decode") == ["d2"] and d.drain_order("prefill") == []
    assert ratios["d2"].requests == 6 * 12
    # too few samples: the ratio waits for the next window's, then moves on all of them
    def sparse(i: int, n: int) -> dict[str, WorkerRatio]:
        ws = _served(rng, {("d2", "decode"): (0.1, 0.4)}, n) + _served(rng, {("d0", "decode"): (0.1, 0.02)})
        return {w.worker: w for w in rp.step(window(i, 5, rng, workers=ws), Sizes(1, 3)).workers}

    before = ratios["d2"].tpot
    assert sparse(6, MIN_WORKER_SAMPLES - 1)["d2"].tpot == before
    assert sparse(7, 1)["d2"].tpot > before * 1.5  # ~20x its pool's median, at weight 0.3
    # the listing is bounded: a worker gone for WORKER_MEMORY windows is dropped
    for i in range(WORKER_MEMORY):
        d = rp.step(window(8 + i, 5, rng, workers=_served(rng, {("d0", "decode"): (0.1, 0.02)})), Sizes(1, 1))
    assert [w.worker for w in d.workers] == ["d0"]
    assert d.as_dict()["workers"][0]["worker"] == "d0"


def test_the_ttft_correction_learns_from_the_prefill_pools_prompts(lat: LatencyModel) -> None:
    """Windows whose remote prefills measure what the model predicts but whose local prefills on decode
    workers (as many) are 5x slower: told which worker computed which prompt, the TTFT correction stays near 1; from
    the pooled samples alone it is pulled away."""
    rng = np.random.default_rng(8)
    probe = Replanner(lat, lat, SLO)
    probe._windows.append(window(0, 20, rng))
    reqs = probe._workload(20.0).at_rate(20.0)
    res = simulate_disaggregated(lat, lat, 4, 4, reqs)
    done = [r for r in res.records if not r.rejected]
    remote = tuple(r.ttft_s for r in done)
    local = tuple(5 * x for x in remote)  # NOTE: as many local prefills, each 5x slower

    def correction(tell: bool) -> float:
        rp = Replanner(lat, lat, SLO, LoopSettings(max=Sizes(32, 32)))
        for i in range(5):
            w = window(i, 20, rng, ttft_s=remote + local, tpot_s=tuple(r.tpot_s for r in done if r.output_len > 1))
            if tell:
                w = w._replace(workers=(WorkerWindow("p0", "prefill", remote), WorkerWindow("d0", "decode", local)))
            d = rp.step(w, Sizes(4, 4))
        return d.ttft_correction

    told, pooled = correction(True), correction(False)
    assert 0.8 < told < 1.25, told
    assert pooled > told * 1.5, (pooled, told)


def test_traffic_log_and_merge_keep_each_workers_samples() -> None:
    """The ingress files a request's TTFT under the worker that computed its prompt and its TPOT under the one
    that decoded it (a one-token request has no TPOT); merged windows join a worker's samples."""
    log = TrafficLog(cap=50)
    for _ in range(10):
        log.finished(100, [8], 0.3, 0.02, 0, prompt_by=[("p0", "prefill")], decoded_by=[("d0", "decode")])
    log.finished(100, [8], 0.1, 0.03, 0, local=True, prompt_by=[("d1", "decode")], decoded_by=[("d1", "decode")])
    log.finished(100, [1], 0.2, 0.0, 0, prompt_by=[("p0", "prefill")], decoded_by=[("d0", "decode")])
    a = log.take()
    by = {(w.worker, w.role): w for w in a.workers}
    assert set(by) == {("p0", "prefill"), ("d0", "decode"), ("d1", "decode")}
    assert len(by["p0", "prefill"].ttft_s) == 11 and by["p0", "prefill"].tpot_s == ()
    assert by["d0", "decode"].ttft_s == () and len(by["d0", "decode"].tpot_s) == 10
    assert by["d1", "decode"].ttft_s == (0.1,) and by["d1", "decode"].tpot_s == (0.03,)
    b = TrafficWindow(5, 10, 1, (100,), (8,), workers=(WorkerWindow("p0", "prefill", (0.5,)),))
    m = merge_windows([a, b], a.start_s, 10.0)
    assert len({(w.worker, w.role): w for w in m.workers}["p0", "prefill"].ttft_s) == 12


def test_a_shrink_drains_the_named_slow_workers_first_then_the_newest() -> None:
    from cluster.control.pools import drain_choice

    ready = ["d0", "d1", "d2", "d3"]  # oldest first
    assert drain_choice(ready, [], 2) == ["d3", "d2"]
    assert drain_choice(ready, ["d1"], 2) == ["d1", "d3"]
    assert drain_choice(ready, ["gone", "d0", "d0"], 1) == ["d0"]  # a named worker no longer ready is skipped
    assert drain_choice(ready, ["d0"], 0) == []


def test_the_metrics_export_each_workers_ratio_and_forget_a_departed_one() -> None:
    from cluster.serve.metrics import Metrics

    m = Metrics()
    base = {"target": {"prefill": 1, "decode": 2}, "wanted": {"prefill": 1, "decode": 2}, "observed_rps": 1.0,
            "forecast_rps": 1.0, "predicted_goodput_rps": 1.0}
    m.planner({"decision": {**base, "workers": [{"worker": "d2", "role": "decode", "ttft": None, "tpot": 2.0,
                                                 "requests": 9}]}})
    text = m.render().decode()
    assert 'saaf_planner_worker_ratio{kind="tpot",role="decode",worker="d2"} 2.0' in text
    assert 'kind="ttft",role="decode",worker="d2"' not in text  # no sample, no figure
    m.planner({"decision": {**base, "workers": []}})
    assert 'worker="d2"' not in m.render().decode()
