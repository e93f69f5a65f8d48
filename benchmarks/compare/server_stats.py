"""What our server says about itself while a step runs: ``/v1/stats`` sampled every second (batch,
queue, KV use per worker; KV transfer telemetry) and ``/metrics`` histogram means over the step."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from benchmarks.stats import LatencySummary

logger = logging.getLogger(__name__)

SERVER_HISTOGRAMS = {"saaf_ttft_seconds": "ttft", "saaf_prefill_seconds": "prefill",
                     "saaf_kv_transfer_seconds": "kv_transfer", "saaf_queue_wait_seconds": "queue_wait"}


class StatsSampler:
    """Polls ``GET /v1/stats`` every ``interval_s`` in a thread (bounded: each call times out)."""

    def __init__(self, endpoint: str, interval_s: float = 1.0) -> None:
        self.url = endpoint.rstrip("/") + "/v1/stats"
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self.first: dict[str, Any] = {}
        self.last: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stats-sampler", daemon=True)

    def _loop(self) -> None:
        with httpx.Client(timeout=3.0, trust_env=False) as client:
            while not self._stop.is_set():
                try:
                    body = client.get(self.url).json()
                    self.samples.append({"t": time.monotonic(), "workers": body.get("workers", [])})
                    self.first = self.first or body
                    self.last = body
                except (httpx.HTTPError, ValueError) as exc:
                    logger.debug("stats sample failed: %s", exc)
                self._stop.wait(self.interval_s)

    def __enter__(self) -> StatsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        # NOTE: one last sample once the step is over, so counters (draft tokens) cover all of it
        try:
            body = httpx.get(self.url, timeout=3.0, trust_env=False).json()
            self.samples.append({"t": time.monotonic(), "workers": body.get("workers", [])})
            self.last = body
        except (httpx.HTTPError, ValueError) as exc:
            logger.debug("stats sample failed: %s", exc)

    def predictions(self) -> list[list[float | None]]:
        """The goodput router's [seq, predicted TTFT, measured TTFT, predicted TPOT, measured TPOT] log."""
        try:
            body = httpx.get(self.url, timeout=5.0, trust_env=False).json()
            return list((body.get("router") or {}).get("predictions") or [])
        except (httpx.HTTPError, ValueError):
            return []

    def transfers(self) -> list[dict[str, Any]]:
        try:
            return httpx.get(self.url, timeout=5.0, trust_env=False).json().get("transfers", [])
        except (httpx.HTTPError, ValueError):
            return []


def worker_load(samples: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per worker from ``/v1/stats`` samples: mean/max running batch over samples where it was busy,
    busy fraction of samples, mean waiting, median recent step time, mean/max KV use."""
    by: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        for w in s.get("workers", []):
            by.setdefault(w["worker_id"], []).append(w)
    out = {}
    for wid, ws in sorted(by.items()):
        busy = [w for w in ws if w.get("running", 0) > 0]
        steps = sorted(t for w in busy for t in w.get("recent_step_times_s", []) or [])
        out[wid] = {
            "role": ws[0].get("role"), "samples": len(ws), "busy_fraction": len(busy) / len(ws),
            "mean_running_when_busy": (sum(w["running"] for w in busy) / len(busy)) if busy else 0.0,
            "max_running": max((w.get("running", 0) for w in ws), default=0),
            "mean_waiting": sum(w.get("waiting", 0) for w in ws) / len(ws),
            "median_step_s": steps[len(steps) // 2] if steps else None,
            "mean_kv_usage": sum(w.get("kv_usage", 0.0) for w in ws) / len(ws),
            "max_kv_usage": max((w.get("kv_usage", 0.0) for w in ws), default=0.0),
            **_acceptance(ws),
        }
    return out


def _acceptance(ws: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Accepted / proposed draft tokens of a speculating worker over the samples (the first and last
    snapshot's counters), so a step is not credited with what earlier steps' traffic proposed; the
    engine's figure since it started where it reports no counters."""
    drafted = (ws[-1].get("spec_drafted") or 0) - (ws[0].get("spec_drafted") or 0)
    if drafted > 0:
        accepted = (ws[-1].get("spec_accepted") or 0) - (ws[0].get("spec_accepted") or 0)
        return {"spec_acceptance": round(accepted / drafted, 4), "spec_drafted": drafted}
    since_start = next((w["spec_acceptance"] for w in reversed(ws) if w.get("spec_acceptance") is not None), None)
    return {"spec_acceptance": since_start, "spec_drafted": None}


def compact_samples(samples: Sequence[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    """The raw samples, small: seconds since ``t0`` and [worker, running, waiting, KV use] per worker."""
    return [{"t": round(x["t"] - t0, 2),
             "w": [[w["worker_id"], w.get("running"), w.get("waiting"), round(w.get("kv_usage", 0.0), 3)]
                   for w in x["workers"]]} for x in samples]


def transfer_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Count, outcomes, wait and hand-off percentiles (nearest rank) of KV transfer telemetry."""
    if not records:
        return {"count": 0}
    waits = LatencySummary.of([r["transfer_wait_s"] for r in records])
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r.get("outcome", "?")] = outcomes.get(r.get("outcome", "?"), 0) + 1
    return {"count": len(records), "outcomes": outcomes, "transfer_wait_p50_s": waits.p50,
            "transfer_wait_p90_s": waits.p90,
            "handoff_p50_s": LatencySummary.of([r["handoff_latency_s"] for r in records]).p50,
            "kv_bytes_mean": sum(r["kv_bytes"] for r in records) / len(records),
            "decode_computed_prompt_tokens_max": max(r.get("decode_computed_prompt_tokens", 0) for r in records)}


def router_counts(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """What the goodput router decided between two ``/v1/stats`` bodies: where prompts were prefilled
    (``placements``: remote / local and why) and the prompt tokens it predicted cached on the prefill
    worker it chose (``prefix_hit_tokens``: follow-up turns sent to the worker holding their prefix)."""
    r0, r1 = first.get("router") or {}, last.get("router") or {}
    if "placements" not in r1:
        return {}
    p0 = r0.get("placements") or {}
    moved = {k: v - p0.get(k, 0) for k, v in (r1.get("placements") or {}).items() if v - p0.get(k, 0)}
    return {"placements": dict(sorted(moved.items())),
            "prefix_hit_tokens": (r1.get("prefix_hit_tokens") or 0) - (r0.get("prefix_hit_tokens") or 0)}


def prediction_summary(entries: Sequence[Sequence[float | None]]) -> dict[str, Any]:
    """The router's predictions next to the measurements (routing -> first token; TPOT) at p50 and p90,
    and the p50/p90 ratio predicted/measured, for the requests of one step; and per request, the error
    ln(measured / predicted): its mean (bias; > 0: slower than predicted) and standard deviation (spread,
    what the router's `prediction_sigma` assumes), and every (predicted, measured) pair with where its prompt was
    prefilled (`placements`: remote:<why> / local:<why> / colocated, from routers that report it)."""
    out: dict[str, Any] = {"count": len(entries)}
    for name, i in (("ttft", 1), ("tpot", 3)):
        kept = [e for e in entries if e[i] is not None and e[i + 1] is not None]
        pairs = [(e[i], e[i + 1]) for e in kept]
        if not pairs:
            continue
        pred, meas = LatencySummary.of([p for p, _ in pairs]), LatencySummary.of([m for _, m in pairs])
        out[name] = {"p50_predicted": pred.p50, "p50_measured": meas.p50, "p90_predicted": pred.p90,
                     "p90_measured": meas.p90,
                     "p50_ratio": round(pred.p50 / meas.p50, 3) if meas.p50 else None,
                     "p90_ratio": round(pred.p90 / meas.p90, 3) if meas.p90 else None,
                     **log_errors(pairs), "pairs": [[p, m] for p, m in pairs]}
        if all(len(e) > 5 for e in kept):
            out[name]["placements"] = [e[5] for e in kept]
    return out


def log_errors(pairs: Sequence[tuple[float, float]]) -> dict[str, float | None]:
    """Mean and standard deviation of ln(measured / predicted) over the pairs where both are positive."""
    errs = [math.log(m / p) for p, m in pairs if p > 0 and m > 0]
    if not errs:
        return {"log_error_mean": None, "log_error_sd": None}
    mean = sum(errs) / len(errs)
    sd = math.sqrt(sum((e - mean) ** 2 for e in errs) / len(errs))
    return {"log_error_mean": round(mean, 3), "log_error_sd": round(sd, 3)}


def parse_metrics(text: str) -> dict[str, float]:
    """``{name_sum: v, name_count: v}`` of the unlabelled histograms in ``SERVER_HISTOGRAMS``."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        base = name.rsplit("_", 1)[0]
        if base in SERVER_HISTOGRAMS and name.endswith(("_sum", "_count")):
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def metric_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Server-side mean of each histogram over the interval between two scrapes."""
    out: dict[str, float | None] = {}
    for base, short in SERVER_HISTOGRAMS.items():
        n = after.get(f"{base}_count", 0.0) - before.get(f"{base}_count", 0.0)
        total = after.get(f"{base}_sum", 0.0) - before.get(f"{base}_sum", 0.0)
        out[short] = total / n if n > 0 else None
    return out


def scrape_metrics(endpoint: str) -> dict[str, float]:
    try:
        return parse_metrics(httpx.get(endpoint.rstrip("/") + "/metrics", timeout=5.0, trust_env=False).text)
    except httpx.HTTPError:
        return {}
