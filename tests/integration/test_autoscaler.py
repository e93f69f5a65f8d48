"""Issue 16 on CPU: what the planner loop asks of Ray's autoscaler grows and shrinks a real autoscaling
cluster. The cluster is Ray's own fake multi-node provider (`fake_multinode`, what
`ray.cluster_utils.AutoscalingCluster` starts; its autoscaler launches and removes real raylets on this
machine as a cloud provider would launch VMs), started here with `ray start --head --block` and ended by
PID (AutoscalingCluster's own start and shutdown stop every Ray instance on the machine, others' included).

The fake nodes advertise GPUs (none exist): the test sizes pools of tensor-parallel GPU engines, whose
bundles (cluster.control.autoplan.resource_bundles, from cluster.control.placer.engine_shape) only fit
on nodes the autoscaler has to add."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtransfer.config import free_port

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration

NODE = {"CPU": 2, "GPU": 2, "object_store_memory": 80_000_000}
MAX_NODES = 3


def _config(gcs_address: str) -> dict:
    return {
        "cluster_name": "saaf-fake", "max_workers": MAX_NODES, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,  # NOTE: 6 s: an idle fake node goes soon after nothing asks for it
        # NOTE: gcs_address: without it the fake provider points its nodes at port 6379 of this machine's
        # interface address, not at the head
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "gpu.2x": {"resources": NODE, "node_config": {}, "min_workers": 0, "max_workers": MAX_NODES},
        },
        "head_node_type": "ray.head.default", "auth": {}, "docker": {}, "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
        "rsync_filter": [], "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


@pytest.fixture(scope="module")
def autoscaling_cluster(tmp_path_factory, ray_session):  # NOTE: ray_session: its token auth env (conftest)
    from cluster.control.runtime import LOOPBACK_ENV
    from engine.procs import descendants, reap

    port = free_port()
    cfg = tmp_path_factory.mktemp("fake-autoscaler") / "cluster.json"
    cfg.write_text(json.dumps(_config(f"127.0.0.1:{port}")))
    env = dict(os.environ, **{**LOOPBACK_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_FAKE_CLUSTER": "1",
                              "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
    proc = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block", "--num-cpus=1",
         f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
         "--object-store-memory=100000000", f"--autoscaling-config={cfg}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        assert _alive(address, want=1, timeout_s=90) == 1, "the autoscaling head did not come up"
        yield address
    finally:
        ours = descendants(proc.pid)  # NOTE: the fake nodes' raylets are the autoscaler's children
        proc.kill()
        proc.wait(30)
        reap(ours, grace_s=1)


def _driver(address: str, body: str, timeout_s: float = 150) -> str:
    """``body`` in a fresh driver attached to the cluster (this process is attached to the session's Ray);
    what it printed last through ``out()`` (the driver also prints the autoscaler's events)."""
    code = (f"import json, time, ray\nray.init(address='{address}', logging_level=40)\n"
            f"def out(v): print('RESULT ' + str(v), flush=True)\n{body}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                       env=dict(os.environ), cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln[7:] for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, r.stdout[-2000:]
    return lines[-1]


def _alive(address: str, want: int, timeout_s: float) -> int:
    """Alive nodes once there are `want` of them (bounded: the count at the deadline otherwise)."""
    body = (f"t = time.time() + {timeout_s}\n"
            "n = lambda: len([x for x in ray.nodes() if x['Alive']])\n"
            f"while n() != {want} and time.time() < t: time.sleep(1)\n"
            "out(n())")
    return int(_driver(address, body, timeout_s + 60))


def test_the_planner_loops_request_grows_nodes_and_clearing_it_lets_them_go(autoscaling_cluster):
    from cluster.control.autoplan import resource_bundles
    from cluster.control.placer import engine_shape

    shape = engine_shape("cuda", 2, 1, 1.0, 1, gpus_per_node=2)  # a TP=2 engine: both GPUs of one node
    bundles = resource_bundles(shape, 1) + resource_bundles(shape, 2)  # 1 prefill + 2 decode engines
    assert bundles == [{"CPU": 1, "GPU": 2.0}] * 3
    # the same call the planner loop makes each interval, from a driver of that cluster
    ask = ("from cluster.control.autoplan import request_pool_resources\n"
           f"out(request_pool_resources({bundles!r}))")
    t0 = time.monotonic()
    assert _driver(autoscaling_cluster, ask) == "True"
    grown = _alive(autoscaling_cluster, want=1 + 3, timeout_s=120)
    print(f"\nautoscaler: {grown - 1} fake GPU nodes launched {time.monotonic() - t0:.1f}s after the request")
    assert grown == 4, f"the autoscaler launched {grown - 1} of the 3 nodes the request needs"
    gpus, addresses = json.loads(_driver(autoscaling_cluster, (
        "out(json.dumps([ray.cluster_resources().get('GPU', 0), "
        "sorted({n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']})]))")))
    # NOTE: one machine: every node on one address (Ray resolves 127.0.0.1 to this machine's interface
    # address for any multi-node cluster: services.resolve_ip_for_localhost; nothing leaves the machine)
    assert gpus == 6 and len(addresses) == 1, addresses
    # the whole desired set is sent each interval: a smaller one (here: nothing) lets idle nodes go
    clear = "from cluster.control.autoplan import request_pool_resources\nout(request_pool_resources([]))"
    assert _driver(autoscaling_cluster, clear) == "True"
    assert _alive(autoscaling_cluster, want=1, timeout_s=120) == 1, "idle nodes stayed after the request cleared"
