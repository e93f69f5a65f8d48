"""Resolve a PlannerConfig into the things the search needs: latency models per (tp, pp), cluster
totals, prices, the search workload; and reject impossible inputs with a named constraint."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from placement.catalog import GIB, HardwareArch, ModelArch, get_hardware, get_model
from placement.config import PlannerConfig
from placement.errors import DoesNotFitError, PlacementError
from placement.latency import LatencyModel
from placement.profile_io import ProfileData, load_profile
from placement.workload import Workload

logger = logging.getLogger(__name__)


@dataclass
class PlanContext:
    cfg: PlannerConfig
    model: ModelArch | None
    hardware: HardwareArch | None
    profile: ProfileData | None
    gpus_per_node: int
    nodes: int
    gpu_hour_usd: float
    max_context: int

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @classmethod
    def from_config(cls, cfg: PlannerConfig) -> PlanContext:
        profile = load_profile(cfg.hardware.profile) if cfg.hardware.profile else None
        hw = get_hardware(cfg.hardware.name) if cfg.hardware.name else None
        model = None if profile is not None and cfg.model.name == profile.model.name else get_model(cfg.model.name)
        if profile is not None:
            gpn = cfg.cluster.gpus_per_node or 1
            price = cfg.cluster.gpu_hour_usd if cfg.cluster.gpu_hour_usd is not None else profile.gpu_hour_usd
            max_ctx = model.max_context if model else 10**9
        else:
            assert hw is not None and model is not None
            gpn = cfg.cluster.gpus_per_node or hw.gpus_per_node
            price = cfg.cluster.gpu_hour_usd if cfg.cluster.gpu_hour_usd is not None else hw.gpu_hour_usd
            max_ctx = model.max_context
        return cls(cfg, model, hw, profile, gpn, cfg.cluster.nodes, price, max_ctx)

    def latency(self, tp: int, pp: int, colocated: bool = False) -> LatencyModel:
        """The (tp, pp) engine's model; `colocated` picks the colocated baseline's (colocated_latency if set)."""
        if self.profile is not None:
            assert self.cfg.hardware.profile is not None
            return LatencyModel.from_profile(self.cfg.hardware.profile)
        assert self.model is not None and self.hardware is not None
        c = self.cfg
        return LatencyModel.from_catalog(self.model, self.hardware, tp=tp, pp=pp,
                                         weight_dtype=c.model.weight_dtype, kv_dtype=c.model.kv_dtype,
                                         spec=c.engine_latency(colocated),
                                         intra_node_gbps=c.cluster.intra_node_gbps,
                                         inter_node_gbps=c.cluster.inter_node_gbps, gpus_per_node=self.gpus_per_node)

    def workload(self) -> Workload:
        s = self.cfg.search
        return Workload.from_spec(self.cfg.workload, s.requests, s.seed, self.max_context)

    def candidates(self, wl: Workload, max_gpus: int | None = None) -> list[LatencyModel]:
        """Every (tp, pp) that divides the heads, fits a node's width, and holds the longest request's KV."""
        if self.profile is not None:
            return [self.latency(self.profile.engine.tp, 1)]
        assert self.model is not None and self.hardware is not None
        s = self.cfg.search
        longest = int((wl.inputs + wl.outputs).max())
        limit = min(self.total_gpus, max_gpus or self.total_gpus)
        out = []
        pps = [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= min(s.max_pp, self.model.layers)]
        for tp in sorted(set(s.tp_options)):
            if tp > self.gpus_per_node or self.model.heads % tp:
                continue
            for pp in pps:
                if tp * pp > limit:
                    continue
                lat = self.latency(tp, pp)
                if lat.kv_capacity_tokens() // pp >= longest:
                    out.append(lat)
        if not out:
            raise self._no_fit(longest)
        return out

    def _no_fit(self, longest: int) -> PlacementError:
        assert self.model is not None and self.hardware is not None
        c = self.cfg
        wgib = self.model.weight_bytes(c.model.weight_dtype) / GIB
        usable = self.hardware.hbm_gib * c.latency.mem_utilization - c.latency.reserve_gib
        max_gpus = min(self.total_gpus, max(c.search.tp_options) * c.search.max_pp)
        return DoesNotFitError(
            f"model {self.model.name} ({wgib:.1f} GiB of {c.model.weight_dtype} weights, plus KV for a "
            f"{longest}-token request) does not fit at any tp in {c.search.tp_options} x pp <= {c.search.max_pp} "
            f"within {max_gpus} GPUs of {self.hardware.name} ({usable:.1f} GiB usable each); use fp8 weights, "
            f"more GPUs per instance (search.max_pp, tp_options), or a larger accelerator")
