"""Soak: many requests against a real deployment; count every one, watch the server's memory.

    python -m benchmarks.soak [--requests 2000] [--concurrency 32] [--out FILE.json]

Starts `python -m cluster.deploy` (its own embedded Ray, 1 prefill + 1 decode tiny-llama engine on CPU,
on a free loopback port) as a subprocess and sends REQUESTS requests, CONCURRENCY at a time: chat and
completions, streaming and not, 1-32 output tokens (ignore_eos, so each must return exactly that many), and
one in twenty deliberately invalid (max_tokens past the context: a documented 400). Every request must end
in a complete answer with the right token count, or its documented 4xx/429; the server's own request
counter must match the client's count (nothing lost or counted twice); the PSS of the whole process tree
(Ray included) in the last quarter of the run must be within 10% of the first quarter (after one
uncounted warm-up round of CONCURRENCY requests). Prints the figures
and PASS/FAIL per criterion; exits 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from benchmarks.deployproc import DeployProcess, pss_by_process, pss_bytes

MAX_MODEL_LEN = 512
GROWTH_LIMIT = 0.10


@dataclass
class Outcome:
    index: int
    kind: str  # ok | expected_4xx | rejected_429 | unexpected
    detail: str = ""
    response_id: str | None = None


def deploy_config(port: int, name: str = "soak") -> dict:
    return {"name": name, "mode": "disaggregated",
            "engine": {"model": "tiny-llama", "kv_cache_mib": 64, "max_model_len": MAX_MODEL_LEN},
            "pools": {"prefill": 1, "decode": 1},
            "serve": {"port": port, "request_timeout_s": 120, "token_timeout_s": 60},
            # NOTE: the soak checks that every request is answered, completely and once, under sustained load;
            # goodput routes it (the default) but serves what it would refuse, so the load stays the load.
            "router": {"admission": "best_effort"},
            "ray": {"namespace": f"saaf-{name}", "num_cpus": 8}}


def plan(i: int, rng: random.Random) -> dict:
    """Request i: which API, streaming or not, how many tokens, valid or not."""
    return {"chat": i % 2 == 0, "stream": (i // 2) % 2 == 0, "max_tokens": rng.randint(1, 32),
            "invalid": i % 20 == 19, "words": rng.randint(1, 60)}


async def one(client: httpx.AsyncClient, endpoint: str, model: str, i: int, p: dict) -> Outcome:
    prompt = f"soak request {i}: " + " ".join(f"w{(i * 7 + k) % 997}" for k in range(p["words"]))
    max_tokens = 1_000_000 if p["invalid"] else p["max_tokens"]  # NOTE: past any context length
    body: dict = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    if p["chat"]:
        url, body["messages"] = f"{endpoint}/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        url, body["prompt"] = f"{endpoint}/v1/completions", prompt
    if p["stream"]:
        body.update(stream=True, stream_options={"include_usage": True})
    try:
        async with client.stream("POST", url, json=body) as r:
            raw = await r.aread()
    except httpx.HTTPError as e:
        return Outcome(i, "unexpected", f"transport: {type(e).__name__}: {e}")
    if r.status_code != 200:
        try:
            err = json.loads(raw)["error"]
        except (ValueError, KeyError, TypeError):
            return Outcome(i, "unexpected", f"HTTP {r.status_code} without an error body: {raw[:200]!r}")
        if r.status_code == 429:
            return Outcome(i, "rejected_429", err.get("message", ""))
        if p["invalid"] and r.status_code == 400:
            return Outcome(i, "expected_4xx", err.get("message", ""))
        return Outcome(i, "unexpected", f"HTTP {r.status_code}: {err}")
    if p["invalid"]:
        return Outcome(i, "unexpected", "an invalid request was accepted")
    return check_answer(i, raw.decode(), p)


def check_answer(i: int, text: str, p: dict) -> Outcome:
    if p["stream"]:
        events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return Outcome(i, "unexpected", f"stream without [DONE]: {text[-200:]!r}")
        bodies = [json.loads(e) for e in events[:-1]]
        if any("error" in b for b in bodies):
            return Outcome(i, "unexpected", f"error event: {bodies}")
        usage = bodies[-1].get("usage") or {}
        rid = bodies[0].get("id")
    else:
        body = json.loads(text)
        usage, rid = body.get("usage") or {}, body.get("id")
    if usage.get("completion_tokens") != p["max_tokens"]:
        return Outcome(i, "unexpected", f"{usage.get('completion_tokens')} tokens, asked {p['max_tokens']}")
    return Outcome(i, "ok", response_id=rid)


def server_requests(endpoint: str) -> dict[str, float]:
    text = httpx.get(f"{endpoint}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^saaf_requests_total\{outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M)}


async def load(endpoint: str, model: str, n: int, concurrency: int, seed: int,
               progress: list[int], headers: dict[str, str] | None = None) -> list[Outcome]:
    rng = random.Random(seed)
    plans = [plan(i, rng) for i in range(n)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    out: list[Outcome] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(180, connect=10), headers=headers,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                out.append(await one(client, endpoint, model, i, plans[i]))
                progress[0] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def run(requests: int, concurrency: int, seed: int = 0) -> dict:
    """Start the deploy CLI, soak it, SIGTERM it and count what is left."""
    from kvtransfer.config import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "soak.yaml"
        path.write_text(yaml.safe_dump(deploy_config(port)))
        dp = DeployProcess(str(path))
        try:
            ready_s = round(dp.start(600), 1)
            res = soak(f"http://127.0.0.1:{port}", dp.pids, requests, concurrency, seed)
            res["ready_s"] = ready_s
        finally:
            left = dp.stop(120)
    res["left_running_after_sigterm"] = left
    res["checks"] = checks(res)
    return res


def soak(endpoint: str, pids: Callable[[], list[int]], requests: int, concurrency: int, seed: int = 0,
         api_key: str | None = None) -> dict:
    """REQUESTS requests against a running deployment whose process tree ``pids()`` lists: one uncounted
    warm-up round, then the counted load with the tree's PSS sampled every 0.25 s."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    model = httpx.get(f"{endpoint}/v1/models", timeout=10, headers=headers).json()["data"][0]["id"]
    res: dict = {"requests": requests, "concurrency": concurrency}
    # NOTE: one round of warm-up requests (not counted) so first-use allocations are not "growth".
    asyncio.run(load(endpoint, model, concurrency, concurrency, seed + 1, [0], headers))
    before = server_requests(endpoint)
    progress = [0]
    samples: list[tuple[int, int]] = []  # (requests done, PSS bytes)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((progress[0], pss_bytes(pids())))
            stop.wait(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    start_pss = pss_by_process(pids())
    # NOTE: one sample before and one after the load, so the first and the last quarter always have one (a
    # fast run of 120 requests, ~5 s, once had no sample in a quarter, the sampler sharing the GIL with the
    # load's event loop, and the memory check failed for want of data)
    samples.append((0, sum(start_pss.values())))
    sampler.start()
    t0 = time.monotonic()
    try:
        outcomes = asyncio.run(load(endpoint, model, requests, concurrency, seed, progress, headers))
    finally:
        stop.set()
        sampler.join(10)
        samples.append((progress[0], pss_bytes(pids())))
    res["wall_s"] = round(time.monotonic() - t0, 1)
    end_pss = pss_by_process(pids())
    grew = sorted(((end_pss[k] - start_pss.get(k, 0), k) for k in end_pss), reverse=True)[:5]
    res["pss_growth_top_processes_mib"] = {k: round(d / 2**20, 1) for d, k in grew}
    time.sleep(1.0)  # NOTE: the server counts a request when its stream has ended
    after = server_requests(endpoint)
    return summarise(res, outcomes, before, after, samples)


def summarise(res: dict, outcomes: list[Outcome], before: dict, after: dict,
              samples: list[tuple[int, int]]) -> dict:
    n = res["requests"]
    kinds = Counter(o.kind for o in outcomes)
    res["outcomes"] = dict(kinds)
    res["unexpected"] = [f"#{o.index}: {o.detail}" for o in outcomes if o.kind == "unexpected"][:20]
    ids = [o.response_id for o in outcomes if o.kind == "ok"]
    res["duplicate_response_ids"] = len(ids) - len(set(ids))
    res["answered"] = len({o.index for o in outcomes})
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    res["server_counted"] = {k: int(v) for k, v in delta.items() if v and k in ("ok", "error", "rejected")}
    res["req_per_s"] = round(n / res["wall_s"], 1) if res.get("wall_s") else None
    q = max(1, n // 4)
    first = [b for done, b in samples if done < q]
    last = [b for done, b in samples if done >= n - q]
    if first and last:
        m1, m4 = sum(first) / len(first), sum(last) / len(last)
        res["pss_first_quarter_gib"] = round(m1 / 2**30, 3)
        res["pss_last_quarter_gib"] = round(m4 / 2**30, 3)
        res["pss_growth"] = round(m4 / m1 - 1, 4)
    res["answered_once"] = res["answered"] == n and len(outcomes) == n
    res["checks"] = checks(res)
    return res


def checks(res: dict) -> dict[str, str]:
    """PASS/FAIL per criterion; the SIGTERM one only when the soak started (and stopped) the deployment."""
    kinds = res["outcomes"]
    checks = {
        "every request answered once": res["answered_once"],
        "no unexpected outcome": kinds.get("unexpected", 0) == 0,
        "no duplicate response id": res["duplicate_response_ids"] == 0,
        "server count == client count": res["server_counted"].get("ok", 0) == kinds.get("ok", 0)
        and res["server_counted"].get("rejected", 0) == kinds.get("rejected_429", 0),
        f"memory growth < {GROWTH_LIMIT:.0%}": res.get("pss_growth") is not None
        and res["pss_growth"] < GROWTH_LIMIT,
    }
    if "left_running_after_sigterm" in res:
        checks["no process left after SIGTERM"] = res["left_running_after_sigterm"] == 0
    return {k: "PASS" if v else "FAIL" for k, v in checks.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the figures as JSON here")
    a = ap.parse_args()
    if not 8 <= a.requests <= 100_000:
        ap.error(f"--requests {a.requests}: give 8..100000")
    if not 1 <= a.concurrency <= 256:
        ap.error(f"--concurrency {a.concurrency}: give 1..256")
    res = run(a.requests, a.concurrency, a.seed)
    for k, v in res.items():
        if k != "checks":
            print(f"{k:28} {v}")
    for k, v in res["checks"].items():
        print(f"{v}  {k}")
    if a.out:
        tmp = Path(a.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(a.out)
    return 0 if all(v == "PASS" for v in res["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
