"""Placement planner: how many prefill and decode instances, with what parallelism and where.

Pure Python (no Ray, no vLLM at import). See docs/placement.md.
"""

from __future__ import annotations

from placement.catalog import (
                              HARDWARE,
                              MODELS,
                              HardwareArch,
                              ModelArch,
                              get_hardware,
                              get_model,
                              model_from_hf_config,
)
from placement.config import (
                              ClusterSpec,
                              Coefficients,
                              HardwareSpec,
                              LatencySpec,
                              LengthDist,
                              ModelSpec,
                              PlannerConfig,
                              SearchSpec,
                              SLOSpec,
                              WorkloadSpec,
                              load_planner_config,
                              parse_planner_config,
)
from placement.dispatch import DispatchPolicy, InstanceView, LeastLoadedDispatch, RoundRobinDispatch
from placement.errors import DoesNotFitError, InfeasibleError, PlacementError, UnknownNameError
from placement.latency import LatencyModel
from placement.plan import Colocated, PlacementPlan, PoolShape, format_plan
from placement.planner import make_plan
from placement.predict import predict
from placement.profile_io import ProfileData, load_profile, save_profile
from placement.roofline import RooflinePoint, decode_roofline
from placement.sim_result import Percentiles, RequestRecord, SimResult
from placement.simulator import simulate_colocated, simulate_disaggregated
from placement.workload import Request, Workload, gamma_trace, load_trace

__all__ = [
    "HARDWARE", "MODELS", "ClusterSpec", "Coefficients", "Colocated", "DispatchPolicy", "DoesNotFitError",
    "HardwareArch", "HardwareSpec", "InfeasibleError", "InstanceView", "LatencyModel", "LatencySpec",
    "LeastLoadedDispatch", "LengthDist", "ModelArch", "ModelSpec", "Percentiles", "PlacementError",
    "PlacementPlan", "PlannerConfig", "PoolShape", "ProfileData", "Request", "RequestRecord", "RooflinePoint",
    "RoundRobinDispatch", "SLOSpec", "SearchSpec", "SimResult", "UnknownNameError", "Workload", "WorkloadSpec",
    "decode_roofline", "format_plan", "gamma_trace", "get_hardware", "get_model", "load_planner_config",
    "load_profile", "load_trace", "make_plan", "model_from_hf_config", "parse_planner_config", "predict",
    "save_profile", "simulate_colocated", "simulate_disaggregated",
]
