"""vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`) as a reference in tests:
started on 127.0.0.1 with a free port and our CPU engine settings, stopped by PID (SIGINT, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from kvtransfer.config import free_port

REPO = Path(__file__).resolve().parents[2]
HEALTH_TIMEOUT_S = 300.0
# NOTE: the same per-process settings our CPU engines get (engine/config.py), so greedy numerics match.
CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_HOST_IP": "127.0.0.1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}


class ServerFailed(RuntimeError):
    pass


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@contextlib.contextmanager
def vllm_server(model_dir: str | Path, name: str, log_path: Path, *, max_model_len: int = 1024,
                kv_cache_mib: int = 128, extra: list[str] | None = None) -> Iterator[str]:
    """Yields the server's base URL once /health answers 200 (bounded); stops it on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--enforce-eager", "--distributed-executor-backend", "uni", "--max-model-len", str(max_model_len),
           "--kv-cache-memory-bytes",
           str(kv_cache_mib << 20), *(extra or [])]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=os.environ | CPU_ENV, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise ServerFailed(f"vLLM server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerFailed(f"vLLM server not healthy in {HEALTH_TIMEOUT_S:.0f} s:\n"
                                   f"{log_path.read_text()[-3000:]}")
            time.sleep(1.0)
        yield url
    finally:
        _stop(proc)
