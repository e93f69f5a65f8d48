"""vLLM's serving layer without an engine: its arguments, VllmConfig, renderer and input processor, built
the way vLLM's own render server builds them (vllm/entrypoints/launchers/render/entry.py).

The ingress has no KV connector of its own (`kv_transfer_config` stays unset): the prefill and decode
engines behind our EngineClient hold the connectors, so vLLM's serving classes see a plain engine.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, NamedTuple

from cluster.config import DeployConfig, ServeConfig

logger = logging.getLogger(__name__)


class Frontend(NamedTuple):
    args: argparse.Namespace  # as vLLM's own `vllm serve` arg parser produces them
    vllm_config: Any
    renderer: Any
    input_processor: Any


def frontend_argv(cfg: DeployConfig, model_dir: str | Path, served_name: str) -> list[str]:
    """`vllm serve` arguments equivalent to this deployment's frontend, then `serve.vllm_args`."""
    dtype = cfg.engine.dtype
    if dtype == "auto" and cfg.engine.device == "cpu":
        dtype = "float32"  # NOTE: what engine/config.py gives CPU engines
    return ["--model", str(model_dir), "--served-model-name", served_name,
            "--max-model-len", str(cfg.engine.max_model_len), "--dtype", dtype, *cfg.serve.vllm_args]


def parse_frontend_args(argv: list[str]) -> argparse.Namespace:
    """vLLM's own parser and checks; a bad `serve.vllm_args` is a ValueError naming it."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="serve.vllm_args", exit_on_error=False))
    try:
        args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
    except (argparse.ArgumentError, SystemExit, TypeError, ValueError) as e:
        raise ValueError(f"serve.vllm_args {argv[8:]!r} are not valid `vllm serve` arguments: {e}") from None
    return args


def build_frontend(cfg: DeployConfig, model_dir: str | Path, served_name: str) -> Frontend:
    from vllm import AsyncEngineArgs, envs
    from vllm.config import VllmConfig
    from vllm.renderers import renderer_from_config
    from vllm.v1.engine.input_processor import InputProcessor

    args = parse_frontend_args(frontend_argv(cfg, model_dir, served_name))
    engine_args = AsyncEngineArgs.from_cli_args(args)
    model_config = engine_args.create_model_config()
    model_config.quantization = None  # NOTE: as vLLM's render server: no kernels run here
    envs.VLLM_CPU_KVCACHE_SPACE = 0  # NOTE: no KV cache here; silences the CPU platform's sizing warning
    vllm_config = VllmConfig(model_config=model_config, logging_config=engine_args.create_logging_config(),
                             structured_outputs_config=engine_args.create_structured_outputs_config())
    # NOTE: init_app_state reads the structured-outputs config (reasoning parser) from the args.
    args.structured_outputs_config = vllm_config.structured_outputs_config
    renderer = renderer_from_config(vllm_config)
    return Frontend(args, vllm_config, renderer, InputProcessor(vllm_config, renderer))


def check_vllm_args(sc: ServeConfig) -> None:
    """Validate serve.vllm_args before anything starts (imports vLLM's arg parser: only when set)."""
    if sc.vllm_args:
        parse_frontend_args(["--model", "m", "--served-model-name", "m", "--max-model-len", "8", "--dtype",
                             "auto", *sc.vllm_args])
