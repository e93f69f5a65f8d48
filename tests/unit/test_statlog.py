"""engine/statlog.py: the decode step times the goodput router compares with its model must be steps of
the batch running now: no idle gap counted as a step, nothing from a batch that ran seconds ago."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import statlog


def _step(logger, clock, at: float, running: int, tokens: int = 1) -> None:
    clock[0] = at
    sched = SimpleNamespace(num_waiting_reqs=0, num_running_reqs=running, kv_cache_usage=0.1,
                            spec_decoding_stats=None, kv_connector_stats=None)
    it = SimpleNamespace(num_generation_tokens=tokens,
                         prompt_token_stats=SimpleNamespace(computed=0, external_kv_transfer=0, total=0))
    logger.record(sched, it)


@pytest.fixture
def clocked(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(statlog.time, "monotonic", lambda: clock[0])
    totals = statlog.EngineTotals()
    return statlog.make_stat_logger_factory(totals)(None), totals, clock


def test_an_idle_gap_is_not_a_step(clocked) -> None:
    logger, totals, clock = clocked
    for i in range(5):  # a request of 5 steps, 0.1 s apart; the last leaves the engine idle
        _step(logger, clock, 1.0 + 0.1 * i, running=1 if i < 4 else 0)
    _step(logger, clock, 20.0, running=1)  # the next request, 15 s later: its first step follows idle time
    _step(logger, clock, 20.1, running=1)
    assert totals.recent_steps(window_s=100) == pytest.approx((0.1,) * 5)


def test_steps_of_an_older_batch_fall_out_of_the_window(clocked) -> None:
    logger, totals, clock = clocked
    for i in range(10):  # a big batch, 0.5 s per step, that keeps running
        _step(logger, clock, 1.0 + 0.5 * i, running=20)
    for i in range(1, 4):  # the batch shrank: 0.05 s steps
        _step(logger, clock, 5.5 + 0.05 * i, running=1)
    clock[0] = 5.55 + statlog.STEP_WINDOW_S - 0.01  # the first small step is still inside, 5.5 is not
    recent = totals.recent_steps()
    assert recent[-3:] == pytest.approx((0.05,) * 3)
    assert len(recent) == 3
