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
from cluster.router.membership import Membership
from engine.stats import WorkerStats

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
    return Routing(DeployConfig(router=RouterConfig(policy="goodput", admission=admission, **router)))


def test_reject_answers_429_with_the_reason() -> None:
    with pytest.raises(APIError) as e:
        asyncio.run(routing("reject").route(HOPELESS))
    assert e.value.status == 429 and e.value.code == "slo_unattainable" and "TTFT" in e.value.message


def test_best_effort_serves_on_the_best_pair() -> None:
    d = asyncio.run(routing("best_effort").route(HOPELESS))
    assert d.admit and (d.prefill, d.decode) == ("p0", "d0") and d.p_slo < 0.5


def test_queue_waits_for_capacity_then_admits() -> None:
    rs = routing("queue", queue_timeout_s=5.0)
    # Hopeless behind 4,000 queued tokens, feasible once they drain (with the 0.12 s already waited).
    req = HOPELESS._replace(ttft_slo_s=2.0)

    async def scenario():
        task = asyncio.create_task(rs.route(req))
        await asyncio.sleep(0.12)
        assert not task.done() and rs.queued == 1
        rs.stats["p0"] = prefill(0)  # the prefill queue drained
        return await asyncio.wait_for(task, 2.0)

    d = asyncio.run(scenario())
    assert d.admit and d.prefill == "p0" and rs.queued == 0


def test_queue_gives_up_once_the_ttft_target_has_passed() -> None:
    rs = routing("queue", queue_timeout_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        asyncio.run(rs.route(HOPELESS))
    assert e.value.status == 429 and "passed while queued" in e.value.message
    assert 1.0 <= time.monotonic() - t0 < 2.0 and rs.queued == 0


def test_queue_gives_up_at_the_deadline() -> None:
    rs = routing("queue", queue_timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        asyncio.run(rs.route(HOPELESS))
    assert e.value.status == 429 and "not admitted within" in e.value.message
    assert 0.2 <= time.monotonic() - t0 < 1.0 and rs.queued == 0
