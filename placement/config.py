"""Planner configuration: pydantic models loaded from YAML; unknown keys are errors.

`PlannerConfig` is the whole input of `make_plan`. Its sections (`ModelSpec`, `HardwareSpec`,
`ClusterSpec`, `WorkloadSpec`, `SLOSpec`, `LatencySpec`, `SearchSpec`) are reusable by other configs
(the deploy config embeds them). See docs/placement.md for every field.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from placement.errors import PlacementError

logger = logging.getLogger(__name__)

Dtype = Literal["fp32", "bf16", "fp16", "fp8", "fp4", "int8", "int4"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    name: str = Field(description="catalog name (e.g. llama-3.1-8b, opt-13b) or a path to an HF config.json")
    weight_dtype: Dtype = Field("bf16", description="dtype of the weights in HBM (fp8 halves weight bytes; fp4 "
                                                    "is NVFP4, 4.5 bits per weight with its scales; int8 is W8A8 "
                                                    "on the INT8 tensor cores; int4 is 4-bit weight-only, 16-bit "
                                                    "matmuls); with pools: auto the engine's quantization sets it")
    kv_dtype: Dtype = Field("bf16", description="dtype of the KV cache")


class HardwareSpec(_Strict):
    name: str | None = Field(None, description="catalog accelerator: a100-80gb, h100-sxm, h200, b200")
    profile: str | None = Field(None, description="measured profile YAML (python -m benchmarks.profile); "
                                                  "replaces the catalog latency model")

    @model_validator(mode="after")
    def _one_source(self) -> HardwareSpec:
        if (self.name is None) == (self.profile is None):
            raise ValueError("give exactly one of hardware.name (catalog) or hardware.profile (measured YAML)")
        return self


class ClusterSpec(_Strict):
    nodes: int = Field(1, ge=1, description="number of nodes")
    gpus_per_node: int | None = Field(None, ge=1, description="GPUs per node (default: the hardware's)")
    intra_node_gbps: float | None = Field(None, gt=0, description="GB/s per GPU per direction inside a node "
                                                                  "(default: the hardware's NVLink)")
    inter_node_gbps: float | None = Field(None, gt=0, description="GB/s per GPU between nodes "
                                                                  "(default: the hardware's NIC)")
    gpu_hour_usd: float | None = Field(None, ge=0, description="price of one GPU-hour (default: catalog)")


class LengthDist(_Strict):
    kind: Literal["fixed", "uniform", "lognormal"] = Field(description="distribution family")
    value: int | None = Field(None, ge=1, description="fixed: the length")
    low: int | None = Field(None, ge=1, description="uniform: smallest length")
    high: int | None = Field(None, ge=1, description="uniform: largest length")
    mean: float | None = Field(None, gt=0, description="lognormal: mean length in tokens")
    sd: float | None = Field(None, ge=0, description="lognormal: standard deviation in tokens")
    min: int = Field(1, ge=1, description="clip: smallest length")
    max: int = Field(1_000_000, ge=1, description="clip: largest length")

    @model_validator(mode="after")
    def _params(self) -> LengthDist:
        need = {"fixed": ("value",), "uniform": ("low", "high"), "lognormal": ("mean", "sd")}[self.kind]
        missing = [n for n in need if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{self.kind} length distribution needs {', '.join(missing)}")
        if self.kind == "uniform" and self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"uniform low={self.low} > high={self.high}; swap them")
        return self


class WorkloadSpec(_Strict):
    rate_rps: float | None = Field(None, gt=0, description="arrival rate to plan for (req/s); omit to fill "
                                                           "the cluster and report its capacity")
    rate_sweep: list[float] | None = Field(None, description="[low, high, steps]: plan for each rate")
    arrival: Literal["poisson", "gamma"] = Field("poisson", description="arrival process")
    cv: float = Field(1.0, gt=0, description="gamma: coefficient of variation of inter-arrival times "
                                             "(1 = Poisson, >1 bursty)")
    input: LengthDist | None = Field(None, description="prompt length distribution")
    output: LengthDist | None = Field(None, description="output length distribution")
    trace: str | None = Field(None, description="CSV/JSONL with input_len, output_len[, arrival_s]; "
                                                "replaces input/output (and arrivals if present)")
    prefix_hit_rate: float = Field(0.0, ge=0, le=0.95, description="share of prompt tokens the engines find "
                                   "in their prefix cache (multi-turn chat, shared system prompts; the "
                                   "running engines report it, the planner loop's status shows it): "
                                   "prefill is planned without them")
    local_prefill_tokens: int = Field(0, ge=0, description="prompts of at most this many tokens are prefilled "
                                      "on their decode worker (router.disaggregation auto takes short prompts "
                                      "there; the planner loop measures the share): the prefill pool is planned "
                                      "without them, the decode pool with their prefill steps among its streams")

    @model_validator(mode="after")
    def _lengths(self) -> WorkloadSpec:
        if self.trace is None and (self.input is None or self.output is None):
            raise ValueError("workload needs input and output length distributions, or a trace file")
        if self.rate_sweep is not None:
            if len(self.rate_sweep) != 3 or not 0 < self.rate_sweep[0] <= self.rate_sweep[1] or self.rate_sweep[2] < 1:
                raise ValueError(f"rate_sweep={self.rate_sweep} must be [low>0, high>=low, steps>=1]")
        return self


class SLOSpec(_Strict):
    ttft_s: float = Field(gt=0, description="time-to-first-token target in seconds (includes KV transfer)")
    tpot_s: float = Field(gt=0, description="time-per-output-token target in seconds")
    percentile: Literal["p50", "p90", "p99"] = Field("p90", description="percentile at which TTFT/TPOT "
                                                                        "are reported")
    attainment: float = Field(0.9, gt=0, le=1, description="fraction of requests that must meet both targets")


class Coefficients(_Strict):
    """DistServe's regression, in milliseconds: prefill a*sum(l) + b*sum(l^2) + c, decode a*sum(ctx) + b*batch + c."""

    prefill_a: float = Field(ge=0, description="ms per prompt token")
    prefill_b: float = Field(ge=0, description="ms per squared prompt token")
    prefill_c: float = Field(ge=0, description="ms per prefill batch")
    decode_a: float = Field(ge=0, description="ms per context token in the batch")
    decode_b: float = Field(ge=0, description="ms per sequence in the batch")
    decode_c: float = Field(ge=0, description="ms per decode step")


class LatencySpec(_Strict):
    coefficients: dict[int, Coefficients] | None = Field(None, description="regression coefficients per TP "
                                                         "degree (ms); TPs not given are derived from the "
                                                         "nearest given one below (else the smallest)")
    compute_efficiency: float = Field(0.6, gt=0, le=1, description="achieved / peak tensor FLOPS")
    memory_efficiency: float = Field(0.85, gt=0, le=1, description="achieved / peak HBM bandwidth")
    link_efficiency: float = Field(0.8, gt=0, le=1, description="achieved / peak NVLink/NIC bandwidth")
    tp_efficiency: float = Field(0.8, gt=0, le=1, description="efficiency of per-token work per doubling "
                                                              "of TP (0.8: DistServe's OPT-13B profiles)")
    step_overhead_ms: float = Field(3.0, ge=0, description="fixed scheduler/launch cost per step (roofline)")
    layer_overhead_us: float = Field(0.0, ge=0, description="fixed cost per layer per step (roofline): the "
                                                            "latency floor of a layer's small kernels")
    allreduce_latency_us: float | None = Field(None, ge=0, description="fixed cost of one TP all-reduce "
                                                                       "(default: the hardware's)")
    ttft_overhead_ms: float = Field(0.0, ge=0, description="serving front-end time per request outside the "
                                                           "engine (HTTP, tokenisation, first-token "
                                                           "streaming): added to TTFT, occupies no GPU")
    ttft_overhead_us_per_token: float = Field(0.0, ge=0, description="serving front-end time per prompt "
                                              "token (tokenising, moving the prompt into the engine): added "
                                              "to TTFT with ttft_overhead_ms, occupies no GPU")
    ttft_overhead_us_per_stream: float = Field(0.0, ge=0, description="serving front-end time per request "
                                               "already in flight when one arrives (the front end streams "
                                               "every open request's tokens in one process): added to TTFT, "
                                               "occupies no GPU")
    pp_hop_latency_ms: float = Field(0.5, ge=0, description="fixed cost per pipeline stage boundary per "
                                                            "step (send/recv, synchronisation)")
    calibration: str | None = Field(None, description="serving engine whose fitted efficiencies to use "
                                                      "(vllm, sglang, trtllm; see placement.calibration); "
                                                      "fields set here win over the fitted ones")
    mem_utilization: float = Field(0.9, gt=0, le=1, description="fraction of HBM the engine may use")
    reserve_gib: float = Field(2.0, ge=0, description="activation/workspace memory per GPU, not for KV")

    @model_validator(mode="after")
    def _some_tp(self) -> LatencySpec:
        if self.coefficients is not None and (not self.coefficients or min(self.coefficients) < 1):
            raise ValueError("latency.coefficients needs at least one entry, keyed by a TP degree >= 1; TPs not "
                             "given are derived from the nearest one below (the smallest where none is)")
        return self


class SearchSpec(_Strict):
    algorithm: Literal["auto", "high-affinity", "low-affinity"] = Field(
        "auto", description="high-affinity: DistServe alg. 1 (fast cross-node links); low-affinity: alg. 2 "
                            "(prefill and decode segments packed per node); auto: by KV transfer time")
    tp_options: list[int] = Field([1, 2, 4, 8], description="tensor-parallel degrees to try")
    max_pp: int = Field(8, ge=1, description="largest pipeline-parallel degree to try")
    max_prefill_tokens: int = Field(4096, ge=1, description="token budget of one prefill batch")
    requests: int = Field(600, ge=50, description="simulated requests per goodput probe")
    seed: int = Field(0, description="random seed for workload sampling")
    node_ratios: bool = Field(False, description="algorithm 2: also try n_p:n_d instance mixes per node "
                                                 "(DistServe pairs one prefill with one decode)")
    colocated_baseline: bool = Field(True, description="also size the colocated baseline on the same GPUs")
    first_token_from_prefill: bool = Field(True, description="the prefill engine's first token streams to the "
                                                             "client at once (our P/D): the KV transfer delays "
                                                             "the second token, not TTFT; false: the decode "
                                                             "engine samples token 1 after the transfer "
                                                             "(DistServe's convention, the engines' own P/D "
                                                             "proxies)")
    colocated_chunked_prefill: bool = Field(False, description="colocated baseline with chunked prefill "
                                                               "(vLLM v1: prompt chunks share each step with the "
                                                               "decodes) instead of prefill batches that stall "
                                                               "every running decode (vLLM 0.2, DistServe's baseline)")


class SpeculationSpec(_Strict):
    tokens: int = Field(ge=1, le=16, description="draft tokens proposed per decode step (vLLM "
                                                 "num_speculative_tokens)")
    acceptance: float = Field(ge=0, lt=1, description="measured probability that a draft token is accepted: "
                                                      "python -m benchmarks.speculation prints it for a "
                                                      "traffic sample; running engines report spec_acceptance")


class PlannerConfig(_Strict):
    model: ModelSpec = Field(description="the model to serve")
    hardware: HardwareSpec = Field(description="accelerator catalog name or measured profile")
    cluster: ClusterSpec = Field(ClusterSpec(), description="nodes, links and prices")
    workload: WorkloadSpec = Field(description="arrivals and lengths")
    slo: SLOSpec = Field(description="latency targets")
    latency: LatencySpec = Field(LatencySpec(), description="latency model knobs and coefficients")
    colocated_latency: LatencySpec | None = Field(None, description="latency model of the colocated baseline "
                                                  "when it is another engine than the pools run (DistServe's "
                                                  "runs: vLLM beside DistServe's own engine); default: latency")
    search: SearchSpec = Field(SearchSpec(), description="search space and simulation size")
    speculation: SpeculationSpec | None = Field(None, description="the decode (and colocated) engines speculate: "
                                                                  "their decode steps are modelled by "
                                                                  "LatencyModel.with_speculation")

    def engine_latency(self, colocated: bool = False) -> LatencySpec:
        """The latency spec of the pools' engine, or of the colocated baseline's (colocated_latency if set)."""
        return (self.colocated_latency or self.latency) if colocated else self.latency


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid planner config {source}:"]
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        got = err.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {loc}: {err['msg']}{shown}")
    return "\n".join(lines)


def parse_planner_config(data: object, source: str = "<dict>") -> PlannerConfig:
    try:
        return PlannerConfig.model_validate(data)
    except ValidationError as exc:
        raise PlacementError(format_validation_error(exc, source)) from None


def load_planner_config(path: str | Path) -> PlannerConfig:
    """Load a planner YAML; relative profile/trace paths resolve against the YAML's folder, then the cwd."""
    p = Path(path)
    if not p.is_file():
        raise PlacementError(f"planner config {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise PlacementError(f"planner config {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except Exception as e:  # noqa: BLE001 - YAMLError, RecursionError, PyYAML's errors on bad tags
        raise PlacementError(f"planner config {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise PlacementError(f"planner config {p} must be a YAML mapping, got {type(data).__name__}")
    cfg = parse_planner_config(data, str(p))
    return resolve_paths(cfg, p.parent)


def resolve_paths(cfg: PlannerConfig, base: Path) -> PlannerConfig:
    def fix(value: str | None) -> str | None:
        if value is None or Path(value).is_absolute() or Path(value).exists():
            return value
        cand = base / value
        return str(cand) if cand.exists() else value

    hw = cfg.hardware.model_copy(update={"profile": fix(cfg.hardware.profile)})
    wl = cfg.workload.model_copy(update={"trace": fix(cfg.workload.trace)})
    return cfg.model_copy(update={"hardware": hw, "workload": wl})
