"""One NIXL agent owning one registered memory region, split into equal blocks (a paged KV layout).

The small surface the fabric check and the transfer benchmark share: allocate + register a region
(DRAM via numpy, VRAM via torch.cuda), publish a picklable `RegionInfo` (agent metadata + address), and
READ a list of remote blocks into a list of local blocks, as vLLM's NixlConnector does on the decode side.
Every agent created here goes through `nixl_patch` first, so its progress thread does not busy-poll.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from kvtransfer import nixl_patch

logger = logging.getLogger(__name__)

MEMORY_KINDS = ("DRAM", "VRAM")
# Backend wheels tried, in the `nixl` shim's own order, when the shim is not installed.
NIXL_BACKEND_MODULES = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


@dataclass(frozen=True)
class RegionInfo:
    """What a peer needs to address a region: sent out of band (Ray object, pipe)."""

    agent_name: str
    metadata: bytes
    addr: int
    nbytes: int
    device_id: int
    memory: str


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """A seeded, position-dependent byte pattern: a misplaced or stale block does not match."""
    words = np.arange((nbytes + 7) // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    return words.view(np.uint8)[:nbytes]


def digest(data: np.ndarray) -> str:
    return hashlib.blake2b(memoryview(np.ascontiguousarray(data)), digest_size=16).hexdigest()


def first_mismatch(got: np.ndarray, want: np.ndarray) -> int | None:
    """Index of the first differing byte, or None when equal."""
    if got.shape != want.shape:
        return 0
    diff = np.flatnonzero(got != want)
    return int(diff[0]) if diff.size else None


def _import_nixl() -> tuple[Any, Any]:
    api = _import_nixl_api()
    return api.nixl_agent, api.nixl_agent_config


def nixl_module() -> str:
    """Name of the module that provides nixl's Python API here, e.g. 'nixl_cu12._api'."""
    return str(_import_nixl_api().__name__)


def _import_nixl_api() -> ModuleType:
    """nixl's `_api` module: through the `nixl` shim, else straight from an installed backend wheel."""
    nixl_patch.register()
    try:
        return importlib.import_module("nixl._api")
    except ModuleNotFoundError as exc:
        # NOTE: the `nixl` wheel is only a shim choosing a backend wheel by CUDA version; a box given just
        # the backend wheel (the GPU run carries nixl-cu13 alone) has no `nixl`. Anything else is re-raised.
        if exc.name not in ("nixl", "nixl._api"):
            raise RuntimeError(_not_importable(exc)) from exc
        first: ImportError = exc
    except ImportError as exc:
        raise RuntimeError(_not_importable(exc)) from exc
    for backend in NIXL_BACKEND_MODULES:
        try:
            return importlib.import_module(f"{backend}._api")
        except ModuleNotFoundError as exc:
            if exc.name not in (backend, f"{backend}._api"):
                raise RuntimeError(_not_importable(exc)) from exc
    raise RuntimeError(_not_importable(first)) from first


def _not_importable(exc: ImportError) -> str:
    return (
        f"nixl is not importable ({exc}); install it with `pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1` "
        "(CPU or CUDA 12, see scripts/setup.sh), or just the wheel for the box's CUDA, e.g. "
        "`pip install --no-deps nixl-cu13==1.5.1` (it needs numpy and torch)"
    )


class NixlRegion:
    """A NIXL UCX agent with one registered region of `nbytes` bytes."""

    def __init__(
        self,
        name: str,
        nbytes: int,
        memory: str = "DRAM",
        backends: Sequence[str] = ("UCX",),
    ) -> None:
        if memory not in MEMORY_KINDS:
            raise ValueError(f"memory={memory!r} is not supported: use one of {MEMORY_KINDS}")
        if nbytes <= 0:
            raise ValueError(f"nbytes={nbytes} must be positive")
        nixl_agent, nixl_agent_config = _import_nixl()
        self.name = name
        self.nbytes = nbytes
        self.memory = memory
        self.device_id = 0
        self.buffer: Any
        if memory == "VRAM":
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("memory='VRAM' needs CUDA, and torch.cuda.is_available() is False: use 'DRAM'")
            self.device_id = torch.cuda.current_device()
            self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{self.device_id}")
            self.addr = int(self.buffer.data_ptr())
        else:
            # NOTE: numpy advises transparent huge pages for large arrays (AnonHugePages confirms it).
            self.buffer = np.zeros(nbytes, dtype=np.uint8)
            self.addr = int(self.buffer.ctypes.data)
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=list(backends)))
        self._reg = self.agent.register_memory([(self.addr, nbytes, self.device_id, "")], memory)
        self._dlists: dict[tuple[str, int], Any] = {}
        self._remotes: dict[str, RegionInfo] = {}
        self.last_prep_s = 0.0  # seconds the last read_blocks spent building its request (in its total)

    def info(self) -> RegionInfo:
        return RegionInfo(self.name, self.agent.get_agent_metadata(), self.addr, self.nbytes, self.device_id, self.memory)

    def write_host(self, data: np.ndarray, offset: int = 0) -> None:
        """Copy host bytes into the region at `offset`."""
        if self.memory == "VRAM":
            import torch

            self.buffer[offset : offset + data.size].copy_(torch.from_numpy(data))
        else:
            self.buffer[offset : offset + data.size] = data

    def read_host(self) -> np.ndarray:
        """The region's bytes on the host (a view for DRAM, a copy for VRAM)."""
        return self.buffer.cpu().numpy() if self.memory == "VRAM" else self.buffer

    def zero(self) -> None:
        if self.memory == "VRAM":
            import torch

            self.buffer.zero_()
            torch.cuda.synchronize(self.device_id)  # NOTE: a later NIXL write must not race the memset
        else:
            self.buffer.fill(0)

    def connect(self, peer: RegionInfo) -> str:
        """Load the peer's agent metadata; returns its agent name. Raises on bad metadata."""
        if peer.agent_name not in self._remotes:
            loaded = self.agent.add_remote_agent(peer.metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else loaded
            if name != peer.agent_name:
                raise RuntimeError(f"peer metadata names agent {name!r}, expected {peer.agent_name!r}")
            self._remotes[peer.agent_name] = peer
        return peer.agent_name

    def _dlist(self, owner: str, region: RegionInfo, block_bytes: int) -> Any:
        key = (owner, block_bytes)
        if key not in self._dlists:
            nblocks = region.nbytes // block_bytes
            if nblocks == 0:
                raise ValueError(f"block_bytes={block_bytes} exceeds the region ({region.nbytes} bytes)")
            descs = np.empty((nblocks, 3), dtype=np.uint64)
            descs[:, 0] = region.addr + np.arange(nblocks, dtype=np.uint64) * np.uint64(block_bytes)
            descs[:, 1] = block_bytes
            descs[:, 2] = region.device_id
            agent_name = "NIXL_INIT_AGENT" if owner == "" else owner
            self._dlists[key] = self.agent.prep_xfer_dlist(agent_name, descs, region.memory)
        return self._dlists[key]

    def read_blocks(
        self,
        peer: RegionInfo,
        block_bytes: int,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        timeout_s: float,
    ) -> float:
        """READ `remote_blocks` of the peer into `local_blocks`; returns seconds from post to done."""
        if len(local_blocks) != len(remote_blocks):
            raise ValueError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks")
        self.connect(peer)
        local = self._dlist("", self._local_info(), block_bytes)
        remote = self._dlist(peer.agent_name, peer, block_bytes)
        local_idx = np.asarray(local_blocks, dtype=np.int32)
        remote_idx = np.asarray(remote_blocks, dtype=np.int32)
        # NOTE: the clock includes building the request, as a per-request KV pull pays it too.
        start = time.perf_counter()
        handle = self.agent.make_prepped_xfer("READ", local, local_idx, remote, remote_idx)
        self.last_prep_s = time.perf_counter() - start
        try:
            state = self.agent.transfer(handle)
            deadline = start + timeout_s
            while state == "PROC":
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"NIXL READ from {peer.agent_name!r} not done after {timeout_s:.1f} s")
                state = self.agent.check_xfer_state(handle)
            elapsed = time.perf_counter() - start
            if state != "DONE":
                raise RuntimeError(f"NIXL READ from {peer.agent_name!r} failed (state {state})")
        except BaseException:
            # NOTE: nixl refuses to release a transfer it cannot cancel; that error must not hide this one.
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:
                logger.warning(
                    "could not release the unfinished NIXL READ from %s: it may still write into %s",
                    peer.agent_name, self.name, exc_info=True,
                )
            raise
        self.agent.release_xfer_handle(handle)
        return elapsed

    def _local_info(self) -> RegionInfo:
        return RegionInfo(self.name, b"", self.addr, self.nbytes, self.device_id, self.memory)

    def close(self) -> None:
        """Release descriptor lists, forget peers, deregister memory. Safe to call twice."""
        for handle in self._dlists.values():
            self.agent.release_dlist_handle(handle)
        self._dlists.clear()
        for name in self._remotes:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # the peer may be gone already
                logger.debug("remove_remote_agent(%s) failed", name, exc_info=True)
        self._remotes.clear()
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None


def idle_cpu_fraction(seconds: float = 2.0) -> float:
    """Cores this process burns while it sleeps `seconds` (1.0 = one full core): an idle agent's cost."""
    import resource

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    cpu0, wall0 = cpu(), time.perf_counter()
    time.sleep(seconds)
    return (cpu() - cpu0) / (time.perf_counter() - wall0)
