"""The abuse table: what a deployment answers to clients that try to get in, fan out, collide, stall or
garble, and whether it stayed up and lost nothing (no request left in flight, no KV block left in use).

    python -m benchmarks.abuse [--out benchmarks/results/abuse-cpu.json]

Starts `python -m cluster.deploy CONFIG --no-demo` (the embedded default with an API key and shorter client
deadlines, router least_loaded so that admission refusals do not hide what is measured) as a subprocess, runs
each abuse against it on 127.0.0.1, and after each checks /health and /v1/stats (in flight 0, KV usage 0 on
every worker, within 30 s). Then lists every listening socket of the deployment's process tree with its
address and what guards it, and SIGTERMs the deployment. Prints the table; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.compare.provenance import Provenance, write_artefact
from benchmarks.deployproc import DeployProcess
from cluster.control.raytoken import refuses_unauthenticated, unauthenticated_answers
from engine.procs import listeners

KEY = "sk-abuse-" + os.urandom(8).hex()
CONFIG = {"router": {"policy": "least_loaded"},
          "serve": {"api_keys": [{"env": "SAAF_ABUSE_KEY"}], "send_timeout_s": 5, "header_timeout_s": 5,
                    "body_timeout_s": 5, "max_connections": 64}}
AUTH = {"Authorization": f"Bearer {KEY}"}


def _post(url: str, body: Any, headers: dict | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(url, json=body, headers={**AUTH, **(headers or {})}, timeout=timeout, trust_env=False)


def _answer(r: httpx.Response) -> str:
    try:
        err = r.json().get("error") or {}
    except ValueError:
        err = {}
    return f"{r.status_code} {err.get('code') or ''}".strip()


class Abuse:
    def __init__(self, endpoint: str, model: str, side_channel_port: int | None) -> None:
        self.ep, self.model, self.side_channel_port = endpoint, model, side_channel_port
        self.ttft: dict | None = None

    def chat(self, content: str = "Hi", **kw: Any) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}

    # each returns (what was tried, what the server answered)
    def no_key(self) -> tuple[str, str]:
        r = httpx.post(f"{self.ep}/v1/chat/completions", json=self.chat(), timeout=30, trust_env=False)
        return "chat completion without an API key", _answer(r)

    def wrong_key(self) -> tuple[str, str]:
        r = _post(f"{self.ep}/v1/chat/completions", self.chat(), {"Authorization": "Bearer sk-wrong"})
        return "chat completion with a wrong key", _answer(r)

    def suffix_path(self) -> tuple[str, str]:
        got = [httpx.get(f"{self.ep}{p}", timeout=30, trust_env=False).status_code
               for p in ("/v1/models/health", "/v1/chat/completions/x/health", "/metrics/../v1/stats")]
        return "keyless GETs of paths ending in /health or /metrics (suffix-match bypass)", " ".join(map(str, got))

    def open_health(self) -> tuple[str, str]:
        r = httpx.get(f"{self.ep}/health", timeout=30, trust_env=False)
        return "keyless GET /health", f"{r.status_code} {json.dumps(r.json())}"

    def docs(self) -> tuple[str, str]:
        got = [httpx.get(f"{self.ep}{p}", headers=AUTH, timeout=30, trust_env=False).status_code
               for p in ("/docs", "/redoc", "/openapi.json")]
        return "GET /docs, /redoc, /openapi.json (with the key)", " ".join(map(str, got))

    def fan_out_n(self) -> tuple[str, str]:
        t0 = time.monotonic()
        r = _post(f"{self.ep}/v1/completions", {"model": self.model, "prompt": "Hi", "max_tokens": 2, "n": 512})
        return "/v1/completions with n = 512", f"{_answer(r)} in {time.monotonic() - t0:.2f} s"

    def fan_out_prompts(self) -> tuple[str, str]:
        t0 = time.monotonic()
        r = _post(f"{self.ep}/v1/completions", {"model": self.model, "prompt": ["Hi"] * 1000, "max_tokens": 2})
        return "/v1/completions with 1,000 prompts", f"{_answer(r)} in {time.monotonic() - t0:.2f} s"

    def fan_out_batch(self) -> tuple[str, str]:
        body = {"model": self.model, "max_tokens": 2, "messages": [[{"role": "user", "content": "Hi"}]] * 100}
        return "/v1/chat/completions/batch with 100 conversations", _answer(_post(f"{self.ep}/v1/chat/completions/batch", body))

    def _ttft(self, prompt: list[int], n: int) -> tuple[float, float]:
        """(first, last) completion's time to its first token, streamed."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 8, "n": n, "temperature": 0.7, "seed": 1,
                "ignore_eos": True, "stream": True}
        t0, firsts = time.monotonic(), {}
        with httpx.stream("POST", f"{self.ep}/v1/completions", json=body, headers=AUTH, timeout=120,
                          trust_env=False) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:]).get("choices", []):
                        if c.get("text") and c["index"] not in firsts:
                            firsts[c["index"]] = time.monotonic() - t0
        return min(firsts.values()), max(firsts.values())

    def _fan_out_ttft(self, tokens: int) -> tuple[str, str]:
        import random
        import statistics

        rng = random.Random(36 + tokens)
        one, eight = [], []
        for _ in range(3):  # NOTE: alternating, a fresh prompt each time (no prefix-cache hit across runs)
            one.append(self._ttft([rng.randrange(1000, 40000) for _ in range(tokens)], 1))
            eight.append(self._ttft([rng.randrange(1000, 40000) for _ in range(tokens)], 8))
        m1 = statistics.median(t for t, _ in one)
        f8 = statistics.median(t for t, _ in eight)
        m8 = statistics.median(t for _, t in eight)
        self.ttft = dict(self.ttft or {}, **{str(tokens): {
            "n1_s": [round(t, 3) for t, _ in one], "n8_first_s": [round(t, 3) for t, _ in eight],
            "n8_last_s": [round(t, 3) for _, t in eight], "ratio_first_n8_to_n1": round(f8 / m1, 2),
            "ratio_last_n8_to_n1": round(m8 / m1, 2)}})
        return (f"{tokens}-token prompt, n = 8 vs n = 1 (TTFT of the response and of the last of the 8 "
                "completions, median of 3)", f"{f8:.2f} s and {m8:.2f} s vs {m1:.2f} s ({f8 / m1:.2f}x, {m8 / m1:.2f}x)")

    def fan_out_ttft(self) -> tuple[str, str]:
        return self._fan_out_ttft(256)  # NOTE: two whole 128-token CPU blocks (a prefix-cache hit stops at one)

    def fan_out_ttft_300(self) -> tuple[str, str]:
        return self._fan_out_ttft(300)  # NOTE: not block-aligned

    def kv_params(self) -> tuple[str, str]:
        body = self.chat(kv_transfer_params={"do_remote_prefill": True, "remote_host": "203.0.113.9"})
        return "a client's own kv_transfer_params (pull KV from any host)", _answer(_post(f"{self.ep}/v1/chat/completions", body))

    def same_id(self) -> tuple[str, str]:
        prompts = [f"Count from {i} to {i + 5}:" for i in range(8)]

        async def one(c: httpx.AsyncClient, p: str, rid: str | None) -> str:
            body = {"model": self.model, "prompt": p, "max_tokens": 8, "temperature": 0}
            r = await c.post(f"{self.ep}/v1/completions", json=body, headers={**AUTH, **({"X-Request-Id": rid} if rid else {})})
            return r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}"

        async def go() -> tuple[list[str], list[str]]:
            async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
                shared = await asyncio.gather(*(one(c, p, "same-id") for p in prompts))
                return list(shared), [await one(c, p, None) for p in prompts]

        shared, alone = asyncio.run(asyncio.wait_for(go(), 300))
        same = sum(a == b for a, b in zip(shared, alone, strict=True))
        return "8 concurrent requests with one X-Request-Id", f"{same} of 8 answered as when sent alone"

    def inflight(self) -> int:
        return httpx.get(f"{self.ep}/v1/stats", headers=AUTH, timeout=10, trust_env=False).json()["inflight"]

    def output_tokens(self) -> float:
        m = httpx.get(f"{self.ep}/metrics", headers=AUTH, timeout=10, trust_env=False).text
        return sum(float(ln.split()[-1]) for ln in m.splitlines() if ln.startswith('saaf_tokens_total{kind="output"}'))

    def slow_reader(self) -> tuple[str, str]:
        c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        host, port = self.ep.removeprefix("http://").split(":")
        c.connect((host, int(port)))
        asked = 4 * 900
        body = json.dumps({"model": self.model, "prompt": "Tell me a long story.", "max_tokens": 900, "n": 4,
                           "ignore_eos": True, "stream": True, "logprobs": 20}).encode()
        tokens0 = self.output_tokens()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        t0, released, seen, served = time.monotonic(), None, False, 0
        try:
            while time.monotonic() - t0 < 180:  # NOTE: bounded; 4 x 900 tokens would take minutes to generate
                served += _post(f"{self.ep}/v1/chat/completions", self.chat()).status_code == 200
                n = self.inflight()
                seen = seen or n > 0
                if seen and n == 0:
                    released = time.monotonic() - t0
                    break
                time.sleep(0.5)
        finally:
            c.close()
        made = self.output_tokens() - tokens0 - 4 * served  # NOTE: the other requests' 4 tokens each left out
        answer = (f"its request released after {released:.1f} s, {made:.0f} of {asked} tokens generated"
                  if released is not None else "held for 180 s")
        return ("a streaming client (n = 4 x 900 tokens, logprobs) that never reads, 4 KiB receive buffer",
                f"{answer}; {served} other requests served meanwhile")

    def slowloris(self) -> tuple[str, str]:
        host, port = self.ep.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as c:
            t0 = time.monotonic()
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            try:
                closed = c.recv(1) == b""
            except (TimeoutError, ConnectionResetError):
                closed = False
            return "a request head never finished (slowloris)", f"closed after {time.monotonic() - t0:.1f} s" if closed else "open"

    def connection_flood(self) -> tuple[str, str]:
        host, port = self.ep.removeprefix("http://").split(":")
        held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(70)]
        try:
            time.sleep(0.5)
            r = httpx.get(f"{self.ep}/health", timeout=30, trust_env=False)
            return "70 idle connections held open (serve.max_connections 64), then one more request", _answer(r)
        finally:
            for h in held:
                h.close()

    def side_channel_garbage(self) -> tuple[str, str]:
        if not self.side_channel_port:
            return "garbage frames to the prefill engine's NIXL side channel", "no port found"
        import zmq

        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{self.side_channel_port}")
        for frames in ([b"\xff" * 64], [b"", b"\x00garbage"], [b"a", b"b", b"c"], [os.urandom(4096)]):
            s.send_multipart(frames)
        time.sleep(1)
        s.close()
        ctx.term()
        r = _post(f"{self.ep}/v1/chat/completions", self.chat("What is the capital of France?", max_tokens=8))
        return "garbage frames to the prefill engine's NIXL side channel, then a request", f"then {_answer(r)}"


def settled(endpoint: str, timeout_s: float = 30) -> dict:
    """/health, and /v1/stats until nothing is in flight and no worker holds KV (bounded)."""
    deadline, last = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"{endpoint}/health", timeout=10, trust_env=False).status_code
            st = httpx.get(f"{endpoint}/v1/stats", headers=AUTH, timeout=10, trust_env=False).json()
        except httpx.HTTPError as e:
            last = {"up": False, "error": str(e)[:200]}
            time.sleep(1)
            continue
        kv = max((w.get("kv_usage") or 0) for w in st["workers"]) if st.get("workers") else None
        last = {"up": health == 200, "inflight": st.get("inflight"), "kv_usage_max": kv}
        if health == 200 and st.get("inflight") == 0 and kv == 0:
            return last
        time.sleep(1)
    return last


def markdown(report: dict) -> str:
    """The README's table from a committed abuse JSON."""
    lines = ["| abuse tried | the server answered | stayed up, lost nothing |", "|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['tried']} | {r['answer']} | {'yes' if r['kept'] else 'NO: ' + json.dumps(r['after'])} |")
    off = [s for s in report["listeners"] if s["guard"] != "loopback"]
    lines.append(f"| what listens: {len(report['listeners'])} sockets of the process tree | "
                 + (", ".join(f"{s['process'][:28]} on {s['host']}:{s['port']}: {s['guard']}" for s in off)
                    or "all on loopback") + " | the rest on loopback |")
    git = report["git"]
    return "\n".join(lines) + (f"\n\n(measured {report['started_at']} at {git.get('commit', '?')[:7]}"
                               f"{' (dirty tree)' if git.get('dirty') else ''}, {report['machine'].get('cpu_model', '?')})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the table as JSON here")
    ap.add_argument("--markdown", metavar="JSON", help="print the Markdown table of a committed run and exit")
    a = ap.parse_args()
    if a.markdown:
        print(markdown(json.loads(Path(a.markdown).read_text())))
        return 0
    prov = Provenance.start(["python", "-m", "benchmarks.abuse"], sys.argv[1:])
    tmp = Path(tempfile.mkdtemp(prefix="saaf-abuse-"))
    (tmp / "deploy.yaml").write_text(yaml.safe_dump(CONFIG))
    os.environ["SAAF_ABUSE_KEY"] = KEY
    dp = DeployProcess(str(tmp / "deploy.yaml"))
    rows, socks, ready, ab = [], [], None, None
    try:
        ready = dp.start(600)
        out = "".join(dp.lines)
        endpoint = out.split("OpenAI-compatible endpoint: ")[1].split("/v1")[0].strip()
        model = out.split("(model '")[1].split("'")[0]
        port = next((int(ln.split()[4]) for ln in dp.lines if ln.startswith("prefill ")), None)
        ab = Abuse(endpoint, model, port)
        for name in ("no_key", "wrong_key", "suffix_path", "open_health", "docs", "fan_out_n", "fan_out_prompts",
                     "fan_out_batch", "fan_out_ttft", "fan_out_ttft_300", "kv_params", "same_id", "slow_reader", "slowloris", "connection_flood",
                     "side_channel_garbage"):
            t0 = time.monotonic()
            try:
                tried, answer = getattr(ab, name)()
            except Exception as e:  # noqa: BLE001 - the row records it
                tried, answer = name, f"client error: {type(e).__name__}: {str(e)[:160]}"
            after = settled(endpoint)
            rows.append({"abuse": name, "tried": tried, "answer": answer, "after": after,
                         "kept": after.get("up") is True and after.get("inflight") == 0 and after.get("kv_usage_max") == 0,
                         "secs": round(time.monotonic() - t0, 1)})
            print(f"{tried:<75} {answer:<45} {'kept' if rows[-1]['kept'] else 'LOST ' + json.dumps(after)}", flush=True)
        for ls in listeners(dp.pids()):
            guard = "loopback"
            if not ls.loopback:  # NOTE: asked, not assumed: a call without the Ray token
                answers = unauthenticated_answers(f"127.0.0.1:{ls.port}")
                guard = ("Ray token (a call without it: UNAUTHENTICATED)" if refuses_unauthenticated(answers)
                         else f"NONE ({answers})")
            socks.append({"pid": ls.pid, "process": ls.process[:60], "host": ls.host, "port": ls.port, "guard": guard})
        print(f"{len(socks)} listening sockets; not on loopback: "
              + (", ".join(f"{s['process'][:30]} {s['host']}:{s['port']} ({s['guard']})" for s in socks
                           if s["guard"] != "loopback") or "none"))
    finally:
        left = dp.stop()
    body = {"ready_s": ready and round(ready, 1), "config": CONFIG, "rows": rows, "listeners": socks,
            "n8_vs_n1_ttft": getattr(ab, "ttft", None) if ready else None, "left_after_sigterm": left}
    if a.out:
        write_artefact(a.out, prov, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
