"""Leg.close() against the moments of a disaggregated attempt (cluster/serve/leg.py), with fake workers, no
Ray: a client that hangs up on the prefill's first token before the decode stream starts gets no decode,
and the prefill's KV handoff is released exactly once, whichever side of the prefill's end close() lands on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput

from cluster.config import DeployConfig
from cluster.router.policy import RouteDecision, RouteRequest
from cluster.serve.leg import Leg, Services
from cluster.serve.metrics import Metrics
from cluster.serve.transfers import TransferLog


class _Remote:
    """`handle.method.remote(...)` / `.options(...).remote(...)`: records the calls, returns `make(*args)`."""

    def __init__(self, make) -> None:
        self.make, self.calls = make, []

    def options(self, **_: Any) -> _Remote:
        return self

    def remote(self, *args: Any) -> Any:
        self.calls.append(args)
        return self.make(*args)


class _Worker:
    def __init__(self, prefill_result: asyncio.Future) -> None:
        self.prefill = _Remote(lambda *a: prefill_result)
        self.release = _Remote(lambda handoff: asyncio.sleep(0))
        self.decode_stream = _Remote(lambda *a: pytest_fail("a decode started after close()"))


def pytest_fail(msg: str) -> None:
    raise AssertionError(msg)


def _first(finish: str | None = "length") -> RequestOutput:
    c = CompletionOutput(index=0, text="Hi", token_ids=[42], cumulative_logprob=None, logprobs=None,
                         finish_reason=finish)
    return RequestOutput("r", None, [1, 2, 3], None, [c], finished=True)


def _leg(worker: _Worker) -> Leg:
    metrics = Metrics()
    members = SimpleNamespace(handle=lambda wid: worker if wid else None)
    svc = Services(DeployConfig(), members, None, metrics, TransferLog(metrics))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    return Leg(svc, "r", [1, 2, 3], params, RouteRequest(prompt_tokens=3, max_tokens=8, ttft_slo_s=2.0, tpot_slo_s=0.15), deadline=1e12)


def _decision() -> RouteDecision:
    return RouteDecision(True, "prefill-0", "decode-0")


def test_close_between_the_first_token_and_the_decode_starts_nothing_and_releases_once() -> None:
    async def run() -> tuple[_Worker, Any]:
        fut = asyncio.get_running_loop().create_future()
        handoff = SimpleNamespace(request_id="r", prefill_worker="prefill-0", cached_tokens=0, prefill_s=0.01)
        fut.set_result(SimpleNamespace(output=_first(), handoff=handoff))
        worker = _Worker(fut)
        leg = _leg(worker)
        gen = leg._attempt("r", leg.ids, leg.params, _decision())
        first = await gen.__anext__()  # the prefill's token, streamed to the client
        assert first.outputs[0].token_ids == [42] and not first.finished
        leg.close()  # the client hangs up here: close() finds nothing in flight
        try:
            await gen.__anext__()
        except StopAsyncIteration:
            pass
        else:
            raise AssertionError("the attempt went on after close()")
        for _ in range(5):  # the release is a task of its own
            await asyncio.sleep(0)
        return worker, handoff

    worker, handoff = asyncio.run(run())
    assert worker.decode_stream.calls == []
    assert worker.release.calls == [(handoff,)]


def test_close_while_the_prefill_runs_releases_its_late_kv_once_and_starts_no_decode(monkeypatch) -> None:
    cancelled: list[Any] = []
    monkeypatch.setattr("ray.cancel", cancelled.append)  # NOTE: no Ray here

    async def run() -> tuple[_Worker, Any]:
        fut = asyncio.get_running_loop().create_future()
        worker = _Worker(fut)
        leg = _leg(worker)
        gen = leg._attempt("r", leg.ids, leg.params, _decision())
        task = asyncio.ensure_future(gen.__anext__())
        for _ in range(5):
            await asyncio.sleep(0)
        assert worker.prefill.calls and not task.done()
        leg.close()  # the client leaves while the prefill runs; the prefill finishes anyway (too late to abort)
        handoff = SimpleNamespace(request_id="r", prefill_worker="prefill-0", cached_tokens=0, prefill_s=0.01)
        fut.set_result(SimpleNamespace(output=_first(), handoff=handoff))
        try:
            await task  # the attempt may still hand out the token it had; it must start nothing after it
            await gen.__anext__()
        except (StopAsyncIteration, asyncio.CancelledError):
            pass
        for _ in range(10):
            await asyncio.sleep(0)
        return worker, handoff

    worker, handoff = asyncio.run(run())
    assert worker.decode_stream.calls == []
    assert len(cancelled) == 1  # the prefill task
    assert worker.release.calls == [(handoff,)]  # by close()'s late release, not a second time by the attempt
