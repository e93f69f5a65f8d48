"""NIXL block-transfer benchmark: scattered KV-style block READs between two processes vs memcpy.

    python -m benchmarks.kvtransfer [--block-kib 16,64,256,1024,2048] [--blocks N] [--repeats R] [--json]

A source process (the "prefill" side) registers one region filled with a seeded pattern; this process
(the "decode" side) registers a region of the same size, both split into blocks of each size. Per size
it READs a scattered subset of remote blocks into scattered local blocks with one NIXL request (one
descriptor per block, as vLLM's NixlConnector does) and, in the same run, copies the same blocks with
numpy between two local regions (memcpy). Every NIXL repeat is verified byte for byte.
GB/s = bytes / seconds / 1e9; medians over repeats; the clock covers building the request + transfer.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

import numpy as np

from kvtransfer.nixl_agent import NixlRegion, RegionInfo, pattern

DEFAULT_BLOCK_KIB = (16, 64, 256, 1024, 2048)
TARGET_BYTES_PER_SIZE = 64 * 2**20
MIN_BLOCKS = 32
SEED = 1234
SOURCE_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class SizeResult:
    block_kib: int
    blocks: int
    total_bytes: int
    nixl_gbps: float  # median over repeats
    memcpy_gbps: float  # median over repeats
    ratio: float
    verified: bool
    nixl_best_gbps: float  # fastest repeat: how far load from other processes pulled the median down
    memcpy_best_gbps: float


def blocks_for(block_bytes: int, blocks: int | None) -> int:
    return blocks if blocks else max(MIN_BLOCKS, TARGET_BYTES_PER_SIZE // block_bytes)


def _source_main(conn: Connection, region_bytes: int, seed: int) -> None:
    """The remote (prefill) side: register a patterned region, publish it, stay up until told to stop."""
    region = NixlRegion(f"bench-src-{os.getpid()}", region_bytes)
    try:
        region.write_host(pattern(region_bytes, seed))
        conn.send(region.info())
        conn.poll(SOURCE_TIMEOUT_S)
    finally:
        region.close()


def _pick_blocks(total: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Scattered, distinct block ids on both sides (the layout of a fragmented paged KV cache)."""
    return rng.permutation(total)[:n], rng.permutation(total)[:n]


def _memcpy_seconds(dst: np.ndarray, src: np.ndarray, block: int, local: np.ndarray, remote: np.ndarray) -> float:
    pairs = [(dst[d * block : (d + 1) * block], src[s * block : (s + 1) * block]) for d, s in zip(local, remote, strict=True)]
    start = time.perf_counter()
    for d_view, s_view in pairs:
        np.copyto(d_view, s_view)
    return time.perf_counter() - start


def _verified(dst: np.ndarray, src: np.ndarray, block: int, local: np.ndarray, remote: np.ndarray) -> bool:
    total = min(dst.size, src.size) // block
    return bool(np.array_equal(dst[: total * block].reshape(total, block)[local], src[: total * block].reshape(total, block)[remote]))


def run_size(
    region: NixlRegion,
    peer: RegionInfo,
    src_copy: np.ndarray,
    block_bytes: int,
    n_blocks: int,
    repeats: int,
    rng: np.random.Generator,
    timeout_s: float,
) -> SizeResult:
    total = peer.nbytes // block_bytes
    if n_blocks > total:
        raise ValueError(f"--blocks {n_blocks} exceeds the {total} blocks of {block_bytes} bytes in the region")
    local, remote = _pick_blocks(total, n_blocks, rng)
    dst = region.read_host()
    nbytes = n_blocks * block_bytes
    verified = True
    nixl_s: list[float] = []
    copy_s: list[float] = []
    # NOTE: NIXL and memcpy repeats alternate, so load from other processes hits both alike.
    for i in range(repeats + 1):  # round 0 warms the connection and the caches: not timed
        region.zero()
        seconds = region.read_blocks(peer, block_bytes, local.tolist(), remote.tolist(), timeout_s)
        verified &= _verified(dst, src_copy, block_bytes, local, remote)
        region.zero()
        copy_seconds = _memcpy_seconds(dst, src_copy, block_bytes, local, remote)
        verified &= _verified(dst, src_copy, block_bytes, local, remote)
        if i:
            nixl_s.append(seconds)
            copy_s.append(copy_seconds)
    nixl_gbps = nbytes / statistics.median(nixl_s) / 1e9
    memcpy_gbps = nbytes / statistics.median(copy_s) / 1e9
    return SizeResult(
        block_bytes // 1024,
        n_blocks,
        nbytes,
        nixl_gbps,
        memcpy_gbps,
        nixl_gbps / memcpy_gbps,
        verified,
        nbytes / min(nixl_s) / 1e9,
        nbytes / min(copy_s) / 1e9,
    )


def run_benchmark(
    block_kib: list[int],
    blocks: int | None = None,
    repeats: int = 9,
    timeout_s: float = 30.0,
    budget_s: float = 50.0,
) -> list[SizeResult]:
    """Spawn the source process, run every block size within `budget_s`, stop the source."""
    sizes = [k * 1024 for k in block_kib]
    # Region: twice the blocks moved, so the subset is scattered; one region serves every block size.
    region_bytes = max(2 * blocks_for(b, blocks) * b for b in sizes)
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    source = ctx.Process(target=_source_main, args=(child_conn, region_bytes, SEED), daemon=True)
    source.start()
    region: NixlRegion | None = None
    deadline = time.monotonic() + budget_s
    try:
        if not parent_conn.poll(timeout_s):
            raise TimeoutError(f"source process did not publish its region within {timeout_s:.0f} s")
        peer: RegionInfo = parent_conn.recv()
        region = NixlRegion(f"bench-dst-{os.getpid()}", region_bytes)
        src_copy = pattern(region_bytes, SEED)  # memcpy's source: a local copy of the remote region
        rng = np.random.default_rng(SEED)
        results = []
        for b in sizes:
            if time.monotonic() > deadline:
                print(f"time budget of {budget_s:.0f} s spent: skipping {b // 1024} KiB and larger", file=sys.stderr)
                break
            results.append(run_size(region, peer, src_copy, b, blocks_for(b, blocks), repeats, rng, timeout_s))
        return results
    finally:
        if region is not None:
            region.close()
        parent_conn.send("stop")
        source.join(timeout=10)
        if source.is_alive():
            source.kill()
            source.join(timeout=5)


def _parse_kib(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"--block-kib {text!r}: give positive integers, e.g. 16,64,256")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kvtransfer", description=__doc__.split("\n")[0])
    parser.add_argument("--block-kib", type=_parse_kib, default=list(DEFAULT_BLOCK_KIB), help="block sizes in KiB")
    parser.add_argument("--blocks", type=int, default=None, help="blocks per transfer (default: 64 MiB worth, >= 32)")
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats per block size (median reported)")
    parser.add_argument("--budget-s", type=float, default=50.0, help="stop starting new block sizes after this")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--out", help="also write the results, with date, commit and machine, as JSON here")
    args = parser.parse_args(argv)
    from benchmarks.compare.provenance import Provenance, write_artefact

    prov = Provenance.start(["python", "-m", "benchmarks.kvtransfer"], sys.argv[1:] if argv is None else argv)
    if args.repeats < 1 or (args.blocks is not None and args.blocks < 1):
        parser.error(f"--repeats {args.repeats} and --blocks {args.blocks} must be >= 1")
    # NOTE: inherited by the source process. Loopback-only box; nixl logs INFO lines to stdout otherwise.
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    results = run_benchmark(args.block_kib, args.blocks, args.repeats, budget_s=args.budget_s)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
        "ucx_net_devices": os.environ.get("UCX_NET_DEVICES"),
    }
    if args.out:
        write_artefact(args.out, prov, {"meta": meta, "results": [asdict(r) for r in results]})
    if args.json:
        print(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2))
    else:
        print(f"# {meta['date']}  host={meta['host']}  cpus={meta['cpus']}  UCX_TLS={meta['ucx_tls']}")
        print(f"{'block':>9} {'blocks':>6} {'MiB':>7} {'NIXL GB/s':>10} {'memcpy GB/s':>12} {'ratio':>6}  verified")
        for r in results:
            print(
                f"{r.block_kib:>6} KiB {r.blocks:>6} {r.total_bytes / 2**20:>7.1f} {r.nixl_gbps:>10.2f} "
                f"{r.memcpy_gbps:>12.2f} {r.ratio:>6.2f}  {'yes' if r.verified else 'NO'}"
            )
    return 0 if results and all(r.verified for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
