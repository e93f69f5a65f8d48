"""One Ray cluster and one disaggregated SmolLM2 deployment for the whole integration session."""

from __future__ import annotations

import os

import pytest

from kvtransfer.config import free_port
from tests.helpers.parity_table import TOOL_ARGS

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# NOTE: no RAY_AUTH_MODE here: the session's embedded Ray runs with token auth, as a user's does (connect()
# gives it a fresh token and puts RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH into this process's environment, so the
# clusters and drivers the tests start as subprocesses share that token).


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from cluster.control.runtime import connect

    connect(None, num_cpus=16, object_store_mib=256, namespace="saaf-test")
    yield ray
    from cluster.deploy import shutdown_embedded

    shutdown_embedded()


@pytest.fixture(scope="session")
def deployment_started(ray_session):
    """The session's deployment, starting in a background thread: a real disaggregated deployment of 1 prefill
    + 1 decode SmolLM2 engine behind the Serve endpoint. A future of lifecycle.start's result.

    NOTE: the parity module asks for it before it starts vLLM's own server, so that the two start-ups
    (mostly single-threaded imports) overlap on the box's two cores instead of running one after the other."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster.config import parse_config
    from cluster.control import lifecycle

    cfg = parse_config({
        "name": "itest",
        "mode": "disaggregated",
        "engine": {"model": "smollm2", "kv_cache_mib": 128, "max_model_len": 1024},
        "pools": {"prefill": 1, "decode": 1},
        # NOTE: the KV integrity check on (opt-in for users): every transfer of the suite is checked, so a
        # false mismatch anywhere would show as a recompute (test_disagg asserts none); fault injection for
        # test_kv_integrity, which corrupts one pull on purpose
        "transfer": {"transfer_timeout_s": 20, "kv_lease_s": 10, "integrity": True, "fault_injection": True},
        # NOTE: admission off here (the default is goodput with admission): these tests compare outputs and
        # faults and must see every request served; test_admission runs a goodput ingress on these pools.
        "router": {"policy": "least_loaded"},
        "serve": {"port": free_port(), "request_timeout_s": 120, "token_timeout_s": 60,
                  "vllm_args": TOOL_ARGS},
        "ray": {"namespace": "saaf-test"},
        "health": {"interval_s": 1, "timeout_s": 5, "failures": 2},
        "worker_cpus": 1,
    })
    pool = ThreadPoolExecutor(1, thread_name_prefix="itest-deploy")
    future = pool.submit(lifecycle.start, cfg, ready_timeout_s=600)
    yield future
    pool.shutdown(wait=True)  # NOTE: bounded by lifecycle.start's own ready timeout
    if future.exception() is None:
        lifecycle.stop(future.result()["config"])


@pytest.fixture(scope="session")
def deployment(deployment_started):
    """The session's deployment once it is up (see deployment_started)."""
    return deployment_started.result(timeout=900)


# NOTE: for development only: SAAF_TEST_ENDPOINT=http://127.0.0.1:PORT runs the HTTP-only tests against a
# deployment that is already up (model SAAF_TEST_MODEL), instead of starting the session's own.
DEV_ENDPOINT = os.environ.get("SAAF_TEST_ENDPOINT")


@pytest.fixture(scope="session")
def endpoint(request) -> str:
    if DEV_ENDPOINT:
        return DEV_ENDPOINT
    return request.getfixturevalue("deployment")["endpoint"]


@pytest.fixture(scope="session")
def model_name(request) -> str:
    if DEV_ENDPOINT:
        return os.environ.get("SAAF_TEST_MODEL", "SmolLM2-135M-Instruct")
    return request.getfixturevalue("deployment")["model"]


@pytest.fixture(scope="session")
def colocated_worker(ray_session, deployment):
    """A colocated engine with the same model and settings, for output comparisons."""
    import ray

    from engine.colocated import ColocatedWorker

    cfg = deployment["config"].engine
    h = ray.remote(ColocatedWorker).options(num_cpus=1).remote("colo-ref", cfg.model_dump(), None)
    ray.get(h.info.remote(), timeout=300)
    yield h
    ray.kill(h, no_restart=True)


@pytest.fixture(scope="session")
def workers(ray_session, deployment):
    """{worker_id: (role, handle)} of the deployment's pools."""
    import ray

    from cluster.control.lifecycle import controller_name

    cfg = deployment["config"]
    ctl = ray.get_actor(controller_name(cfg), namespace=cfg.ray.namespace)
    _, members = ray.get(ctl.members.remote(), timeout=30)
    return {wid: (role, h) for wid, role, h, _ in members}
