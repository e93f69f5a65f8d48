"""Model preparation: prepared copies are reused when intact and rebuilt when damaged."""

from __future__ import annotations

import pytest

from engine import checkpoints, models


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SAAF_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One tiny-llama build for the module (~8 s each); tests copy it into their own cache."""
    root = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SAAF_CACHE_DIR", str(root))
        models.resolve_model("tiny-llama")
    return root


@pytest.fixture()
def cache_with_tiny(cache, built):
    import shutil

    shutil.copytree(built, cache, dirs_exist_ok=True)
    return cache


def test_tiny_llama_is_built_once_and_reused(cache_with_tiny):
    first = models.resolve_model("tiny-llama")
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = models.resolve_model("tiny")
    assert again == first
    assert weights.stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_damaged_copy_is_rebuilt(cache_with_tiny):
    first = models.resolve_model("tiny-llama")
    weights = first / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    models.resolve_model("tiny-llama")
    assert weights.stat().st_size == size


def test_tiny_llama_is_deterministic(cache_with_tiny, tmp_path_factory, monkeypatch):
    a = (models.resolve_model("tiny-llama") / "model.safetensors").read_bytes()
    monkeypatch.setenv("SAAF_CACHE_DIR", str(tmp_path_factory.mktemp("other")))
    b = (models.resolve_model("tiny-llama") / "model.safetensors").read_bytes()
    assert a == b


def test_smollm2_manifest_matches_what_prepare_expects(cache):
    """The intact-check compares the manifest's source with what prepare_smollm2 expects; a mismatch
    re-converts the model on every call (a bug this test reproduces by checking the source dict)."""
    src = {"gguf": checkpoints.GGUF_NAME, "size": checkpoints.GGUF_SIZE, "sha256": checkpoints.GGUF_SHA256, "dtype": "float32"}
    folder = cache / "x"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"123")
    import shutil
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp(dir=cache))
    shutil.copy(folder / "a.bin", tmp / "a.bin")
    out = checkpoints.publish(tmp, cache / "published", src)
    assert checkpoints.intact(out, src)
    assert not checkpoints.intact(out, dict(src, sha256="0" * 64))


def test_unknown_model_names_the_choices(cache, tmp_path):
    with pytest.raises(checkpoints.ModelError, match="tiny-llama"):
        models.resolve_model("no-such-model")
    (tmp_path / "m").mkdir()
    with pytest.raises(checkpoints.ModelError, match="config.json"):
        models.resolve_model(str(tmp_path / "m"))


def test_served_names():
    assert models.served_name("smollm2") == "SmolLM2-135M-Instruct"
    assert models.served_name("/a/b/My-Model") == "My-Model"
