"""The ingress's view of the pools (cluster/serve/membership.py): a worker removed while a stats refresh
was waiting for its answer does not come back with that answer (a clean-clone CI run saw /v1/stats list two
drained and stopped workers for minutes after the planner loop shrank both pools)."""

from __future__ import annotations

import asyncio

from cluster.serve.membership import Membership
from engine.contract import WorkerStats


def _stats(wid: str, role: str) -> WorkerStats:
    return WorkerStats(wid, role, "", 0, 0, 0, 0, 0.0, 5760, (), True, 1000.0)


class _Remote:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *a):
        return self.fn(*a)


class _Worker:
    def __init__(self, wid: str, role: str, gate: asyncio.Event) -> None:
        async def stats() -> WorkerStats:
            await gate.wait()
            return _stats(wid, role)
        self.stats = _Remote(lambda: asyncio.ensure_future(stats()))


class _Controller:
    def __init__(self, members) -> None:
        self.version, self.list = 1, members

        async def get():
            return self.version, self.list
        self.members = _Remote(lambda: asyncio.ensure_future(get()))


def test_a_worker_removed_during_a_stats_refresh_stays_removed() -> None:
    async def run() -> Membership:
        gate = asyncio.Event()
        ws = {w: _Worker(w, r, gate) for w, r in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))}
        ctl = _Controller([(w, r, ws[w], None) for w, r in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))])
        m = Membership(ctl, "disaggregated", 0.1, busy=lambda: False)
        await m.refresh_members()
        pending = asyncio.ensure_future(m.refresh_stats())  # asks all three, waits for their answers
        await asyncio.sleep(0)
        ctl.version, ctl.list = 2, [x for x in ctl.list if x[0] != "d1"]  # the loop shrank the decode pool
        await m.refresh_members()
        gate.set()  # d1, still draining, answers anyway
        await pending
        return m

    m = asyncio.run(run())
    assert set(m.stats) == {"p0", "d0"}
    assert {w["worker_id"] for w in m.summary()} == {"p0", "d0"}
    assert [s.worker_id for s in m.pools().decode] == ["d0"]
