"""Placement planner: how many prefill and decode instances, with what parallelism and where.

Pure Python (no Ray, no vLLM at import). See docs/placement.md.

The public names below load on first use (PEP 562), so `import placement.catalog` or
`placement.roofline` needs neither pydantic nor PyYAML (only `placement.config` and what builds on it
does): a GPU box without them can still read the catalog and the roofline.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

# NOTE: public name -> the submodule that defines it; `from placement import X` resolves through here.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(["HARDWARE", "MODELS", "HardwareArch", "ModelArch", "get_hardware", "get_model",
                     "model_from_hf_config"], "catalog"),
    **dict.fromkeys(["ClusterSpec", "Coefficients", "HardwareSpec", "LatencySpec", "LengthDist", "ModelSpec",
                     "PlannerConfig", "SearchSpec", "SLOSpec", "WorkloadSpec", "load_planner_config",
                     "parse_planner_config"], "config"),
    **dict.fromkeys(["DispatchPolicy", "InstanceView", "LeastLoadedDispatch", "RoundRobinDispatch"], "dispatch"),
    **dict.fromkeys(["DoesNotFitError", "InfeasibleError", "PlacementError", "UnknownNameError"], "errors"),
    "LatencyModel": "latency",
    **dict.fromkeys(["Colocated", "PlacementPlan", "PoolShape", "format_plan"], "plan"),
    "make_plan": "planner",
    "predict": "predict",
    **dict.fromkeys(["ProfileData", "load_profile", "save_profile"], "profile_io"),
    **dict.fromkeys(["RooflinePoint", "decode_roofline"], "roofline"),
    **dict.fromkeys(["Percentiles", "RequestRecord", "SimResult"], "sim_result"),
    **dict.fromkeys(["simulate_colocated", "simulate_disaggregated"], "simulator"),
    **dict.fromkeys(["Request", "Workload", "gamma_trace", "load_trace"], "workload"),
}

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        # NOTE: the eager package made its submodules attributes (`placement.config`); so does this one.
        if not name.startswith("_") and importlib.util.find_spec(f"placement.{name}") is not None:
            return importlib.import_module(f"placement.{name}")
        raise AttributeError(f"module 'placement' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"placement.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:
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
