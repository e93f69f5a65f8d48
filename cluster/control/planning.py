"""pools: auto -> run the placement planner and size the pools from its plan."""

from __future__ import annotations

import json
from pathlib import Path
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
    pc, dtype_notes = _engine_dtypes(cfg, pc)
    try:
        plan = make_plan(pc)
    except PlacementError as e:
        raise ConfigError(f"planner: {e}") from None
    plan.notes.extend(dtype_notes + ([note] if note is not None else []))
    return plan, format_plan(plan)


def _checkpoint_quant_config(model: str) -> dict | None:
    """``quantization_config`` of a local checkpoint's config.json (None for catalog names and aliases)."""
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None


def _engine_dtypes(cfg: DeployConfig, pc: Any) -> tuple[Any, list[str]]:
    """The planner's weight and KV dtypes from what the engines run: vLLM's ``engine.quantization`` (or the
    checkpoint's own quantization config) and ``engine.kv_cache_dtype``. Set in the planner section and
    different: a ConfigError naming both; left at the default: taken from the engines, with a note."""
    from placement.catalog import weight_dtype_of

    eng = cfg.engine
    implied = {"weight_dtype": weight_dtype_of(eng.quantization, _checkpoint_quant_config(eng.model)),
               "kv_dtype": "fp8" if eng.kv_cache_dtype.startswith("fp8") else None}
    source = {"weight_dtype": f"engine.quantization={eng.quantization}" if eng.quantization else
              f"the quantization_config of {eng.model}/config.json",
              "kv_dtype": f"engine.kv_cache_dtype={eng.kv_cache_dtype}"}
    update, notes = {}, []
    for field, want in implied.items():
        have = getattr(pc.model, field)
        if want is None or want == have:
            continue
        if field in pc.model.model_fields_set:
            raise ConfigError(f"planner.model.{field}={have} but the engines run {want} ({source[field]}): "
                              f"set planner.model.{field}: {want}, or leave it out to take the engines'")
        update[field] = want
        notes.append(f"planner.model.{field}: {want}, from {source[field]}")
    if not update:
        return pc, notes
    return pc.model_copy(update={"model": pc.model.model_copy(update=update)}), notes


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
