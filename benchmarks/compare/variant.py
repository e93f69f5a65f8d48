"""A variant of a deployment: a name and the deploy-config keys it changes from a shared base.

    base = {"engine": {"model": "smollm2"}, "serve": {"port": 8123}}
    Variant("prefix-cache", {"engine": {"enable_prefix_caching": True}}).config(base)
    Variant.parse("disagg", ["mode=disaggregated", "router.policy=goodput"])

Overrides merge into the base key by key (nested mappings merge, anything else replaces), so a variant
states only what it changes and every variant of a comparison shares everything else."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import yaml


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: ``base`` with ``overrides`` merged in recursively (neither is modified)."""
    out = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["router.policy=goodput", "engine.kv_cache_mib=128"]`` -> nested overrides; values are YAML
    scalars (``true``, ``128``, ``0.5``, ``null``, else a string)."""
    out: dict[str, Any] = {}
    for item in items:
        path, sep, text = item.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise ValueError(f"override {item!r}: give KEY.SUBKEY=VALUE, e.g. router.policy=goodput")
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {k!r} is already set to a value, not a mapping")
        node[keys[-1]] = yaml.safe_load(text) if text.strip() else ""
    return out


class Variant(NamedTuple):
    """One deployment of a comparison: ``name`` (a report label, unique within the comparison) and the
    deploy-config ``overrides`` (nested, as in a deploy YAML) it applies to the shared base."""

    name: str
    overrides: dict[str, Any]

    def config(self, base: Mapping[str, Any]) -> dict[str, Any]:
        return merge(base, self.overrides)

    @classmethod
    def parse(cls, name: str, items: Sequence[str]) -> Variant:
        return cls(name, parse_overrides(items))
