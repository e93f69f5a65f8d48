"""Fitted efficiencies per serving engine and accelerator, and each engine's default scheduler.

`python -m placement validate --write-calibration placement/calibration_data.py` fits the roofline's
free parameters (achieved/peak compute and HBM bandwidth, per-layer and per-step fixed costs, TP
all-reduce latency, the front-end's TTFT share) on the fit part of measured serving results and writes
them to `placement.calibration_data`; docs/placement.md and
benchmarks/results/prediction-validation/ say how well they predict the held-out part.
`LatencySpec(calibration="vllm")` applies them: fields the spec sets explicitly win.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from placement.config import LatencySpec
from placement.errors import UnknownNameError

logger = logging.getLogger(__name__)

FITTED_FIELDS = ("compute_efficiency", "memory_efficiency", "layer_overhead_us", "step_overhead_ms",
                 "allreduce_latency_us", "tp_efficiency", "ttft_overhead_ms", "ttft_overhead_us_per_token",
                 "ttft_overhead_us_per_stream")


class Scheduler(NamedTuple):
    """How an engine mixes the phases: chunked prefill (prompt chunks ride along with the running
    decodes in one step of at most `max_batched_tokens` tokens) or prefill batches that stall decode."""

    chunked_prefill: bool
    max_batched_tokens: int


# NOTE: defaults of the engines' OpenAI servers on 80+ GiB GPUs: vLLM v1 always chunks with
# max_num_batched_tokens 8192; TensorRT-LLM's inflight batching mixes context chunks and generation up to
# max_num_tokens 8192; SGLang runs prefill (extend) batches of chunked_prefill_size 8192 apart from decode.
SCHEDULERS: dict[str, Scheduler] = {
    "vllm": Scheduler(True, 8192),
    "trtllm": Scheduler(True, 8192),
    "sglang": Scheduler(False, 8192),
    "none": Scheduler(False, 4096),
}


def precision_class(weight_dtype: str) -> str:
    return {"fp16": "bf16", "fp32": "bf16"}.get(weight_dtype, weight_dtype)


def fitted(backend: str, hardware: str, weight_dtype: str) -> dict[str, float]:
    """The most specific fitted values: backend/hardware/precision, then backend/hardware, then backend."""
    from placement.calibration_data import FITTED

    if backend not in SCHEDULERS:
        raise UnknownNameError("serving engine", backend, list(SCHEDULERS))
    prec = precision_class(weight_dtype)
    for key in (f"{backend}/{hardware}/{prec}", f"{backend}/{hardware}/*", f"{backend}/*/*"):
        if key in FITTED:
            return dict(FITTED[key])
    return {}


def calibrated_spec(spec: LatencySpec, hardware: str, weight_dtype: str) -> LatencySpec:
    """`spec` with the fitted values of its `calibration` engine for fields it does not set itself."""
    assert spec.calibration is not None
    values = fitted(spec.calibration, hardware, weight_dtype)
    update = {k: v for k, v in values.items() if k in FITTED_FIELDS and k not in spec.model_fields_set}
    logger.debug("calibration %s on %s (%s): %s", spec.calibration, hardware, weight_dtype, update)
    return spec.model_copy(update={**update, "calibration": None})
