"""n > 1 prefills the prompt once (cluster/serve/leg.py, Leg.lead): completions 1..n-1 are admitted with
completion 0, onto its decode worker, as local prefills there once its KV has landed (their prompt a
prefix-cache hit); if the lead's KV never lands there, a sibling is routed on its own. Fake router, no Ray."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from vllm import SamplingParams

from cluster.config import DeployConfig
from cluster.router.policy import RouteDecision, RouteRequest
from cluster.serve.job import Job
from cluster.serve.leg import Leg, Services
from cluster.serve.metrics import Metrics
from cluster.serve.transfers import TransferLog


def _svc() -> tuple[Services, list]:
    routed: list = []

    async def route(req, exclude=frozenset(), must_admit=False):
        routed.append(must_admit)
        return RouteDecision(True, "prefill-0", f"decode-{len(routed) - 1}", placement="remote:policy", ticket=7)

    metrics = Metrics()
    members = SimpleNamespace(handle=lambda w: object())
    policy = SimpleNamespace(observe_first_token=lambda *a: None, observe=lambda *a: None)
    return (Services(DeployConfig(), members, SimpleNamespace(route=route, policy=policy), metrics, TransferLog(metrics)),
            routed)


def _legs(svc: Services, n: int) -> list[Leg]:
    route = RouteRequest(10, 8, 2.0, 0.2, 0, [], True)
    lead = Leg(svc, "r-c0", [1] * 10, None, route, time.monotonic() + 30)
    return [lead] + [Leg(svc, f"r-c{i}", [1] * 10, None, route, time.monotonic() + 30, lead=lead) for i in range(1, n)]


def test_siblings_are_admitted_with_their_lead_onto_its_decode_worker():
    svc, routed = _svc()

    async def go():
        lead, a, b = _legs(svc, 3)
        decs = [await leg.admit() for leg in (lead, a, b)]
        assert routed == [False]  # the router was asked once, for the lead
        assert decs[1] == decs[2] and decs[1].decode == decs[0].decode == "decode-0"
        assert decs[1].local and decs[1].prefill is None and decs[1].placement == "local:sibling"
        waiting = asyncio.ensure_future(a._lead_kv(decs[1]))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # it waits for the lead's KV
        lead._kv_landed("decode-0")
        assert await asyncio.wait_for(waiting, 5) == decs[1] and routed == [False]

    asyncio.run(go())


def test_a_sibling_whose_lead_never_lands_its_kv_is_routed_on_its_own():
    svc, routed = _svc()

    async def go():
        lead, a = _legs(svc, 2)
        await lead.admit()
        dec = await a.admit()
        waiting = asyncio.ensure_future(a._lead_kv(dec))
        await asyncio.sleep(0.05)
        lead.close()  # e.g. the lead failed before its KV reached the decode worker
        own = await asyncio.wait_for(waiting, 5)
        assert routed == [False, True] and own.decode == "decode-1" and a.lead is None

    asyncio.run(go())


def test_a_job_shares_its_prefill_only_when_there_is_a_decode_to_share():
    svc, _ = _svc()
    many = Job(svc, "j", [1, 2, 3], None, SamplingParams(n=4, max_tokens=8), 2.0, 0.2)
    assert many.legs[0].lead is None and all(leg.lead is many.legs[0] for leg in many.legs[1:])
    one_token = Job(svc, "k", [1, 2, 3], None, SamplingParams(n=4, max_tokens=1), 2.0, 0.2)
    assert all(leg.lead is None for leg in one_token.legs)  # completion 0 ends on the prefill worker


def test_a_lead_that_ends_at_its_first_token_lets_its_siblings_go_at_once(monkeypatch):
    """The lead's first token ends it (EOS) on the prefill worker: no decode ever holds its KV, so its siblings
    are routed on their own when it ends, not after the request's deadline."""
    svc, routed = _svc()

    async def first_token_only(self, rid, ids, params, dec):
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5])])  # EOS at once: no decode, no KV

    monkeypatch.setattr(Leg, "_attempt", first_token_only)

    async def go():
        lead, a = _legs(svc, 2)
        lead.params = a.params = SimpleNamespace(max_tokens=4, min_tokens=0, prompt_logprobs=None,
                                                 clone=lambda: SimpleNamespace(max_tokens=4, min_tokens=0))
        await lead.admit()
        dec = await a.admit()
        waiting = asyncio.ensure_future(a._lead_kv(dec))
        async for _ in lead.outputs():
            pass
        own = await asyncio.wait_for(waiting, 5)
        assert routed == [False, True] and own.decode == "decode-1" and lead.kv_on is None

    asyncio.run(go())
