"""Offline checks of the `ray up` cluster manifests (manifests/cluster-*.yaml); no node or cloud is touched.

Ray's own checks: `prepare_config` + `validate_config` (defaults merge, JSON schema, node-type rules) on
every manifest, and `_bootstrap_config` on local-provider ones. For aws/gcp the `cloud` extra (boto3,
google-api-python-client; scripts/setup.sh installs it) must be there: the node provider classes `ray up`
loads are imported, and `_bootstrap_config`'s steps run up to the first one that calls the cloud, never
further (EC2 instance types, IAM, key pairs, subnets, security groups; Cloud Resource Manager, IAM, Compute);
any network use fails the test. Then Saaf's own invariants: the gpu extra on every node, the NIXL fabric
environment, saaf resources and node labels, the metrics port, and the cloud fields that must agree with
each other (EFA interfaces, GCP zones).
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import shutil
import socket
import subprocess
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import click
import jsonschema
import pytest
import yaml
from ray._private.label_utils import (
    parse_node_labels_string,
    validate_node_label_syntax,
    validate_node_labels,
)
from ray.autoscaler._private.commands import _bootstrap_config, create_or_update_cluster
from ray.autoscaler._private.providers import _NODE_PROVIDERS, _get_node_provider_cls
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.autoscaler.node_provider import NodeProvider

MANIFEST_DIR = Path(__file__).resolve().parents[2] / "manifests"
MANIFESTS = sorted(MANIFEST_DIR.glob("cluster-*.yaml"))
EXPECTED_PROVIDERS = {
    "cluster-aws-h100.yaml": "aws",
    "cluster-aws-a100.yaml": "aws",
    "cluster-gcp-a3.yaml": "gcp",
    "cluster-onprem.yaml": "local",
}
CLOUD_PROVIDERS = {"aws": "AWSNodeProvider", "gcp": "GCPNodeProvider"}
EFA_CARDS = {"p5.48xlarge": 32, "p4d.24xlarge": 4}
GPU_RESOURCE = re.compile(r"saaf_gpu_(?!node$)\w+")
ENV_FILE = re.compile(r"cat > (\S+) <<'EOF'\n(.*?)\nEOF", re.S)


def ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


@cache
def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((MANIFEST_DIR / name).read_text())


def load(path: Path) -> dict[str, Any]:
    return copy.deepcopy(_load(path.name))


def by_provider(*types: str) -> list[Path]:
    return [p for p in MANIFESTS if _load(p.name)["provider"]["type"] in types]


class Node(NamedTuple):
    """What one kind of node offers the deployer: its setup, its Ray start, its resources and labels."""

    name: str
    is_head: bool
    setup: tuple[str, ...]
    start: tuple[str, ...]
    resources: dict[str, float]
    labels: dict[str, str]


def nodes(cfg: dict[str, Any]) -> list[Node]:
    """Head and worker kinds as Ray would run them (setup_commands merged into head/worker setup)."""
    prepared = prepare_config(copy.deepcopy(cfg))
    head_setup = tuple(prepared["head_setup_commands"])
    worker_setup = tuple(prepared["worker_setup_commands"])
    head_start = tuple(prepared["head_start_ray_commands"])
    worker_start = tuple(prepared["worker_start_ray_commands"])
    if cfg["provider"]["type"] == "local":
        # NOTE: the local provider ignores per-type resources/labels; they ride on `ray start` instead.
        return [Node("head", True, head_setup, head_start, *_start_flags(head_start)),
                Node("worker", False, worker_setup, worker_start, *_start_flags(worker_start))]
    out = []
    for name, spec in prepared["available_node_types"].items():
        is_head = name == prepared["head_node_type"]
        # NOTE: a node type's own worker_setup_commands replace the global setup for that type.
        setup = head_setup if is_head else tuple(spec.get("worker_setup_commands", ())) or worker_setup
        out.append(Node(name, is_head, setup, head_start if is_head else worker_start,
                        spec["resources"], spec.get("labels", {})))
    return out


def _start_flags(commands: tuple[str, ...]) -> tuple[dict[str, float], dict[str, str]]:
    start = "\n".join(commands)
    resources = re.search(r"--resources='([^']*)'", start)
    labels = re.search(r"--labels=(\S+)", start)
    res = json.loads(resources.group(1)) if resources else {}
    if "--num-gpus=0" in start:
        res["GPU"] = 0
    return res, parse_node_labels_string(labels.group(1)) if labels else {}


def who(node: Node) -> str:
    return f"{node.name}: resources={node.resources} labels={node.labels}"


def env_file(node: Node) -> tuple[str, str]:
    found = ENV_FILE.search("\n".join(node.setup))
    assert found, f"{node.name}: setup writes no environment file (cat > FILE <<'EOF' ... EOF)"
    return found.group(1), found.group(2)


# ---- Ray's own validation -------------------------------------------------------------------------


def test_every_expected_manifest_exists_with_its_provider() -> None:
    found = {p.name: _load(p.name)["provider"]["type"] for p in MANIFESTS}
    assert {n: found.get(n) for n in EXPECTED_PROVIDERS} == EXPECTED_PROVIDERS


@pytest.mark.parametrize("path", MANIFESTS, ids=ids(MANIFESTS))
def test_ray_accepts_manifest(path: Path) -> None:
    validate_config(prepare_config(load(path)))


@pytest.mark.parametrize("path", by_provider("local"), ids=ids(by_provider("local")))
def test_ray_bootstraps_local_manifest(path: Path) -> None:
    cfg = load(path)
    resolved = _bootstrap_config(cfg, no_config_cache=True)
    validate_config(resolved)
    # Manually managed on-prem: every listed worker is started by `ray up`.
    (node_type,) = resolved["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(cfg["provider"]["worker_ips"])


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection or name lookup fails the test: the steps below must never reach a cloud."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network use in an offline test: {args[1:] or args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def cloud_provider_cls(provider: dict[str, Any]) -> type[NodeProvider]:
    try:
        return _get_node_provider_cls(provider)
    except ImportError as e:  # a failure, not a skip: set-up installs the extra
        pytest.fail(f"{e}\nThe `cloud` extra is missing: run scripts/setup.sh (or pip install -e '.[cloud]').")


CLOUD = by_provider(*CLOUD_PROVIDERS)


@pytest.mark.parametrize("path", CLOUD, ids=ids(CLOUD))
def test_ray_up_imports_the_cloud_node_provider(path: Path, offline: None) -> None:
    provider = load(path)["provider"]
    cls = cloud_provider_cls(provider)
    assert issubclass(cls, NodeProvider) and cls.__name__ == CLOUD_PROVIDERS[provider["type"]]
    # The cloud's own bootstrap (bootstrap_aws / bootstrap_gcp) came with it; it is not called here.
    assert cls.bootstrap_config is not NodeProvider.bootstrap_config


# `ray up` -> create_or_update_cluster -> _bootstrap_config, whose steps are, in this order:
RAY_UP_STEPS = ["_bootstrap_config(config", "prepare_config(config)", "importer(config[\"provider\"])",
                "fillout_available_node_types_resources(config)", "validate_config(config)",
                "provider_cls.bootstrap_config(config)"]


def test_ray_up_steps_are_the_ones_run_offline() -> None:
    # Ray is pinned; this fails on an upgrade that changes the path, so the offline test below is re-read.
    source = inspect.getsource(create_or_update_cluster) + inspect.getsource(_bootstrap_config)
    at = [source.find(step) for step in RAY_UP_STEPS]
    assert -1 not in at and at == sorted(at), dict(zip(RAY_UP_STEPS, at, strict=True))


@pytest.mark.parametrize("path", CLOUD, ids=ids(CLOUD))
def test_ray_up_offline_steps_pass_for_cloud_manifest(path: Path, offline: None) -> None:
    """`_bootstrap_config` up to the cloud: prepare, load the provider, (gcp) fill out resources, validate.

    Not run: AWS's fillout (EC2 DescribeInstanceTypes) and `bootstrap_config` for both clouds. GCP's fillout
    only reads node_config (it adds TPU pod resources) and rejects a node type that is not a Compute instance.
    """
    cfg = prepare_config(load(path))
    kind = cfg["provider"]["type"]
    cloud_provider_cls(cfg["provider"])  # a clear failure when the extra is missing
    provider_cls = _NODE_PROVIDERS[kind](cfg["provider"])
    if kind == "gcp":
        filled = provider_cls.fillout_available_node_types_resources(cfg)
        assert filled["available_node_types"] == cfg["available_node_types"]  # no TPUs: nothing added
        cfg = filled
    validate_config(cfg)


@pytest.mark.parametrize("path", by_provider("gcp"), ids=ids(by_provider("gcp")))
def test_gcp_fillout_rejects_a_node_type_without_machine_type(path: Path, offline: None) -> None:
    cfg = prepare_config(load(path))
    _first_worker(cfg)["node_config"].pop("machineType")
    with pytest.raises(ValueError, match="For a Compute instance, 'machineType' is required"):
        cloud_provider_cls(cfg["provider"]).fillout_available_node_types_resources(cfg)


def _rename(d: dict[str, Any], old: str, new: str) -> None:
    d[new] = d.pop(old)


def _first_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    return next(v for k, v in cfg["available_node_types"].items() if k != cfg["head_node_type"])


BROKEN = [
    ("cluster-aws-h100.yaml", lambda c: _rename(c, "max_workers", "max_worker"),
     jsonschema.ValidationError, r"'max_worker' was unexpected"),
    ("cluster-gcp-a3.yaml", lambda c: _rename(_first_worker(c), "min_workers", "min_worker"),
     jsonschema.ValidationError, r"'min_worker' was unexpected"),
    ("cluster-aws-a100.yaml", lambda c: c["provider"].update(type="awz"),
     NotImplementedError, r"Unsupported node provider: awz"),
    ("cluster-aws-h100.yaml", lambda c: _first_worker(c)["resources"].update(saaf_gpu_h100=0.5),
     jsonschema.ValidationError, r"0\.5 is not of type 'integer'"),
    ("cluster-gcp-a3.yaml", lambda c: c.update(head_node_type="ray_head"),
     ValueError, r"`head_node_type` must be one of `available_node_types`"),
    ("cluster-onprem.yaml", lambda c: c.update(max_worker=2),
     jsonschema.ValidationError, r"'max_worker' was unexpected"),
    ("cluster-onprem.yaml", lambda c: c["provider"].pop("worker_ips"),
     click.ClickException, r"supply a `head_ip` and list of `worker_ips`"),
    ("cluster-onprem.yaml", lambda c: c.update(available_node_types={"gpu": {"resources": {}, "node_config": {}}}),
     click.ClickException, r"available_node_types is not supported for on-premise"),
]


@pytest.mark.parametrize(("name", "breaks", "error", "message"), BROKEN,
                         ids=[f"{n}-{m[:28]}" for n, _, _, m in BROKEN])
def test_ray_rejects_broken_manifest(name: str, breaks, error: type[Exception], message: str) -> None:
    cfg = load(MANIFEST_DIR / name)
    breaks(cfg)
    with pytest.raises(error) as info:
        validate_config(prepare_config(cfg))
    text = info.value.message if isinstance(info.value, click.ClickException) else str(info.value)
    assert re.search(message, text), text


# ---- Saaf invariants ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", MANIFESTS, ids=ids(MANIFESTS))
def test_every_node_installs_the_gpu_extra(path: Path) -> None:
    for node in nodes(load(path)):
        installs = [c for c in node.setup if re.search(r"SAAF_EXTRA=gpu bash scripts/setup\.sh|pip install .*\.\[gpu", c)]
        assert installs, node.name


@pytest.mark.parametrize("path", MANIFESTS, ids=ids(MANIFESTS))
def test_every_ray_start_gets_the_nixl_fabric_environment(path: Path) -> None:
    for node in nodes(load(path)):
        target, body = env_file(node)
        assert re.search(r"^export UCX_TLS=\S", body, re.M), node.name
        assert re.search(r"^export VLLM_NIXL_SIDE_CHANNEL_HOST=\$SAAF_NODE_IP$", body, re.M), node.name
        if node.labels.get("saaf.io/nixl-backend") == "LIBFABRIC":
            assert "export FI_PROVIDER=efa" in body, node.name
        starts = [c for c in node.start if "ray start" in c]
        assert starts, node.name
        for command in starts:
            assert f"source {target} " in command.split("ray start")[0], (node.name, command)


@pytest.mark.parametrize("path", MANIFESTS, ids=ids(MANIFESTS))
def test_gpu_workers_declare_saaf_resources_and_labels(path: Path) -> None:
    all_nodes = nodes(load(path))
    assert sum(n.is_head for n in all_nodes) == 1
    for node in all_nodes:
        validate_node_labels(node.labels)  # Ray's checks: syntax, no reserved ray.io/ prefix
        validate_node_label_syntax(node.labels)
        gpu_types = {k: v for k, v in node.resources.items() if GPU_RESOURCE.fullmatch(k)}
        if node.is_head:
            assert node.resources.get("GPU") == 0 and node.resources.get("saaf_head") == 1, who(node)
            assert "saaf_gpu_node" not in node.resources and not gpu_types, who(node)
            assert node.labels.get("saaf.io/role") == "head", who(node)
            continue
        assert node.resources.get("saaf_gpu_node") == 1, who(node)
        assert len(gpu_types) == 1 and next(iter(gpu_types.values())) > 0, who(node)
        if "GPU" in node.resources:  # cloud node types declare it; on-prem Ray detects it
            assert gpu_types == {next(iter(gpu_types)): node.resources["GPU"]}, who(node)
        assert node.labels.get("saaf.io/role") == "gpu-worker", who(node)
        assert {"saaf.io/gpu", "saaf.io/fabric", "saaf.io/nixl-backend"} <= node.labels.keys(), who(node)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("path", MANIFESTS, ids=ids(MANIFESTS))
def test_every_command_is_valid_bash(path: Path) -> None:
    # YAML folding (>-) and heredocs inside block scalars are easy to get wrong; `bash -n` only parses.
    for node in nodes(load(path)):
        for command in node.setup + node.start:
            run = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True, timeout=10)
            assert run.returncode == 0, (node.name, command, run.stderr)


@pytest.mark.parametrize("path", MANIFESTS, ids=ids(MANIFESTS))
def test_every_ray_start_exports_metrics_and_is_not_loopback(path: Path) -> None:
    for node in nodes(load(path)):
        for command in node.start:
            if "ray start" in command:
                assert "--metrics-export-port=" in command, (node.name, command)
            assert "127.0.0.1" not in command and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in command


@pytest.mark.parametrize("path", by_provider("aws"), ids=ids(by_provider("aws")))
def test_aws_gpu_workers_attach_every_efa_card(path: Path) -> None:
    cfg = load(path)
    # EC2 gives a multi-card instance no public IP, and Ray then only accepts private subnets with this.
    assert cfg["provider"].get("use_internal_ips") is True
    for name, spec in cfg["available_node_types"].items():
        conf = spec["node_config"]
        if name == cfg["head_node_type"]:
            continue
        nics = conf["NetworkInterfaces"]
        # Ray's own rule (bootstrap_aws): subnets and groups only inside the interfaces.
        assert not {"SubnetId", "SubnetIds", "SecurityGroupIds"} & conf.keys(), name
        assert all(n.get("SubnetId") and n.get("Groups") for n in nics), name
        assert [n["NetworkCardIndex"] for n in nics] == list(range(EFA_CARDS[conf["InstanceType"]])), name
        assert [n["DeviceIndex"] for n in nics].count(0) == 1 and nics[0]["DeviceIndex"] == 0, name
        assert all(n["InterfaceType"] in ("efa", "efa-only") for n in nics), name
        assert len({n["SubnetId"] for n in nics}) == 1, f"{name}: EFA needs one subnet (one AZ)"


@pytest.mark.parametrize("path", by_provider("gcp"), ids=ids(by_provider("gcp")))
def test_gcp_zones_and_regions_agree(path: Path) -> None:
    cfg = load(path)
    zone, region = cfg["provider"]["availability_zone"], cfg["provider"]["region"]
    assert zone.startswith(region + "-")
    for name, spec in cfg["available_node_types"].items():
        conf = spec["node_config"]
        for disk in conf["disks"]:
            disk_type = disk["initializeParams"]["diskType"]
            assert disk_type.startswith(f"zones/{zone}/diskTypes/"), (name, disk_type)
        for nic in conf["networkInterfaces"]:
            assert nic["subnetwork"].startswith(f"regions/{region}/subnetworks/"), (name, nic)
        if name != cfg["head_node_type"]:
            assert conf["scheduling"]["onHostMaintenance"] == "TERMINATE", name


@pytest.mark.parametrize("path", by_provider("gcp"), ids=ids(by_provider("gcp")))
def test_gcp_workers_get_no_public_ip(path: Path) -> None:
    """Issue 14: Ray's, NIXL's and the engines' ports stay inside the VPC; only the head is reachable."""
    cfg = load(path)
    for name, spec in cfg["available_node_types"].items():
        if name != cfg["head_node_type"]:
            assert not any(nic.get("accessConfigs") for nic in spec["node_config"]["networkInterfaces"]), name


@pytest.mark.parametrize("path", MANIFESTS, ids=ids(MANIFESTS))
def test_every_node_gets_the_ray_token_and_every_ray_start_uses_it(path: Path) -> None:
    cfg = load(path)
    assert cfg["file_mounts"].get("~/.saaf/ray_token") == "~/.saaf/ray_token"
    for node in nodes(cfg):
        target, body = env_file(node)
        assert re.search(r"^export RAY_AUTH_MODE=token$", body, re.M), node.name
        assert re.search(r"^export RAY_AUTH_TOKEN_PATH=\$HOME/\.saaf/ray_token$", body, re.M), node.name
        assert "RAY_AUTH_MODE=disabled" not in "\n".join(node.setup + node.start), node.name
        checks = [c for c in node.setup if "test -s ~/.saaf/ray_token" in c and "chmod 600 ~/.saaf/ray_token" in c]
        assert checks, node.name  # a node without the token stops its setup with a message
        for command in (c for c in node.start if "ray start" in c):
            assert f"source {target} " in command.split("ray start")[0], (node.name, command)
