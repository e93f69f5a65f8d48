"""PoolController: a named Ray actor that owns the worker actors of one deployment.

It starts workers (placing each on a node with room), waits until they are ready (bounded), answers
membership queries from the ingress, scales pools up and down (draining removed workers), and stops
everything on shutdown. It holds no request state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import ray

from cluster.control.autoplan import LIVE, PlannerLoop
from decode.worker import DecodeWorker
from engine.colocated import ColocatedWorker
from prefill.worker import PrefillWorker

logger = logging.getLogger(__name__)

WORKER_CLASSES = {"prefill": PrefillWorker, "decode": DecodeWorker, "colocated": ColocatedWorker}


def actor_state(handle: Any) -> str:
    """ALIVE, RESTARTING, DEAD, ... from Ray's actor table (UNKNOWN if it cannot be read)."""
    try:
        from ray._private.state import actors

        return str(actors(actor_id=handle._actor_id.hex()).get("State", "UNKNOWN"))
    except Exception:  # noqa: BLE001 - a private API; the stats timeout still detects hangs
        return "UNKNOWN"


def drain_choice(ready: Sequence[str], first: Sequence[str], n: int) -> list[str]:
    """The `n` workers a shrink removes: those of `first` that are ready, in that order, then the newest of
    the rest (`ready` is oldest first)."""
    named = [w for w in dict.fromkeys(first) if w in ready]
    return (named + [w for w in reversed(ready) if w not in named])[:max(0, n)]


def _root_cause(e: BaseException) -> str:
    """The last line of the innermost error Ray reports for an actor whose creation task raised."""
    text = str(getattr(e, "error_msg", None) or e).strip()
    last = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(" ")]
    return last[-1][:400] if last else type(e).__name__


class PoolController:
    def __init__(self, deploy_cfg: dict[str, Any]) -> None:
        from cluster.config import DeployConfig

        logging.basicConfig(level=logging.INFO)
        self.cfg = DeployConfig.model_validate(deploy_cfg)
        self.workers: dict[str, dict[str, Any]] = {}  # id -> {role, handle, info, state}
        self.counter = {"prefill": 0, "decode": 0, "colocated": 0}
        self.version = 0
        self.events: list[dict[str, Any]] = []  # health replacements, for status and the fault matrix
        self._health_task: asyncio.Task | None = None
        self._replacing: dict[str, asyncio.Task] = {}  # worker id -> its replacement, running beside the checks
        self._calibration: asyncio.Task | None = None
        self.calibrated: tuple[int, Any] = (0, None)  # (version, latest Calibration) as published
        self.planner = PlannerLoop(self) if self.cfg.planner_loop.mode != "off" else None

    def engine_for(self, role: str):
        """The engine config of one pool: the shared one with the pool's TP/PP from the plan, if any."""
        pools, ecfg = self.cfg.pools, self.cfg.pool_engines.apply(role, self.cfg.engine)
        if pools == "auto" or role == "colocated":
            return ecfg
        tp = getattr(pools, f"{role}_tp") or ecfg.tensor_parallel_size
        pp = getattr(pools, f"{role}_pp") or ecfg.pipeline_parallel_size
        return ecfg.model_copy(update={"tensor_parallel_size": tp, "pipeline_parallel_size": pp})

    def reported(self, role: str, key: str, fallback: Any = None) -> Any:
        """What a live engine of `role`'s pool reports for `key` in its info: the value vLLM settled on (e.g.
        its step budget where the config leaves it unset); `fallback` until one has reported."""
        for w in self.workers.values():
            if w["role"] == role and (w["info"] or {}).get(key) is not None:
                return w["info"][key]
        return fallback

    def shape_for(self, role: str, gpus_per_node: int | None = None):
        from cluster.control.placer import engine_shape

        e = self.engine_for(role)
        return engine_shape(e.resolved_device(), e.tensor_parallel_size, e.pipeline_parallel_size,
                            e.gpu_fraction, self.cfg.worker_cpus, gpus_per_node)

    def node_pins(self, sizes: dict[str, int]) -> dict[str, str]:
        """{engine label (P0, D1): node id} from the plan's node packing (or a first-fit one)."""
        from cluster.control import placer
        from cluster.control.runtime import cluster_gpus

        if "colocated" in sizes:
            return {}
        nodes = cluster_gpus()
        resource = "GPU" if self.cfg.engine.resolved_device() == "cuda" else "CPU"
        width = max((n["gpus"] if resource == "GPU" else n["cpus"] for n in nodes), default=0)
        need = {r: self.shape_for(r, int(width)).capacity.get(resource, 0.0) for r in ("prefill", "decode")}
        pools = self.cfg.pools
        packing = pools.node_packing if pools != "auto" and pools.node_packing else placer.default_packing(
            sizes.get("prefill", 0), need["prefill"], sizes.get("decode", 0), need["decode"], width)
        pins = placer.map_nodes(packing, need, nodes, resource)
        logger.info("node packing %s -> %s", packing, {k: v[:12] for k, v in pins.items()})
        return pins

    def _spawn(self, role: str, node_id: str | None = None) -> str:
        from cluster.control import placer
        from cluster.control.runtime import cluster_gpus

        index = self.counter[role]
        wid = f"{role}-{index}"
        self.counter[role] += 1
        ecfg = self.engine_for(role)
        width = None  # NOTE: node width matters only to an engine of several GPUs (STRICT_PACK or PACK)
        if ecfg.resolved_device() == "cuda" and ecfg.gpus_per_engine > 1:
            width = max((n["gpus"] for n in cluster_gpus()), default=0) or None
        shape = self.shape_for(role, width)
        pg = placer.create_group(shape, f"{self.cfg.name}-{wid}", node_id)
        opts: dict[str, Any] = {
            "num_cpus": shape.actor_cpus,
            "num_gpus": shape.actor_gpus,
            "max_restarts": 10,
            "max_task_retries": 0,
            "name": f"{self.cfg.name}-{wid}",
            "lifetime": "detached",
            "scheduling_strategy": placer.scheduling(pg),
        }
        transfer = self.cfg.transfer.model_dump() if role != "colocated" else None
        cls = ray.remote(WORKER_CLASSES[role])
        handle = cls.options(**opts).remote(wid, ecfg.model_dump(), transfer)
        self.workers[wid] = {"role": role, "handle": handle, "info": None, "state": "starting",
                             "started_at": time.time(), "pg": pg, "node": node_id,
                             "bundles": shape.bundles}
        return wid

    async def _await_ready(self, ids: list[str]) -> None:
        """Wait for every worker in `ids`; the first that fails ends the wait at once (the others may still
        be loading their engines) with an error naming it, its node and the root cause."""
        timeout = self.cfg.engine.startup_timeout_s
        deadline = time.monotonic() + timeout
        tasks = [asyncio.ensure_future(self._ready(wid, deadline, timeout)) for wid in ids]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
        for t in tasks:  # NOTE: in start order, so the error named is the first failed worker's
            if t in done and t.exception() is not None:
                raise t.exception()
        self.version += 1

    async def _ready(self, wid: str, deadline: float, timeout: float) -> None:
        try:
            self.workers[wid]["info"] = await asyncio.wait_for(self.workers[wid]["handle"].info.remote(),
                                                               timeout=max(1.0, deadline - time.monotonic()))
            self.workers[wid]["state"] = "ready"
        except Exception as e:  # noqa: BLE001 - reported with the worker's name
            from cluster.control.placer import group_node, group_state

            w = self.workers.get(wid)
            if w is None:  # NOTE: removed while it started (the deployment is being stopped)
                raise RuntimeError(f"worker {wid} was stopped before it was ready") from None
            w["state"] = "failed"
            pg_state = group_state(w["pg"])
            if pg_state != "CREATED":
                where = f" on node {w['node'][:12]}" if w["node"] else ""
                raise RuntimeError(
                    f"worker {wid} did not start within {timeout:.0f}s: its placement group "
                    f"{w['bundles']}{where} is {pg_state} (the cluster has no room for it); free or add "
                    "resources, or lower the pool sizes") from e
            node = w["node"] or group_node(w["pg"])
            where = f" on node {node[:12]}" if node else ""
            if isinstance(e, ray.exceptions.RayActorError):  # NOTE: its __init__ raised: the engine failed
                raise RuntimeError(
                    f"worker {wid}{where} failed to start: {_root_cause(e)}; the worker's log (Ray's "
                    "session logs, worker-*.err) has vLLM's own message") from None
            raise RuntimeError(f"worker {wid}{where} did not start within {timeout:.0f}s: {e}") from e

    async def start(self, sizes: dict[str, int]) -> list[dict[str, Any]]:
        from cluster.control.placer import label_of

        pins = self.node_pins(sizes)
        ids = [self._spawn(role, pins.get(label_of(role, self.counter[role])))
               for role, n in sizes.items() for _ in range(n)]
        await self._await_ready(ids)
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        if self.planner is not None:
            self.planner.start()
        return [self.workers[w]["info"] for w in ids]

    # ---- health: a worker that stops answering is taken out of routing and replaced -------------------
    async def _health_loop(self) -> None:
        hc = self.cfg.health
        while True:
            await asyncio.sleep(hc.interval_s)
            ready = [wid for wid, w in self.workers.items() if w["state"] == "ready"]
            await asyncio.gather(*(self._check(wid) for wid in ready), return_exceptions=True)

    async def _check(self, wid: str) -> None:
        hc = self.cfg.health
        w = self.workers.get(wid)
        if w is None:
            return
        state = actor_state(w["handle"])
        if state == "DEAD":  # out of restarts: a new worker takes its place
            w["misses"] = hc.failures
        elif state not in ("ALIVE", "UNKNOWN"):  # NOTE: Ray is restarting it (a crash)
            w["misses"] = 0
            return
        else:
            t = time.time()
            try:
                # NOTE: kept: the planner loop reads a speculating pool's acceptance from it
                w["stats"] = await asyncio.wait_for(w["handle"].stats.remote(), timeout=hc.timeout_s)
                w["misses"] = 0
                w.pop("first_miss_at", None)
                return
            except Exception as e:  # noqa: BLE001 - no answer in time: a miss
                w["misses"] = w.get("misses", 0) + 1
                w.setdefault("first_miss_at", t)
                logger.warning("worker %s missed health check %d/%d: %s", wid, w["misses"], hc.failures,
                               type(e).__name__)
        if w["misses"] >= hc.failures and w["state"] == "ready" and wid not in self._replacing:
            # NOTE: a task of its own: a replacement can take startup_timeout_s, and every other worker
            # keeps being checked (and replaced) meanwhile
            task = asyncio.get_running_loop().create_task(self._replace(wid))
            self._replacing[wid] = task
            task.add_done_callback(lambda t, wid=wid: self._replaced(wid, t))

    def _replaced(self, wid: str, task: asyncio.Task) -> None:
        self._replacing.pop(wid, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error("replacing worker %s failed: %s", wid, task.exception())

    async def _replace(self, wid: str) -> None:
        """Out of routing at once; Ray restarts the actor (a new engine); back in when it answers."""
        w = self.workers[wid]
        event = {"worker_id": wid, "role": w["role"], "first_miss_at": w.pop("first_miss_at", None),
                 "detected_at": time.time(), "old_engine_id": (w["info"] or {}).get("engine_id")}
        w["state"], w["misses"] = "replacing", 0
        self.version += 1
        logger.warning("worker %s stopped answering health checks; replacing it", wid)
        try:
            ray.kill(w["handle"], no_restart=False)
            # NOTE: the restarted actor answers info() only once its new engine is up.
            deadline = time.monotonic() + self.cfg.engine.startup_timeout_s
            while True:
                try:
                    w["info"] = await asyncio.wait_for(w["handle"].info.remote(), timeout=30)
                    break
                except (TimeoutError, ray.exceptions.RayActorError):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(1.0)
            w["state"] = "ready"
            event.update(outcome="restarted", new_engine_id=w["info"]["engine_id"])
        except Exception as e:  # noqa: BLE001 - out of restarts, or never came back: start a new worker
            logger.warning("worker %s could not be restarted (%s); starting a new one", wid, e)
            role = w["role"]
            await self._stop(wid)
            new = self._spawn(role)
            await self._await_ready([new])
            event.update(outcome="respawned", new_worker_id=new, new_engine_id=self.workers[new]["info"]["engine_id"])
        event["ready_at"] = time.time()
        self.events.append(event)
        del self.events[:-100]
        self.version += 1

    def health_events(self) -> list[dict[str, Any]]:
        return list(self.events)

    def config(self) -> dict[str, Any]:
        return self.cfg.model_dump(mode="json")

    def members(self) -> tuple[int, list[tuple[str, str, Any, dict | None]]]:
        """(version, [(worker id, role, handle, info)]) of workers ready to take requests."""
        return self.version, [
            (wid, w["role"], w["handle"], w["info"]) for wid, w in self.workers.items() if w["state"] == "ready"
        ]

    # ---- the router's latency model, fitted on these workers (cluster/control/calibration.py) ---------
    async def calibrate(self) -> None:
        """Start the calibration once (an ingress replica whose router wants it asks when it is ready);
        idempotent."""
        if self._calibration is not None:
            return
        ready = {w["role"]: w["handle"] for w in self.workers.values() if w["state"] == "ready"}
        if self.cfg.mode == "colocated":
            pair = (ready.get("colocated"), None)
        else:
            pair = (ready.get("prefill"), ready.get("decode"))
        if pair[0] is None or (self.cfg.mode != "colocated" and pair[1] is None):
            return
        from cluster.control.calibration import calibrations

        def publish(cal: Any) -> None:
            self.calibrated = (self.calibrated[0] + 1, cal)

        self._calibration = asyncio.get_running_loop().create_task(calibrations(*pair, publish))

    def calibration(self) -> tuple[int, Any, bool]:
        """(version, the latest Calibration or None, final): the cached model may come first, the fresh
        measurement last; a failed measurement is final with its error text."""
        t = self._calibration
        version, cal = self.calibrated
        if t is None or not t.done():
            return version, cal, False
        if t.cancelled() or t.exception() is not None:
            return version + 1, f"calibration failed: {t.exception() if not t.cancelled() else 'cancelled'}", True
        return version, cal, True

    def describe(self) -> list[dict[str, Any]]:
        return [{"worker_id": wid, "role": w["role"], "state": w["state"], "info": w["info"],
                 "placement_group": w["pg"].id.hex(), "pinned_node": w["node"], "bundles": w["bundles"]}
                for wid, w in self.workers.items()]

    async def scale(self, role: str, target: int, drain_timeout_s: float = 120,
                    first: Sequence[str] = ()) -> dict[str, Any]:
        """Grow or shrink one pool to `target` workers (starting and replacing ones count as members). A
        shrink drains the ready workers named in `first` before the others (the planner loop names those
        slower than their pool)."""
        live = [wid for wid, w in self.workers.items() if w["role"] == role and w["state"] in LIVE]
        added, removed = [], []
        if target > len(live):
            added = [self._spawn(role) for _ in range(target - len(live))]
            await self._await_ready(added)
        elif target < len(live):
            # NOTE: the slow ones named, then the newest ready workers (a starting one would be waited for anyway)
            ready = [wid for wid in live if self.workers[wid]["state"] == "ready"]
            removed = drain_choice(ready, first, len(live) - target)
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
            # NOTE: a prefill worker also holds the KV of prompts whose decode has not pulled yet (kv_usage > 0
            # with nothing running): it stops once each is pulled, released or past its lease.
            if st.waiting == 0 and st.running == 0 and (st.role != "prefill" or st.kv_usage == 0):
                break
            await asyncio.sleep(0.2)
        await self._stop(wid)

    async def _stop(self, wid: str) -> None:
        w = self.workers.pop(wid, None)
        if w is None:
            return
        try:  # NOTE: one still starting would run shutdown only after its __init__: it is killed at once
            if w["state"] != "starting":
                await asyncio.wait_for(w["handle"].shutdown.remote(), timeout=20)
        except Exception:  # noqa: BLE001
            pass
        ray.kill(w["handle"], no_restart=True)
        from cluster.control.placer import remove_group

        remove_group(w["pg"])

    # ---- the planner loop (cluster/control/autoplan.py) -----------------------------------------------
    def report_traffic(self, replica: str, windows: list[Any]) -> dict[str, Any] | None:
        """An ingress replica's traffic since its last report; the reply is the loop's latest decision."""
        return None if self.planner is None else self.planner.report(windows)

    def planner_status(self) -> dict[str, Any] | None:
        return None if self.planner is None else self.planner.status()

    async def shutdown(self) -> None:
        if self.planner is not None:
            await self.planner.stop()
        for t in (self._health_task, self._calibration, *self._replacing.values()):
            if t is not None:
                t.cancel()
        await asyncio.gather(*(self._stop(wid) for wid in list(self.workers)))
        self.version += 1
