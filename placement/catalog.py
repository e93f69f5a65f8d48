"""Model and hardware catalogs, and reading a model's shape from a Hugging Face `config.json`.

Numbers are public spec-sheet values: dense (no sparsity) peak tensor FLOPS per dtype, HBM size and
bandwidth, NVLink bandwidth per GPU per direction, NIC bandwidth per GPU. Unknown names raise
`UnknownNameError` listing the supported ones. `fp4` is NVFP4: 4-bit values plus one fp8 scale per 16,
so 4.5 bits per weight.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from placement.errors import PlacementError, UnknownNameError

logger = logging.getLogger(__name__)

# NOTE: int8 = W8A8 (per-channel scales, negligible); int4 = weight-only 4-bit with a 16-bit scale and zero
# point per group of 128 (GPTQ/AWQ), whose matmuls run at the 16-bit peak (no int4 tensor-core path in vLLM).
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp4": 0.5625, "int8": 1, "int4": 0.53}
GIB = 1024**3


# vLLM quantization methods whose weight format the method's name alone fixes.
QUANT_METHOD_DTYPE = {"fp8": "fp8", "modelopt": "fp8", "modelopt_fp4": "fp4", "awq": "int4", "awq_marlin": "int4",
                      "gptq": "int4", "gptq_marlin": "int4"}


def weight_dtype_of(quantization: str | None, quant_config: dict | None = None) -> str | None:
    """The planner's weight dtype for an engine's vLLM ``quantization`` (or, when that is unset, the
    checkpoint's ``quantization_config`` from its config.json); None when neither says (unquantized or a
    scheme the planner has no dtype for)."""
    method = quantization or (quant_config or {}).get("quant_method")
    if method in QUANT_METHOD_DTYPE:
        return QUANT_METHOD_DTYPE[method]
    if method != "compressed-tensors":
        return None
    bits = set()
    for group in ((quant_config or {}).get("config_groups") or {}).values():
        w = group.get("weights") or {}
        acts = group.get("input_activations")
        bits.add((w.get("type"), w.get("num_bits"), bool(acts)))
    if len(bits) != 1:
        return None
    kind, nbits, w_and_a = bits.pop()
    if kind == "float" and nbits == 8:
        return "fp8"
    if kind == "int" and nbits == 8:
        return "int8" if w_and_a else None
    if kind == "int" and nbits == 4:
        return "int4"
    return None


def dtype_bytes(dtype: str) -> float:
    if dtype not in DTYPE_BYTES:
        raise UnknownNameError("dtype", dtype, list(DTYPE_BYTES))
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelArch:
    """The shape of a decoder-only transformer, enough for FLOP, byte and KV-size arithmetic."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    params: int
    max_context: int
    gated_ffn: bool = True
    tied_embeddings: bool = False  # the LM head is the input embedding (counted once in `params`)

    def weight_bytes(self, weight_dtype: str) -> int:
        return int(self.params * dtype_bytes(weight_dtype))

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """K and V for every layer, all tensor-parallel shards together."""
        return int(2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes(kv_dtype))

    def layer_flops_per_token(self) -> float:
        """2 FLOPs per weight per token in the transformer layers (no embedding, no LM head): what a prompt
        token costs, since the engine computes logits for each prompt's last token only."""
        return 2.0 * (self.params - self.vocab * self.hidden * (1 if self.tied_embeddings else 2))

    def linear_flops_per_token(self) -> float:
        """2 FLOPs per weight per generated token: the layers and the LM head."""
        return self.layer_flops_per_token() + 2.0 * self.vocab * self.hidden

    def attention_flops(self, sum_sq_len: float) -> float:
        """QK^T and PV over a causal prompt: 2 matmuls x 2 FLOPs x heads*head_dim x l^2/2 per layer."""
        return 2.0 * self.layers * self.heads * self.head_dim * sum_sq_len

    def decode_attention_flops(self, total_context: float) -> float:
        return 4.0 * self.layers * self.heads * self.head_dim * total_context


@dataclass(frozen=True)
class HardwareArch:
    """One accelerator type as sold in an 8-GPU (or N-GPU) node."""

    name: str
    peak_tflops: dict[str, float]
    hbm_gib: float
    hbm_tbps: float
    nvlink_gbps: float
    nic_gbps: float
    gpus_per_node: int
    allreduce_latency_us: float = 10.0
    gpu_hour_usd: float = 2.0

    def compute_dtype(self, weight_dtype: str) -> str:
        """The tensor-core dtype the matmuls run in: the weights' own where the chip has it, else bf16."""
        return weight_dtype if weight_dtype in self.peak_tflops else "bf16"

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak_tflops:
            raise PlacementError(
                f"hardware {self.name!r} has no {dtype} tensor throughput; use one of {sorted(self.peak_tflops)}"
            )
        return self.peak_tflops[dtype] * 1e12


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, params: float,
           ctx: int, head_dim: int = 128, tied: bool = False) -> ModelArch:
    return ModelArch(name, layers, hidden, heads, kv, head_dim, ffn, vocab, int(params), ctx, True, tied)


def _opt(name: str, layers: int, hidden: int, params: float) -> ModelArch:
    heads = hidden // 128
    return ModelArch(name, layers, hidden, heads, heads, 128, 4 * hidden, 50272, int(params), 2048, False, True)


MODELS: dict[str, ModelArch] = {
    m.name: m
    for m in (
        _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 8.03e9, 131072),
        _llama("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, 70.55e9, 131072),
        _llama("qwen3-32b", 64, 5120, 64, 8, 25600, 151936, 32.76e9, 40960),
        _llama("smollm2-135m", 30, 576, 9, 3, 1536, 49152, 134.5e6, 8192, head_dim=64, tied=True),
        _opt("opt-13b", 40, 5120, 12.85e9),
        _opt("opt-66b", 64, 9216, 65.7e9),
        _opt("opt-175b", 96, 12288, 174.6e9),
    )
}

HARDWARE: dict[str, HardwareArch] = {
    h.name: h
    for h in (
        # NOTE: A100 has no FP8 tensor cores; fp8 weights on A100 are dequantised to fp16 for the matmul.
        # INT8 tensor cores (dense TOPS) where the chip has them: W8A8 int8 weights compute there.
        HardwareArch("a100-80gb", {"fp32": 19.5, "bf16": 312, "fp16": 312, "fp8": 312, "int8": 624}, 80, 2.039, 300,
                     25, 8, gpu_hour_usd=1.8),
        HardwareArch("h100-sxm", {"fp32": 67, "bf16": 989, "fp16": 989, "fp8": 1979, "int8": 1979}, 80, 3.35, 450, 50,
                     8, gpu_hour_usd=3.0),
        HardwareArch("h200", {"fp32": 67, "bf16": 989, "fp16": 989, "fp8": 1979, "int8": 1979}, 141 * 1e9 / GIB, 4.8,
                     450, 50, 8, gpu_hour_usd=3.8),
        # Blackwell, per GPU, dense: NVIDIA HGX B200 / HGX B300 and GB200 / GB300 NVL72 datasheets (8-GPU
        # HGX figures and 72-GPU rack figures divided by the GPU count; sparsity halved away). NVLink 5 is
        # 1.8 TB/s per GPU in both directions, 900 GB/s each way. A GB200/GB300 "node" here is the
        # 72-GPU NVLink domain of one NVL72 rack.
        HardwareArch("b200", {"fp32": 80, "bf16": 2250, "fp16": 2250, "fp8": 4500, "fp4": 9000, "int8": 4500},
                     180 * 1e9 / GIB, 8.0, 900, 50, 8, gpu_hour_usd=5.5),
        # NOTE: no int8 entry for B300/GB300 (Blackwell Ultra cut INT8 throughput and we hold no datasheet
        # figure): int8 weights are planned at the 16-bit peak there.
        HardwareArch("b300", {"fp32": 75, "bf16": 2250, "fp16": 2250, "fp8": 4500, "fp4": 13500},
                     288 * 1e9 / GIB, 8.0, 900, 100, 8, gpu_hour_usd=7.0),
        HardwareArch("gb200", {"fp32": 80, "bf16": 2500, "fp16": 2500, "fp8": 5000, "fp4": 10000, "int8": 5000},
                     186 * 1e9 / GIB, 8.0, 900, 50, 72, gpu_hour_usd=6.5),
        HardwareArch("gb300", {"fp32": 75, "bf16": 2500, "fp16": 2500, "fp8": 5000, "fp4": 15000},
                     288 * 1e9 / GIB, 8.0, 900, 100, 72, gpu_hour_usd=8.0),
    )
}


def get_model(name: str) -> ModelArch:
    if name in MODELS:
        return MODELS[name]
    path = Path(name)
    if path.name == "config.json" or (path.is_dir() and (path / "config.json").is_file()):
        return model_from_hf_config(path)
    raise UnknownNameError("model", name, [*MODELS, "<path to an HF config.json>"])


def get_hardware(name: str) -> HardwareArch:
    if name not in HARDWARE:
        raise UnknownNameError("hardware", name, list(HARDWARE))
    return HARDWARE[name]


def model_from_hf_config(path: str | Path) -> ModelArch:
    """Read layers, widths, heads and vocab from an HF `config.json` (a file or a model folder)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PlacementError(f"model config {str(p)!r} does not exist; give a catalog name or an HF config.json")
    cfg = json.loads(p.read_text())
    try:
        layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
    except KeyError as exc:
        raise PlacementError(f"{p}: missing key {exc.args[0]!r}; is this a decoder-only HF config?") from exc
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    ffn = int(cfg.get("intermediate_size") or cfg.get("ffn_dim") or 4 * hidden)
    vocab = int(cfg.get("vocab_size", 32000))
    gated = str(cfg.get("hidden_act", cfg.get("activation_function", "silu"))) in ("silu", "swiglu", "gelu_glu")
    tied = bool(cfg.get("tie_word_embeddings", False))
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    mlp = (3 if gated else 2) * hidden * ffn
    params = vocab * hidden * (1 if tied else 2) + layers * (attn + mlp)
    ctx = int(cfg.get("max_position_embeddings", 4096))
    name = str(cfg.get("_name_or_path") or p.parent.name)
    logger.debug("model %s from %s: %d layers, %.3g params", name, p, layers, params)
    return ModelArch(name, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, params, ctx, gated, tied)


def with_overrides(hw: HardwareArch, **fields: float | int | None) -> HardwareArch:
    """A copy of `hw` with the given non-None fields replaced (cluster-level link speeds, prices)."""
    return replace(hw, **{k: v for k, v in fields.items() if v is not None})  # type: ignore[arg-type]
