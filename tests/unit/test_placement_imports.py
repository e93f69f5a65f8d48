"""placement.catalog and placement.roofline import without pydantic or PyYAML (the GPU box has neither),
while `from placement import X` keeps working for every public name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import placement

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
for name in ("pydantic", "yaml"):
    sys.modules[name] = None  # importing them now raises ImportError
from placement.catalog import get_hardware, get_model
from placement.roofline import decode_roofline
(p,) = decode_roofline(get_model("llama-3.1-8b"), get_hardware("h200"), gpus=1, weight_dtype="bf16",
                       kv_dtype="bf16", context=1024, batches=[1])
print(round(p.tpot_s * 1e3, 3))
"""


def test_catalog_and_roofline_need_neither_pydantic_nor_yaml() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout.strip()) > 3.0  # 16 GB of weights at 4.8 TB/s


def test_every_public_name_resolves() -> None:
    for name in placement.__all__:
        assert getattr(placement, name) is not None, name
    assert set(placement.__all__) <= set(dir(placement))
    assert placement.catalog.get_model("llama-3.1-8b").layers == 32  # submodules stay attributes
