"""Per-pool engine options (pool_engines): what a pool may set for itself, what must stay shared (NIXL's
handshake compares model, dtype and KV cache dtype), and the vLLM arguments each pool's engines get."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, parse_config
from cluster.control.pools import PoolController


def _engine(cfg, role: str):
    ctl = PoolController.__new__(PoolController)  # NOTE: engine_for reads only the config
    ctl.cfg = cfg
    return ctl.engine_for(role)


def test_decode_speculates_and_prefill_keeps_its_own_budget() -> None:
    cfg = parse_config({"engine": {"device": "cpu", "max_num_batched_tokens": 2048},
                        "pool_engines": {"decode": {"speculative": {"num_speculative_tokens": 3}},
                                         "prefill": {"max_num_batched_tokens": 512, "enable_prefix_caching": False}}})
    dec = _engine(cfg, "decode").engine_kwargs("/m", "m")
    pre = _engine(cfg, "prefill").engine_kwargs("/m", "m")
    assert dec["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                         "prompt_lookup_max": 4}
    assert dec["max_num_batched_tokens"] == 2048 and dec["enable_prefix_caching"] is True
    assert "speculative_config" not in pre and pre["max_num_batched_tokens"] == 512
    assert pre["enable_prefix_caching"] is False
    assert pre["dtype"] == dec["dtype"] == "float32"


def test_a_deployment_wide_speculative_setting_never_reaches_the_prefill_pool() -> None:
    cfg = parse_config({"engine": {"device": "cpu", "speculative": {}}})
    assert "speculative_config" in _engine(cfg, "decode").engine_kwargs("/m", "m")
    assert "speculative_config" not in _engine(cfg, "prefill").engine_kwargs("/m", "m")


@pytest.mark.parametrize("over,needle", [
    ({"decode": {"dtype": "bfloat16"}}, "pool_engines.decode.dtype: set it once under engine.dtype (NIXL's handshake"),
    ({"prefill": {"kv_cache_dtype": "fp8"}}, "compares the KV cache dtype"),
    ({"decode": {"model": "tiny-llama"}}, "both pools serve one model"),
    ({"decode": {"quantization": "fp8"}}, "engine.quantization"),
    ({"prefill": {"speculative": {}}}, "speculative decoding belongs on the decode pool"),
    ({"decode": {"bogus": 1}}, "pool_engines.decode.bogus: not a per-pool engine option"),
    ({"decode": {"max_num_seqs": 0}}, "max_num_seqs"),
    ({"decode": {"speculative": {"prompt_lookup_min": 5, "prompt_lookup_max": 3}}}, "prompt_lookup_min=5"),
])
def test_what_must_stay_shared_is_refused_by_name(over, needle) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"engine": {"device": "cpu"}, "pool_engines": over})
    assert needle in str(e.value), str(e.value)


def test_colocated_mode_has_no_per_pool_options() -> None:
    with pytest.raises(ConfigError, match="colocated mode has one pool"):
        parse_config({"mode": "colocated", "pool_engines": {"decode": {"max_num_seqs": 8}}})
