"""The router's latency model fitted on the serving machine: the fit (placement.profile_fit), the swap in
the goodput policy, the quiet-engine rule of the sampler (engine/calibrate.py) and its cache files."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.config import RouterConfig, SLOConfig
from cluster.control.calibration import calibrate, calibrations
from cluster.router import RouteRequest, make_policy
from engine import calibrate as sampler
from engine.contract import WorkerStats
from engine.procs import ForeignCores, cpu_seconds, tree
from placement.profile_fit import fit_coefficients

TRUE = dict(prefill_a=2.5, prefill_b=0.0004, prefill_c=60.0, decode_a=0.01, decode_b=4.0, decode_c=50.0)


def synthetic() -> sampler.Samples:
    pre = [(n, n * n, TRUE["prefill_a"] * n + TRUE["prefill_b"] * n * n + TRUE["prefill_c"]) for n in (32, 128, 256, 512)]
    dec = [(b, b * c, TRUE["decode_a"] * b * c + TRUE["decode_b"] * b + TRUE["decode_c"])
           for b, c in sampler.DECODE_POINTS]
    return sampler.Samples(pre, dec, 1.0)


def test_fit_recovers_the_coefficients_of_exact_samples() -> None:
    s = synthetic()
    coeffs, p_r2, d_r2 = fit_coefficients(s.prefill, s.decode)
    for k, v in TRUE.items():
        assert getattr(coeffs, k) == pytest.approx(v, rel=1e-3, abs=1e-6), k
    assert p_r2 > 0.999 and d_r2 > 0.999
    with pytest.raises(ValueError, match="need >= 3 samples"):
        fit_coefficients(s.prefill[:2], s.decode)


class Handle:
    """Stands in for a worker's actor handle: `calibration_samples.remote(cached)` returns an awaitable;
    `cache` is what the worker's node has cached (None: nothing); `samples` one measurement, or a list of
    them in turn (the last repeats)."""

    def __init__(self, samples: sampler.Samples | list[sampler.Samples],
                 cache: sampler.Samples | None = None) -> None:
        self.calls: list[bool] = []
        outer = self
        todo = list(samples) if isinstance(samples, list) else [samples]

        class Method:
            def remote(self, cached: bool = True):
                outer.calls.append(cached)

                async def answer():
                    if cached:
                        return None if cache is None else (cache, "cache", "key")
                    return (todo.pop(0) if len(todo) > 1 else todo[0]), "measured on w", "key"
                return answer()
        self.calibration_samples = Method()


def test_colocated_calibration_asks_its_one_worker_once() -> None:
    h = Handle(synthetic())
    cal = asyncio.run(calibrate(h, None))
    assert h.calls == [False] and cal.prefill_r2 > 0.999 and cal.coefficients.decode_b == pytest.approx(4.0, rel=1e-3)


def test_a_cached_model_is_used_as_it_is_and_nothing_is_measured() -> None:
    """A restart on the same machine (same key: hardware, engine settings, model files, vLLM) reuses the
    cache and puts no measurement on the engines."""
    old = sampler.Samples([(n, n * n, 3 * ms) for n, _, ms in synthetic().prefill],
                          [(b, c, 3 * ms) for b, c, ms in synthetic().decode], 1.0)
    published = []
    p, d = Handle(synthetic(), cache=old), Handle(synthetic(), cache=old)
    asyncio.run(calibrations(p, d, published.append))
    assert [c.source for c in published] == ["prefill cache, decode cache"]
    assert published[0].coefficients.prefill_a == pytest.approx(3 * TRUE["prefill_a"], rel=1e-3)
    assert p.calls == [True] and d.calls == [True]
    published.clear()
    asyncio.run(calibrations(Handle(synthetic()), Handle(synthetic()), published.append))  # no cache yet
    assert len(published) == 1 and "measured" in published[0].source


def test_a_measurement_under_load_is_never_published_and_is_tried_again() -> None:
    """Samples that traffic or another process overlapped are slower than the engine: a model fitted on them
    would refuse what the engines can serve. Not published; tried again until one is clean."""
    busy = synthetic()._replace(clean=False, foreign_cores=1.4)
    p, d = Handle([busy, busy, synthetic()]), Handle([busy, synthetic()])
    published = []
    cal = asyncio.run(calibrations(p, d, published.append, delays_s=(0.0,), every_s=0.0, tries=5))
    assert published == [cal] and cal.coefficients.prefill_a == pytest.approx(TRUE["prefill_a"], rel=1e-3)
    # prefill unclean twice (decode not asked then), then prefill clean + decode unclean, then both clean
    assert p.calls == [True, False, False, False, False] and d.calls == [False, False]


def test_the_sampler_counts_other_processes_load_and_looks_before_measuring() -> None:
    """Cores used outside the worker's process tree (here a busy loop that is not our descendant) are
    seen; a busy box or engine is refused after a look, without a single measured request."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = subprocess.run(["sh", "-c", f"{sys.executable} -c 'import time\nt=time.time()+20\nwhile time.time()<t: "
                                      "pass' >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, timeout=10)
    pid = int(out.stdout.strip())
    try:
        assert pid not in sampler_tree()
        # NOTE: on a box other tenants already load, the loop gets what share of a core it can: the sampler must
        # see at least what the loop used (its own CPU ticks), not a fixed amount more than before it started
        t0, loop0, f = time.monotonic(), cpu_seconds([pid]), ForeignCores()
        time.sleep(1.0)
        seen, loop = f.cores(), (cpu_seconds([pid]) - loop0) / (time.monotonic() - t0)
        assert loop > 0.2 and seen >= 0.8 * loop, (seen, loop)
        host = FakeHost()
        host._generate = None  # NOTE: the look must refuse before any request could run
        t0 = time.monotonic()
        s = asyncio.run(sampler.measure(host, 1000, foreign_max=0.3))
        assert not s.clean and s.prefill == [] and s.foreign_cores > 0.3 and time.monotonic() - t0 < 3
    finally:
        os.kill(pid, signal.SIGKILL)
    host = FakeHost()
    host._pending["chatcmpl-x"] = 50
    s = asyncio.run(sampler.measure(host, 1000, foreign_max=100.0))
    assert not s.clean and s.decode == []
    assert sampler.foreign_limit(1, cpus=2) == 0.5 and sampler.foreign_limit(8, cpus=8) == 0.3


def sampler_tree() -> list[int]:
    import os

    return tree(os.getpid())


def test_the_goodput_policy_predicts_with_the_calibrated_model() -> None:
    def fresh():
        return make_policy("goodput", router_cfg=RouterConfig(), slo=SLOConfig())

    p = [WorkerStats("p", "prefill", "", 0, 0, 0, 0, 0.0, 5760, (), True, 0.0)]
    d = [WorkerStats("d", "decode", "", 0, 0, 0, 0, 0.0, 5760, (), True, 0.0)]
    req = RouteRequest(400, 16, 2.0, 0.2)
    before = fresh()(req, p, d).predicted_ttft_s
    policy = fresh()
    policy._state("p").ttft_ratio = 3.0  # an online correction learnt against the bundled profile
    coeffs, _, _ = fit_coefficients(*synthetic()[:2])
    policy.calibrate(coeffs)
    after = policy(req, p, d).predicted_ttft_s
    prefill_s = (TRUE["prefill_a"] * 400 + TRUE["prefill_b"] * 400 ** 2 + TRUE["prefill_c"]) / 1e3
    assert after != pytest.approx(before, rel=0.05)
    assert prefill_s * 0.999 <= after <= prefill_s + 0.1  # plus the KV transfer, if remote
    assert policy.states["p"].ttft_ratio == 1.0 and policy.describe()["latency_model"] == "calibrated"


def test_calibration_is_on_only_where_no_latency_model_was_chosen() -> None:
    assert RouterConfig().calibrates()
    assert not RouterConfig(policy="least_loaded").calibrates()
    assert not RouterConfig(latency_profile="x.yaml").calibrates()
    assert not RouterConfig(calibrate=False).calibrates()


class FakeHost:
    def __init__(self) -> None:
        self._pending: dict[str, int] = {}
        self._running_ctx: dict[str, int] = {}


def test_samples_wait_for_an_engine_without_serving_traffic() -> None:
    host = FakeHost()
    assert sampler._quiet(host)
    host._running_ctx["calib-1"] = 10
    assert sampler._quiet(host)  # its own requests
    host._pending["chatcmpl-x"] = 50
    assert not sampler._quiet(host)


def test_a_measurement_gives_way_to_serving_traffic_at_once() -> None:
    """A request that arrives while the engine measures itself must not wait for the measurement: the
    sampler aborts its own requests within a poll and reports the samples unclean."""
    import time

    class SlowHost(FakeHost):
        def __init__(self) -> None:
            super().__init__()
            self.closed: list[str] = []

        async def _generate(self, rid, ids, params):
            self._running_ctx[rid] = len(ids)
            try:
                for _ in range(1000):  # NOTE: bounded: ~10 s if nothing gave way
                    await asyncio.sleep(0.01)
                    yield None
            finally:
                self._running_ctx.pop(rid, None)
                self.closed.append(rid)

    async def main() -> tuple:
        host = SlowHost()
        task = asyncio.ensure_future(sampler.measure(host, 1000))
        await asyncio.sleep(0.3)
        assert host._running_ctx and all(r.startswith("calib-") for r in host._running_ctx)
        host._pending["chatcmpl-y"] = 40  # serving traffic arrives
        t0 = time.monotonic()
        s = await asyncio.wait_for(task, 5)
        return s, time.monotonic() - t0, host

    s, waited, host = asyncio.run(main())
    assert not s.clean and s.prefill == [] and waited < 0.5, (s, waited)
    assert host.closed and not host._running_ctx  # its engine requests were ended, not left to run


def test_cache_files_are_written_whole(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SAAF_CACHE_DIR", str(tmp_path))
    s = synthetic()
    sampler.store("k1", s)
    assert sampler.load_cached("k1") == sampler.Samples([tuple(r) for r in s.prefill],
                                                        [tuple(r) for r in s.decode], 1.0, True, 0.0)
    assert [p.name for p in (tmp_path / "profiles").iterdir()] == ["k1.json"]  # no temporary left
    (tmp_path / "profiles" / "k2.json").write_text("{\"prefill\": ")  # a torn file reads as absent
    assert sampler.load_cached("k2") is None
    assert json.loads((tmp_path / "profiles" / "k1.json").read_text())["clean"] is True


def _host(pending: dict[str, int], running: dict[str, int], engine_waiting: int, engine_running: int):
    """What EngineHost.stats reads, with the engine's own counts (which include a measurement's requests)."""
    from types import SimpleNamespace

    totals = SimpleNamespace(waiting=engine_waiting, running=engine_running, kv_usage=0.1, spec_drafted=0,
                             spec_accepted=0, recent_steps=lambda: (0.3, 0.3))
    sched = SimpleNamespace(max_num_batched_tokens=2048)
    vc = SimpleNamespace(scheduler_config=sched, cache_config=SimpleNamespace(enable_prefix_caching=False))
    return SimpleNamespace(totals=totals, _pending=pending, _running_ctx=running, _pulling={}, worker_id="p-0",
                           role="prefill", node_id="n", num_gpu_blocks=10, block_size=16,
                           engine=SimpleNamespace(errored=False, vllm_config=vc))


def test_a_measurement_is_not_load_in_the_stats_the_router_reads() -> None:
    """The first request after start used to queue behind (and be refused for) the calibration's own
    512-token prefill: the router must see an idle worker while only a measurement runs."""
    from engine.host import EngineHost

    s = EngineHost.stats(_host({"calib-a": 512}, {"calib-b": 96, "calib-c": 96}, 1, 2))
    assert (s.waiting, s.running, s.queued_prompt_tokens, s.running_context_tokens) == (0, 0, 0, 0)
    assert s.calibrating == 3 and s.recent_step_times_s == ()  # its steps teach the corrections nothing
    s = EngineHost.stats(_host({"calib-a": 512, "cmpl-x": 40}, {"cmpl-y": 70}, 2, 1))
    assert (s.waiting, s.running, s.queued_prompt_tokens, s.running_context_tokens) == (1, 1, 40, 70)
    s = EngineHost.stats(_host({"cmpl-x": 40}, {}, 3, 1))  # no measurement: the engine's counts as before
    assert (s.waiting, s.running, s.calibrating) == (3, 1, 0) and s.recent_step_times_s == (0.3, 0.3)


def test_the_cache_key_changes_with_the_engine_settings_and_the_model_files(tmp_path) -> None:
    from types import SimpleNamespace

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"x" * 100)

    def vc(budget: int = 2048, block: int = 16, tp: int = 1) -> SimpleNamespace:
        return SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_batched_tokens=budget, enable_chunked_prefill=True, max_num_seqs=64),
            cache_config=SimpleNamespace(block_size=block, cache_dtype="auto"),
            model_config=SimpleNamespace(model=str(model), max_model_len=2048, enforce_eager=True),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
            speculative_config=None)

    base = sampler.engine_fingerprint(vc())
    assert base == sampler.engine_fingerprint(vc()) and len(base) == 12
    assert sampler.engine_fingerprint(vc(budget=512)) != base
    assert sampler.engine_fingerprint(vc(block=32)) != base
    assert sampler.engine_fingerprint(vc(tp=2)) != base  # NOTE: a CPU engine of TP 2 steps at another speed
    (model / "model.safetensors").write_bytes(b"x" * 101)  # other weights
    assert sampler.engine_fingerprint(vc()) != base
    key = sampler.machine_key("smollm2", "float32", 1, "cpu", base)
    assert key.endswith("-" + base) and key.startswith("smollm2-float32-t1-cpu-")


def test_the_profile_dir_can_be_set(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SAAF_PROFILE_DIR", str(tmp_path / "p"))
    sampler.store("k", synthetic())
    assert (tmp_path / "p" / "k.json").is_file() and sampler.load_cached("k") is not None
