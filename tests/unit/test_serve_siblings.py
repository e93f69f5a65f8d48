"""n > 1 prefills the prompt once (cluster/serve/leg.py, Leg.lead): completions 1..n-1 are admitted with
completion 0, onto its decode worker. When the lead's prefill hands off its KV, each sibling pulls that handoff
itself (one reader each, counted in the handoff); when the lead prefilled on its decode worker, a sibling runs
there once its KV has landed (a prefix-cache hit); if neither happens, a sibling is routed on its own. Fake
router and handles, no Ray."""

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
        return RouteDecision(True, "prefill-0", f"decode-{len(routed) - 1}", placement="remote:policy")

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


class _Handle:
    """A decode worker's handle: records decode_stream() submissions and release() calls."""

    def __init__(self) -> None:
        self.pulls: list = []
        self.released: list = []
        self.decode_stream = SimpleNamespace(options=lambda **kw: SimpleNamespace(remote=self._pull))
        self.release = SimpleNamespace(remote=self._release)

    def _pull(self, rid, ids, params, handoff):
        self.pulls.append((rid, handoff.readers))
        return object()  # NOTE: a stand-in for the ObjectRefGenerator (hashable)

    def _release(self, handoff):
        self.released.append(handoff.readers)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def test_a_lead_offers_its_handoff_to_every_sibling_each_a_counted_reader(monkeypatch):
    """The lead's handoff is pulled by all n completions: each waiting sibling gets it (readers = n) with its
    pull already submitted, and stops waiting without asking the router; a sibling already closed releases its
    read at once, so the prefill engine's count of readers still reaches n."""
    from kvtransfer.handoff import READERS, KVHandoff

    cancelled: list = []
    monkeypatch.setattr("ray.cancel", cancelled.append)  # NOTE: no Ray here
    svc, routed = _svc()
    handle = _Handle()
    h = KVHandoff("r-c0", "prefill-0", "prefill-0-x", 10, {"do_remote_prefill": True, "remote_block_ids": [1]},
                  1024, 16)

    async def go():
        lead, a, b, gone = _legs(svc, 4)
        decs = [await leg.admit() for leg in (lead, a, b, gone)]
        lead.decision = decs[0]
        gone.close()
        waiting = asyncio.ensure_future(a._lead_kv(decs[1]))
        await asyncio.sleep(0.05)
        shared = lead._offer_siblings("decode-0", handle, h)
        own = await asyncio.wait_for(waiting, 5)
        await asyncio.sleep(0.05)
        assert shared.readers == 4 and shared.decode_params()[READERS] == 4 and READERS not in h.decode_params()
        assert sorted(handle.pulls) == [("r-c1", 4), ("r-c2", 4)] and handle.released == [4]
        assert own.placement == "remote:sibling" and not own.local and own.prefill == "prefill-0"
        assert own.decode == "decode-0" and routed == [False]
        assert a._unpulled == (handle, shared) and b._unpulled == (handle, shared)
        assert lead._offer_siblings("decode-0", handle, h) is h  # once: a retried lead pulls alone
        pull = b._pulling
        b.close()  # NOTE: a sibling closed before its pull reported: its pull is cancelled, its read released
        await asyncio.sleep(0.05)
        assert handle.released == [4, 4] and pull in cancelled

    asyncio.run(go())
