"""Engine placement logic: bundles per engine, node packing onto real nodes, NIXL backend from labels."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, DeployConfig, parse_config
from cluster.control import placer
from cluster.control.lifecycle import resolve_backends
from kvtransfer.config import backends_from_labels


def node(nid: str, gpus: int = 0, cpus: float = 8, labels: dict | None = None) -> dict:
    return {"node_id": nid, "address": "192.0.2.1", "gpus": gpus, "cpus": cpus, "memory": 0, "labels": labels or {}}


def test_cpu_engine_is_one_cpu_bundle():
    s = placer.engine_shape("cpu", 1, 1, 1.0, 1.5)
    assert s.bundles == [{"CPU": 1.5}] and s.strategy == "STRICT_PACK"
    assert (s.actor_cpus, s.actor_gpus) == (1.5, 0.0)


def test_cpu_engine_of_tp2_reserves_cpus_for_both_rank_processes():
    s = placer.engine_shape("cpu", 2, 1, 1.0, 1.0)
    assert s.bundles == [{"CPU": 2.0}] and (s.actor_cpus, s.actor_gpus) == (2.0, 0.0)


def test_zero_cpu_worker_still_gets_a_valid_bundle():
    s = placer.engine_shape("cpu", 1, 1, 1.0, 0.0)
    assert s.bundles[0]["CPU"] > 0 and s.actor_cpus == 0.0


def test_gpu_tp1_shares_gpu_by_fraction():
    s = placer.engine_shape("cuda", 1, 1, 0.4, 1)
    assert s.bundles == [{"CPU": 1, "GPU": 0.4}] and s.actor_gpus == 0.4


def test_tp_engine_has_one_gpu_bundle_per_rank_and_actor_holds_none():
    s = placer.engine_shape("cuda", 4, 2, 1.0, 1, gpus_per_node=8)
    assert len(s.bundles) == 8 and all(b["GPU"] == 1.0 for b in s.bundles)
    assert s.bundles[0]["CPU"] == 1 and s.actor_gpus == 0.0 and s.strategy == "STRICT_PACK"
    assert s.capacity == {"CPU": 1, "GPU": 8.0}


def test_engine_wider_than_a_node_is_not_strict():
    assert placer.engine_shape("cuda", 8, 2, 1.0, 1, gpus_per_node=8).strategy == "PACK"


def test_default_packing_pairs_prefill_and_decode():
    packing = placer.default_packing(2, 2, 2, 2, 8)
    assert packing == [["P0", "D0", "P1", "D1"]]
    packing = placer.default_packing(2, 4, 2, 4, 8)
    assert sorted(map(sorted, packing)) == [["D0", "P0"], ["D1", "P1"]]


def test_default_packing_with_fractional_cpus():
    assert placer.default_packing(1, 0.5, 1, 0.5, 4) == [["P0", "D0"]]


def test_map_nodes_puts_each_logical_node_on_one_real_node():
    nodes = [node("a", gpus=8), node("b", gpus=8)]
    pins = placer.map_nodes([["P0", "D0"], ["P1", "D1"]], {"prefill": 4, "decode": 4}, nodes, "GPU")
    assert pins["P0"] == pins["D0"] and pins["P1"] == pins["D1"] and pins["P0"] != pins["P1"]


def test_map_nodes_biggest_first_and_multi_node_engines_unpinned():
    nodes = [node("small", gpus=4), node("big", gpus=8), node("big2", gpus=8), node("big3", gpus=8)]
    pins = placer.map_nodes([["D0", "D1"], ["P0.0"], ["P0.1"], ["P1"]], {"prefill": 8, "decode": 2}, nodes, "GPU")
    assert "P0.0" not in pins and "P0" not in pins
    # the wide engine's two nodes are taken first; P1 gets the third 8-GPU node, the decoders the small one
    assert pins == {"P1": "big", "D0": "small", "D1": "small"}


def test_map_nodes_error_names_need_and_what_is_left():
    with pytest.raises(placer.PlacementError, match=r"needs 16 GPU; the cluster's nodes have 8 GPU left"):
        placer.map_nodes([["P0", "D0"]], {"prefill": 8, "decode": 8}, [node("a", gpus=8)], "GPU")


def test_map_nodes_on_cpu_uses_cpus():
    pins = placer.map_nodes([["P0", "D0"]], {"prefill": 1, "decode": 1}, [node("a", cpus=4)], "CPU")
    assert pins == {"P0": "a", "D0": "a"}


@pytest.mark.parametrize("packing,msg", [
    ([["P0", "X1"]], "not an engine label"),
    ([["P0", "D0", "D1"]], "decode pool has 1"),
    ([["P0"]], "leaves out D0"),
])
def test_bad_packing_in_config_is_a_clear_error(packing, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_config({"pools": {"prefill": 1, "decode": 1, "node_packing": packing}})


def test_good_packing_in_config():
    cfg = parse_config({"pools": {"prefill": 2, "decode": 1, "node_packing": [["P0", "D0"], ["P1"]]}})
    assert cfg.pools.node_packing == [["P0", "D0"], ["P1"]]


def test_backend_from_node_labels():
    assert backends_from_labels([{}, {"saaf.io/nixl-backend": "libfabric"}]) == ["LIBFABRIC"]
    assert backends_from_labels([{}, {"saaf.io/role": "head"}]) is None
    with pytest.raises(ValueError, match="disagree"):
        backends_from_labels([{"saaf.io/nixl-backend": "UCX"}, {"saaf.io/nixl-backend": "LIBFABRIC"}])


def test_resolve_backends_label_default_and_explicit():
    labelled = [node("a", labels={"saaf.io/nixl-backend": "LIBFABRIC"})]
    assert resolve_backends(DeployConfig(), labelled).transfer.backends == ["LIBFABRIC"]
    assert resolve_backends(DeployConfig(), [node("a")]).transfer.backends == ["UCX"]
    explicit = parse_config({"transfer": {"backends": ["UCX"]}})
    assert resolve_backends(explicit, labelled).transfer.backends == ["UCX"]
    mixed = labelled + [node("b", labels={"saaf.io/nixl-backend": "UCX"})]
    with pytest.raises(ConfigError, match="set transfer.backends"):
        resolve_backends(DeployConfig(), mixed)


def test_map_nodes_keeps_separate_logical_nodes_apart_while_nodes_are_left():
    """[[P0], [D0]] on a big and a small node: P0 and D0 on different nodes, though the big one has room for both."""
    nodes = [node("big", cpus=8), node("small", cpus=4)]
    assert placer.map_nodes([["P0"], ["D0"]], {"prefill": 1, "decode": 1}, nodes, "CPU") == {"P0": "big", "D0": "small"}
    one = [node("only", cpus=8)]  # NOTE: one node: they share it
    assert placer.map_nodes([["P0"], ["D0"]], {"prefill": 1, "decode": 1}, one, "CPU") == {"P0": "only", "D0": "only"}
