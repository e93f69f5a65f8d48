"""Issue 14: the decode worker's transfer timeout runs from when its engine starts the KV pull. The pieces
that carry that moment: our connector's stats (LoadStats, aggregated with vLLM's own in either order), the
stat logger that reads them, and the worker's wait (queued beats; timeout after the pull started, or when the
engine makes no step at all)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from decode import worker as dw
from engine.statlog import EngineTotals, make_stat_logger_factory
from kvtransfer.connector import LOAD_STARTED, LoadStats, as_load_stats


def test_load_stats_aggregate_with_vllms_in_either_order() -> None:
    ours = as_load_stats(None, ["req-a-12345678"])
    assert ours is not None and not ours.is_empty()
    assert as_load_stats(None, []) is None  # nothing to report: vLLM's scheduler skips it
    theirs = NixlKVConnectorStats()
    theirs.data["transfer_duration"].append(0.01)
    theirs.data["bytes_transferred"].append(4096)
    both = as_load_stats(theirs, ["req-b-12345678"]).aggregate(ours)
    assert both.data[LOAD_STARTED] == ["req-b-12345678", "req-a-12345678"]
    assert both.data["bytes_transferred"] == [4096]
    assert set(NixlKVConnectorStats().data) <= set(LoadStats().data)  # vLLM's Prometheus logger reads them all


def test_the_stat_logger_records_when_each_pull_started() -> None:
    totals = EngineTotals()
    logger = make_stat_logger_factory(totals)(None)
    sched = SimpleNamespace(num_waiting_reqs=1, num_running_reqs=0, kv_cache_usage=0.2, spec_decoding_stats=None,
                            kv_connector_stats=as_load_stats(None, ["cmpl-7-0-abcdef12", "x"]).data)
    before = time.monotonic()
    logger.record(sched, None)
    at = totals.load_started_at("cmpl-7-0")  # NOTE: vLLM's engine id is ours + "-" + 8 random characters
    assert at is not None and at >= before
    assert totals.load_started_at("x") is not None and totals.load_started_at("cmpl-7") is None
    assert totals.load_started_at("cmpl-7-0", since=at + 1) is None  # an earlier request of the same id


def _worker(totals: EngineTotals) -> dw.DecodeWorker:
    w = dw.DecodeWorker.__new__(dw.DecodeWorker)  # NOTE: the wait's logic only, no engine
    w.totals = totals
    return w


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(dw, "POLL_S", 0.01)
    monkeypatch.setattr(dw, "QUEUED_BEAT_S", 0.1)


def test_a_queued_handoff_beats_and_never_times_out_while_the_engine_steps() -> None:
    totals = EngineTotals()

    async def scenario():
        loop = asyncio.get_running_loop()
        first = loop.create_future()

        async def engine():  # steps for others for 0.6 s (twice the timeout), then starts our pull
            t_end = time.monotonic() + 0.6
            while time.monotonic() < t_end:
                totals.last_step_at = time.monotonic()
                await asyncio.sleep(0.02)
            totals.loads_started["r1"] = time.monotonic()
            await asyncio.sleep(0.1)
            first.set_result("token")
        task = asyncio.ensure_future(engine())
        beats = [b async for b in _worker(totals)._until_pulled(first, "r1", time.monotonic(), 0.3)]
        await task
        return beats
    beats = asyncio.run(scenario())
    assert len(beats) >= 4 and beats == sorted(beats)


def _seconds_to_timeout(totals: EngineTotals, rid: str, started_in: float | None, steps: bool) -> float:
    """How long the wait for `rid` (timeout 0.2 s) takes to raise TimeoutError."""
    async def scenario():
        first = asyncio.get_running_loop().create_future()
        if started_in is not None:
            totals.loads_started[rid] = time.monotonic() + started_in
        if steps:
            totals.last_step_at = time.monotonic() + 10  # NOTE: the engine keeps stepping
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async for _ in _worker(totals)._until_pulled(first, rid, time.monotonic(), 0.2):
                pass
        return time.monotonic() - t0
    return asyncio.run(scenario())


def test_a_pull_that_runs_past_the_timeout_times_out() -> None:
    assert 0.2 < _seconds_to_timeout(EngineTotals(), "r2", 0.05, steps=True) < 1.0


def test_an_engine_that_makes_no_step_times_out() -> None:
    # NOTE: last step long ago, and no pull started: hung (e.g. SIGSTOP)
    assert 0.2 < _seconds_to_timeout(EngineTotals(), "r3", None, steps=False) < 1.0
