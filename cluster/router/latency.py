"""The latency model a router config names: a catalog roofline, a measured profile, or the bundled one."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from placement.latency import LatencyModel

if TYPE_CHECKING:
    from cluster.config import RouterConfig

DEFAULT_PROFILE = Path(__file__).resolve().parents[2] / "manifests" / "profiles" / "cpu-smollm2.yaml"


def latency_from_config(rc: RouterConfig | None, tp: int | None = None) -> LatencyModel:
    """A catalog roofline (`latency_model` on `latency_hardware`, at `tp` or `latency_tp`), a measured
    profile (`latency_profile`), or the bundled CPU SmolLM2 profile."""
    if rc is not None and rc.latency_model is not None:
        from placement.catalog import get_hardware, get_model

        assert rc.latency_hardware is not None  # RouterConfig's validator requires both
        return LatencyModel.from_catalog(get_model(rc.latency_model), get_hardware(rc.latency_hardware),
                                         tp=tp or rc.latency_tp)
    path = Path(rc.latency_profile).expanduser() if rc is not None and rc.latency_profile else DEFAULT_PROFILE
    if not path.is_absolute() and not path.is_file():
        path = DEFAULT_PROFILE.parents[2] / path  # NOTE: relative paths also resolve against the repo root
    if not path.is_file():
        raise FileNotFoundError(f"router.latency_profile {str(path)!r} does not exist; measure one with `python "
                                "-m placement profile --out PATH` or set latency_model and latency_hardware")
    return LatencyModel.from_profile(path)
