"""nixl_patch: the progress-thread delay reaches every agent, and an idle agent stops burning a core.

Reproduces the bug: stock nixl 1.5.1 agents spin ~100% of a core idle; patched ones use a few %.
Run with -s to see the measured idle CPU figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvtransfer import nixl_patch

ROOT = Path(__file__).resolve().parents[2]
IDLE_SECONDS = 2.0

# Creates one agent through nixl's Python API in a fresh process; reports its delay and idle CPU.
PROBE = """
import json, sys
from kvtransfer import nixl_patch
from kvtransfer.nixl_agent import idle_cpu_fraction
order = sys.argv[1]
if order == "register-first":
    nixl_patch.register()
import nixl
from nixl._api import nixl_agent, nixl_agent_config
if order == "import-first":
    nixl_patch.register()
agent = nixl_agent("probe", nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
print(json.dumps({
    "patched": nixl_patch.is_patched(),
    "delay_us": getattr(agent.agent, "saaf_pthr_delay_us", None),
    "cpu": idle_cpu_fraction(float(sys.argv[2])),
}))
"""


def run_probe(order: str, delay_env: str | None) -> dict:
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    env.pop(nixl_patch.PTHR_DELAY_ENV, None)
    if delay_env is not None:
        env[nixl_patch.PTHR_DELAY_ENV] = delay_env
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, order, str(IDLE_SECONDS)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture()
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_patch, "_registered_delay_us", None)
    monkeypatch.delenv(nixl_patch.PTHR_DELAY_ENV, raising=False)


def fake_bindings() -> types.ModuleType:
    class Config:
        def __init__(self) -> None:
            self.useProgThread = True
            self.pthrDelay = 0

    class Agent:
        def __init__(self, name: str, config: Config) -> None:
            self.name = name
            self.native_delay = config.pthrDelay

    module = types.ModuleType("nixl_fake._bindings")
    module.nixlAgent = Agent
    module.nixlAgentConfig = Config
    return module


def test_delay_from_env(fresh_state: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert nixl_patch.pthr_delay_us_from_env() == nixl_patch.DEFAULT_PTHR_DELAY_US
    monkeypatch.setenv(nixl_patch.PTHR_DELAY_ENV, "250")
    assert nixl_patch.pthr_delay_us_from_env() == 250
    for bad in ("fast", "-1", "5000000"):
        monkeypatch.setenv(nixl_patch.PTHR_DELAY_ENV, bad)
        with pytest.raises(ValueError, match=rf"SAAF_NIXL_PTHR_DELAY_US='{bad}'.*0\.\.1000000"):
            nixl_patch.pthr_delay_us_from_env()


def test_patch_sets_delay_only_where_zero_and_is_idempotent() -> None:
    bindings = fake_bindings()
    assert nixl_patch.patch_bindings(bindings, 700)
    first = bindings.nixlAgent
    assert not nixl_patch.patch_bindings(bindings, 900)
    assert bindings.nixlAgent is first and nixl_patch.is_patched(bindings)

    assert bindings.nixlAgent("a", bindings.nixlAgentConfig()).native_delay == 700
    explicit = bindings.nixlAgentConfig()
    explicit.pthrDelay = 50
    assert bindings.nixlAgent("b", explicit).native_delay == 50
    no_thread = bindings.nixlAgentConfig()
    no_thread.useProgThread = False
    assert bindings.nixlAgent("c", no_thread).native_delay == 0


def test_register_is_idempotent_and_quiet_without_nixl(
    fresh_state: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(nixl_patch, "_loaded_bindings", lambda: None)
    monkeypatch.setattr(nixl_patch, "_find_spec", lambda name: False)
    caplog.set_level("INFO", logger=nixl_patch.__name__)
    nixl_patch.register()
    nixl_patch.register()
    assert [r.getMessage() for r in caplog.records] == [
        "nixl is not installed: NIXL progress-thread delay patch not applied"
    ]
    assert nixl_patch.registered_delay_us() == nixl_patch.DEFAULT_PTHR_DELAY_US


@pytest.mark.parametrize("order", ["register-first", "import-first"])
def test_agent_gets_delay_and_idles_cheaply(order: str) -> None:
    patched = run_probe(order, None)
    print(f"\nidle NIXL agent, patched ({order}, 1000 us): {patched['cpu']:.1%} of a core")
    assert patched["patched"] and patched["delay_us"] == nixl_patch.DEFAULT_PTHR_DELAY_US
    assert patched["cpu"] < 0.15, f"patched idle agent still burns {patched['cpu']:.0%} of a core"


def test_stock_agent_busy_polls() -> None:
    """The bug itself: with the delay disabled (=0, stock nixl) an idle agent spins a core."""
    stock = run_probe("register-first", "0")
    print(f"\nidle NIXL agent, stock (delay 0): {stock['cpu']:.1%} of a core")
    assert not stock["patched"] and stock["delay_us"] is None
    # NOTE: on a loaded 2-core box the spinner gets less than a full core; still far above patched.
    assert stock["cpu"] > 0.35, f"stock agent used only {stock['cpu']:.0%}: is the box overloaded?"
