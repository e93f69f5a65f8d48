"""Fabric check CLI: move a verified buffer over NIXL between every prefill/decode node pair.

    python -m kvtransfer.check [--address ADDR] [--mib N] [--timeout S] [--memory DRAM|VRAM]
                               [--backend UCX] [--env KEY=VALUE ...] [--json]

Connects to the Ray cluster at --address, else $RAY_ADDRESS, else starts a local loopback Ray just for
the check. Prints GB/s and OK/FAIL per pair; exits 1 naming the failing pairs if any pair cannot move
bytes (exit 2 for bad arguments or no cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import ray

from kvtransfer.fabric import (
    DEFAULT_NBYTES,
    DEFAULT_TIMEOUT_S,
    FabricCheckError,
    PairResult,
    fabric_pairs_from_cluster,
    require_fabric,
    run_fabric_check,
)

# NOTE: a Ray started here must stay on loopback (see shared/ENVIRONMENT.md, Ray section); its token auth
# stays on (Ray's default for a new local cluster: it makes ~/.ray/auth_token if there is none).
LOCAL_RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "UCX_NET_DEVICES": "lo",
}


def connect(address: str | None) -> bool:
    """ray.init to `address` / $RAY_ADDRESS, or start a local loopback Ray. Returns True if started here."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        return False
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 2**20,
        logging_level="WARNING",
        log_to_driver=False,
    )
    return True


def format_table(results: Sequence[PairResult]) -> str:
    lines = [f"{'prefill node':<16} {'decode node':<16} {'GB/s':>7} {'ms':>8}  result"]
    for r in results:
        status = "OK" if r.ok else f"FAIL  {r.error}"
        lines.append(f"{r.prefill_node[:16]:<16} {r.decode_node[:16]:<16} {r.gbps:>7.2f} {r.seconds * 1e3:>8.1f}  {status}")
    return "\n".join(lines)


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--env {text!r}: write KEY=VALUE, e.g. --env UCX_TLS=tcp")
    return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtransfer.check", description=__doc__.split("\n")[0])
    parser.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else local)")
    parser.add_argument("--mib", type=int, default=DEFAULT_NBYTES // 2**20, help="buffer size per pair in MiB")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds allowed per pair")
    parser.add_argument("--memory", choices=["DRAM", "VRAM"], default="DRAM", help="buffer memory kind")
    parser.add_argument("--backend", action="append", default=None, help="NIXL backend (repeatable; default UCX)")
    parser.add_argument(
        "--env", action="append", default=[], type=_env_pair, help="KEY=VALUE for the check's actors (e.g. UCX_TLS=tcp)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.mib <= 0 or args.timeout <= 0:
        parser.error(f"--mib {args.mib} and --timeout {args.timeout} must be positive")
    backends = args.backend or ["UCX"]

    try:
        started = connect(args.address)
    except ConnectionError as exc:
        print(f"cannot reach the Ray cluster: {exc}. Pass --address HOST:PORT or set RAY_ADDRESS.", file=sys.stderr)
        return 2
    try:
        pairs = fabric_pairs_from_cluster()
        results = run_fabric_check(
            pairs,
            nbytes=args.mib * 2**20,
            timeout_s=args.timeout,
            memory=args.memory,
            backends=backends,
            env=dict(args.env),
        )
    finally:
        if started:
            ray.shutdown()

    if args.json:
        print(json.dumps([r._asdict() for r in results], indent=2))
    else:
        print(format_table(results))
    try:
        require_fabric(results)
    except FabricCheckError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(f"fabric check OK: {len(results)} pair(s), {args.mib} MiB each", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
