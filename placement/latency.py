"""Per-instance latency model: prefill batch time, decode step time, KV size, transfer and capacity.

Every source (roofline from the catalog, DistServe regression coefficients, a measured profile)
compiles to the same handful of terms, so each call is a few multiplications (the router calls these
per request). With T = sum(l), S2 = sum(l^2), B = batch, C = total context tokens:

    roofline:   prefill = max(pa*T, p_mem) + pb*S2 + p_fixed + p_lin*T
                decode  = max(d_mem_c, d_comp_b*B) + max(d_mem_a, d_comp_a)*C + d_fixed + d_lin*B
    regression: prefill = max(pa*T + pb*S2, p_mem) + p_fixed + p_lin*T
                decode  = max(d_mem_c + d_mem_a*C, d_comp_b*B + d_comp_a*C) + d_fixed + d_lin*B

Roofline: compute terms are FLOPs / (peak x efficiency), memory terms bytes / (HBM bw x efficiency). The
GEMMs (bound by the weights' bytes or their FLOPs) and attention (bound by the KV cache's bytes or its FLOPs)
are separate kernels that run one after the other, so their times add; each is bound by its own roofline.
A prompt token costs the layers' FLOPs (logits only for a prompt's last token), a generated token the LM
head's too; attention runs at the 16-bit peak (activations times activations) whatever the weights' dtype.
Regression (a measured TP): pa=a, pb=b, p_fixed=c; d_mem_a=a, d_lin=b, d_fixed=c. A TP not measured scales
from the nearest measured TP below it (the smallest measured where none is): for k times the GPUs the
per-token terms divide by k*e (e = tp_efficiency^log2 k), the weight-streaming share of the constant
divides by k, and each layer adds the two ring all-reduces' share the measured TP did not pay. Pipeline
stages add one activation hop per stage boundary; the times below are end-to-end latencies, and the simulator overlaps `pp` batches in flight, splitting each
step with `stage_split` (the driver's serial share, each stage's share, the hop between stages).

A mixed step (chunked prefill: prompt tokens and running decodes in one batch) reads the weights once
for both in the roofline's GEMMs; the regression's terms add up (`mixed_step_time_s`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from placement.catalog import GIB, HardwareArch, ModelArch
from placement.config import Coefficients, LatencySpec
from placement.errors import DoesNotFitError

ACT_BYTES = 2  # activations cross links in 16-bit


@dataclass(frozen=True)
class PipelineSplit:
    """How one step's end-to-end time divides over `pp` stages: `serial_s` on the driver (scheduling and
    sampling, one micro-batch at a time), each stage's share of the rest (layers do not split evenly
    and the last stage also holds the LM head), and a hop (latency + activations) between stages."""

    shares: tuple[float, ...] = (1.0,)
    serial_s: float = 0.0
    hop_s: float = 0.0
    hop_s_per_token: float = 0.0

    @classmethod
    def even(cls, pp: int) -> PipelineSplit:
        return cls(tuple([1.0 / pp] * pp))


def stage_shares(model: ModelArch, pp: int) -> tuple[float, ...]:
    """Share of a step's work per stage: layers split as evenly as they go (the first stages take the
    remainder, like vLLM's partition), the LM head on the last stage."""
    if pp <= 1:
        return (1.0,)
    head = float(model.vocab * model.hidden)
    layer = max(1.0, (model.params - 2 * head) / model.layers)
    base, extra = divmod(model.layers, pp)
    work = [(base + (1 if s < extra else 0)) * layer for s in range(pp)]
    work[-1] += head
    total = sum(work)
    return tuple(w / total for w in work)


@dataclass(frozen=True)
class Terms:
    """Seconds-based coefficients of the two formulas in the module docstring."""

    pa: float = 0.0
    pb: float = 0.0
    p_mem: float = 0.0
    p_fixed: float = 0.0
    p_lin: float = 0.0
    d_mem_c: float = 0.0
    d_mem_a: float = 0.0
    d_comp_b: float = 0.0
    d_comp_a: float = 0.0
    d_fixed: float = 0.0
    d_lin: float = 0.0


class LatencyModel:
    """Latency of one instance (tp x pp GPUs). Build with `from_catalog`, `from_coefficients` or `from_profile`."""

    def __init__(self, terms: Terms, *, tp: int, pp: int, kv_bytes_per_token: int, kv_capacity_tokens: int,
                 same_node_bps: float, cross_node_bps: float, transfer_latency_s: float = 5e-4,
                 label: str = "", shared_weights: bool = False, request_overhead_s: float = 0.0,
                 stages: PipelineSplit | None = None, tokens_per_step: float = 1.0,
                 request_overhead_s_per_token: float = 0.0, request_overhead_s_per_stream: float = 0.0) -> None:
        self.terms = terms
        # NOTE: output tokens per sequence per engine step (1; E under speculative decoding): the decode
        # terms are per output token, so an engine step lasts decode_step_time_s x tokens_per_step.
        self.tokens_per_step = tokens_per_step
        self.tp = tp
        self.pp = pp
        self._kvb = kv_bytes_per_token
        self._kv_cap = kv_capacity_tokens
        self._same_bps = same_node_bps
        self._cross_bps = cross_node_bps
        self.transfer_latency_s = transfer_latency_s
        self.label = label
        self.shared_weights = shared_weights
        self.request_overhead_s = request_overhead_s
        # NOTE: the front-end's share that grows with the prompt (tokenising it, moving it over HTTP and
        # into the engine process): also outside the GPU
        self.request_overhead_s_per_token = request_overhead_s_per_token
        # NOTE: and the share that grows with the requests it already serves: one front-end process
        # detokenises and streams every open request's tokens, and a new request's tokenising and hand-off
        # to the engine wait behind that work (measured vLLM TTFT grows with concurrency even where the
        # GPU queue stays short)
        self.request_overhead_s_per_stream = request_overhead_s_per_stream
        self.stages = stages or PipelineSplit.even(pp)

    def request_overhead(self, prompt_tokens: int, in_flight: float = 0.0) -> float:
        """Front-end time of one request outside the engine (s): a fixed part, one per prompt token and one
        per request already in flight at its front end."""
        return (self.request_overhead_s + self.request_overhead_s_per_token * prompt_tokens
                + self.request_overhead_s_per_stream * in_flight)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def prefill_time_s(self, prompt_lens: Sequence[int]) -> float:
        total = 0
        sq = 0
        for n in prompt_lens:
            total += n
            sq += n * n
        return self.prefill_time_from_sums(total, sq)

    def prefill_time_from_sums(self, total_tokens: float, sum_sq: float) -> float:
        t = self.terms
        if self.shared_weights:  # roofline: attention runs in kernels of its own, after the GEMMs
            return max(t.pa * total_tokens, t.p_mem) + t.pb * sum_sq + t.p_fixed + t.p_lin * total_tokens
        return max(t.pa * total_tokens + t.pb * sum_sq, t.p_mem) + t.p_fixed + t.p_lin * total_tokens

    def decode_step_time_s(self, batch: int, total_context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        t = self.terms
        if self.shared_weights:  # roofline: GEMMs (weights vs FLOPs), then attention (KV reads vs FLOPs)
            attn = max(t.d_mem_a * total_context_tokens, t.d_comp_a * total_context_tokens)
            return max(t.d_mem_c, t.d_comp_b * batch) + attn + t.d_fixed + t.d_lin * batch
        mem = t.d_mem_c + t.d_mem_a * total_context_tokens
        comp = t.d_comp_b * batch + t.d_comp_a * total_context_tokens
        return (mem if mem > comp else comp) + t.d_fixed + t.d_lin * batch

    def mixed_step_time_s(self, prefill_tokens: int, prefill_sum_sq: float, batch: int,
                          total_context_tokens: int) -> float:
        """One engine step holding `prefill_tokens` prompt tokens (chunks; `prefill_sum_sq` is the sum over
        chunks of (done + chunk)^2 - done^2, the causal-attention work) and `batch` decoding sequences."""
        if prefill_tokens <= 0:
            return self.decode_step_time_s(batch, total_context_tokens)
        if batch <= 0:
            return self.prefill_time_from_sums(prefill_tokens, prefill_sum_sq)
        t = self.terms
        if self.shared_weights:
            # roofline: one pass over the weights serves prompt and decode tokens in the GEMMs; attention (the
            # prompt chunks' FLOPs, the decodes' KV reads) runs in kernels of its own, after them
            attn = max(t.d_mem_a * total_context_tokens, t.d_comp_a * total_context_tokens)
            core = max(t.p_mem, t.pa * prefill_tokens + t.d_comp_b * batch) + t.pb * prefill_sum_sq + attn
        else:  # regression: DistServe's prefill and decode terms add up
            core = (t.pa * prefill_tokens + t.pb * prefill_sum_sq + t.d_comp_b * batch + t.d_comp_a *
                    total_context_tokens + t.d_mem_c + t.d_mem_a * total_context_tokens)
        fixed = t.p_fixed if t.p_fixed > t.d_fixed else t.d_fixed
        return core + fixed + t.p_lin * prefill_tokens + t.d_lin * batch

    def stage_split(self, total_s: float, tokens: int) -> tuple[float, list[float], float]:
        """(serial driver time, time in each pipeline stage, hop between stages) of a step whose
        end-to-end latency alone is `total_s`; the parts add up to `total_s`."""
        sp = self.stages
        hop = sp.hop_s + sp.hop_s_per_token * tokens
        serial = min(sp.serial_s, total_s)
        work = max(0.0, total_s - serial - hop * (len(sp.shares) - 1))
        return serial, [work * f for f in sp.shares], hop

    def kv_bytes_per_token(self) -> int:
        return self._kvb

    def kv_capacity_tokens(self) -> int:
        return self._kv_cap

    def kv_transfer_time_s(self, tokens: int, same_node: bool) -> float:
        """KV bytes over NVLink (same node) or the NICs; each of the tp*pp shards moves in parallel."""
        bps = (self._same_bps if same_node else self._cross_bps) * self.gpus
        return self.transfer_latency_s + tokens * self._kvb / bps

    def __repr__(self) -> str:
        return f"LatencyModel({self.label or 'custom'}, tp={self.tp}, pp={self.pp}, kv_cap={self._kv_cap})"

    # ---- constructors -------------------------------------------------------------------------------

    @classmethod
    def from_catalog(cls, model: ModelArch, hardware: HardwareArch, *, tp: int = 1, pp: int = 1,
                     weight_dtype: str = "bf16", kv_dtype: str = "bf16", spec: LatencySpec | None = None,
                     intra_node_gbps: float | None = None, inter_node_gbps: float | None = None,
                     gpus_per_node: int | None = None) -> LatencyModel:
        """Roofline model, or DistServe regression when `spec.coefficients` is set (missing TPs derived)."""
        spec = spec or LatencySpec()
        if spec.calibration:
            from placement.calibration import calibrated_spec

            spec = calibrated_spec(spec, hardware.name, weight_dtype)
        if tp < 1 or pp < 1:
            raise DoesNotFitError(f"tp={tp}, pp={pp}: both must be >= 1")
        kvb = model.kv_bytes_per_token(kv_dtype)
        wbytes = model.weight_bytes(weight_dtype)
        per_gpu_free = hardware.hbm_gib * GIB * spec.mem_utilization - wbytes / (tp * pp) - spec.reserve_gib * GIB
        capacity = int(per_gpu_free * tp * pp // kvb) if per_gpu_free > 0 else 0
        nvlink = (intra_node_gbps or hardware.nvlink_gbps) * 1e9 * spec.link_efficiency
        nic = (inter_node_gbps or hardware.nic_gbps) * 1e9 * spec.link_efficiency
        hbm = hardware.hbm_tbps * 1e12 * spec.memory_efficiency
        e = spec.tp_efficiency ** math.log2(tp) if tp > 1 else 1.0
        gpn = gpus_per_node or hardware.gpus_per_node
        # Ring all-reduce after attention and after the MLP in every layer.
        ar_us = hardware.allreduce_latency_us if spec.allreduce_latency_us is None else spec.allreduce_latency_us
        ar_fixed = 2 * model.layers * ar_us * 1e-6 if tp > 1 else 0.0

        def ring_tok(k: int) -> float:  # two ring all-reduces per layer, per token, at TP k (0 at k = 1)
            return 2 * model.layers * 2 * (k - 1) / k * model.hidden * ACT_BYTES / nvlink

        ar_tok = ring_tok(tp)
        hop_bps = nvlink if tp * pp <= gpn else nic
        pp_fixed = (pp - 1) * spec.pp_hop_latency_ms / 1000.0
        pp_tok = (pp - 1) * model.hidden * ACT_BYTES / hop_bps
        serial = spec.step_overhead_ms / 1000.0
        if spec.coefficients:
            coeffs = spec.coefficients
            # NOTE: a TP not measured is derived from the nearest measured one below it (the smallest where
            # none is below): the measured TPs carry the engine's own scaling, which TP1 alone does not show
            base = max((k for k in coeffs if k <= tp), default=min(coeffs))
            cb = coeffs[base]
            w_share = min(0.95, wbytes / base / hbm / (cb.decode_c / 1000.0)) if cb.decode_c else 0.0
            # NOTE: the constant's share that is not weight streaming (launch, scheduling, sampling) is paid
            # once per step on the driver, whatever the TP or PP.
            serial = (1.0 - w_share) * cb.decode_c / 1000.0
            if tp == base:
                terms = _regression_terms(cb, 1, 1.0, 0.0)
            else:
                r = tp / base
                terms = _regression_terms(cb, r, spec.tp_efficiency ** math.log2(r), w_share)
                # the all-reduces the base TP does not already pay (all of them from TP1)
                terms = _add(terms, ar_fixed if base == 1 else 0.0, ring_tok(tp) - ring_tok(base))
            label = f"{model.name}@{hardware.name} regression"
        else:
            peak = hardware.peak_flops(hardware.compute_dtype(weight_dtype)) * spec.compute_efficiency * tp * e
            # NOTE: attention multiplies activations by activations (and a cache dequantised to 16 bits):
            # it runs at the 16-bit peak whatever the weights' dtype
            apeak = hardware.peak_flops(hardware.compute_dtype("bf16")) * spec.compute_efficiency * tp * e
            over = spec.step_overhead_ms / 1000.0 + model.layers * spec.layer_overhead_us * 1e-6
            terms = Terms(
                pa=model.layer_flops_per_token() / peak,
                pb=model.attention_flops(1.0) / apeak,
                p_mem=wbytes / (tp * hbm),
                p_fixed=over + ar_fixed,
                p_lin=ar_tok,
                d_mem_c=wbytes / (tp * hbm),
                d_mem_a=kvb / (tp * hbm),
                d_comp_b=model.linear_flops_per_token() / peak,
                d_comp_a=model.decode_attention_flops(1.0) / apeak,
                d_fixed=over + ar_fixed,
                d_lin=ar_tok,
            )
            label = f"{model.name}@{hardware.name} roofline"
        terms = _add(terms, pp_fixed, pp_tok)
        roofline = not spec.coefficients
        split = PipelineSplit(stage_shares(model, pp), serial if pp > 1 else 0.0, spec.pp_hop_latency_ms / 1000.0,
                              model.hidden * ACT_BYTES / hop_bps)
        return cls(terms, tp=tp, pp=pp, kv_bytes_per_token=kvb, kv_capacity_tokens=capacity,
                   same_node_bps=nvlink, cross_node_bps=nic, label=f"{label} tp{tp} pp{pp}",
                   shared_weights=roofline, request_overhead_s=spec.ttft_overhead_ms / 1000.0, stages=split,
                   request_overhead_s_per_token=spec.ttft_overhead_us_per_token * 1e-6,
                   request_overhead_s_per_stream=spec.ttft_overhead_us_per_stream * 1e-6)

    @classmethod
    def from_coefficients(cls, coeffs: Coefficients, *, kv_bytes_per_token: int, kv_capacity_tokens: int,
                          same_node_gbps: float = 300.0, cross_node_gbps: float = 25.0,
                          transfer_latency_s: float = 5e-4) -> LatencyModel:
        """One instance exactly as DistServe's regression describes it (coefficients in ms)."""
        return cls(_regression_terms(coeffs, 1, 1.0, 0.0), tp=1, pp=1, kv_bytes_per_token=kv_bytes_per_token,
                   kv_capacity_tokens=kv_capacity_tokens, same_node_bps=same_node_gbps * 1e9,
                   cross_node_bps=cross_node_gbps * 1e9, transfer_latency_s=transfer_latency_s,
                   label="regression")

    def refitted(self, coeffs: Coefficients, label: str) -> LatencyModel:
        """This instance with its compute terms replaced by DistServe coefficients measured on the instance
        itself (at its own tp: no scaling); KV size, capacity and network stay."""
        return self._derived(_regression_terms(coeffs, 1, 1.0, 0.0), label, shared_weights=False, stages=None,
                             tokens_per_step=1.0)

    def with_speculation(self, k: int, acceptance: float) -> LatencyModel:
        """Decode with `k` draft tokens per step accepted independently with probability `acceptance`
        (Leviathan et al.): each step verifies k+1 tokens per sequence (the per-sequence and per-token
        compute terms grow k+1 times; weights and KV are read once) and yields E = (1 - a^(k+1)) / (1 - a)
        tokens on average. The model's decode step becomes that step's time / E: one step per output token,
        as the simulator counts (`tokens_per_step` = E says how long the engine's own step is). Prefill is
        unchanged. NOTE: n-gram proposals cost no model time."""
        a = min(max(acceptance, 0.0), 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        t, v = self.terms, k + 1
        d = {"d_mem_c": t.d_mem_c / tokens, "d_mem_a": t.d_mem_a / tokens, "d_comp_b": t.d_comp_b * v / tokens,
             "d_comp_a": t.d_comp_a * v / tokens, "d_fixed": t.d_fixed / tokens, "d_lin": t.d_lin * v / tokens}
        p = {f: getattr(t, f) for f in ("pa", "pb", "p_mem", "p_fixed", "p_lin")}
        return self._derived(Terms(**p, **d), f"{self.label} spec{k}@{a:.2f}", tokens_per_step=tokens)

    def with_prefix_hits(self, rate: float) -> LatencyModel:
        """Prefill when a share `rate` of every prompt's tokens is already in the prefix cache (a cached
        prefix is not computed again): the per-token GEMM and link terms shrink by (1 - rate), attention by
        (1 - rate^2) (the new tokens still attend to the cached ones); the weights' pass, fixed costs,
        the front-end and decode stay."""
        h = min(max(rate, 0.0), 0.95)
        if h == 0.0:
            return self
        t = self.terms
        terms = Terms(t.pa * (1 - h), t.pb * (1 - h * h), t.p_mem, t.p_fixed, t.p_lin * (1 - h), t.d_mem_c,
                      t.d_mem_a, t.d_comp_b, t.d_comp_a, t.d_fixed, t.d_lin)
        return self._derived(terms, f"{self.label} hits{h:.2f}")

    def scaled(self, prefill_k: float, decode_k: float) -> LatencyModel:
        """This instance with every prefill time multiplied by `prefill_k` and every decode step by
        `decode_k` (an online correction, or a machine slower than its model)."""
        t = self.terms
        p = {f: getattr(t, f) * prefill_k for f in ("pa", "pb", "p_mem", "p_fixed", "p_lin")}
        d = {f: getattr(t, f) * decode_k for f in ("d_mem_c", "d_mem_a", "d_comp_b", "d_comp_a", "d_fixed", "d_lin")}
        return self._derived(Terms(**p, **d), f"{self.label} x{prefill_k:.3g}/{decode_k:.3g}",
                             request_overhead_s=self.request_overhead_s * prefill_k,
                             request_overhead_s_per_token=self.request_overhead_s_per_token * prefill_k,
                             request_overhead_s_per_stream=self.request_overhead_s_per_stream * prefill_k)

    def _derived(self, terms: Terms, label: str, **changed: object) -> LatencyModel:
        """This instance with other terms and label (KV size, capacity, links, front-end, pipeline and tokens
        per step kept unless `changed` names them)."""
        kw: dict[str, object] = dict(
            tp=self.tp, pp=self.pp, kv_bytes_per_token=self._kvb, kv_capacity_tokens=self._kv_cap,
            same_node_bps=self._same_bps, cross_node_bps=self._cross_bps, transfer_latency_s=self.transfer_latency_s,
            shared_weights=self.shared_weights, request_overhead_s=self.request_overhead_s, stages=self.stages,
            tokens_per_step=self.tokens_per_step, request_overhead_s_per_token=self.request_overhead_s_per_token,
            request_overhead_s_per_stream=self.request_overhead_s_per_stream)
        kw.update(changed)
        return LatencyModel(terms, label=label, **kw)  # type: ignore[arg-type]

    @classmethod
    def from_profile(cls, path: str | Path) -> LatencyModel:
        """The model measured by `python -m benchmarks.profile` (see placement.profile_io)."""
        from placement.profile_io import load_profile

        prof = load_profile(path)
        return cls(_regression_terms(prof.coefficients, 1, 1.0, 0.0), tp=prof.engine.tp, pp=1,
                   kv_bytes_per_token=prof.kv_bytes_per_token, kv_capacity_tokens=prof.kv_capacity_tokens,
                   same_node_bps=prof.transfer.same_node_gbps * 1e9,
                   cross_node_bps=prof.transfer.cross_node_gbps * 1e9,
                   transfer_latency_s=prof.transfer.latency_ms / 1000.0, label=f"profile {prof.model.name}")


def _regression_terms(c: Coefficients, tp: float, e: float, weight_share: float) -> Terms:
    """DistServe coefficients (ms) measured at one TP, scaled to `tp` times as many GPUs (module docstring)."""
    k = tp * e
    const_scale = weight_share / tp + (1.0 - weight_share)
    return Terms(pa=c.prefill_a / 1e3 / k, pb=c.prefill_b / 1e3 / k, p_fixed=c.prefill_c / 1e3 * const_scale,
                 d_mem_a=c.decode_a / 1e3 / k, d_lin=c.decode_b / 1e3 / k, d_fixed=c.decode_c / 1e3 * const_scale)


def _add(t: Terms, fixed: float, per_token: float) -> Terms:
    return Terms(t.pa, t.pb, t.p_mem, t.p_fixed + fixed, t.p_lin + per_token, t.d_mem_c, t.d_mem_a, t.d_comp_b,
                 t.d_comp_a, t.d_fixed + fixed, t.d_lin + per_token)
