"""Node packing, in one place: which engines share a node.

- ``first_fit``: items (largest first) onto bins with the room each has, the first bin with room; the
  one rule every packing here follows.
- ``pack_nodes``: the planner's algorithm-1 packing onto identical nodes, prefill and decode interleaved
  so pairs share a node; engines wider than a node take whole nodes.
- ``unit_packing``: algorithm 2 (DistServe): units of prefill + decode instances, each unit on one node,
  as many whole units to a node as fit.

The deploy check (cluster/control/lifecycle.py) asks ``first_fit`` whether the pools fit a real cluster's
nodes; the placer maps logical nodes onto real ones (cluster/control/placer.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def first_fit(items: Sequence[float], room: Sequence[float]) -> list[int] | None:
    """Bin index of each item (in ``items``' order), placing the largest first into the first bin with
    room; None when one does not fit. First-fit decreasing: what a node can hold, not the best packing."""
    free = list(room)
    out = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda k: -items[k]):
        b = next((j for j, f in enumerate(free) if f + 1e-9 >= items[i]), None)
        if b is None:
            return None
        free[b] -= items[i]
        out[i] = b
    return out


def pack_nodes(n_p: int, g_p: int, n_d: int, g_d: int, gpn: int) -> tuple[list[list[str]], list[int], list[int]]:
    """First-fit packing of instances onto nodes of ``gpn`` GPUs, prefill and decode interleaved so pairs
    share nodes (a new node opens when none has room). Instances wider than a node take whole nodes.
    Returns (node contents, node of each P, node of each D)."""
    nodes: list[list[str]] = []
    free: list[int] = []
    p_node = [0] * n_p
    d_node = [0] * n_d
    order = [("P", i, g_p) for i in range(n_p)] + [("D", i, g_d) for i in range(n_d)]
    order.sort(key=lambda x: (x[1] * (n_p + n_d) // (n_p if x[0] == "P" else n_d), x[0] == "D"))
    for kind, i, g in order:
        label = f"{kind}{i}"
        if g >= gpn:
            node = len(nodes)
            for k in range(math.ceil(g / gpn)):
                nodes.append([f"{label}.{k}"])
                free.append(0)
        else:
            fit = first_fit([g], free)
            if fit is None:
                nodes.append([])
                free.append(gpn)
                fit = [len(nodes) - 1]
            node = fit[0]
            nodes[node].append(label)
            free[node] -= g
        (p_node if kind == "P" else d_node)[i] = node
    return nodes, p_node, d_node


def unit_packing(n_prefill: int, n_decode: int, unit_gpus: int, units: int,
                 gpus_per_node: int) -> tuple[list[list[str]], list[int], list[int]]:
    """Algorithm 2: each unit's ``n_prefill`` prefill and ``n_decode`` decode instances on one node, as
    many whole units to a node as fit (two 3-GPU units share an 8-GPU node). Groups are nodes: any
    prefill/decode pair of a node moves KV over NVLink. Returns (node contents, node of each P, of each D)."""
    per_node = max(1, gpus_per_node // max(1, unit_gpus))
    nodes: list[list[str]] = [[] for _ in range(math.ceil(units / per_node))]
    for u in range(units):
        nodes[u // per_node] += ([f"P{u * n_prefill + i}" for i in range(n_prefill)]
                                 + [f"D{u * n_decode + i}" for i in range(n_decode)])
    p_group = [i // n_prefill // per_node for i in range(units * n_prefill)]
    d_group = [i // n_decode // per_node for i in range(units * n_decode)]
    return nodes, p_group, d_group
