"""Engine placement: one Ray placement group per engine, pinned to a node by the planner's node packing.

Each engine gets its own placement group. Its bundles hold everything the engine uses: the worker actor's
CPUs (bundle 0) and, on GPU, one bundle per GPU of a tensor/pipeline-parallel engine (vLLM's Ray executor
finds the group it runs in and starts its GPU workers on those bundles), packed STRICT on one node.

Node packing: the planner answers which prefill (P<i>) and decode (D<i>) engines share a node
(``node_packing``: with slow links between nodes, a prefill engine and the decode engines it feeds sit on
one node so KV moves over NVLink). Without a plan the same first-fit packing is computed here. Logical
nodes are then mapped onto the cluster's real nodes, biggest first, and each engine's group is pinned to its
node with a label selector on the node id. Engines wider than one node are not pinned (PACK).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from placement.errors import PlacementError  # NOTE: one name: the pools cannot be placed on this cluster
from placement.packing import pack_nodes

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"
LABEL_RE = re.compile(r"^([PD])(\d+)(?:\.(\d+))?$")
ROLE_OF = {"P": "prefill", "D": "decode"}
# NOTE: Ray rejects a bundle without resources; a worker reserving 0 CPUs still gets a token share.
MIN_BUNDLE_CPU = 0.01


@dataclass(frozen=True)
class EngineShape:
    """What one engine's placement group asks for."""

    bundles: list[dict[str, float]]
    strategy: str
    actor_cpus: float
    actor_gpus: float

    @property
    def capacity(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for b in self.bundles:
            for k, v in b.items():
                out[k] = out.get(k, 0.0) + v
        return out


def engine_shape(device: str, tp: int, pp: int, gpu_fraction: float, worker_cpus: float,
                 gpus_per_node: int | None = None) -> EngineShape:
    """Bundles of one engine: the actor's CPUs in bundle 0; on GPU one GPU bundle per rank."""
    cpus = max(worker_cpus, MIN_BUNDLE_CPU)
    if device != "cuda":
        # NOTE: a CPU engine of TP > 1 runs one process per rank on the actor's node (vLLM's mp executor):
        # the actor's bundle reserves CPUs for all of them
        return EngineShape([{"CPU": cpus * tp}], "STRICT_PACK", worker_cpus * tp, 0.0)
    world = tp * pp
    if world == 1:
        return EngineShape([{"CPU": cpus, "GPU": gpu_fraction}], "STRICT_PACK", worker_cpus, gpu_fraction)
    # NOTE: the actor holds no GPU; vLLM's executor puts one GPU worker on every GPU bundle, bundle 0 included.
    bundles = [{"CPU": cpus, "GPU": 1.0}] + [{"GPU": 1.0} for _ in range(world - 1)]
    fits_one_node = gpus_per_node is None or world <= gpus_per_node
    return EngineShape(bundles, "STRICT_PACK" if fits_one_node else "PACK", worker_cpus, 0.0)


def parse_label(label: str) -> tuple[str, int, int | None]:
    m = LABEL_RE.match(label)
    if not m:
        raise PlacementError(f"node_packing: {label!r} is not an engine label; use P<i> or D<i> (e.g. P0, D1)")
    return ROLE_OF[m.group(1)], int(m.group(2)), None if m.group(3) is None else int(m.group(3))


def check_packing(packing: list[list[str]], n_prefill: int, n_decode: int) -> None:
    """Every engine appears (a multi-node engine as P<i>.<k> on each of its nodes); no unknown engine."""
    seen: dict[tuple[str, int], int] = {}
    for node in packing:
        for label in node:
            role, i, _ = parse_label(label)
            limit = n_prefill if role == "prefill" else n_decode
            if i >= limit:
                raise PlacementError(f"node_packing names {label} but the {role} pool has {limit} engine(s)")
            seen[(role, i)] = seen.get((role, i), 0) + 1
    missing = [f"{r[0].upper()}{i}" for r, n in (("prefill", n_prefill), ("decode", n_decode))
               for i in range(n) if (r, i) not in seen]
    if missing:
        raise PlacementError(f"node_packing leaves out {', '.join(missing)}; list every engine once")


def default_packing(n_prefill: int, need_p: float, n_decode: int, need_d: float,
                    node_capacity: float) -> list[list[str]]:
    """First-fit packing with prefill and decode interleaved, so P/D pairs share a node (as the planner)."""
    # NOTE: pack_nodes counts whole units; scale fractional needs (0.5 GPU, 1.5 CPUs) to integers.
    scale = 100
    packing, _, _ = pack_nodes(n_prefill, max(1, round(need_p * scale)), n_decode,
                               max(1, round(need_d * scale)), max(1, int(node_capacity * scale)))
    return packing


def map_nodes(packing: list[list[str]], need: dict[str, float], nodes: list[dict[str, Any]],
              resource: str) -> dict[str, str]:
    """Logical node -> real node: each logical node's engines onto one real node with room, biggest
    logical nodes first, onto the roomiest real nodes not yet holding another logical node (then any). Returns {engine label: node id} for pinned engines.

    ``need`` is the per-role demand of ``resource`` ('GPU' or 'CPU'); ``nodes`` are cluster_nodes() rows."""
    free = {n["node_id"]: float(n["gpus"] if resource == "GPU" else n["cpus"]) for n in nodes}
    demands = []
    for idx, node in enumerate(packing):
        parsed = [(lb, parse_label(lb)) for lb in node]
        labels = [lb for lb, (_, _, part) in parsed if part is None]
        spans = any(part is not None for _, (_, _, part) in parsed)  # a part of an engine wider than a node
        demand = sum(need[role] for _, (role, _, part) in parsed if part is None)
        demands.append((float("inf") if spans else demand, idx, labels))
    out: dict[str, str] = {}
    used: set[str] = set()
    for demand, idx, labels in sorted(demands, key=lambda d: (-d[0], d[1])):
        # NOTE: separate logical nodes onto separate real nodes while there are any left with room (the
        # packing says which engines share a node, and so which do not); then onto any node with room.
        fresh = [nid for nid in free if nid not in used and free[nid] + 1e-9 >= min(demand, max(free.values()))]
        choice = max(fresh or free, key=lambda nid: (free[nid], nid), default=None)
        if choice is not None:
            used.add(choice)
        if demand == float("inf"):
            # NOTE: not pinned (Ray packs the wide engine), but the node it takes is no longer free.
            if choice is not None:
                free[choice] = 0.0
            continue
        if choice is None or free[choice] + 1e-9 < demand:
            have = ", ".join(f"{v:g}" for v in sorted(free.values(), reverse=True)) or "none"
            raise PlacementError(
                f"node {idx} of the packing ({' '.join(labels)}) needs {demand:g} {resource}; the cluster's "
                f"nodes have {have} {resource} left. Add nodes or lower the pool sizes.")
        free[choice] -= demand
        for lb in labels:
            out[lb] = choice
    return out


def label_of(role: str, index: int) -> str:
    return f"{role[0].upper()}{index}"


def create_group(shape: EngineShape, name: str, node_id: str | None):
    """Create (asynchronously) the engine's placement group; pinned to ``node_id`` when given."""
    from ray.util.placement_group import placement_group

    selector = [{NODE_ID_LABEL: node_id} for _ in shape.bundles] if node_id else None
    return placement_group(shape.bundles, strategy=shape.strategy, name=name, bundle_label_selector=selector)


def scheduling(pg: Any):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # NOTE: capture_child_tasks lets vLLM (ray.util.get_current_placement_group) start its TP workers here.
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0,
                                            placement_group_capture_child_tasks=True)


def group_state(pg: Any) -> str:
    from ray.util.placement_group import placement_group_table

    try:
        return str(placement_group_table(pg).get("state", "UNKNOWN"))
    except Exception:  # noqa: BLE001 - removed or unknown group
        return "UNKNOWN"


def group_node(pg: Any) -> str | None:
    """The Ray node id the group's first bundle is on, if it is placed."""
    from ray.util.placement_group import placement_group_table

    try:
        nodes = placement_group_table(pg).get("bundles_to_node_id") or {}
    except Exception:  # noqa: BLE001 - removed or unknown group
        return None
    return nodes.get(0) or next(iter(nodes.values()), None)


def remove_group(pg: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception as e:  # noqa: BLE001 - already removed with its creator
        logger.debug("remove_placement_group: %s", e)
