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
        pc = parse_planner_config(cfg.planner, "planner")
    except PlacementError as e:
        raise ConfigError(f"planner: {e}") from None
    role = "colocated" if cfg.mode == "colocated" else "decode"
    spec = cfg.pool_engines.apply(role, cfg.engine).speculative
    note = None
    if spec is not None and pc.speculation is None:
        note = (f"the {role} engines speculate ({spec.num_speculative_tokens} tokens) but planner.speculation is "
                "not given: planned as plain engines; give planner.speculation {tokens, acceptance} (python -m "
                "benchmarks.speculation measures the acceptance on a traffic sample)")
    elif pc.speculation is not None and (spec is None or spec.num_speculative_tokens != pc.speculation.tokens):
        raise ConfigError(f"planner.speculation.tokens={pc.speculation.tokens} but the {role} engines speculate "
                          f"{spec.num_speculative_tokens if spec else 0} tokens ("
                          f"{'pool_engines.decode' if role == 'decode' else 'engine'}.speculative."
                          "num_speculative_tokens): plan for what the engines run")
    try:
        plan = make_plan(pc)
    except PlacementError as e:
        raise ConfigError(f"planner: {e}") from None
    if note is not None:
        plan.notes.append(note)
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
