"""kvtransfer.check / fabric helpers without Ray: exit codes, failing pairs named, pair listing."""

from __future__ import annotations

import pytest

from kvtransfer import check, fabric
from kvtransfer.fabric import FabricCheckError, PairResult, require_fabric

OK = PairResult("node-a", "node-b", True, 3.2, 0.02, "")
BAD = PairResult("node-b", "node-a", False, 0.0, 0.0, "TimeoutError: READs did not finish within 5.0 s")


def test_require_fabric_names_failing_pairs() -> None:
    require_fabric([OK])
    with pytest.raises(FabricCheckError) as info:
        require_fabric([OK, BAD])
    assert info.value.failed == [BAD]
    assert "prefill node-b -> decode node-a: TimeoutError" in str(info.value)
    assert "node-a -> decode node-b" not in str(info.value)
    with pytest.raises(FabricCheckError, match="no pairs were checked"):
        require_fabric([])


def patch_cli(monkeypatch: pytest.MonkeyPatch, results: list[PairResult]) -> None:
    monkeypatch.setattr(check, "connect", lambda address: False)
    monkeypatch.setattr(check, "fabric_pairs_from_cluster", lambda: [(r.prefill_node, r.decode_node) for r in results])
    monkeypatch.setattr(check, "run_fabric_check", lambda pairs, **kw: results)


def test_cli_exit_codes(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    patch_cli(monkeypatch, [OK])
    assert check.main([]) == 0
    assert "OK" in capsys.readouterr().out

    patch_cli(monkeypatch, [OK, BAD])
    assert check.main(["--json"]) == 1
    captured = capsys.readouterr()
    assert '"ok": false' in captured.out
    assert "prefill node-b -> decode node-a" in captured.err


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        check.main(["--mib", "0"])
    assert "--mib 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check.main(["--env", "UCX_TLS"])
    assert "--env 'UCX_TLS': write KEY=VALUE" in capsys.readouterr().err


def test_cli_passes_backend_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict = {}
    patch_cli(monkeypatch, [OK])
    monkeypatch.setattr(check, "run_fabric_check", lambda pairs, **kw: seen.update(kw) or [OK])
    assert check.main(["--backend", "LIBFABRIC", "--env", "UCX_TLS=tcp", "--mib", "4"]) == 0
    assert seen["backends"] == ["LIBFABRIC"] and seen["env"] == {"UCX_TLS": "tcp"}
    assert seen["nbytes"] == 4 * 2**20


def fake_nodes(*states: tuple[str, bool]) -> list[dict]:
    return [{"NodeID": node, "Alive": alive} for node, alive in states]


def test_pairs_from_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fabric.ray, "nodes", lambda: fake_nodes(("n1", True)))
    assert fabric.fabric_pairs_from_cluster() == [("n1", "n1")]

    monkeypatch.setattr(fabric.ray, "nodes", lambda: fake_nodes(("n1", True), ("n2", True), ("n3", False)))
    assert fabric.fabric_pairs_from_cluster() == [("n1", "n2"), ("n2", "n1")]
    assert fabric.fabric_pairs_from_cluster(["n1"], ["n1", "n2"]) == [("n1", "n1"), ("n1", "n2")]
    with pytest.raises(ValueError, match=r"\['n3'\] are not alive"):
        fabric.fabric_pairs_from_cluster(["n3"], ["n1"])


def test_run_fabric_check_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="memory='HBM'"):
        fabric.run_fabric_check([("a", "b")], memory="HBM")
    with pytest.raises(ValueError, match="fault='explode'"):
        fabric.run_fabric_check([("a", "b")], fault="explode")
