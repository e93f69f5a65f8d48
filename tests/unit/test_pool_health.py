"""The PoolController's health loop keeps checking every worker while one is being replaced (issue 14).

Logic only: the controller's worker table holds fake handles (stats() answers or hangs) and its replacement
is a coroutine that takes as long as an engine start; no Ray actor is made."""

from __future__ import annotations

import asyncio

import pytest

from cluster.control import pools
from cluster.control.pools import PoolController


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self):
        return self.fn()


class _Handle:
    def __init__(self, name: str, calls: list[str], hangs: asyncio.Event) -> None:
        async def stats():
            calls.append(name)
            if hangs.is_set():
                await asyncio.sleep(3600)
            return {}
        self.stats = _Method(stats)


def test_a_replacement_in_progress_does_not_stop_the_checks_of_the_others(monkeypatch):
    monkeypatch.setattr(pools, "actor_state", lambda _h: "ALIVE")
    ctl = PoolController({"health": {"interval_s": 0.05, "timeout_s": 0.05, "failures": 1}})
    calls: list[str] = []
    a_hangs, b_hangs = asyncio.Event(), asyncio.Event()
    replaced: list[str] = []
    release = asyncio.Event()

    async def slow_replace(wid: str) -> None:  # NOTE: as long as a new engine takes to start
        replaced.append(wid)
        ctl.workers[wid]["state"] = "replacing"
        await release.wait()
        ctl.workers[wid]["state"] = "ready"

    monkeypatch.setattr(ctl, "_replace", slow_replace)
    for wid, ev in (("decode-0", a_hangs), ("decode-1", b_hangs)):
        ctl.workers[wid] = {"role": "decode", "handle": _Handle(wid, calls, ev), "info": {}, "state": "ready"}

    async def scenario() -> None:
        loop_task = asyncio.get_running_loop().create_task(ctl._health_loop())
        try:
            a_hangs.set()
            for _ in range(100):  # bounded: 100 x 20 ms
                if replaced:
                    break
                await asyncio.sleep(0.02)
            assert replaced == ["decode-0"]
            before = calls.count("decode-1")
            await asyncio.sleep(0.5)  # decode-0's replacement still runs
            assert calls.count("decode-1") >= before + 3, calls  # decode-1 kept being checked
            b_hangs.set()  # and a second failure meanwhile is replaced too, not queued behind the first
            for _ in range(100):
                if len(replaced) == 2:
                    break
                await asyncio.sleep(0.02)
            assert replaced == ["decode-0", "decode-1"]
            assert set(ctl._replacing) == {"decode-0", "decode-1"}
            release.set()
            for _ in range(100):
                if not ctl._replacing:
                    break
                await asyncio.sleep(0.02)
            assert not ctl._replacing
        finally:
            loop_task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await loop_task

    asyncio.run(asyncio.wait_for(scenario(), 30))
