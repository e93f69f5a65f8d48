"""Measure a worker's own running engine for the router's latency model: a few prefills of different
lengths and decode steps at a few batch sizes, through the same AsyncLLM path requests take.

Machines of one kind differ (AVX-512 vs AVX2 CPUs: ~1.7x per prefill), so the router's model is fitted on
the machine that serves (cluster/control/calibration.py) rather than read from a profile measured elsewhere.
About 1,100 prompt tokens and ~50 decode steps in all: a few seconds on a small CPU, done in the background
after the deployment is ready. Rows are what placement.profile_fit.fit_coefficients takes.

Samples count only when nothing else ran: no serving traffic on this engine (a request that arrives makes
the measurement give way at once: its own requests are aborted, so calibrating never delays traffic), and
(CPU engines) no more than `foreign_limit` cores of other processes on the box, which a second engine, a
benchmark or a test's reference server would take from every sample (the whole measurement is then
unclean, and unused).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any, NamedTuple

from engine.procs import ForeignCores

PREFILL_LENS = (32, 128, 256, 512)
# NOTE: (batch, context per request): the batch sizes alone would make context tokens proportional to the
# batch, and the fit could not tell the per-token term from the per-sequence one.
DECODE_POINTS = ((1, 96), (4, 96), (8, 96), (2, 640))
DECODE_STEPS = 6


class Samples(NamedTuple):
    prefill: list[tuple[float, float, float]]  # (tokens, sum of squared lengths, ms)
    decode: list[tuple[float, float, float]]  # (batch, context tokens, ms)
    seconds: float
    clean: bool = True  # no serving traffic or other load overlapped the samples (only clean ones are used)
    foreign_cores: float = 0.0  # cores other processes used meanwhile (CPU engines; 0 where unchecked)


def _params(max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)


def _prompt(n: int, salt: int, vocab: int) -> list[int]:
    # NOTE: a fresh first token per prompt: no prefix-cache hit can shorten a measured prefill.
    return [100 + (salt * 7919) % (vocab - 200)] + [100 + (salt * 31 + i * 104729) % (vocab - 200)
                                                    for i in range(n - 1)]


LOOK_S = 1.0  # how long a measurement first watches the box's other load
YIELD_POLL_S = 0.01  # how often a running measurement checks for serving traffic (and then gives way)


REQUEST_PREFIX = "calib-"  # the request ids of a measurement


def own_requests(host: Any) -> int:
    """How many of the requests on `host`'s engine are a measurement's (WorkerStats.calibrating)."""
    return sum(r.startswith(REQUEST_PREFIX) for r in (*host._pending, *host._running_ctx))


def _quiet(host: Any) -> bool:
    """Only our own requests on the engine (serving traffic would inflate every sample)."""
    return own_requests(host) == len(host._pending) + len(host._running_ctx)


async def _run(host: Any, ids: list[int], max_tokens: int, stamps: list[float] | None = None) -> None:
    from contextlib import aclosing

    rid = f"{REQUEST_PREFIX}{uuid.uuid4().hex[:8]}"
    # NOTE: aclosing: a measurement that gives way to traffic aborts its engine requests at once
    async with aclosing(host._generate(rid, ids, _params(max_tokens))) as outs:
        async for out in outs:
            if stamps is not None and out.outputs and out.outputs[0].token_ids:
                stamps.append(time.monotonic())


def foreign_limit(engine_threads: int, cpus: int | None = None) -> float:
    """Cores other processes may use while a CPU engine is measured: half of what its threads leave free
    (at least 0.3), so on a 2-core box with a 1-thread engine, 0.5."""
    import os

    free = (cpus or os.cpu_count() or 1) - engine_threads
    return max(0.3, 0.5 * free)


async def _sample(host: Any, vocab: int, prefill_lens: tuple[int, ...], decode_points: tuple[tuple[int, int], ...],
                  steps: int, repeats: int) -> tuple[list, list]:
    salt = int(time.time()) % 100_000
    await _run(host, _prompt(16, salt, vocab), 2)  # NOTE: warm-up
    prefill = []
    for n in prefill_lens:
        times = []
        for r in range(repeats):
            t = time.monotonic()
            await _run(host, _prompt(n, salt + 13 * n + r, vocab), 1)
            times.append((time.monotonic() - t) * 1e3)
        prefill.append((float(n), float(n * n), min(times)))
    decode = []
    for b, context in decode_points:
        stamps: list[list[float]] = [[] for _ in range(b)]
        await asyncio.gather(*(_run(host, _prompt(context, salt + 1000 * b + i, vocab), steps + 2, stamps[i])
                               for i in range(b)))
        # NOTE: steps after the last request's first token run the whole batch; the median resists spikes.
        start = max(s[0] for s in stamps)
        gaps = [y - x for x, y in zip(stamps[0], stamps[0][1:], strict=False) if x >= start]
        if gaps:
            decode.append((float(b), float(b * (context + 1 + steps / 2)), statistics.median(gaps) * 1e3))
    return prefill, decode


async def measure(host: Any, vocab: int, prefill_lens: tuple[int, ...] = PREFILL_LENS,
                  decode_points: tuple[tuple[int, int], ...] = DECODE_POINTS, steps: int = DECODE_STEPS,
                  repeats: int = 2, foreign_max: float | None = None) -> Samples:
    """Samples from `host`'s engine, on an engine without serving traffic: a serving request that arrives
    meanwhile makes the measurement give way at once (its requests aborted, within an engine step; the
    samples unclean, unused), so calibrating never delays traffic. `foreign_max` (CPU engines): the cores
    other processes may use meanwhile (a second engine or a benchmark on the same box slows every sample)
    before the samples count as unclean; None: unchecked."""
    t0 = time.monotonic()
    foreign = ForeignCores() if foreign_max is not None else None
    if foreign is not None:  # NOTE: a busy box is seen in a second, before any measuring
        await asyncio.sleep(LOOK_S)
    seen = 0.0 if foreign is None else foreign.cores()
    if not _quiet(host) or foreign_max is not None and seen > foreign_max:
        return Samples([], [], time.monotonic() - t0, False, round(seen, 3))
    room = getattr(host, "max_model_len", 1 << 30) - steps - 4
    prefill_lens = tuple(n for n in prefill_lens if n <= room) or (min(16, room),)
    decode_points = tuple((b, c) for b, c in decode_points if c <= room) or ((1, min(16, room)),)
    body = asyncio.ensure_future(_sample(host, vocab, prefill_lens, decode_points, steps, repeats))
    try:
        while not body.done() and _quiet(host):
            await asyncio.wait({body}, timeout=YIELD_POLL_S)
    finally:
        if not body.done():  # serving traffic arrived (or this call was cancelled): give way
            body.cancel()
            await asyncio.gather(body, return_exceptions=True)
    others = 0.0 if foreign is None else foreign.cores()
    if body.cancelled():
        return Samples([], [], time.monotonic() - t0, False, round(others, 3))
    prefill, decode = body.result()
    clean = foreign_max is None or others <= foreign_max
    return Samples(prefill, decode, time.monotonic() - t0, clean, round(others, 3))


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def machine_key(model_name: str, dtype: str, threads: int, device: str, engine: str = "") -> str:
    """One cache entry per CPU (or GPU) model, model, dtype, threads, vLLM version and `engine`
    (engine_fingerprint: the engine settings and model files that change step times)."""
    import re

    import vllm

    hw = cpu_model() if device == "cpu" else _gpu_name()
    raw = f"{model_name}-{dtype}-t{threads}-{device}-{hw}-vllm{vllm.__version__}"
    return re.sub(r"[^A-Za-z0-9.]+", "-", raw).strip("-").lower()[:140] + (f"-{engine}" if engine else "")


def engine_fingerprint(vllm_config: Any) -> str:
    """12 hex digits over what makes one engine's steps slower or faster than another's on the same
    machine: step budget, chunked prefill, batch and context limits, block size, KV dtype, eager mode,
    speculation, TP and PP sizes, and the model files (config.json's bytes, each weight file's name and size)."""
    import hashlib
    from pathlib import Path

    sc, cc, mc = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.model_config
    spec = getattr(vllm_config, "speculative_config", None)
    parts = [sc.max_num_batched_tokens, sc.enable_chunked_prefill, sc.max_num_seqs, cc.block_size, cc.cache_dtype,
             mc.max_model_len, mc.enforce_eager, getattr(spec, "method", None), getattr(spec, "num_speculative_tokens", None),
             vllm_config.parallel_config.tensor_parallel_size, vllm_config.parallel_config.pipeline_parallel_size]
    h = hashlib.sha256(repr(parts).encode())
    root = Path(str(mc.model))
    files = sorted(root.iterdir()) if root.is_dir() else [root] if root.is_file() else []
    for f in files:
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:12]


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "gpu"


def cache_path(key: str) -> Any:
    """$SAAF_PROFILE_DIR/KEY.json, by default <cache dir>/profiles/ (engine/checkpoints.py cache_dir)."""
    import os
    from pathlib import Path

    from engine.checkpoints import cache_dir

    return Path(os.environ.get("SAAF_PROFILE_DIR") or cache_dir() / "profiles") / f"{key}.json"


def load_cached(key: str) -> Samples | None:
    import json

    path = cache_path(key)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Samples([tuple(r) for r in data["prefill"]], [tuple(r) for r in data["decode"]],
                       float(data["seconds"]), bool(data.get("clean", True)), float(data.get("foreign_cores", 0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(key: str, samples: Samples) -> None:
    """Written to a temporary file and renamed into place: never a half-written cache entry."""
    import json
    import os

    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(samples._asdict()), encoding="utf-8")
    tmp.replace(path)
