"""KV block digests (kvtransfer/integrity.py): a changed element is caught in the block that holds it and
nowhere else, the pairing follows vLLM's (from the end), and the block axis is found in vLLM's layouts."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import integrity


def _caches(layout: str, blocks: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = {"2B": (2, blocks, 3, 16, 8),  # K/V first, then blocks (FlashAttention-style)
             "B2": (blocks, 2, 16, 3, 8),  # blocks first (FlashInfer-style)
             "BHNC": (blocks, 3, 16, 16)}[layout]  # one tensor per layer, K and V packed
    return {f"layers.{i}": torch.randn(shape, generator=g) for i in range(3)}


@pytest.mark.parametrize("layout", ["2B", "B2", "BHNC"])
def test_a_changed_element_changes_only_its_blocks_digest(layout) -> None:
    caches = _caches(layout)
    before = integrity.block_digests(caches, [0, 2, 5], 6)
    assert len(before) == 3 and len(set(before)) == 3 and all(len(d) == 16 for d in before)
    assert integrity.block_digests({k: v.clone() for k, v in caches.items()}, [0, 2, 5], 6) == before
    integrity.corrupt_block(caches, 2, 6)
    after = integrity.block_digests(caches, [0, 2, 5], 6)
    assert [a != b for a, b in zip(before, after, strict=True)] == [False, True, False]


def test_a_change_in_any_layer_is_caught() -> None:
    caches = _caches("2B")
    before = integrity.block_digests(caches, [1, 3], 6)
    caches["layers.2"][1, 3, 2, 7, 5] += 1e-6  # V of the last layer, deep inside block 3
    assert integrity.block_digests(caches, [1, 3], 6) == [before[0], integrity.block_digests(caches, [1, 3], 6)[1]]
    assert integrity.block_digests(caches, [1, 3], 6)[1] != before[1]


def test_digests_follow_block_contents_not_ids() -> None:
    """The prefill's block 4 and the decode's block 1 hold the same KV: same digest (the blocks move, the
    ids differ between the engines)."""
    p, d = _caches("2B", seed=1), _caches("2B", seed=2)
    for k in p:
        d[k][:, 1] = p[k][:, 4]
    assert integrity.block_digests(p, [4], 6) == integrity.block_digests(d, [1], 6)


def test_physical_blocks_per_logical_are_hashed_together() -> None:
    caches = _caches("2B", blocks=8)
    whole = integrity.block_digests(caches, [1], 8, per_logical=2)  # logical block 1 = physical 2 and 3
    caches["layers.0"][0, 3, 0, 0, 0] += 1
    assert integrity.block_digests(caches, [1], 8, per_logical=2) != whole
    assert integrity.block_digests(caches, [0], 8, per_logical=2) == integrity.block_digests(
        _caches("2B", blocks=8), [0], 8, per_logical=2)


def test_mismatched_pairs_from_the_end_as_vllm_pulls_a_tail() -> None:
    # NOTE: a decode-side prefix-cache hit pulls only the last blocks of the prefill's list
    assert integrity.mismatched([7, 8], ["a", "b", "c"], ["b", "x"]) == [8]
    assert integrity.mismatched([7, 8, 9], ["a", "b", "c"], ["a", "b", "c"]) == []
    assert integrity.mismatched([], ["a"], []) == []


def test_block_axis() -> None:
    assert integrity.block_axis((2, 100, 3, 16, 8), 100) == 1
    assert integrity.block_axis((100, 2, 16, 3, 8), 100) == 0
    assert integrity.block_axis((3, 2, 100), 100) == 2
    with pytest.raises(ValueError, match="no axis of size 100"):
        integrity.block_axis((2, 99, 3), 100)


def test_bfloat16_caches_are_hashed_by_their_bytes() -> None:
    caches = {k: v.to(torch.bfloat16) for k, v in _caches("2B").items()}
    before = integrity.block_digests(caches, [0, 1], 6)
    integrity.corrupt_block(caches, 0, 6)
    after = integrity.block_digests(caches, [0, 1], 6)
    assert after[0] != before[0] and after[1] == before[1]


def test_fault_injection_is_refused_where_it_is_off() -> None:
    from decode.worker import DecodeWorker
    from engine.host import EngineError
    from kvtransfer.config import TransferConfig

    w = object.__new__(DecodeWorker)
    w.transfer_cfg = TransferConfig()  # the default: off
    with pytest.raises(EngineError, match="fault injection is off"):
        w.inject_kv_corruption(1)
    w.transfer_cfg = TransferConfig(fault_injection=True)
    assert w.inject_kv_corruption(2) == 2 and w._corrupt_next == 2
