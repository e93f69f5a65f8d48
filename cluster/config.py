"""DeployConfig: one YAML file describes a deployment. Unknown keys are errors that name the key."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.vllm_flags import refused_vllm_args
from engine.config import EngineConfig
from kvtransfer.config import TransferConfig
from placement.config import SLOSpec


class ConfigError(Exception):
    """A deploy config that cannot be used; the message names the field and the fix."""


class PoolSizes(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill: int = Field(1, ge=1, le=512, description="Prefill workers (disaggregated mode)")
    decode: int = Field(1, ge=1, le=512, description="Decode workers (disaggregated mode)")
    colocated: int = Field(1, ge=1, le=512, description="Workers doing both phases (colocated mode)")
    prefill_tp: int | None = Field(None, ge=1, description="Tensor parallel size of prefill engines")
    prefill_pp: int | None = Field(None, ge=1, description="Pipeline stages of prefill engines")
    decode_tp: int | None = Field(None, ge=1, description="Tensor parallel size of decode engines")
    decode_pp: int | None = Field(None, ge=1, description="Pipeline stages of decode engines")
    node_packing: list[list[str]] | None = Field(
        None, description="Engines per node, e.g. [[P0, D0], [P1, D1]] (the planner's node packing); "
                          "None = prefill/decode pairs packed first-fit (cluster/placer.py)")

    @model_validator(mode="after")
    def _packing(self) -> PoolSizes:
        if self.node_packing is not None:
            from cluster.control.placer import PlacementError, check_packing

            try:
                check_packing(self.node_packing, self.prefill, self.decode)
            except PlacementError as e:
                raise ValueError(str(e)) from None
        return self


# What a pool may set for itself (cluster.config.PoolEngines); everything else is one value for the deployment.
POOL_ENGINE_FIELDS = ("enable_prefix_caching", "enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs",
                      "speculative", "kv_cache_mib", "cpu_threads", "gpu_memory_utilization", "startup_timeout_s")
# NOTE: NIXL's handshake compares the model, its dtype and the KV cache dtype (and the block layout
# follows from them): a prefill engine's KV blocks must be byte-for-byte what the decode engine expects.
SHARED_ENGINE_FIELDS = {"model": "both pools serve one model", "dtype": "NIXL's handshake compares the dtype",
                        "kv_cache_dtype": "NIXL's handshake compares the KV cache dtype",
                        "quantization": "quantization changes the weights both pools compute the KV from",
                        "max_model_len": "a prompt the prefill pool accepts must fit the decode pool",
                        "served_model_name": "clients see one model name", "device": "one device kind per deployment",
                        "seed": "one seed keeps seeded sampling reproducible across the handoff"}


class PoolEngines(BaseModel):
    """Engine options one pool sets for itself, over `engine` (e.g. speculative decoding on decode, prefix
    caching or a chunked-prefill budget on prefill). Weights and KV layout stay shared: see
    SHARED_ENGINE_FIELDS."""

    model_config = ConfigDict(extra="forbid")
    prefill: dict[str, Any] = Field(default_factory=dict, description="Overrides for prefill engines")
    decode: dict[str, Any] = Field(default_factory=dict, description="Overrides for decode engines")

    @model_validator(mode="after")
    def _fields(self) -> PoolEngines:
        for pool in ("prefill", "decode"):
            for key in getattr(self, pool):
                if key in SHARED_ENGINE_FIELDS:
                    raise ValueError(f"pool_engines.{pool}.{key}: set it once under engine.{key} ("
                                     f"{SHARED_ENGINE_FIELDS[key]})")
                if key not in POOL_ENGINE_FIELDS:
                    raise ValueError(f"pool_engines.{pool}.{key}: not a per-pool engine option; use one of "
                                     f"{', '.join(POOL_ENGINE_FIELDS)}")
        if "speculative" in self.prefill and self.prefill["speculative"] is not None:
            raise ValueError("pool_engines.prefill.speculative: a prefill engine emits one token; speculative "
                             "decoding belongs on the decode pool (pool_engines.decode.speculative)")
        return self

    def apply(self, role: str, engine: EngineConfig) -> EngineConfig:
        """The engine config of one pool. A prefill engine never speculates (it emits one token), even when
        `engine.speculative` is set for the deployment."""
        over = dict(getattr(self, role, None) or {}) if role in ("prefill", "decode") else {}
        if role == "prefill" and engine.speculative is not None:
            over["speculative"] = None
        if not over:
            return engine
        return EngineConfig.model_validate({**engine.model_dump(), **over})


class SLOConfig(BaseModel):
    """The deployment's one SLO: the router admits against it and the planner (pools: auto) sizes the pools
    for it (`spec()` is the planner's placement.config.SLOSpec). Per-request headers may only tighten it."""

    model_config = ConfigDict(extra="forbid")
    ttft_ms: float = Field(2000, gt=0, description="Time-to-first-token target, ms")
    tpot_ms: float = Field(200, gt=0, description="Time-per-output-token target, ms")
    percentile: Literal["p50", "p90", "p99"] = Field("p90", description="Percentile the targets are read at")
    attainment: float = Field(0.9, gt=0, le=1, description="Fraction of requests that must meet both targets")

    def spec(self) -> SLOSpec:
        return SLOSpec(ttft_s=self.ttft_ms / 1000.0, tpot_s=self.tpot_ms / 1000.0, percentile=self.percentile,
                       attainment=self.attainment)

    @classmethod
    def of(cls, spec: SLOSpec) -> SLOConfig:
        return cls(ttft_ms=spec.ttft_s * 1000.0, tpot_ms=spec.tpot_s * 1000.0, percentile=spec.percentile,
                   attainment=spec.attainment)


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy: Literal["goodput", "least_loaded", "round_robin"] = Field(
        "goodput", description="Routing policy (docs/router.md): goodput predicts TTFT/TPOT per pair and admits "
                               "what can meet the SLO; least_loaded and round_robin admit everything")
    admission: Literal["queue", "reject", "best_effort"] = Field(
        "queue", description="When no pair can meet the SLO: queue while the request's own TTFT budget can "
                             "still be met (429 at once when it cannot), 429, or serve anyway")
    max_queue: int = Field(256, ge=0, description="Requests waiting for admission before 429s")
    queue_timeout_s: float = Field(30, gt=0, description="Max seconds a request waits for admission")
    stats_interval_s: float = Field(0.1, gt=0, le=5, description="Worker stats refresh period")
    latency_profile: str | None = Field(
        None, description="goodput: measured profile YAML (python -m placement profile); relative paths "
                          "resolve against the working dir, then the repo; None = the bundled "
                          "manifests/profiles/cpu-smollm2.yaml")
    latency_model: str | None = Field(
        None, description="goodput: catalog model (e.g. llama-3.1-8b) for a roofline latency model instead "
                          "of a profile; needs latency_hardware")
    latency_hardware: str | None = Field(None, description="goodput: catalog accelerator (e.g. h100-sxm)")
    latency_tp: int = Field(1, ge=1, le=64, description="goodput: tensor parallelism of one engine (catalog)")
    prediction_sigma: float = Field(
        0.25, gt=0, le=5, description="goodput: log-normal sd of the prediction error; larger = more cautious")
    admit_probability: float = Field(
        0.5, ge=0, le=1, description="goodput: admit only pairs at least this likely to meet both targets")
    ewma_alpha: float = Field(
        0.1, gt=0, le=1, description="goodput: weight of each observed/predicted sample in the corrections")
    disaggregation: Literal["auto", "always", "never"] = Field(
        "auto", description="Where a request's prompt runs: auto = per request, a prefill worker (KV moved to the "
                            "decode worker) or the decode worker itself, whichever the goodput model predicts "
                            "better, counting the transfer and the stall a local prefill causes the streams "
                            "decoding there; always = a prefill worker; never = the decode worker")
    calibrate: bool = Field(
        True, description="goodput with the bundled profile: fit the latency model on the serving machine, in "
                          "the background once the endpoint is ready and idle, never delaying a request (cached "
                          "per machine, model files and engine settings: ~/.cache/saaf-infer/profiles)")

    def calibrates(self) -> bool:
        """Live calibration applies: goodput routing with no latency model the user chose."""
        return (self.calibrate and self.policy == "goodput" and self.latency_profile is None
                and self.latency_model is None)

    @model_validator(mode="after")
    def _latency_source(self) -> RouterConfig:
        if (self.latency_model is None) != (self.latency_hardware is None):
            raise ValueError("router: give both latency_model and latency_hardware (catalog), or neither")
        if self.latency_model is not None and self.latency_profile is not None:
            raise ValueError("router: give latency_profile or latency_model/latency_hardware, not both")
        return self


class KeyFromEnv(BaseModel):
    model_config = ConfigDict(extra="forbid")
    env: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Environment variable holding one key")


class KeyFromFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: str = Field(min_length=1, description="File with one key per line ('#' comments, blank lines skipped)")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = Field("127.0.0.1", description="HTTP bind address")
    api_keys: list[str | KeyFromEnv | KeyFromFile] = Field(
        default_factory=list, description="Keys clients must send (`Authorization: Bearer KEY`): inline strings, "
                                          "{env: VAR} or {file: PATH}; read on the deploying machine at start")
    api_key_sha256: list[str] = Field(
        default_factory=list, description="Keys given as SHA-256 hex digests (what the replicas hold; api_keys "
                                          "end up here)")
    auth_health: bool = Field(False, description="/health needs a key too (default: open, for load balancers)")
    auth_metrics: bool = Field(False, description="/metrics needs a key too (default: open, for Prometheus)")
    allow_unauthenticated: bool = Field(
        False, description="Serve a non-loopback host without api_keys (anyone who reaches the port can use it)")
    port: int = Field(8000, ge=1, le=65535, description="The endpoint's port")
    direct: bool = Field(
        True, description="The ingress replica serves HTTP itself on host:port (one hop less than Ray Serve's "
                          "proxy; cluster/direct.py); false = through the proxy on port")
    proxy_port: int | None = Field(
        None, ge=1, le=65535, description="With direct: also run Ray Serve's proxy on this port (None = no proxy)")
    route_prefix: str = Field("/", pattern=r"^/[A-Za-z0-9_/-]*$",
                              description="URL prefix of this app (several apps can share one Serve)")
    request_timeout_s: float = Field(300, gt=0, description="Max seconds for one request end to end")
    token_timeout_s: float = Field(60, gt=0, description="Max seconds between two streamed tokens")
    max_body_bytes: int = Field(1 << 20, gt=0, description="Largest accepted request body")
    body_timeout_s: float = Field(30, gt=0, le=3600, description="Seconds a client gets to send a request body; "
                                                                "then 408 (slow or stalled clients)")
    header_timeout_s: float = Field(30, gt=0, le=3600, description="Seconds a connection gets to send a request's "
                                                                  "head (line + headers); then it is closed")
    recovery_timeout_s: float = Field(
        90, gt=0, description="Max seconds a request waits for a pool with no healthy worker (restarts)"
    )
    max_inflight: int = Field(
        1024, ge=1, le=1_000_000, description="Requests in flight per ingress replica; beyond it 429 at once")
    vllm_args: list[str] = Field(
        default_factory=list, description="Extra `vllm serve` arguments for the OpenAI frontend (vLLM's serving "
                                          "layer in the ingress), e.g. [--enable-auto-tool-choice, "
                                          "--tool-call-parser, hermes]; validated by vLLM's own parser")
    drain_timeout_s: float = Field(
        30, ge=0, le=3600, description="On shutdown (SIGTERM, `shutdown`): seconds in-flight requests get to "
                                       "finish while new ones get 503; then the rest end with an error")
    max_completions_per_request: int = Field(
        16, ge=1, le=4096, description="Completions one request may ask for (n x prompts, batch entries); each "
                                       "is its own prefill, KV transfer and decode. Beyond it 400")
    send_timeout_s: float = Field(
        60, gt=0, le=3600, description="Seconds a client may leave a response unread (a full send buffer); then "
                                       "the connection is closed and its request's engines and KV freed")
    max_connections: int = Field(
        1024, ge=1, le=1_000_000, description="Open client connections per ingress replica; beyond it new "
                                             "connections get 503 and are closed")
    served_header: bool = Field(
        True, description="Every generating response says how it was served: the x-saaf-served header (path, "
                          "workers, KV bytes, transfer time) and, in a stream with usage, usage.saaf_served")
    docs: bool = Field(False, description="Serve /docs and /openapi.json (off: they describe every route to "
                                          "anyone who reaches the port)")
    cors_origins: list[str] = Field(
        default_factory=list, description="Browser origins allowed to call the endpoint (CORS); empty = none. "
                                          "Requests still need an API key where keys are set")

    @model_validator(mode="after")
    def _exposed(self) -> ServeConfig:
        for i, d in enumerate(self.api_key_sha256):
            if len(d) != 64 or any(c not in "0123456789abcdefABCDEF" for c in d):
                # NOTE: never echoed: a plain key put here by mistake would end up in a log
                raise ValueError(f"api_key_sha256[{i}] is not a SHA-256 hex digest (64 hex digits); give plain "
                                 "keys under api_keys instead")
        refused = refused_vllm_args(self.vllm_args)
        if refused:
            raise ValueError("vllm_args: " + "; ".join(refused))
        if self.api_keys and any(isinstance(k, str) and not k.strip() for k in self.api_keys):
            raise ValueError("api_keys: an inline key is empty")
        if not is_loopback(self.host) and not (self.api_keys or self.api_key_sha256) and not self.allow_unauthenticated:
            raise ValueError(
                f"host {self.host!r} is reachable from other machines and no api_keys are set: give "
                "serve.api_keys (e.g. [{env: SAAF_API_KEY}]), bind host 127.0.0.1, or set "
                "serve.allow_unauthenticated: true")
        return self


class HealthConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    interval_s: float = Field(2.0, gt=0, le=60, description="Seconds between health checks of each worker")
    timeout_s: float = Field(5.0, gt=0, le=300, description="A worker answering slower than this missed a check")
    failures: int = Field(3, ge=1, le=100, description="Missed checks in a row before a worker is replaced")


class PlannerLoopConfig(BaseModel):
    """The planner loop (cluster/control/autoplan.py): re-plans both pools from observed traffic."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["off", "advisory", "on"] = Field(
        "advisory", description="off; advisory: log and expose (/v1/stats, saaf_planner_* metrics) what it would "
                                "do; on: also resize the pools (and ask Ray's autoscaler for the resources)")
    interval_s: float = Field(30.0, ge=1, le=3600, description="Seconds of traffic per re-plan")
    min_prefill: int = Field(1, ge=1, le=512, description="Smallest prefill pool it sets")
    max_prefill: int = Field(4, ge=1, le=512, description="Largest prefill pool it sets")
    min_decode: int = Field(1, ge=1, le=512, description="Smallest decode (colocated: the only) pool it sets")
    max_decode: int = Field(4, ge=1, le=512, description="Largest decode (colocated: the only) pool it sets")
    down_after: int = Field(3, ge=1, le=100, description="Intervals in a row that must want fewer before a shrink")
    cooldown_s: float = Field(120.0, ge=0, description="Seconds after any change before a pool shrinks")
    up_cooldown_s: float = Field(0.0, ge=0, description="Seconds after any change before a pool grows")
    drain_timeout_s: float = Field(120.0, gt=0, description="Max seconds a removed worker drains in-flight work")
    request_resources: bool = Field(True, description="on: ask Ray's autoscaler (ray.autoscaler.sdk."
                                                      "request_resources) for the planned pools' bundles")

    @model_validator(mode="after")
    def _bounds(self) -> PlannerLoopConfig:
        for pool in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")
            if lo > hi:
                raise ValueError(f"planner_loop: min_{pool}={lo} > max_{pool}={hi}; give min <= max")
        return self


class RayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    address: str | None = Field(None, description="Existing cluster ('auto', host:port); None = embedded")
    num_cpus: int | None = Field(None, ge=1, description="Logical CPUs for the embedded local Ray")
    object_store_mib: int = Field(256, ge=64, description="Object store of the embedded local Ray")
    namespace: str = Field("saaf-infer", description="Ray namespace of the deployment's named actors")
    allow_unauthenticated: bool = Field(
        False, description="Deploy onto a cluster (address) that runs without Ray's token auth; refused otherwise: "
                           "anyone who reaches such a cluster's ports can run code on it")


class DeployConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("saaf", pattern=r"^[a-z][a-z0-9-]{0,40}$", description="Deployment name")
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    engine: EngineConfig = Field(default_factory=EngineConfig)
    pool_engines: PoolEngines = Field(default_factory=PoolEngines)
    pools: PoolSizes | Literal["auto"] = Field(default_factory=PoolSizes)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    slo: SLOConfig = Field(default_factory=SLOConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    planner_loop: PlannerLoopConfig = Field(default_factory=PlannerLoopConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    planner: dict[str, Any] | str | None = Field(
        None, description="Planner inputs inline, or a planner YAML path (docs/placement.md); for pools: auto"
    )
    worker_cpus: float = Field(1.0, ge=0, description="Logical CPUs reserved per engine worker")

    @model_validator(mode="after")
    def _check(self) -> DeployConfig:
        if self.pools == "auto" and self.planner is None:
            raise ValueError("pools: auto needs a 'planner' section (model, hardware, workload, slo)")
        if self.mode == "colocated" and (self.pool_engines.prefill or self.pool_engines.decode):
            raise ValueError("pool_engines: colocated mode has one pool; set the options under engine")
        for pool in ("prefill", "decode"):
            try:
                self.pool_engines.apply(pool, self.engine)
            except ValidationError as e:
                raise ValueError(f"pool_engines.{pool}: {_fmt(e).strip()}") from None
        return self


SECRET_FIELDS = ("api_keys", "api_key_sha256")


def _fmt(err: ValidationError) -> str:
    """One line per error naming the field. NOTE: the input is echoed only where it cannot hold a secret:
    never under a key field (there even a mistyped key name may be the key) and never for a whole-section
    check (its input is the section, keys and all)."""
    lines: list[str] = []
    for e in err.errors():
        parts = [str(p) for p in e["loc"]]
        secret = next((i for i, p in enumerate(parts) if p in SECRET_FIELDS), None)
        if secret is not None:
            keep = parts[:secret + 2] if len(parts) > secret + 1 and parts[secret + 1].isdigit() else parts[:secret + 1]
            line = f"  {'.'.join(keep)}: invalid (value not shown: it may be a secret); give a list of keys: " \
                   "strings, {env: VAR} or {file: PATH}" if parts[secret] == "api_keys" else \
                   f"  {'.'.join(keep)}: invalid (value not shown: it may be a secret); give a list of " \
                   "SHA-256 hex digests"
        elif e["type"] == "extra_forbidden":
            line = f"  {'.'.join(parts) or '(top level)'}: unknown key; remove it or check its spelling"
        elif e["type"] == "value_error":
            line = f"  {'.'.join(parts) or '(top level)'}: {e['msg']}"
        else:
            got = repr(e.get("input"))
            line = f"  {'.'.join(parts) or '(top level)'}: {e['msg']} (got {got[:120]}{'...' if len(got) > 120 else ''})"
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)


def parse_config(data: dict[str, Any] | None, source: str = "config") -> DeployConfig:
    try:
        return DeployConfig.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(f"{source} is invalid:\n{_fmt(e)}") from None


def load_config(path: str | Path | None, *, check_paths: bool = True) -> DeployConfig:
    """Load and validate a deploy YAML (None = the embedded default). Checks a model path exists
    (unless ``check_paths`` is False: capacity planning needs no weights on this machine)."""
    if path is None:
        return DeployConfig()
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"deploy config {str(path)!r} not found; pass a YAML file path")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except Exception as e:  # noqa: BLE001 - YAMLError, RecursionError, PyYAML's errors on bad tags
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys, got {type(data).__name__}")
    cfg = parse_config(data, str(path))
    if check_paths:
        check_model(cfg)
        resolve_api_keys(cfg)  # NOTE: errors now; the keys stay for deploy.start (its demo request needs one)
    if cfg.planner is not None:
        planner = cfg.planner
        if isinstance(planner, dict) and "slo" not in planner:  # NOTE: the deployment's SLO, given once
            planner = dict(planner, slo=cfg.slo.spec().model_dump())
        cfg = cfg.model_copy(update={"planner": _planner_dict(planner, p.parent)})
        cfg = one_slo(cfg, slo_given="slo" in data)
    return cfg


def one_slo(cfg: DeployConfig, slo_given: bool) -> DeployConfig:
    """The planner and the router read one SLO: a planner section's own `slo` becomes the deployment's when
    `slo:` is not given; given both, they must agree."""
    planned = SLOConfig.of(SLOSpec.model_validate(cfg.planner["slo"]))
    if not slo_given:
        return cfg.model_copy(update={"slo": planned})
    if planned.spec() != cfg.slo.spec():
        raise ConfigError(f"slo {cfg.slo.model_dump()} and planner.slo {planned.model_dump()} differ: the "
                          "router admits against one and the planner sizes pools for the other; give the SLO "
                          "once, in `slo:` or in the planner section")
    return cfg


def _planner_dict(planner: dict[str, Any] | str, base: Path) -> dict[str, Any]:
    """Validate the planner section now (errors before anything starts); make its paths absolute."""
    from placement import PlacementError
    from placement.config import load_planner_config, parse_planner_config, resolve_paths

    try:
        if isinstance(planner, str):
            path = Path(planner) if Path(planner).is_absolute() else base / planner
            pc = load_planner_config(path)
        else:
            pc = resolve_paths(parse_planner_config(planner, "planner"), base)
    except PlacementError as e:
        raise ConfigError(f"planner: {e}") from None
    out = pc.model_dump(mode="json", exclude_none=True)
    # NOTE: the model section keeps only what was given: a dtype left out follows the engines' (planning.py)
    out["model"] = pc.model.model_dump(mode="json", exclude_unset=True)
    return out


def resolve_api_keys(cfg: DeployConfig) -> tuple[DeployConfig, str | None]:
    """serve.api_keys read (inline, env, file) into serve.api_key_sha256, so the config the replicas get
    holds no key. Returns the config and one plain key (for the CLI's own demo request), or None."""
    keys: list[str] = []
    for k in cfg.serve.api_keys:
        if isinstance(k, str):
            keys.append(k.strip())
        elif isinstance(k, KeyFromEnv):
            value = os.environ.get(k.env, "").strip()
            if not value:
                raise ConfigError(f"serve.api_keys: environment variable {k.env} is not set (or empty); export "
                                  "it before deploying, or give the key another way")
            keys.append(value)
        else:
            path = Path(k.file).expanduser()
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"serve.api_keys: cannot read key file {k.file!r} ({e}); give a readable "
                                  "file with one key per line") from None
            found = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
            if not found:
                raise ConfigError(f"serve.api_keys: key file {k.file!r} holds no key (one per line)")
            keys.extend(found)
    if not keys:
        return cfg, None
    digests = list(dict.fromkeys([*cfg.serve.api_key_sha256, *(key_digest(k) for k in keys)]))
    serve = cfg.serve.model_copy(update={"api_keys": [], "api_key_sha256": digests})
    return cfg.model_copy(update={"serve": serve}), keys[0]


def check_model(cfg: DeployConfig) -> None:
    from engine.models import ALIASES, HEADS

    m = cfg.engine.model
    if m.lower() in ALIASES:
        check_tp_split(cfg, *HEADS[ALIASES[m.lower()]])
        return
    if not Path(m).expanduser().is_dir():
        raise ConfigError(
            f"engine.model: {m!r} is not a directory; give a local HF model dir or one of "
            f"{', '.join(sorted(ALIASES))}"
        )
    if not (Path(m).expanduser() / "config.json").is_file():
        raise ConfigError(f"engine.model: {m!r} has no config.json; is it a Hugging Face model dir?")
    try:
        hf = json.loads((Path(m).expanduser() / "config.json").read_text())
        heads = int(hf.get("num_attention_heads") or (hf.get("text_config") or {}).get("num_attention_heads") or 0)
        kv = int(hf.get("num_key_value_heads") or (hf.get("text_config") or {}).get("num_key_value_heads") or heads)
    except (OSError, ValueError, TypeError, AttributeError):
        return  # NOTE: vLLM reads it at start and says what is wrong
    if heads:
        check_tp_split(cfg, heads, kv)


def check_tp_split(cfg: DeployConfig, heads: int, kv_heads: int) -> None:
    """Every pool's TP size divides the model's attention heads (and its KV heads, or is a multiple of them,
    which vLLM then replicates): before any engine starts, not as an engine start failing."""
    pools = cfg.pools if isinstance(cfg.pools, PoolSizes) else None
    tps = {"engine.tensor_parallel_size": cfg.engine.tensor_parallel_size}
    if pools is not None:
        tps.update({f"pools.{r}_tp": t for r in ("prefill", "decode") if (t := getattr(pools, f"{r}_tp"))})
    for field, tp in tps.items():
        kv_ok = kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0
        if heads % tp or not kv_ok:
            fits = [d for d in range(1, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
            raise ConfigError(f"{field}: {tp} ranks cannot split {cfg.engine.model!r} ({heads} attention heads, "
                              f"{kv_heads} KV heads); use one of {fits}")
