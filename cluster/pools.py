"""PoolController: a named Ray actor that owns the worker actors of one deployment.

It starts workers (placing each on a node with room), waits until they are ready (bounded), answers
membership queries from the ingress, scales pools up and down (draining removed workers), and stops
everything on shutdown. It holds no request state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

logger = logging.getLogger(__name__)

WORKER_CLASSES = {
    "prefill": ("prefill.worker", "PrefillWorker"),
    "decode": ("decode.worker", "DecodeWorker"),
    "colocated": ("engine.colocated", "ColocatedWorker"),
}


def worker_class(role: str):
    import importlib

    mod, name = WORKER_CLASSES[role]
    return getattr(importlib.import_module(mod), name)


class PoolController:
    def __init__(self, deploy_cfg: dict[str, Any]) -> None:
        from cluster.config import DeployConfig

        logging.basicConfig(level=logging.INFO)
        self.cfg = DeployConfig.model_validate(deploy_cfg)
        self.workers: dict[str, dict[str, Any]] = {}  # id -> {role, handle, info, state}
        self.counter = {"prefill": 0, "decode": 0, "colocated": 0}
        self.version = 0

    def engine_for(self, role: str):
        """The engine config of one pool: the shared one with the pool's TP/PP from the plan, if any."""
        pools, ecfg = self.cfg.pools, self.cfg.engine
        if pools == "auto" or role == "colocated":
            return ecfg
        tp = getattr(pools, f"{role}_tp") or ecfg.tensor_parallel_size
        pp = getattr(pools, f"{role}_pp") or ecfg.pipeline_parallel_size
        return ecfg.model_copy(update={"tensor_parallel_size": tp, "pipeline_parallel_size": pp})

    def _spawn(self, role: str) -> str:
        wid = f"{role}-{self.counter[role]}"
        self.counter[role] += 1
        ecfg = self.engine_for(role)
        opts: dict[str, Any] = {
            "num_cpus": self.cfg.worker_cpus,
            "max_restarts": 10,
            "max_task_retries": 0,
            "name": f"{self.cfg.name}-{wid}",
            "lifetime": "detached",
        }
        if ecfg.resolved_device() == "cuda":
            if ecfg.gpus_per_engine == 1:
                opts["num_gpus"] = ecfg.gpu_fraction
            else:
                # NOTE: a TP/PP engine drives its GPUs through Ray workers; the actor itself holds none and
                # vLLM's ray executor packs its bundles on one node (placement group).
                opts["num_gpus"] = 0
        transfer = self.cfg.transfer.model_dump() if role != "colocated" else None
        cls = ray.remote(worker_class(role))
        handle = cls.options(**opts).remote(wid, ecfg.model_dump(), transfer)
        self.workers[wid] = {"role": role, "handle": handle, "info": None, "state": "starting",
                             "started_at": time.time()}
        return wid

    async def _await_ready(self, ids: list[str]) -> None:
        timeout = self.cfg.engine.startup_timeout_s
        refs = {wid: self.workers[wid]["handle"].info.remote() for wid in ids}
        deadline = time.monotonic() + timeout
        for wid, ref in refs.items():
            left = max(1.0, deadline - time.monotonic())
            try:
                self.workers[wid]["info"] = await asyncio.wait_for(ref, timeout=left)
                self.workers[wid]["state"] = "ready"
            except Exception as e:  # noqa: BLE001 - reported with the worker's name
                self.workers[wid]["state"] = "failed"
                raise RuntimeError(f"worker {wid} did not start within {timeout:.0f}s: {e}") from e
        self.version += 1

    async def start(self, sizes: dict[str, int]) -> list[dict[str, Any]]:
        ids = [self._spawn(role) for role, n in sizes.items() for _ in range(n)]
        await self._await_ready(ids)
        return [self.workers[w]["info"] for w in ids]

    def config(self) -> dict[str, Any]:
        return self.cfg.model_dump(mode="json")

    def members(self) -> tuple[int, list[tuple[str, str, Any, dict | None]]]:
        """(version, [(worker id, role, handle, info)]) of workers ready to take requests."""
        return self.version, [
            (wid, w["role"], w["handle"], w["info"]) for wid, w in self.workers.items() if w["state"] == "ready"
        ]

    def describe(self) -> list[dict[str, Any]]:
        return [{"worker_id": wid, "role": w["role"], "state": w["state"], "info": w["info"]}
                for wid, w in self.workers.items()]

    async def scale(self, role: str, target: int, drain_timeout_s: float = 120) -> dict[str, Any]:
        current = [wid for wid, w in self.workers.items() if w["role"] == role and w["state"] == "ready"]
        added, removed = [], []
        if target > len(current):
            added = [self._spawn(role) for _ in range(target - len(current))]
            await self._await_ready(added)
        elif target < len(current):
            removed = current[target:]
            for wid in removed:
                self.workers[wid]["state"] = "draining"
            self.version += 1
            await asyncio.gather(*(self._drain(wid, drain_timeout_s) for wid in removed))
        return {"added": added, "removed": removed}

    async def _drain(self, wid: str, timeout_s: float) -> None:
        handle = self.workers[wid]["handle"]
        deadline = time.monotonic() + timeout_s
        # NOTE: give ingress replicas one membership refresh to stop routing here before counting load.
        await asyncio.sleep(2.0)
        while time.monotonic() < deadline:
            try:
                st = await asyncio.wait_for(handle.stats.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a dead worker has nothing left to drain
                break
            if st.waiting == 0 and st.running == 0:
                break
            await asyncio.sleep(0.2)
        await self._stop(wid)

    async def _stop(self, wid: str) -> None:
        w = self.workers.pop(wid, None)
        if w is None:
            return
        try:
            await asyncio.wait_for(w["handle"].shutdown.remote(), timeout=20)
        except Exception:  # noqa: BLE001
            pass
        ray.kill(w["handle"], no_restart=True)

    async def shutdown(self) -> None:
        await asyncio.gather(*(self._stop(wid) for wid in list(self.workers)))
        self.version += 1
