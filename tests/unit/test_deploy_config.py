"""Deploy config: bad configs fail before anything starts, with a message naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config import ConfigError, load_config
from cluster.control.lifecycle import check_resources, pool_sizes, resolve_device


def _write(tmp_path, data) -> str:
    p = tmp_path / "deploy.yaml"
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(p)


def test_embedded_default_is_disaggregated_1p1d():
    cfg = load_config(None)
    assert cfg.mode == "disaggregated"
    assert pool_sizes(cfg) == {"prefill": 1, "decode": 1}
    assert cfg.serve.host == "127.0.0.1"
    assert cfg.planner_loop.mode == "advisory"  # the loop runs and says what it would do; it resizes only when on


@pytest.mark.parametrize("data,needle", [
    ({"engine": {"modle": "smollm2"}}, "engine.modle: unknown key"),
    ({"bogus": 1}, "bogus: unknown key"),
    ({"pools": {"prefill": "two"}}, "pools"),
    ({"pools": {"prefill": 0}}, "pools"),
    ({"engine": {"model": "/no/such/dir"}}, "engine.model: '/no/such/dir' is not a directory"),
    ({"mode": "split"}, "mode"),
    ({"serve": {"port": 70000}}, "serve.port"),
    ({"pools": "auto"}, "planner"),
    ({"transfer": {"failure_policy": "retry"}}, "transfer.failure_policy"),
    ({"engine": {"device": "cpu", "pipeline_parallel_size": 2}}, "pipeline parallelism needs device 'cuda'"),
    ({"planner_loop": {"mode": "auto"}}, "planner_loop.mode"),
    ({"planner_loop": {"min_decode": 3, "max_decode": 2}}, "min_decode=3 > max_decode=2"),
    ({"planner_loop": {"interval_s": 0.1}}, "planner_loop.interval_s"),
    ("[1, 2]", "top level must be a mapping"),
    ("a: [", "not valid YAML"),
])
def test_bad_config_names_the_field(tmp_path, data, needle):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, data))
    assert needle in str(e.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/no/such/deploy.yaml")


def test_every_committed_deploy_manifest_parses():
    import glob

    paths = sorted(glob.glob("manifests/deploy-*.yaml"))
    assert len(paths) >= 4
    for p in paths:
        cfg = load_config(p, check_paths=False)
        # NOTE: issue 14: a manifest reachable from other machines asks for keys (none opts out)
        if cfg.serve.host not in ("127.0.0.1", "localhost"):
            assert cfg.serve.api_keys and not cfg.serve.allow_unauthenticated, p


def test_resource_check_refuses_oversized_gpu_plan():
    cfg = load_config("manifests/deploy-llama-8b.yaml", check_paths=False)
    cfg = resolve_device(cfg, [{"gpus": 8}])
    check_resources(cfg, pool_sizes(cfg), [{"gpus": 8}])  # 3 + 5 engines of 1 GPU fit one node
    with pytest.raises(ConfigError, match="plan needs 8 GPUs .* cluster has 1 node"):
        check_resources(cfg, pool_sizes(cfg), [{"gpus": 4}])
    cfg16 = cfg.model_copy(update={"pools": cfg.pools.model_copy(update={"prefill_tp": 4, "decode_tp": 4,
                                                                          "prefill": 2, "decode": 2})})
    with pytest.raises(ConfigError, match="plan needs 16 GPUs in 2 node"):
        check_resources(cfg16, pool_sizes(cfg16), [{"gpus": 8}])
    check_resources(cfg16, pool_sizes(cfg16), [{"gpus": 8}, {"gpus": 8}])


def test_auto_device_follows_cluster():
    cfg = load_config(None)
    assert resolve_device(cfg, [{"gpus": 0}]).engine.device == "cpu"
    assert resolve_device(cfg, [{"gpus": 8}]).engine.device == "cuda"


def test_fabric_check_runs_where_engines_can_sit_on_different_nodes() -> None:
    from cluster.config import parse_config
    from cluster.control.lifecycle import wants_fabric_check

    one, two = [{"node_id": "a"}], [{"node_id": "a"}, {"node_id": "b"}]
    auto = parse_config({})
    assert auto.transfer.fabric_check == "auto"
    assert not wants_fabric_check(auto, one) and wants_fabric_check(auto, two)
    assert wants_fabric_check(parse_config({"transfer": {"fabric_check": True}}), one)
    assert not wants_fabric_check(parse_config({"transfer": {"fabric_check": False}}), two)


def _auto_deploy(tmp_path, slo: dict | None, planner_slo: dict | None, **extra):
    import shutil

    from cluster.config import load_config

    repo = Path(__file__).resolve().parents[2]
    plan = yaml.safe_load((repo / "manifests" / "plan-cpu-smollm2.yaml").read_text())
    shutil.copytree(repo / "manifests" / "profiles", tmp_path / "profiles")
    if planner_slo is None:
        plan.pop("slo")
    else:
        plan["slo"] = planner_slo
    plan.update(extra.pop("planner_extra", {}))
    data = {"pools": "auto", "planner": plan} | ({"slo": slo} if slo is not None else {}) | extra
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, check_paths=False)


def test_the_planner_and_the_router_read_one_slo(tmp_path):
    from cluster.config import ConfigError

    # the planner's SLO becomes the deployment's when `slo:` is not given
    cfg = _auto_deploy(tmp_path / "a", None, {"ttft_s": 1.5, "tpot_s": 0.1, "percentile": "p99"})
    assert (cfg.slo.ttft_ms, cfg.slo.tpot_ms, cfg.slo.percentile) == (1500, 100, "p99")
    # the deployment's SLO becomes the planner's when the planner section has none
    cfg = _auto_deploy(tmp_path / "b", {"ttft_ms": 800, "tpot_ms": 90}, None)
    assert (cfg.planner["slo"]["ttft_s"], cfg.planner["slo"]["tpot_s"]) == (0.8, 0.09)
    # both, agreeing, are fine; disagreeing, an error naming both
    _auto_deploy(tmp_path / "c", {"ttft_ms": 800, "tpot_ms": 90}, {"ttft_s": 0.8, "tpot_s": 0.09})
    with pytest.raises(ConfigError, match="planner.slo .* differ"):
        _auto_deploy(tmp_path / "d", {"ttft_ms": 800, "tpot_ms": 90}, {"ttft_s": 2.0, "tpot_s": 0.09})


def test_cpu_kv_caches_that_cannot_fit_the_nodes_memory_are_refused_before_start():
    """Issue 14: an engine that cannot start (KV cache larger than memory) is a clear error up front."""
    from cluster.config import parse_config
    from cluster.control.lifecycle import check_cpu_memory

    cfg = parse_config({"engine": {"model": "tiny-llama", "kv_cache_mib": 4096}})
    sizes = {"prefill": 1, "decode": 1}
    check_cpu_memory(cfg, sizes, [{"memory": 16 << 30}])
    with pytest.raises(ConfigError, match=r"engine.kv_cache_mib 4096 MiB per engine x 2 engine\(s\) = 8192 MiB"
                                          r".* 6144 MiB .*lower engine.kv_cache_mib"):
        check_cpu_memory(cfg, sizes, [{"memory": 6 << 30}])
    with pytest.raises(ConfigError, match="2048 MiB, 2048 MiB"):  # each engine needs one node that holds it
        check_cpu_memory(cfg, sizes, [{"memory": 2 << 30}, {"memory": 2 << 30}])
    check_cpu_memory(cfg, sizes, [{"memory": 5 << 30}, {"memory": 5 << 30}])


def test_the_deploy_time_planner_plans_the_speculation_the_decode_pool_runs(tmp_path):
    from cluster.control.planning import plan_for

    spec = {"pool_engines": {"decode": {"speculative": {"num_speculative_tokens": 3}}}}
    plain, _ = plan_for(_auto_deploy(tmp_path / "a", None, None))
    # the pool speculates, the acceptance is not given: planned as plain engines, and the plan says so
    unsure, text = plan_for(_auto_deploy(tmp_path / "b", None, None, **spec))
    assert unsure.tpot_s == plain.tpot_s and "planner.speculation is not given" in text
    sure, text = plan_for(_auto_deploy(tmp_path / "c", None, None, planner_extra={
        "speculation": {"tokens": 3, "acceptance": 0.7}}, **spec))
    assert sure.tpot_s < plain.tpot_s and "speculates 3 tokens" in text
    with pytest.raises(ConfigError, match="planner.speculation.tokens=4 but the decode engines speculate 3"):
        plan_for(_auto_deploy(tmp_path / "d", None, None, planner_extra={
            "speculation": {"tokens": 4, "acceptance": 0.7}}, **spec))


def test_a_tp_size_that_cannot_split_the_heads_is_a_config_error(tmp_path):
    """SmolLM2-135M has 9 attention heads and 3 KV heads: TP 2 is refused before any engine starts, and the
    message names the field and the sizes that split it; the tiny Llama (4 / 2) splits at 2."""
    with pytest.raises(ConfigError, match=r"pools.prefill_tp: 2 ranks cannot split 'smollm2' \(9 attention heads, "
                                          r"3 KV heads\); use one of \[1, 3, 9\]"):
        load_config(_write(tmp_path, {"engine": {"model": "smollm2"}, "pools": {"prefill_tp": 2}}))
    cfg = load_config(_write(tmp_path, {"engine": {"model": "tiny-llama"}, "pools": {"prefill_tp": 2}}))
    assert cfg.pools.prefill_tp == 2
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"num_attention_heads": 8, "num_key_value_heads": 2}')
    load_config(_write(tmp_path, {"engine": {"model": str(model)}, "pools": {"decode_tp": 4}}))  # KV replicated
    with pytest.raises(ConfigError, match=r"pools.decode_tp: 3 ranks .* use one of \[1, 2, 4, 8\]"):
        load_config(_write(tmp_path, {"engine": {"model": str(model)}, "pools": {"decode_tp": 3}}))
