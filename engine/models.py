"""Which model a spec names: the bundled SmolLM2, its int8 W8A8 copy, a tiny random Llama for tests, or any
local Hugging Face-format directory; the name clients use for it. Preparing a bundled one into the cache is
engine/checkpoints.py's (engine/quantize.py's for the W8A8 copy).
"""

from __future__ import annotations

from pathlib import Path

from engine.checkpoints import ModelError, prepare_smollm2, prepare_tiny_llama
from engine.quantize import prepare_smollm2_w8a8

BUNDLED = "smollm2"
TINY = "tiny-llama"
BUNDLED_W8A8 = "smollm2-w8a8"  # engine/quantize.py
ALIASES = {
    "smollm2": BUNDLED,
    "smollm2-135m": BUNDLED,
    "smollm2-135m-instruct": BUNDLED,
    "bundled": BUNDLED,
    "tiny-llama": TINY,
    "tiny": TINY,
    "smollm2-w8a8": BUNDLED_W8A8,
}


# (attention heads, KV heads) of the bundled models, known before they are prepared
HEADS = {BUNDLED: (9, 3), BUNDLED_W8A8: (9, 3), TINY: (4, 2)}


def served_name(spec: str) -> str:
    """The model name clients use in requests (OpenAI ``model`` field)."""
    canonical = ALIASES.get(spec.lower())
    if canonical == BUNDLED:
        return "SmolLM2-135M-Instruct"
    if canonical == TINY:
        return "tiny-llama"
    if canonical == BUNDLED_W8A8:
        return "SmolLM2-135M-Instruct-W8A8"
    return Path(spec).name


def resolve_model(spec: str) -> Path:
    """Return a local HF-format model directory for ``spec``, preparing it if needed."""
    canonical = ALIASES.get(spec.lower())
    if canonical == BUNDLED:
        return prepare_smollm2()
    if canonical == TINY:
        return prepare_tiny_llama()
    if canonical == BUNDLED_W8A8:
        return prepare_smollm2_w8a8()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelError(
            f"model {spec!r}: no such directory. Give a local Hugging Face model directory "
            f"(with config.json) or one of: {', '.join(sorted(ALIASES))}"
        )
    if not (path / "config.json").is_file():
        raise ModelError(f"model {spec!r}: {path}/config.json is missing; is this a Hugging Face model dir?")
    return path.resolve()
