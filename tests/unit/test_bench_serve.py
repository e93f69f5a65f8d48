"""run_benchmark, the report files and the CLI against an in-memory OpenAI-style streaming server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from benchmarks import serve
from benchmarks.client import make_client
from benchmarks.report import summary_table, to_markdown, write_report
from benchmarks.stats import SLO, CostModel
from benchmarks.workload import ChatWorkload


class FakeServer:
    """Streams ``max_tokens`` one-token chunks 2 ms apart; every ``reject_every``-th request gets 429."""

    def __init__(self, reject_every: int = 0, fail_all: bool = False) -> None:
        self.calls, self.reject_every, self.fail_all = 0, reject_every, fail_all
        self.bodies: list[dict] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.fail_all:
            return httpx.Response(503, text="down")
        if self.reject_every and self.calls % self.reject_every == 0:
            return httpx.Response(429, text="too many")
        n, prompt = body["max_tokens"], len(body["prompt"].split())

        async def stream() -> AsyncIterator[bytes]:
            for _ in range(n):
                await asyncio.sleep(0.002)
                yield b'data: {"choices": [{"index": 0, "text": " w"}]}\n\n'
            usage = {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n}}
            yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()

        return httpx.Response(200, content=stream())


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    server = FakeServer(reject_every=4)

    def client(timeout_s: float, max_connections: int = 1024, api_key: str | None = None) -> httpx.AsyncClient:
        real = make_client(timeout_s, max_connections, api_key)
        real._transport = httpx.MockTransport(server.handle)
        return real

    monkeypatch.setattr(serve, "make_client", client)
    return server


WORKLOAD = ChatWorkload(input_median=20, input_sigma=0.3, output_median=6, output_sigma=0.3)


def test_run_benchmark_counts_and_summaries(fake: FakeServer) -> None:
    result = serve.run_benchmark("http://127.0.0.1:9", "m", WORKLOAD, [20.0, 40.0], num_requests=8,
                                 slo=SLO(ttft_s=5.0, tpot_s=1.0), cost=CostModel(3.6, 1, 1))
    assert fake.calls == 1 + 16  # one warm-up, then 8 per rate
    assert [s.rate for s in result.steps] == [20.0, 40.0]
    for step in result.steps:
        s = step.summary
        assert s.sent == 8 and s.succeeded + s.rejected_429 == 8 and s.rejected_429 >= 1
        assert s.slo_met == s.succeeded and s.attainment == pytest.approx(s.succeeded / 8)
        assert s.ttft.count == s.succeeded and s.ttft.p50 is not None and s.ttft.p50 > 0
        ok = [r for r in step.records if r.ok]
        assert all(r.completion_tokens == r.output_len and r.prompt_tokens == r.input_len for r in ok)
        assert s.itl.count == sum(r.output_len - 1 for r in ok)
        assert s.cost is not None and s.cost.prefill_fraction == 0.5
        # open loop: each request left at (or just after) its scheduled time
        assert all(r.start_s >= r.scheduled_s - 1e-3 for r in step.records)
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0.0 for b in fake.bodies)


def test_report_files_and_json_round_trip(fake: FakeServer, tmp_path: Path) -> None:
    result = serve.run_benchmark("http://127.0.0.1:9", "m", WORKLOAD, [50.0], num_requests=6, warmup_requests=0)
    paths = write_report(result, tmp_path)
    names = {p.name for p in paths}
    assert {"report.json", "report.md"} <= names
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert ("ttft_cdf.png" in names) == has_mpl and all(p.is_file() for p in paths)
    data = json.loads((tmp_path / "report.json").read_text())
    step = data["steps"][0]
    assert step["summary"]["sent"] == len(step["records"]) == 6
    assert data["config"]["slo"] == {"ttft_s": 1.0, "tpot_s": 0.1}
    md = to_markdown(result)
    assert "TTFT p50/p90/p99 ms" in md and "| 50 |" in md
    assert "SLO: TTFT <= 1000 ms" in summary_table(result)


def test_duration_bound_and_warmup_failure(monkeypatch: pytest.MonkeyPatch, fake: FakeServer) -> None:
    result = serve.run_benchmark("http://127.0.0.1:9", "m", WORKLOAD, [20.0], duration_s=0.3, warmup_requests=0)
    assert all(r.scheduled_s < 0.3 for r in result.steps[0].records)
    fake.fail_all = True
    with pytest.raises(serve.BenchmarkError, match="warm-up request .* failed"):
        serve.run_benchmark("http://127.0.0.1:9", "m", WORKLOAD, [20.0], num_requests=2)


def test_cli_runs_and_writes_report(fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = serve.main(["--endpoint", "http://127.0.0.1:9", "--model", "m", "--input-len", "16", "--output-len", "4",
                     "--rate", "30,60", "--num-requests", "5", "--dollars-per-hour", "2", "--out", str(out),
                     "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "SLO attain" in printed and "wrote" in printed
    data = json.loads((out / "report.json").read_text())
    assert [s["rate"] for s in data["steps"]] == [30.0, 60.0]
    assert "--rate 30,60" in data["command"]


@pytest.mark.parametrize(("args", "message"), [
    (["--rate", "fast", "--num-requests", "3"], "--rate 'fast' is not a number"),
    (["--rate", "1", "--num-requests", "3", "--workload", "zipf"], "--workload 'zipf' is unknown; use one of: chat, longdoc, trace"),
    (["--rate", "1", "--num-requests", "3", "--burstiness-cv", "2"], "needs --arrivals gamma"),
    (["--rate", "1", "--num-requests", "3", "--prefill-gpus", "1", "--decode-gpus", "1"],
     "need --dollars-per-hour"),
    (["--workload", "trace", "--num-requests", "3"], "needs --trace FILE"),
    (["--rate", "1", "--arrivals", "gamma", "--burstiness-cv", "0", "--num-requests", "3"],
     "--burstiness-cv 0.0 must be > 0"),
    (["--num-requests", "3"], "give --rate R"),
    (["--rate", "0", "--num-requests", "3"], "--rate '0' must be > 0"),
    (["--rate", "1"], "give --num-requests N and/or --duration S"),
    (["--rate", "1", "--duration", "-2"], "--duration -2.0 must be > 0"),
    (["--rate", "1", "--num-requests", "2", "--workload", "trace", "--trace", "/nonexistent.csv"],
     "trace file '/nonexistent.csv' does not exist"),
])
def test_cli_bad_input_names_the_value(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.main(["--endpoint", "http://127.0.0.1:9", "--model", "m", "--no-progress", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
