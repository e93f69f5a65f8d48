"""Device ceilings for `benchmarks.gpu_nixl`: memory bandwidth, bf16 matmul rate, a decode-step matmul chain.

Same code on CUDA and on CPU (where it measures DRAM and the CPU's bf16 GEMM, so the suite can run it).
The functions allocate their own buffers; call `free_memory` after each. On CUDA, times come from CUDA events around each call; on CPU, from perf_counter. Medians over repeats
after warm-up calls. Bandwidths in TB/s = 1e12 B/s; a copy counts its bytes read plus written.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from placement.catalog import HardwareArch, ModelArch
from placement.roofline import decode_roofline


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds per call of `fn`, `repeats` timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    out: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def free_memory(device: torch.device) -> None:
    """Give cached CUDA memory back (call after a measurement returns, so the NIXL children have it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure_memory(device: torch.device, nbytes: int, repeats: int, catalog: HardwareArch) -> dict[str, Any]:
    """Copy (read + write), read-only (a sum) and write-only (a fill) bandwidth over `nbytes` buffers."""
    nbytes -= nbytes % 8
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    a.fill_(1)  # NOTE: read as float32 that is 2.4e-38, a normal number: no denormal slow path on CPUs
    b = torch.empty_like(a)
    copy = statistics.median(timed(lambda: b.copy_(a), device, repeats))
    words = a.view(torch.float32)
    read = statistics.median(timed(lambda: words.sum(), device, repeats))
    write = statistics.median(timed(lambda: b.fill_(7), device, repeats))
    copy_tbps = 2 * nbytes / copy / 1e12
    return {
        "buffer_bytes": nbytes,
        "copy_rw_tbps": copy_tbps,
        "read_tbps": nbytes / read / 1e12,
        "write_tbps": nbytes / write / 1e12,
        "catalog_tbps": catalog.hbm_tbps,
        "copy_vs_catalog": copy_tbps / catalog.hbm_tbps,
    }


def measure_matmul(device: torch.device, n: int, repeats: int, catalog: HardwareArch) -> dict[str, Any]:
    """bf16 n x n x n matrix product on random data."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device, generator=gen)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device, generator=gen)
    seconds = timed(lambda: a @ b, device, repeats, warmup=3)
    tflops = 2 * n**3 / statistics.median(seconds) / 1e12
    peak = catalog.peak_tflops["bf16"]
    return {
        "n": n,
        "dtype": "bf16",
        "tflops": tflops,
        "best_tflops": 2 * n**3 / min(seconds) / 1e12,
        "catalog_tflops": peak,
        "vs_catalog": tflops / peak,
    }


class DecodeChain:
    """The linear layers of one decode step, vLLM's fused shapes: per layer qkv, o, gate_up, down; lm_head.

    Attention itself, norms and activations are left out: this is the weight-streaming part the
    roofline's memory term describes. Every layer has its own weights, so nothing stays in L2.
    """

    def __init__(self, model: ModelArch, device: torch.device, layers: int | None = None) -> None:
        self.model = model
        self.layers = model.layers if layers is None else min(layers, model.layers)
        q, kv, h, f = model.heads * model.head_dim, model.kv_heads * model.head_dim, model.hidden, model.ffn
        up = 2 * f if model.gated_ffn else f
        gen = torch.Generator(device=device).manual_seed(1)

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.empty(rows, cols, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen)

        self.blocks = [(weight(q + 2 * kv, h), weight(h, q), weight(up, h), weight(h, f)) for _ in range(self.layers)]
        self.lm_head = weight(model.vocab, h)
        self.q, self.f = q, f

    @property
    def weight_bytes(self) -> int:
        return 2 * (sum(w.numel() for blk in self.blocks for w in blk) + self.lm_head.numel())

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for w_qkv, w_o, w_up, w_down in self.blocks:
            x = F.linear(F.linear(x, w_qkv)[:, : self.q], w_o)
            x = F.linear(F.linear(x, w_up)[:, : self.f], w_down)
        return F.linear(x, self.lm_head)


def _graph_seconds(chain: DecodeChain, x: torch.Tensor, repeats: int) -> float:
    """Median seconds of one replay of the chain captured as a CUDA graph (no launch overhead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            chain.step(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain.step(x)
    return statistics.median(timed(graph.replay, x.device, repeats))


def measure_decode_chain(
    device: torch.device,
    model: ModelArch,
    catalog: HardwareArch,
    batches: Sequence[int],
    context: int,
    repeats: int,
    layers: int | None = None,
    measured_tbps: float | None = None,
) -> dict[str, Any]:
    """Roofline prediction for one decode step of `model` on `catalog` next to the measured chain."""
    chain = DecodeChain(model, device, layers)
    roof = {p.batch: p for p in decode_roofline(model, catalog, gpus=1, weight_dtype="bf16", kv_dtype="bf16",
                                                   context=context, batches=list(batches))}
    rows = []
    for batch in batches:
        x = torch.randn(batch, model.hidden, dtype=torch.bfloat16, device=device)
        eager = statistics.median(timed(lambda x=x: chain.step(x), device, repeats))
        row: dict[str, Any] = {
            "batch": batch,
            "roofline_tpot_ms": roof[batch].tpot_s * 1e3,
            "roofline_bound": roof[batch].bound,
            "roofline_chain_ms": chain.weight_bytes / (catalog.hbm_tbps * 1e12) * 1e3,
            "measured_eager_ms": eager * 1e3,
            "eager_tbps": chain.weight_bytes / eager / 1e12,
        }
        if measured_tbps:
            row["chain_at_measured_copy_bw_ms"] = chain.weight_bytes / (measured_tbps * 1e12) * 1e3
        if device.type == "cuda":
            try:
                graph = _graph_seconds(chain, x, repeats)
                row["measured_graph_ms"] = graph * 1e3
                row["graph_tbps"] = chain.weight_bytes / graph / 1e12
            except Exception as exc:  # noqa: BLE001 - the eager number still stands
                row["graph_error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    result = {
        "model": model.name,
        "layers_run": chain.layers,
        "layers_model": model.layers,
        "chain_weight_bytes": chain.weight_bytes,
        "roofline_weight_bytes": model.weight_bytes("bf16"),
        "context": context,
        "hardware": catalog.name,
        "rows": rows,
    }
    return result
