"""engine/quantize.py: the W8A8 checkpoint vLLM's compressed-tensors loader reads (round to nearest, one
scale per output channel), written from a real local model."""

from __future__ import annotations

import json

import pytest
import torch

from engine import quantize


def test_rows_round_to_nearest_within_half_a_step_per_channel():
    torch.manual_seed(0)
    w = torch.randn(16, 64) * torch.linspace(0.01, 3.0, 16)[:, None]  # NOTE: rows of very different ranges
    q, scale = quantize.quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (16, 1)
    assert q.abs().max() == 127 and (q.abs().amax(dim=1) == 127).all()  # each row uses its whole range
    err = (q.float() * scale - w).abs()
    assert (err <= scale / 2 + 1e-6).all()


def test_only_the_decoder_linears_are_quantized():
    assert quantize.is_linear("model.layers.3.self_attn.q_proj.weight")
    assert quantize.is_linear("model.layers.0.mlp.down_proj.weight")
    for name in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight",
                 "model.norm.weight", "model.layers.0.mlp.down_proj.bias"):
        assert not quantize.is_linear(name)


def test_write_w8a8_from_a_real_model_directory(tmp_path):
    from safetensors.torch import load_file

    from engine.checkpoints import prepare_tiny_llama

    src = prepare_tiny_llama()
    counts = quantize.write_w8a8(src, tmp_path)
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert counts["quantized"] == 2 * 7 and counts["kept"] == len(before) - 14  # 2 layers x 7 linears
    for name, t in before.items():
        if quantize.is_linear(name):
            q, s = after[name], after[name.replace(".weight", ".weight_scale")]
            assert q.dtype == torch.int8 and q.shape == t.shape and s.shape == (t.shape[0], 1)
            assert torch.allclose(q.float() * s, t.float(), atol=float(s.max()) / 2 + 1e-6)
        else:
            assert torch.equal(after[name], t)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
    assert (tmp_path / "tokenizer.json").is_file() and not (tmp_path / "saaf-manifest.json").exists()


def test_a_directory_without_linears_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file

    from engine.checkpoints import ModelError

    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.norm.weight": torch.ones(4)}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    (tmp_path / "dst").mkdir()
    with pytest.raises(ModelError, match="no linear layer"):
        quantize.write_w8a8(src, tmp_path / "dst")
