"""Node packing (placement/packing.py): first fit, the planner's interleaved packing and DistServe's units."""

from __future__ import annotations

from cluster.config import parse_config
from cluster.control.lifecycle import check_resources
from placement.packing import first_fit, pack_nodes, unit_packing


def test_first_fit_places_the_largest_first_in_the_first_bin_with_room() -> None:
    assert first_fit([1, 4, 2], [4, 4]) == [1, 0, 1]
    assert first_fit([3, 3, 3], [4, 4]) is None  # 9 GPUs of 3-GPU engines do not fit 2 x 4 whole
    assert first_fit([], [8]) == []


def test_pack_nodes_interleaves_pairs_and_gives_wide_engines_whole_nodes() -> None:
    nodes, p, d = pack_nodes(2, 2, 2, 1, 8)
    assert nodes == [["P0", "D0", "P1", "D1"]] and p == [0, 0] and d == [0, 0]
    nodes, p, d = pack_nodes(1, 16, 1, 4, 8)
    assert nodes == [["P0.0"], ["P0.1"], ["D0"]] and p == [0] and d == [2]


def test_units_share_a_node_when_several_fit() -> None:
    # two units of one TP1xPP2 prefill (2 GPUs) + one decode (1 GPU) on 8-GPU nodes: one node, not two
    nodes, p, d = unit_packing(1, 1, 3, 2, 8)
    assert nodes == [["P0", "D0", "P1", "D1"]] and p == [0, 0] and d == [0, 0]
    nodes, p, d = unit_packing(1, 2, 6, 3, 8)  # 6-GPU units: one per node
    assert len(nodes) == 3 and p == [0, 1, 2] and d == [0, 0, 1, 1, 2, 2]


def test_the_deploy_check_refuses_engines_that_do_not_fit_whole_nodes() -> None:
    import pytest

    from cluster.config import ConfigError

    cfg = parse_config({"engine": {"model": "tiny-llama", "device": "cuda", "tensor_parallel_size": 3},
                        "pools": {"prefill": 1, "decode": 2}})
    check_resources(cfg, {"prefill": 1, "decode": 2}, [{"gpus": 8}, {"gpus": 4}])
    with pytest.raises(ConfigError, match="9 GPUs"):  # 9 GPUs exist, but no node holds a third engine whole
        check_resources(cfg, {"prefill": 1, "decode": 2}, [{"gpus": 4}, {"gpus": 4}, {"gpus": 1}])
