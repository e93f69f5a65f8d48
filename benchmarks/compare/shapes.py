"""The two shapes ``python -m benchmarks.compare`` compares on the same resources, as variants of one
base deploy config: ``--colocated N`` engines vs ``--prefill P`` + ``--decode D`` engines."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.compare.provenance import REPO
from benchmarks.compare.variant import Variant

DEFAULT_PROFILE = REPO / "manifests" / "profiles" / "cpu-smollm2.yaml"
MODES = ("colocated", "disaggregated")
SHORT = {"colocated": "colo", "disaggregated": "disagg"}
QUALITY_SOURCES = ("disaggregated", "colocated", "offline")
NAMESPACE = "saaf-compare"


def base_config(args: argparse.Namespace, port: int) -> dict[str, Any]:
    """What both shapes share: engine, Serve port and timeout, router, Ray namespace."""
    return {"engine": {"model": args.model, "max_model_len": args.max_model_len, "kv_cache_mib": args.kv_cache_mib,
                       "enable_prefix_caching": args.prefix_caching},
            "serve": {"port": port, "request_timeout_s": max(300.0, args.request_timeout)},
            "router": {"policy": args.policy, "disaggregation": getattr(args, "disaggregation", "always")},
            # NOTE: the router admits against the deployment's SLO: the one the run judges by
            "slo": {"ttft_ms": args.ttft_slo * 1000.0, "tpot_ms": args.tpot_slo * 1000.0},
            "ray": {"namespace": NAMESPACE}}


def shape_variant(args: argparse.Namespace, mode: str) -> Variant:
    pools = {"colocated": args.colocated} if mode == "colocated" else {"prefill": args.prefill, "decode": args.decode}
    return Variant(mode, {"name": f"cmp-{SHORT[mode]}", "mode": mode, "pools": pools})


def deploy_config(args: argparse.Namespace, mode: str, port: int) -> dict[str, Any]:
    """The deploy config of one shape (``mode``: colocated or disaggregated)."""
    return shape_variant(args, mode).config(base_config(args, port))


def shapes(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The report's description of both shapes: engines and pool sizes."""
    return {"colocated": {"engines": args.colocated, "pools": {"colocated": args.colocated}},
            "disaggregated": {"engines": args.prefill + args.decode,
                              "pools": {"prefill": args.prefill, "decode": args.decode}}}
