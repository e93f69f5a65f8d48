"""The contention term: CPU engines sharing a node's cores are predicted slower while another one there is
busy, exactly as calibrated while alone, and never on GPUs or on a node with cores to spare."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.router import contention
from engine.contract import WorkerStats


def stats(wid: str, node: str = "n1", running: int = 0, threads: int = 1, cores: int = 2) -> WorkerStats:
    return WorkerStats(wid, "prefill", node, 0, running, 0, 0, 0.0, 1000, (), cpu_threads=threads, cpu_cores=cores)


IDLE = SimpleNamespace(led=(), inc=(), q=0)


def test_an_engine_alone_is_predicted_as_calibrated() -> None:
    assert contention.factors([stats("p", running=1), stats("d")], {}) == {"d": 1.5}  # p alone: absent
    assert contention.factors([stats("p"), stats("d")], {}) == {}


def test_two_busy_engines_on_two_cores_slow_each_other() -> None:
    f = contention.factors([stats("p", running=1), stats("d", running=2)], {})
    # (1 + 1 + 1) / 2 = 1.5 over (1 + 1) / 2 = 1 alone
    assert f == {"p": pytest.approx(1.5), "d": pytest.approx(1.5)}


def test_routes_booked_since_the_stats_count_as_busy() -> None:
    booked = SimpleNamespace(led=[(0.0, 256, 2.0)], inc=(), q=256)
    assert contention.factors([stats("p"), stats("d")], {"p": booked, "d": IDLE}) == {"d": pytest.approx(1.5)}


def test_no_contention_across_nodes_on_gpus_or_with_cores_to_spare() -> None:
    assert contention.factors([stats("p", running=1), stats("d", node="n2", running=1)], {}) == {}
    assert contention.factors([stats("p", running=1, threads=0, cores=0),
                               stats("d", running=1, threads=0, cores=0)], {}) == {}
    big = contention.factors([stats("p", running=1, threads=4, cores=16), stats("d", running=1, threads=4, cores=16)], {})
    assert big == {"p": 1.0, "d": 1.0}


def test_the_goodput_policy_predicts_a_slower_prefill_beside_a_busy_engine() -> None:
    from cluster.config import RouterConfig, SLOConfig
    from cluster.router import RouteRequest, make_policy

    req = RouteRequest(prompt_tokens=256, max_tokens=32, ttft_slo_s=2.0, tpot_slo_s=0.2)

    def ttft(decode_running: int) -> float:
        policy = make_policy("goodput", router_cfg=RouterConfig(disaggregation="always"), slo=SLOConfig())
        p = WorkerStats("p", "prefill", "n1", 0, 0, 0, 0, 0.0, 10_000, (), cpu_threads=1, cpu_cores=2)
        d = WorkerStats("d", "decode", "n1", 0, decode_running, 0, 100 * decode_running, 0.0, 10_000, (),
                        cpu_threads=1, cpu_cores=2)
        return policy(req, [p], [d]).predicted_ttft_s

    assert ttft(2) == pytest.approx(1.5 * ttft(0), rel=0.02)
