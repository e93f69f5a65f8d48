"""Issue 5 live: a burst beyond capacity gets 429s (goodput policy, admission on) instead of unbounded
latency, the admitted requests meet their targets more often than with admission off (least_loaded,
everything admitted), and the Prometheus metrics scraped during the run show the counts."""

from __future__ import annotations

import time

import httpx
import pytest

from benchmarks import admission as adm

pytestmark = pytest.mark.integration

BURST = 20
TARGETS: dict[str, float] = {}  # ttft_ms, tpot_ms: set by the off_burst fixture


@pytest.fixture(scope="module")
def off_burst(deployment, workers) -> list[dict]:
    """The burst on the session's ingress (least_loaded, admission off), with the SLO derived from it.

    NOTE: the targets are measured on this machine (CPUs of one kind differ ~1.7x, CI boxes are noisy):
    TPOT a multiple of a lone request's, TTFT what only the first ~40% of this very burst met with
    everything admitted, so the burst is past capacity by construction and admission has work to do."""
    ttft, tpot = adm.lone(deployment["endpoint"], deployment["model"])
    off = adm.burst(deployment["endpoint"], deployment["model"], BURST, 1, None)
    assert all(r["status"] == 200 for r in off), [r for r in off if r["status"] != 200][:1]
    TARGETS.update(adm.targets_from(ttft, tpot, off))
    print(f"\nlone request on this machine: TTFT {ttft * 1000:.0f} ms, TPOT {tpot * 1000:.0f} ms -> targets {TARGETS}")
    adm.wait_idle(workers)
    return off


@pytest.fixture(scope="module")
def ingresses(deployment, off_burst) -> dict[str, str]:
    """Two more ingresses on the same pools, each on its own port, started together (CI time):
    - "adm": goodput policy, admission 'reject', under /adm. NOTE: ewma_alpha 0.3 (default 0.1): the warm-up
      traffic below (adm.warm) is all this ingress has seen. A cautious operator's admit_probability 0.95
      (default 0.5; see benchmarks/admission.py) keeps the burst's shared prefill step inside the target. Every
      prompt on the prefill worker (disaggregation always): this burst is about admission on one prefill
      engine. The burst's targets are this ingress's own SLO: a header may only tighten them.
    - "auto": the default router (goodput, disaggregation auto), serving all, under /auto: local prefill."""
    specs = [adm.IngressSpec("itest-adm", "/adm", adm.ADMISSION_ROUTER,
                             {"slo": deployment["config"].slo.model_copy(update=TARGETS)}),
             adm.IngressSpec("itest-auto", "/auto", {"policy": "goodput", "disaggregation": "auto",
                                                      "admission": "best_effort"})]
    with adm.ingresses(deployment, specs) as (adm_url, auto_url):
        yield {"adm": adm_url, "auto": auto_url}


@pytest.fixture(scope="module")
def admission_endpoint(ingresses) -> str:
    return ingresses["adm"]


def _last_seq(endpoint: str) -> int:
    """The sequence number of the last finished request the goodput router has a prediction for."""
    preds = httpx.get(f"{endpoint}/v1/stats", timeout=10).json()["router"]["predictions"]
    return preds[-1][0] if preds else 0


def _metric(text: str, name: str, label: str) -> float:
    """The sum of the samples of `name` whose labels include `label`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_impossible_slo_header_is_a_429_before_any_stream(admission_endpoint, model_name, path, stream):
    """vLLM's serving layer would start a 200 stream before generate() runs; our admission wrapper routes
    first, so a refusal is an HTTP 429 with Retry-After and an OpenAI-style body, streamed or not."""
    body = {"model": model_name, "max_tokens": 8, "stream": stream}
    body |= {"prompt": "Hello"} if path.endswith("/completions") and "chat" not in path else {
        "messages": [{"role": "user", "content": "Hello"}]}
    t0 = time.monotonic()
    r = httpx.post(f"{admission_endpoint}{path}", json=body, headers={"x-slo-ttft-ms": "1"}, timeout=60)
    assert r.status_code == 429, r.text[:300]
    assert r.headers.get("retry-after") and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == "slo_unattainable" and err["type"] == "rate_limit_exceeded" and "TTFT" in err["message"]
    assert time.monotonic() - t0 < 5
    ok = httpx.post(f"{admission_endpoint}{path}", json=body, timeout=120)  # the deployment's own SLO admits it
    assert ok.status_code == 200, ok.text[:300]
    # nothing of the refused request stays in flight (a drain would wait for it)
    assert httpx.get(f"{admission_endpoint}/v1/stats", timeout=10).json()["inflight"] == 0


# NOTE: after the impossible-SLO checks: the burst teaches this ingress's router large TPOT corrections
# (observed/predicted under a full decode batch), which then refuse a lone request at the deployment's SLO.
def test_burst_with_admission_beats_admission_off(off_burst, admission_endpoint, model_name, workers):
    off = off_burst
    adm.wait_idle(workers)
    # NOTE: admission predicts with the latency model the controller measures on these engines (this goodput
    # ingress asked for it when it came up) once the box is quiet: here, while nothing else runs.
    cal = adm.wait_calibrated(admission_endpoint)
    # Served traffic first (lone requests and one burst): the goodput policy corrects its latency model online
    # (EWMA of observed/predicted), as it would have done in any deployment that has served traffic.
    adm.warm(admission_endpoint, model_name, BURST, TARGETS, workers)
    att_off = sum(adm.met(r, TARGETS) for r in off) / len(off)
    # NOTE: at most two bursts. The router learns the box's speed from what it serves (per-worker corrections);
    # on a shared VM the speed can change between the warm-up and the burst (a clean-clone CI run saw a batched
    # prefill take 1.6x its prediction), and a deployment then learns from the burst it misjudged. The
    # second burst, with those corrections, must do what the first did not: a router that does not learn
    # fails both. Every burst must refuse at once and be counted exactly in /metrics.
    for attempt, seed in enumerate((2, 4)):
        adm.wait_idle(workers)
        print(f"\nburst {attempt + 1}: router latency model {cal['source']}; admission off: attainment "
              f"{att_off:.0%}, max e2e {max(r['e2e'] for r in off):.1f}s")
        rejected, admitted, att_admitted = _admission_burst(admission_endpoint, model_name, seed)
        if att_admitted > att_off and (rejected or att_admitted >= 0.75):
            break
    # NOTE: what admission must get right is what it admits: those meet the targets more often than the same
    # burst served whole. The targets make the burst past capacity as the admission-off run measured it; on
    # a noisy box the router may judge this burst within capacity and admit it all, and then nearly
    # all of it must meet the targets.
    assert att_admitted > att_off
    assert rejected or att_admitted >= 0.75, "admitted the whole burst, and too much of it missed"


def _admission_burst(endpoint: str, model_name: str, seed: int) -> tuple[list[dict], list[dict], float]:
    """One burst on the admission ingress: (refused, admitted, attainment of the admitted); asserts what
    every burst must show: only 200s and 429s, refusals at once with Retry-After, /metrics counting them."""
    before = httpx.get(f"{endpoint}/metrics", timeout=10).text
    seq0 = _last_seq(endpoint)
    on = adm.burst(endpoint, model_name, BURST, seed, TARGETS)
    after = httpx.get(f"{endpoint}/metrics", timeout=10).text
    router = httpx.get(f"{endpoint}/v1/stats", timeout=10).json()["router"]
    predicted = [(p[1], p[2]) for p in router["predictions"] if p[0] > seq0]
    rejected = [r for r in on if r["status"] == 429]
    admitted = [r for r in on if r["status"] == 200]
    n_met = sum(adm.met(r, TARGETS) for r in admitted)
    att_admitted = n_met / len(admitted) if admitted else 0.0
    print(f"admission on: {len(admitted)} admitted, {len(rejected)} rejected, attainment of admitted "
          f"{att_admitted:.0%}, overall {n_met / len(on):.0%}; admitted (ttft, tpot): "
          f"{[(round(r['ttft'] or -1, 2), round(r['tpot'] or -1, 3)) for r in admitted]}; the router's TTFT "
          f"(predicted, measured): {predicted}; corrections {router['corrections']}")
    assert {r["status"] for r in on} <= {200, 429}
    assert admitted, f"every request of the burst was refused: {rejected[0]['body']}"
    assert all(r["retry_after"] and '"error"' in r["body"] for r in rejected)
    if rejected:
        assert max(r["e2e"] for r in rejected) < TARGETS["ttft_ms"] / 1000  # refused at once, not after a wait
    # The metrics scraped around the run count exactly what the clients saw.
    for outcome, n in (("rejected", len(rejected)), ("ok", len(admitted))):
        key = f'outcome="{outcome}"'
        assert _metric(after, "saaf_requests_total", key) - _metric(before, "saaf_requests_total", key) == n
    return rejected, admitted, att_admitted


@pytest.fixture(scope="module")
def auto_endpoint(ingresses) -> str:
    return ingresses["auto"]


def test_auto_prefills_a_short_prompt_on_the_idle_decode_worker(auto_endpoint, model_name, workers,
                                                                 colocated_worker):
    """router.disaggregation auto (the default) on idle workers: a short prompt is prefilled on the decode
    worker itself (no KV transfer), counted in /metrics and /v1/stats, and answers as one engine does."""
    from tests.helpers.engines import generate, params, token_ids

    adm.wait_idle(workers)
    prompt = [1200 + 17 * k for k in range(24)]
    before = httpx.get(f"{auto_endpoint}/metrics", timeout=10).text
    r = httpx.post(f"{auto_endpoint}/v1/completions", timeout=120, json={
        "model": model_name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    after = httpx.get(f"{auto_endpoint}/metrics", timeout=10).text
    key = 'where="local"'
    assert _metric(after, "saaf_prefill_placement_total", key) - _metric(before, "saaf_prefill_placement_total",
                                                                        key) == 1
    want = token_ids(generate(colocated_worker, "colo-local", prompt, params(12, ignore_eos=True)))
    assert r.json()["choices"][0]["token_ids"] == want
    router = httpx.get(f"{auto_endpoint}/v1/stats", timeout=10).json()["router"]
    assert router["disaggregation"] == "auto" and any(k.startswith("local:") for k in router["placements"])
