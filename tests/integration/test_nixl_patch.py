"""vLLM really loads our `vllm.general_plugins` entry point, and its NIXL agents then idle cheaply.

A fresh process does what every vLLM process (EngineCore included, vllm/v1/engine/core.py) does at
start, `load_general_plugins()`, then builds the agent the way NixlConnector does (vLLM's NixlWrapper
and nixl_agent_config with telemetry and 4 UCX threads). Run with -s to see the idle CPU figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, logging, sys
from importlib.metadata import entry_points
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from vllm.plugins import load_general_plugins
load_general_plugins()
from kvtransfer import nixl_patch
from kvtransfer.nixl_agent import idle_cpu_fraction
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
agent = NixlWrapper("engine-probe", nixl_agent_config(num_threads=4, capture_telemetry=True))
print(json.dumps({
    "entry_points": [ep.value for ep in entry_points(group="vllm.general_plugins")],
    "registered_us": nixl_patch.registered_delay_us(),
    "patched": nixl_patch.is_patched(),
    "delay_us": getattr(agent.agent, "saaf_pthr_delay_us", None),
    "cpu": idle_cpu_fraction(2.0),
}))
"""


def test_vllm_loads_plugin_and_agent_gets_delay() -> None:
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "SAAF_NIXL_PTHR_DELAY_US": "1000"}
    env.pop("VLLM_PLUGINS", None)  # an allow-list without our plugin would skip it
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nvLLM process after load_general_plugins(): idle NixlWrapper agent {report['cpu']:.1%} of a core")
    assert "kvtransfer.nixl_patch:register" in report["entry_points"]
    assert report["registered_us"] == 1000, "vLLM did not call kvtransfer.nixl_patch.register()"
    assert report["patched"] and report["delay_us"] == 1000
    assert "NIXL progress-thread delay" in proc.stderr
    assert report["cpu"] < 0.15
