"""One generate() call (cluster/serve/job.py): n legs merged into the RequestOutputs vLLM's serving layer
expects, streamed (DELTA) or whole (FINAL_ONLY); fake legs, no Ray."""

from __future__ import annotations

import asyncio

import pytest
from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

from cluster.config import DeployConfig
from cluster.serve.job import Job, leg_params
from cluster.serve.leg import Leg, Services
from cluster.serve.metrics import Metrics
from cluster.serve.transfers import TransferLog


def _out(rid: str, text: str, ids: list[int], finish: str | None = None) -> RequestOutput:
    c = CompletionOutput(index=0, text=text, token_ids=ids, cumulative_logprob=None, logprobs=None,
                         finish_reason=finish)
    return RequestOutput(rid, None, [1, 2, 3], None, [c], finished=finish is not None,
                         kv_transfer_params={"remote_block_ids": [[1]]})


def _job(monkeypatch, n: int, kind: RequestOutputKind, script: dict[int, list[RequestOutput]]) -> Job:
    metrics = Metrics()
    svc = Services(DeployConfig(), None, None, metrics, TransferLog(metrics))

    async def admit(self):
        return None

    async def outputs(self):
        index = int(self.request_id.rsplit("-c", 1)[1]) if "-c" in self.request_id else 0
        for i, out in enumerate(script[index]):
            await asyncio.sleep(0.001 * (index + 1) * (i + 1))  # NOTE: the legs interleave
            self.tokens += len(out.outputs[0].token_ids)
            yield out

    monkeypatch.setattr(Leg, "admit", admit)
    monkeypatch.setattr(Leg, "outputs", outputs)
    params = SamplingParams(n=n, max_tokens=4, temperature=0.8, seed=5, output_kind=kind)
    return Job(svc, "cmpl-1", [1, 2, 3], "a b c", params, 2.0, 0.2)


def script() -> dict[int, list[RequestOutput]]:
    """Fresh outputs per test (merging mutates them, as it may: each comes from its own Ray message)."""
    return {0: [_out("x-c0", "He", [7]), _out("x-c0", "llo", [8], "length")],
            1: [_out("x-c1", "Bye", [9]), _out("x-c1", "!", [10]), _out("x-c1", "", [11], "stop")]}


async def _collect(job: Job) -> list[RequestOutput]:
    return [o async for o in job.outputs()]


def test_whole_answer_merges_every_completion(monkeypatch) -> None:
    job = _job(monkeypatch, 2, RequestOutputKind.FINAL_ONLY, script())
    outs = asyncio.run(_collect(job))
    assert len(outs) == 1
    final = outs[0]
    assert (final.request_id, final.prompt, final.prompt_token_ids) == ("cmpl-1", "a b c", [1, 2, 3])
    assert final.kv_transfer_params is None and final.finished
    assert [(c.index, c.text, list(c.token_ids), c.finish_reason) for c in final.outputs] == [
        (0, "Hello", [7, 8], "length"), (1, "Bye!", [9, 10, 11], "stop")]
    assert job.svc.metrics.requests.labels("ok")._value.get() == 1


def test_stream_keeps_each_completion_index_and_finishes_once(monkeypatch) -> None:
    outs = asyncio.run(_collect(_job(monkeypatch, 2, RequestOutputKind.DELTA, script())))
    assert len(outs) == 5
    per = {i: "".join(o.outputs[0].text for o in outs if o.outputs[0].index == i) for i in (0, 1)}
    assert per == {0: "Hello", 1: "Bye!"}
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert all(o.kv_transfer_params is None and o.request_id == "cmpl-1" for o in outs)


def test_legs_are_vllm_children() -> None:
    p = SamplingParams(n=3, seed=10, temperature=1.0, prompt_logprobs=2, max_tokens=4)
    legs = [leg_params(p, i) for i in range(3)]
    assert [(q.n, q.seed) for q in legs] == [(1, 10), (1, 11), (1, 12)]  # as vLLM seeds its n children
    assert [q.prompt_logprobs for q in legs] == [2, None, None]  # one copy of the prompt's logprobs
    assert leg_params(SamplingParams(n=2, temperature=1.0), 1).seed is None


def test_a_failing_leg_fails_the_request_and_closes_the_others(monkeypatch) -> None:
    from cluster.errors import ServeError

    job = _job(monkeypatch, 2, RequestOutputKind.DELTA, script())
    closed = []
    monkeypatch.setattr(Leg, "close", lambda self: closed.append(self.request_id))

    async def broken(self):
        if self.request_id.endswith("-c1"):
            raise ServeError(503, "worker lost")
        yield _out("x", "a", [1])

    monkeypatch.setattr(Leg, "outputs", broken)
    with pytest.raises(ServeError):
        asyncio.run(_collect(job))
    assert sorted(closed) == ["cmpl-1-c0", "cmpl-1-c1"]
    assert job.svc.metrics.requests.labels("error")._value.get() == 1
