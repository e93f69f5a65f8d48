"""Admission (cluster/router/admission.py) with the goodput policy, on synthetic stats (no Ray
cluster): a request whose TTFT cannot be met is rejected, queued, or served per `router.admission`."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.config import DeployConfig, RouterConfig
from cluster.errors import ServeError as APIError
from cluster.router import RouteRequest, make_policy
from cluster.router.admission import Admission
from cluster.serve.membership import Membership
from engine.contract import WorkerStats

HOPELESS = RouteRequest(prompt_tokens=500, max_tokens=32, ttft_slo_s=1.0, tpot_slo_s=0.2)


def prefill(queued: int) -> WorkerStats:
    return WorkerStats("p0", "prefill", "", queued // 250, 0, queued, 0, 0.0, 5760, (), True, time.time())


class Routing(Admission):
    """Admission over a Membership whose stats the test sets by hand (`stats`)."""

    def __init__(self, cfg: DeployConfig) -> None:
        members = Membership(None, cfg.mode, 0.1, busy=lambda: False)
        members.handles = {"p0": object(), "d0": object()}
        members.roles = {"p0": "prefill", "d0": "decode"}
        members.stats = {"p0": prefill(4000),
                         "d0": WorkerStats("d0", "decode", "", 0, 2, 0, 600, 0.1, 5760, (), True, time.time())}
        policy = make_policy("goodput", router_cfg=cfg.router, slo=cfg.slo)
        super().__init__(policy, members, cfg.router, colocated=False, recovery_timeout_s=5.0)
        self.stats = members.stats


def routing(admission: str, **router: float) -> Routing:
    # NOTE: prefill always on a prefill worker here: these scenarios are about its queue (auto would prefill
    # on the idle decode worker instead: tests/unit/test_router_disaggregation.py).
    return Routing(DeployConfig(router=RouterConfig(policy="goodput", admission=admission,
                                                    disaggregation="always", **router)))


def test_reject_answers_429_with_the_reason() -> None:
    with pytest.raises(APIError) as e:
        asyncio.run(routing("reject").route(HOPELESS))
    assert e.value.status == 429 and e.value.code == "slo_unattainable" and "TTFT" in e.value.message


def test_best_effort_serves_on_the_best_pair() -> None:
    d = asyncio.run(routing("best_effort").route(HOPELESS))
    assert d.admit and (d.prefill, d.decode) == ("p0", "d0") and d.p_slo < 0.5


def busy_decode(running: int) -> WorkerStats:
    return WorkerStats("d0", "decode", "", 0, running, 0, 30 * running, 0.5, 5760, (), True, time.time())


# A short prompt on an idle prefill engine (its TTFT is easily met) whose decode engine is too busy for the
# TPOT target: waiting can help here, unlike behind a prefill queue.
TPOT_BOUND = RouteRequest(prompt_tokens=50, max_tokens=32, ttft_slo_s=1.0, tpot_slo_s=0.2)


def tpot_bound(admission: str, **router: float) -> Routing:
    rs = routing(admission, **router)
    rs.stats["p0"], rs.stats["d0"] = prefill(0), busy_decode(150)
    return rs


def test_queue_refuses_at_once_when_waiting_cannot_meet_the_ttft() -> None:
    rs = routing("queue", queue_timeout_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        asyncio.run(rs.route(HOPELESS))  # behind 4,000 queued prompt tokens: the TTFT only grows by waiting
    assert e.value.status == 429 and e.value.code == "slo_unattainable" and "TTFT" in e.value.message
    assert time.monotonic() - t0 < 0.2 and rs.queued == 0


def test_queue_waits_while_the_budget_holds_then_admits() -> None:
    rs = tpot_bound("queue", queue_timeout_s=5.0)

    async def scenario():
        task = asyncio.create_task(rs.route(TPOT_BOUND))
        await asyncio.sleep(0.12)
        assert not task.done() and rs.queued == 1
        rs.stats["d0"] = busy_decode(2)  # the decode batch finished
        return await asyncio.wait_for(task, 2.0)

    d = asyncio.run(scenario())
    assert d.admit and (d.prefill, d.decode) == ("p0", "d0") and rs.queued == 0


def test_queue_gives_up_once_the_ttft_target_has_passed() -> None:
    rs = tpot_bound("queue", queue_timeout_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        asyncio.run(rs.route(TPOT_BOUND))
    assert e.value.status == 429 and e.value.code == "slo_unattainable", e.value.message
    assert 0.5 <= time.monotonic() - t0 < 1.5 and rs.queued == 0


def test_queue_gives_up_at_the_deadline() -> None:
    rs = tpot_bound("queue", queue_timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        asyncio.run(rs.route(TPOT_BOUND))
    assert e.value.status == 429 and "not admitted within" in e.value.message
    assert 0.2 <= time.monotonic() - t0 < 1.0 and rs.queued == 0
