"""The NIXL side of `benchmarks.gpu_nixl`: KV-shaped paged regions moved through `kvtransfer.nixl_agent`.

Runs in child processes (spawned by `benchmarks.gpu_nixl`, which relays messages and enforces deadlines),
so a native hang or crash in NIXL/UCX costs one attempt, not the whole run:
- `source_main`: the prefill side. Registers a region (VRAM with CUDA, else DRAM), fills it with the
  seeded position-dependent pattern, publishes its `RegionInfo`, waits to be told to stop.
- `dest_main`: the decode side. Registers a region of the same size and, per (model layout, slab size),
  READs a scattered set of block ids across every layer's K and V (one descriptor per layer x K|V x
  block, as vLLM's NixlConnector does) in one NIXL request; in the same rounds it copies the same bytes
  with torch on the same device (one contiguous copy, and an index gather of the same slabs). Every
  transfer and every copy is verified against a reference the destination computes itself.
  With `one_process=True` it creates the source agent itself (the fallback when CUDA IPC between
  processes is refused).

Region layout per model: [layers, K|V, num_blocks, slab], slab = block_tokens x kv_heads x head_dim x 2
bytes (bf16), so a descriptor id is (layer * 2 + kv) * num_blocks + block.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvtransfer import nixl_patch
from kvtransfer.nixl_agent import NixlRegion, RegionInfo, nixl_module

_GOLDEN = 0x9E3779B97F4A7C15  # kvtransfer.nixl_agent.pattern's multiplier
BF16_BYTES = 2
FAULTS = ("source",)  # test hook: the two-process source fails, so the one-process fallback must run


@dataclass(frozen=True)
class KVLayout:
    """One model's paged KV cache at one block size (tensor parallel 1: all KV heads on one GPU)."""

    model: str
    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int

    @property
    def slab_bytes(self) -> int:
        """One descriptor: one layer's K (or V) of one block."""
        return self.block_tokens * self.kv_heads * self.head_dim * BF16_BYTES

    @property
    def block_bytes(self) -> int:
        """One block id: every layer, K and V."""
        return 2 * self.layers * self.slab_bytes

    def descriptor_ids(self, blocks: np.ndarray, num_blocks: int) -> np.ndarray:
        planes = np.arange(2 * self.layers, dtype=np.int64)[:, None] * num_blocks
        return (planes + blocks[None, :].astype(np.int64)).reshape(-1)


def layout_for(model: Any, slab_bytes: int) -> KVLayout:
    """The layout of a catalog `ModelArch` whose descriptor (one layer's K or V of a block) is `slab_bytes`."""
    per_token = model.kv_heads * model.head_dim * BF16_BYTES
    if slab_bytes % per_token:
        raise ValueError(
            f"{model.name}: a {slab_bytes // 1024} KiB slab is not a whole number of tokens "
            f"({per_token} bytes per token per layer); use a multiple of {per_token // 1024 or per_token} "
            f"{'KiB' if per_token >= 1024 else 'bytes'}"
        )
    return KVLayout(model.name, model.layers, model.kv_heads, model.head_dim, slab_bytes // per_token)


@dataclass(frozen=True)
class XferSpec:
    """What the NIXL children do; picklable (spawn)."""

    memory: str  # "VRAM" | "DRAM"
    region_bytes: int
    layouts: tuple[KVLayout, ...]
    target_bytes: int  # bytes per transfer (at least one block id)
    repeats: int
    transfer_timeout_s: float
    deadline: float  # time.time() after which no new layout is started
    seed: int = 0x5AAF
    fault: str | None = None


def blocks_per_transfer(layout: KVLayout, target_bytes: int) -> int:
    return max(1, target_bytes // layout.block_bytes)


def region_bytes_for(layouts: Sequence[KVLayout], target_bytes: int) -> int:
    """One region for all layouts: twice the largest transfer, so block ids can be scattered."""
    need = max(2 * blocks_per_transfer(x, target_bytes) * x.block_bytes for x in layouts)
    return -(-need // 2**20) * 2**20


# ---- torch helpers (the same code on CUDA and CPU) --------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


def _signed64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def fill_pattern(buf: Any, seed: int) -> None:
    """Write `kvtransfer.nixl_agent.pattern(buf.numel(), seed)` into a uint8 tensor in place (any device)."""
    torch = _torch()
    if buf.dtype != torch.uint8 or buf.numel() % 8:
        raise ValueError(f"fill_pattern needs a uint8 tensor of a multiple of 8 bytes, got {buf.dtype} x {buf.numel()}")
    words = buf.view(torch.int64)
    torch.arange(words.numel(), out=words)
    words.mul_(_signed64(_GOLDEN))  # NOTE: int64 multiply wraps like numpy's uint64 one: same bits
    words.bitwise_xor_(_signed64(seed))


def checksum(buf: Any) -> int:
    """Order-independent (wrapping int64 sum) checksum of a uint8 tensor whose size is a multiple of 8."""
    torch = _torch()
    return int(buf.view(torch.int64).sum())


def region_tensor(region: NixlRegion) -> Any:
    """The region's bytes as a uint8 tensor sharing its memory (CUDA tensor for VRAM, CPU for DRAM)."""
    return region.buffer if region.memory == "VRAM" else _torch().from_numpy(region.buffer)


def _sync(t: Any) -> None:
    if t.is_cuda:
        _torch().cuda.synchronize(t.device)


def _timed(fn: Any, t: Any) -> float:
    _sync(t)
    start = time.perf_counter()
    fn()
    _sync(t)
    return time.perf_counter() - start


# ---- one measurement --------------------------------------------------------------------------------


def measure_layout(
    region: NixlRegion, peer: RegionInfo, ref: Any, layout: KVLayout, spec: XferSpec, rng: np.random.Generator
) -> dict[str, Any]:
    """NIXL READ vs torch copies of the same bytes, alternating, 1 warm-up + `spec.repeats` timed rounds."""
    torch = _torch()
    slab = layout.slab_bytes
    planes = 2 * layout.layers
    num_blocks = region.nbytes // (planes * slab)
    n = blocks_per_transfer(layout, spec.target_bytes)
    if n > num_blocks:
        raise ValueError(f"{layout.model} {slab // 1024} KiB: {n} blocks do not fit a {num_blocks}-block region")
    local = layout.descriptor_ids(rng.permutation(num_blocks)[:n], num_blocks)
    remote = layout.descriptor_ids(rng.permutation(num_blocks)[:n], num_blocks)
    nbytes = n * layout.block_bytes
    dst = region_tensor(region)
    nslabs = region.nbytes // slab
    dst2d, ref2d = dst[: nslabs * slab].view(nslabs, slab), ref[: nslabs * slab].view(nslabs, slab)
    local_t = torch.from_numpy(local).to(dst.device)
    remote_t = torch.from_numpy(remote).to(dst.device)

    def nixl_ok() -> bool:
        got = dst2d.index_select(0, local_t)
        # NOTE: equal slabs, and nothing written elsewhere: the zeroed region's only nonzero words are theirs.
        return bool(torch.equal(got, ref2d.index_select(0, remote_t))) and nonzero_words(dst) == nonzero_words(got)

    def bulk() -> None:
        dst[:nbytes].copy_(ref[:nbytes])

    def gather() -> None:
        dst2d.index_copy_(0, local_t, ref2d.index_select(0, remote_t))

    ok = {"nixl": True, "copy": True, "gather": True}
    nixl_s: list[float] = []
    prep_s: list[float] = []
    bulk_s: list[float] = []
    gather_s: list[float] = []
    first_s = 0.0
    # NOTE: NIXL and torch rounds alternate, so anything else on the machine hits both alike.
    for i in range(spec.repeats + 1):
        region.zero()
        seconds = region.read_blocks(peer, slab, local, remote, spec.transfer_timeout_s)
        ok["nixl"] &= nixl_ok()
        region.zero()
        b = _timed(bulk, dst)
        ok["copy"] &= bool(torch.equal(dst[:nbytes], ref[:nbytes]))
        region.zero()
        g = _timed(gather, dst)
        ok["gather"] &= nixl_ok()
        if i == 0:
            first_s = seconds
            continue
        nixl_s.append(seconds)
        prep_s.append(region.last_prep_s)
        bulk_s.append(b)
        gather_s.append(g)
    nixl_gbps = nbytes / statistics.median(nixl_s) / 1e9
    copy_gbps = nbytes / statistics.median(bulk_s) / 1e9
    gather_gbps = nbytes / statistics.median(gather_s) / 1e9
    return {
        **asdict(layout),
        "slab_kib": slab // 1024,
        "blocks": n,
        "descriptors": int(local.size),
        "total_bytes": nbytes,
        "repeats": spec.repeats,
        "verified": all(ok.values()),
        **{f"verified_{k}": v for k, v in ok.items()},
        "nixl_gbps": nixl_gbps,
        "nixl_best_gbps": nbytes / min(nixl_s) / 1e9,
        "nixl_prep_ms": statistics.median(prep_s) * 1e3,
        "nixl_first_ms": first_s * 1e3,
        "copy_gbps": copy_gbps,
        "copy_best_gbps": nbytes / min(bulk_s) / 1e9,
        "gather_gbps": gather_gbps,
        "ratio": nixl_gbps / copy_gbps,
        "ratio_gather": nixl_gbps / gather_gbps,
    }


def nonzero_words(t: Any) -> int:
    """Nonzero 8-byte words of a uint8 tensor (size a multiple of 8); fast on CPU too, unlike a byte sum."""
    torch = _torch()
    return int(torch.count_nonzero(t.reshape(-1).view(torch.int64)))


# ---- child processes --------------------------------------------------------------------------------


def _child_setup(spec: XferSpec) -> dict[str, Any]:
    torch = _torch()
    if spec.memory == "DRAM":
        torch.set_num_threads(1)  # NOTE: NIXL's DRAM path is one thread too (CMA); keep the copies comparable
    info: dict[str, Any] = {"pid": os.getpid(), "torch": torch.__version__, "nixl_module": nixl_module()}
    if spec.memory == "VRAM":
        info["device_name"] = torch.cuda.get_device_name(0)
    info["pthr_delay_us"] = nixl_patch.registered_delay_us()
    return info


def _describe(exc: BaseException) -> str:
    tail = "".join(traceback.format_exception(exc)[-3:]).strip().replace("\n", " | ")
    return f"{type(exc).__name__}: {exc} [{tail[-600:]}]"


def _new_source(spec: XferSpec) -> tuple[NixlRegion, int]:
    region = NixlRegion(f"gpu-nixl-src-{os.getpid()}", spec.region_bytes, spec.memory)
    t = region_tensor(region)
    fill_pattern(t, spec.seed)
    _sync(t)
    return region, checksum(t)


def source_main(conn: Connection, spec: XferSpec) -> None:
    """Prefill side: publish a patterned region, stay up until the parent says stop (or the deadline)."""
    region: NixlRegion | None = None
    try:
        if spec.fault == "source":
            raise RuntimeError("injected fault 'source' (test hook): the source process refuses to serve")
        _child_setup(spec)
        region, sum_ = _new_source(spec)
        conn.send(("info", region.info(), sum_))
        conn.poll(max(1.0, spec.deadline - time.time() + 30))
    except BaseException as exc:  # reported to the parent, which decides on the fallback
        conn.send(("error", _describe(exc)))
    finally:
        if region is not None:
            region.close()


def dest_main(conn: Connection, spec: XferSpec, one_process: bool) -> None:
    """Decode side: measure every layout until done or past the deadline; one message per layout."""
    regions: list[NixlRegion] = []
    try:
        torch = _torch()
        ready = _child_setup(spec)
        region = NixlRegion(f"gpu-nixl-dst-{os.getpid()}", spec.region_bytes, spec.memory)
        regions.append(region)
        conn.send(("ready", ready))
        if one_process:
            source, src_sum = _new_source(spec)
            regions.append(source)
            peer = source.info()
        else:
            msg = conn.recv()
            if msg[0] != "peer":  # the parent gave up on this attempt (the source failed)
                return
            _, peer, src_sum = msg
        dst = region_tensor(region)
        ref = torch.empty(spec.region_bytes, dtype=torch.uint8, device=dst.device)
        fill_pattern(ref, spec.seed)
        if checksum(ref) != src_sum:
            raise RuntimeError("the source region's checksum differs from the pattern computed here")
        rng = np.random.default_rng(spec.seed)
        for layout in spec.layouts:
            if time.time() > spec.deadline:
                conn.send(("skip", f"deadline reached before {layout.model} {layout.slab_bytes // 1024} KiB"))
                break
            conn.send(("row", measure_layout(region, peer, ref, layout, spec, rng)))
        conn.send(("done", None))
    except BaseException as exc:  # reported to the parent, which records it
        conn.send(("error", _describe(exc)))
    finally:
        for r in regions:
            r.close()
