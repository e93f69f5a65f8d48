"""Open-loop load generator against any OpenAI-compatible endpoint (library + ``python -m`` CLI).

Library use (e.g. by ``benchmarks.compare``)::

    result = run_benchmark("http://127.0.0.1:8000", "tiny-llama", ChatWorkload(64, 0.5, 32, 0.5),
                           rates=[1.0, 2.0], num_requests=40, slo=SLO(ttft_s=1.0, tpot_s=0.1))
    write_report(result, Path("out"))

Each rate is one step: requests are sent at their scheduled times whatever the server's state
(open loop), every request has a timeout, and the step ends when the last response is done.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from benchmarks.client import (
    APIS,
    RequestRecord,
    endpoint_url,
    first_model,
    make_client,
    request_body,
    send_request,
)
from benchmarks.report import describe_workload, environment
from benchmarks.stats import SLO, BenchmarkResult, CostModel, StepResult, summarize
from benchmarks.workload import (
    WORKLOADS,
    ChatWorkload,
    LongDocWorkload,
    RequestSpec,
    TraceWorkload,
    Workload,
    build_requests,
    make_prompt,
)

logger = logging.getLogger(__name__)

DEFAULT_SLO = SLO(ttft_s=1.0, tpot_s=0.1)
ProgressFn = Callable[[float | None, int, int, int, float], None]
"""progress(rate, done, failed, total, elapsed_s), called as requests finish."""


class BenchmarkError(RuntimeError):
    """The benchmark could not run at all (e.g. the endpoint is down); the message says why."""


@dataclass(frozen=True)
class _Run:
    url: str
    model: str
    api: str
    ignore_eos: bool
    timeout_s: float


async def _warmup(client: httpx.AsyncClient, run: _Run, n: int) -> None:
    import numpy as np

    rng = np.random.default_rng(12345)
    for i in range(n):
        rec = RequestRecord(index=-1 - i, input_len=16, output_len=4, scheduled_s=0.0)
        body = request_body(run.model, make_prompt(16, rng), 4, run.api, run.ignore_eos)
        await send_request(client, run.url, body, run.api, rec, run.timeout_s, time.perf_counter())
        # NOTE: a 429 is an answer (an admission router refusing a target it predicts missing): the server is
        # up and serving; only a failure to answer at all stops the run.
        if not rec.ok and rec.error_kind != "rejected_429":
            raise BenchmarkError(f"warm-up request to {run.url} failed ({rec.error_kind}: {rec.error}); "
                                 f"check that the server is up and serves model {run.model!r}")


async def _run_step(client: httpx.AsyncClient, run: _Run, specs: Sequence[RequestSpec], rate: float | None,
                    progress: ProgressFn | None) -> tuple[list[RequestRecord], float]:
    t0 = time.perf_counter()
    done = [0, 0]

    def tick(task: asyncio.Task[RequestRecord]) -> None:
        done[0] += 1
        done[1] += 0 if task.result().ok else 1
        if progress is not None:
            progress(rate, done[0], done[1], len(specs), time.perf_counter() - t0)

    tasks = []
    for spec in specs:
        delay = t0 + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = RequestRecord(spec.index, spec.input_len, spec.output_len, spec.arrival_s)
        body = request_body(run.model, spec.prompt, spec.output_len, run.api, run.ignore_eos)
        task = asyncio.create_task(send_request(client, run.url, body, run.api, rec, run.timeout_s, t0))
        task.add_done_callback(tick)
        tasks.append(task)
    # NOTE: bounded: every send_request is wrapped in its own timeout.
    records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - t0


async def run_benchmark_async(
    endpoint: str, model: str, workload: Workload, rates: Sequence[float | None], *,
    num_requests: int | None = None, duration_s: float | None = None, slo: SLO = DEFAULT_SLO,
    cost: CostModel | None = None, burstiness_cv: float = 1.0, seed: int = 0, api: str = "completions",
    ignore_eos: bool = True, request_timeout_s: float = 120.0, max_total_len: int | None = None,
    warmup_requests: int = 1, api_key: str | None = None, progress: ProgressFn | None = None,
) -> BenchmarkResult:
    """Async form of :func:`run_benchmark` for callers that already run an event loop."""
    if not rates:
        raise ValueError("rates is empty; give at least one rate in requests/s (None replays a trace)")
    if request_timeout_s <= 0:
        raise ValueError(f"request_timeout_s={request_timeout_s!r} must be > 0")
    run = _Run(endpoint_url(endpoint, api), model, api, ignore_eos, request_timeout_s)
    plans = [build_requests(workload, r, num_requests, duration_s, burstiness_cv, seed, max_total_len)
             for r in rates]
    config = {
        "endpoint": endpoint, "model": model, "api": api, "workload": describe_workload(workload),
        "rates": list(rates), "num_requests": num_requests, "duration_s": duration_s,
        "burstiness_cv": burstiness_cv, "seed": seed, "ignore_eos": ignore_eos,
        "request_timeout_s": request_timeout_s, "max_total_len": max_total_len,
        "warmup_requests": warmup_requests, "slo": asdict(slo), "cost": asdict(cost) if cost else None,
    }
    started = datetime.now(UTC).isoformat(timespec="seconds")
    steps = []
    async with make_client(request_timeout_s, api_key=api_key) as client:
        await _warmup(client, run, warmup_requests)
        for rate, specs in zip(rates, plans, strict=True):
            if not specs:
                raise ValueError(f"rate {rate}: no request falls inside duration_s={duration_s}; raise it")
            logger.info("rate %s: %d requests", rate, len(specs))
            records, wall = await _run_step(client, run, specs, rate, progress)
            steps.append(StepResult(rate, summarize(records, wall, rate, slo, cost), records))
    finished = datetime.now(UTC).isoformat(timespec="seconds")
    return BenchmarkResult(config, steps, started, finished, environment=environment())


def run_benchmark(endpoint: str, model: str, workload: Workload, rates: Sequence[float | None],
                  **kwargs: object) -> BenchmarkResult:
    """Run one step per rate against ``endpoint`` and return every record and summary.

    Keyword arguments are those of :func:`run_benchmark_async`: ``num_requests`` and/or ``duration_s``
    (at least one) bound each step; ``slo``, ``cost``, ``burstiness_cv``, ``seed``, ``api``
    ("completions" or "chat"), ``ignore_eos``, ``request_timeout_s``, ``max_total_len``,
    ``warmup_requests``, ``api_key``, ``progress``.
    """
    return asyncio.run(run_benchmark_async(endpoint, model, workload, rates, **kwargs))  # type: ignore[arg-type]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--endpoint", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    a("--model", help="model name sent in requests (default: the first of GET /v1/models)")
    a("--api", default="completions", choices=APIS, help="route: /v1/completions or /v1/chat/completions")
    a("--workload", default="chat", help=f"one of: {', '.join(WORKLOADS)}")
    a("--trace", help="trace file for --workload trace (.csv with header or .jsonl): "
      "input_len,output_len[,arrival_s]")
    a("--input-len", type=int, help="chat: median input tokens (256); longdoc: input tokens (2048)")
    a("--output-len", type=int, help="chat: median output tokens (128); longdoc: output tokens (32)")
    a("--sigma", type=float, default=0.6, help="chat: lognormal sigma of both lengths")
    a("--rate", nargs="+", help="requests/s; several values (or 1,2,4) sweep; omit to replay trace times")
    a("--arrivals", default="poisson", choices=("poisson", "gamma"))
    a("--burstiness-cv", type=float, help="gamma arrivals: coefficient of variation of gaps (>1 bursty)")
    a("--num-requests", type=int, help="requests per rate step (upper bound)")
    a("--duration", type=float, help="seconds of arrivals per rate step (upper bound)")
    a("--ttft-slo", type=float, default=1.0, help="TTFT target, seconds")
    a("--tpot-slo", type=float, default=0.1, help="TPOT target, seconds per output token")
    a("--dollars-per-hour", type=float, help="cost of the whole deployment per hour")
    a("--prefill-gpus", type=int, help="disaggregated: GPUs in the prefill pool (cost split)")
    a("--decode-gpus", type=int, help="disaggregated: GPUs in the decode pool (cost split)")
    a("--max-total-len", type=int, help="clip input+output to the server's max model length")
    a("--request-timeout", type=float, default=120.0, help="seconds per request")
    a("--warmup", type=int, default=1, help="sequential warm-up requests before measuring")
    a("--seed", type=int, default=0)
    a("--no-ignore-eos", action="store_true", help="do not send vLLM's ignore_eos extension")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default $OPENAI_API_KEY)")
    a("--out", help="directory for report.json, report.md and PNG plots")
    a("--no-progress", action="store_true")
    return p


def _rates(values: list[str] | None) -> list[float | None]:
    if not values:
        return [None]
    out: list[float | None] = []
    for item in (v for value in values for v in value.split(",") if v):
        try:
            rate = float(item)
        except ValueError:
            raise ValueError(f"--rate {item!r} is not a number; give requests/s, e.g. --rate 1 2 4") from None
        if not rate > 0:
            raise ValueError(f"--rate {item!r} must be > 0 requests/s")
        out.append(rate)
    return out


def _check_args(args: argparse.Namespace) -> None:
    if args.num_requests is None and args.duration is None:
        raise ValueError("give --num-requests N and/or --duration S to bound each rate step")
    for flag, value in (("--num-requests", args.num_requests), ("--duration", args.duration),
                        ("--burstiness-cv", args.burstiness_cv), ("--request-timeout", args.request_timeout)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} {value} must be > 0")
    if args.arrivals == "poisson" and args.burstiness_cv not in (None, 1.0):
        raise ValueError(f"--burstiness-cv {args.burstiness_cv} needs --arrivals gamma (Poisson has CV 1)")


def _workload(args: argparse.Namespace) -> Workload:
    if args.workload not in WORKLOADS:
        raise ValueError(f"--workload {args.workload!r} is unknown; use one of: {', '.join(WORKLOADS)}")
    if args.workload == "trace":
        if not args.trace:
            raise ValueError("--workload trace needs --trace FILE (input_len,output_len[,arrival_s])")
        return TraceWorkload.from_file(args.trace)
    if args.workload == "longdoc":
        return LongDocWorkload(args.input_len or 2048, args.output_len or 32)
    return ChatWorkload(args.input_len or 256, args.sigma, args.output_len or 128, args.sigma)


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.report import ProgressLine, summary_table, write_report

    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        _check_args(args)
        workload, rates = _workload(args), _rates(args.rate)
        if rates == [None] and workload.trace_arrivals() is None:
            raise ValueError("give --rate R [R ...] in requests/s (only a trace with arrival_s runs without it)")
        cost = None
        if args.dollars_per_hour is not None:
            cost = CostModel(args.dollars_per_hour, args.prefill_gpus, args.decode_gpus)
        elif args.prefill_gpus is not None or args.decode_gpus is not None:
            raise ValueError("--prefill-gpus/--decode-gpus need --dollars-per-hour")
        model = args.model or first_model(args.endpoint, args.api_key)
        result = run_benchmark(
            args.endpoint, model, workload, rates, num_requests=args.num_requests, duration_s=args.duration,
            slo=SLO(args.ttft_slo, args.tpot_slo), cost=cost, burstiness_cv=args.burstiness_cv or 1.0,
            seed=args.seed, api=args.api, ignore_eos=not args.no_ignore_eos,
            request_timeout_s=args.request_timeout, max_total_len=args.max_total_len,
            warmup_requests=args.warmup, api_key=args.api_key,
            progress=None if args.no_progress else ProgressLine())
    except (ValueError, BenchmarkError) as exc:
        parser.error(str(exc))
    result.command = shlex.join([sys.executable, "-m", "benchmarks.serve", *(sys.argv[1:] if argv is None else argv)])
    print(summary_table(result))
    if args.out:
        for path in write_report(result, Path(args.out)):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
