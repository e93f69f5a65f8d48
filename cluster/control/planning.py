"""pools: auto -> run the placement planner and size the pools from its plan."""

from __future__ import annotations

from typing import Any

from cluster.config import ConfigError, DeployConfig, PoolSizes


def plan_for(cfg: DeployConfig) -> tuple[Any, str]:
    from placement import PlacementError, format_plan, make_plan
    from placement.config import parse_planner_config

    if cfg.planner is None or isinstance(cfg.planner, str):
        raise ConfigError("pools: auto needs a 'planner' section; load the config with load_config()")
    try:
        plan = make_plan(parse_planner_config(cfg.planner, "planner"))
    except PlacementError as e:
        raise ConfigError(f"planner: {e}") from None
    return plan, format_plan(plan)


def apply_plan(cfg: DeployConfig) -> DeployConfig:
    """The config with pool sizes (and per-pool TP/PP) taken from the planner's plan."""
    plan, text = plan_for(cfg)
    print(text, flush=True)
    if not plan.feasible:
        raise ConfigError("the planner found no configuration meeting the SLO (see above); "
                          "relax the SLO or give explicit pool sizes")
    if cfg.mode == "colocated":
        pools = PoolSizes(colocated=max(1, plan.colocated.instances if plan.colocated else plan.gpus))
    else:
        pools = PoolSizes(prefill=plan.prefill.instances, decode=plan.decode.instances,
                          prefill_tp=plan.prefill.tp, prefill_pp=plan.prefill.pp,
                          decode_tp=plan.decode.tp, decode_pp=plan.decode.pp, node_packing=plan.node_packing)
    return cfg.model_copy(update={"pools": pools})
