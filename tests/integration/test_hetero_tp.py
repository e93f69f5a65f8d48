"""Issue 40: prefill and decode engines of different tensor parallelism, run for real on CPU (prefill TP 2 ->
decode TP 1, and the reverse): vLLM's CPU backend runs each TP-2 engine as two rank processes, and NIXL moves
the KV between the two layouts. Greedy answers are token for token those of one TP-1 colocated engine,
streamed and not, 8 at once; the bytes each response reports are the bytes the decode engine's NIXL moved.

The model is the tiny random Llama (4 query and 2 KV heads): the bundled SmolLM2's 9 heads do not split over
2 ranks (vLLM refuses it).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray
import yaml

from kvtransfer.config import free_port
from tests.helpers import sse
from tests.helpers.engines import generate, params, token_ids

pytestmark = pytest.mark.integration

MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "deploy-cpu-hetero-tp.yaml"
BLOCK = 128
LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 2, 2 * BLOCK, 700]


def _config(prefill_tp: int, decode_tp: int) -> dict:
    cfg = yaml.safe_load(MANIFEST.read_text())  # NOTE: the committed manifest, with its own port here
    cfg["pools"].update(prefill_tp=prefill_tp, decode_tp=decode_tp)
    cfg["name"] = f"tp{prefill_tp}{decode_tp}"
    cfg["serve"].update(port=free_port(), route_prefix=f"/tp{prefill_tp}{decode_tp}")
    cfg["ray"] = {"namespace": "saaf-test"}
    return cfg


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1000 + k * 7] + [rng.randrange(200, 40000) for _ in range(n - 1)] for k, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def reference(ray_session):
    """One colocated TP-1 engine of the same model and settings: what every answer must equal."""
    from cluster.config import parse_config
    from engine.colocated import ColocatedWorker

    ecfg = parse_config(_config(1, 1)).engine
    h = ray.remote(ColocatedWorker).options(num_cpus=1).remote("tp-ref", ecfg.model_dump(), None)
    ray.get(h.info.remote(), timeout=300)
    answers: dict[tuple, list[int]] = {}

    def answer(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in answers:
            answers[key] = token_ids(generate(h, f"ref-{len(answers)}", prompt, params(16, ignore_eos=True)))
        return answers[key]

    yield answer
    ray.kill(h, no_restart=True)


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["prefill-tp2-decode-tp1", "prefill-tp1-decode-tp2"])
def shaped(request, ray_session):
    from cluster.config import parse_config
    from cluster.control import lifecycle
    from cluster.control.lifecycle import controller_name

    info = lifecycle.start(parse_config(_config(*request.param)), ready_timeout_s=600)
    ctl = ray.get_actor(controller_name(info["config"]), namespace="saaf-test")
    _, members = ray.get(ctl.members.remote(), timeout=30)
    decode = next(h for _, role, h, _ in members if role == "decode")
    yield request.param, info, decode
    lifecycle.stop(info["config"])


def _complete(endpoint: str, model: str, prompt: list[int], stream: bool) -> tuple[list[int], dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    if not stream:
        r = httpx.post(f"{endpoint}/v1/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        (element,) = r.headers["x-saaf-served"].split(",")
        return r.json()["choices"][0]["token_ids"], dict(kv.strip().split("=", 1) for kv in element.split(";"))
    ids: list[int] = []
    served: dict = {}
    for chunk in sse.chunks(f"{endpoint}/v1/completions", body):
        ids += [t for c in chunk["choices"] for t in (c.get("token_ids") or [])]
        if chunk.get("usage"):
            (served,) = chunk["usage"]["saaf_served"]
    return ids, {k: str(v) for k, v in served.items()}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_answers_equal_one_tp1_engine_and_bytes_are_what_nixl_moved(shaped, reference, stream) -> None:
    (ptp, dtp), info, decode = shaped
    endpoint, model = info["endpoint"], info["model"]
    prompts = _prompts(21 + stream + 2 * ptp)
    before = ray.get(decode.transfer_counters.remote(), timeout=30)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: _complete(endpoint, model, p, stream), prompts))
    after = ray.get(decode.transfer_counters.remote(), timeout=30)
    block_bytes = ray.get(decode.info.remote(), timeout=30)["block_bytes"]
    for n, p, (ids, served) in zip(LENGTHS, prompts, got, strict=True):
        assert ids == reference(p), f"prompt of {n} tokens, TP {ptp} -> {dtp}: differs from one TP-1 engine"
        assert (served["path"], served["kv"], served["tp"]) == ("remote", "ok", f"{ptp}:{dtp}"), served
        assert int(served["kv_bytes"]) == -(-n // BLOCK) * block_bytes, served  # every rank's heads
        assert int(served["decode_computed"]) <= 1, served
    moved = after["kv_bytes"] - before["kv_bytes"]
    print(f"\nTP {ptp} -> {dtp}: NIXL moved {moved} bytes in {after['kv_transfers'] - before['kv_transfers']} "
          f"transfers for {len(prompts)} requests")
    assert moved == sum(int(s["kv_bytes"]) for _, s in got)  # the decode engine's NIXL, all its ranks
    # NOTE: one read per pair of ranks that hold the same heads: each of the TP-2 side's ranks moved its half
    assert after["kv_transfers"] - before["kv_transfers"] == len(prompts) * max(ptp, dtp)
