"""An int8 W8A8 checkpoint of the bundled SmolLM2, written locally (nothing downloaded), in the
compressed-tensors format vLLM loads: every linear layer of the decoder's blocks round-to-nearest to int8
with one scale per output channel (symmetric), activations quantized per token at run time (dynamic);
embeddings, norms and the tied LM head stay fp32.

    engine.model: smollm2-w8a8      (engine.models resolves it; prepared once into the cache, ~10 s)

NOTE: round-to-nearest, no calibration data (GPTQ/SmoothQuant would need llm-compressor and a dataset):
the simplest quantizer, so the accuracy it loses is an upper bound of what a careful one loses. vLLM's
CPU int8 GEMM (oneDNN, `CPUInt8ScaledMMLinearKernel`) runs it; FP8 on CPU needs AMX, which these boxes
lack. Our code, not llm-compressor's: that package is not installed and would pull a training stack."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from engine import checkpoints

logger = logging.getLogger(__name__)

QUANT_VERSION = 1
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True},
    }},
}


def is_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEAR


def quantize_rows(w):
    """(int8 weight, fp32 scale of shape [rows, 1]): per output channel, symmetric, round to nearest."""
    import torch

    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def write_w8a8(src: Path, dst: Path) -> dict[str, int]:
    """Quantize `src` (a local fp16/fp32 HF Llama directory) into `dst` (written whole: the caller renames
    a temporary folder into place). Returns {"quantized": n, "kept": m} tensor counts."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    out, counts = {}, {"quantized": 0, "kept": 0}
    for name, t in tensors.items():
        if is_linear(name):
            out[name], out[name[: -len("weight")] + "weight_scale"] = quantize_rows(t)
            counts["quantized"] += 1
        else:
            out[name] = t.contiguous()
            counts["kept"] += 1
    if not counts["quantized"]:
        raise checkpoints.ModelError(f"{src}: no linear layer ({', '.join(LINEAR)}) to quantize")
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json", checkpoints.MANIFEST):
            shutil.copy2(f, dst / f.name)
    return counts


def prepare_smollm2_w8a8() -> Path:
    """The bundled model's W8A8 copy in the cache; a no-op when already intact."""
    src = checkpoints.prepare_smollm2()
    source = {"from": src.name, "quant_version": QUANT_VERSION, "scheme": "w8a8-int8-rtn-channel-token"}
    dest = checkpoints.cache_dir() / "SmolLM2-135M-Instruct-W8A8"
    if checkpoints.intact(dest, source):
        return dest
    with checkpoints.prepare_lock():
        if checkpoints.intact(dest, source):
            return dest
        t0 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=".w8a8-", dir=dest.parent))
        try:
            counts = write_w8a8(src, tmp)
            out = checkpoints.publish(tmp, dest, source)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("W8A8 copy of the bundled model ready at %s in %.1fs (%s)", dest,
                           time.monotonic() - t0, counts)
        return out
