"""The generated results index: committed page is current, provenance shapes normalise, rows come in order."""

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from benchmarks import results_page
from benchmarks.results_page import NO_PROVENANCE, RESULTS, Provenance, provenance, render, rows

COMMIT = "0123456789abcdef0123456789abcdef01234567"
WHEN = datetime(2026, 12, 1, 15, 27, 2, tzinfo=UTC)


def test_committed_page_is_current() -> None:
    page = RESULTS / "README.md"
    assert page.is_file(), f"{page} is missing: run `{results_page.COMMAND}`"
    assert page.read_text() == render(RESULTS), (
        f"{page} is stale: regenerate it with `{results_page.COMMAND}`"
    )


def test_git_machine_shape() -> None:
    obj = {
        "command": ["python", "-m", "benchmarks.footprint", "--out", "x.json"],
        "started_at": "2026-12-01T15:24:34+00:00",
        "finished_at": "2026-12-01T15:27:02+00:00",
        "git": {"commit": COMMIT, "dirty": True, "dirty_files": 2},
        "machine": {"cpu_model": "AMD EPYC", "nproc": 2},
    }
    assert provenance(obj) == Provenance(
        WHEN, COMMIT, True, "AMD EPYC", "python -m benchmarks.footprint --out x.json"
    )


def test_started_at_used_when_not_finished() -> None:
    obj = {"command": "c", "started_at": "2026-12-01T16:27:02+01:00", "git": {"commit": COMMIT}}
    assert provenance(obj) == Provenance(WHEN, COMMIT, False, None, "c")


@pytest.mark.parametrize("obj", [
    {"provenance": {"date": "2026-12-01T15:27:02+00:00", "git_commit": COMMIT, "cpu": "Xeon", "command": "v"},
     "rows": []},
    {"date": "2026-12-01T15:27:02+00:00", "git_commit": COMMIT, "cpu": "Xeon", "command": "v", "rows": []},
], ids=["nested-provenance", "top-level-date-commit"])
def test_date_commit_cpu_command_shapes(obj: dict) -> None:
    assert provenance(obj) == Provenance(WHEN, COMMIT, False, "Xeon", "v")


def test_meta_shape_gives_its_date() -> None:
    obj = {"meta": {"date": "2026-12-01 15:27:02 +0000", "host": "vm", "cpus": 2}, "results": []}
    assert provenance(obj) == Provenance(WHEN, None, False, None, None)


def test_raw_json_nests_its_report() -> None:
    obj = {"report": {"command": "r", "finished_at": "2026-12-01T15:27:02+00:00", "git": {"commit": COMMIT}}}
    assert provenance(obj) == Provenance(WHEN, COMMIT, False, None, "r")


def test_no_provenance() -> None:
    assert provenance({"requests": 10, "checks": {"a": "PASS"}}) is None


def _write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_artefact_without_provenance_gets_remeasure_row(tmp_path: Path) -> None:
    _write(
        tmp_path / "soak-cpu.json", {"requests": 2, "answered": 2, "checks": {"one": "PASS", "two": "FAIL"}}
    )
    (row,) = rows(tmp_path)
    assert row.section == "Footprint, start-up & soak"
    assert row.cells[0] == "[soak-cpu.json](soak-cpu.json)"
    assert row.cells[2:6] == (NO_PROVENANCE, "-", "-", "-")
    assert row.cells[6] == "checks 1/2 PASS; answered 2/2"
    assert NO_PROVENANCE in render(tmp_path)


def test_tree_rows_in_section_order(tmp_path: Path) -> None:
    git = {"commit": COMMIT, "dirty": True}
    _write(
        tmp_path / "kvtransfer-x.json",
        {"command": "k" * 150, "finished_at": "2026-12-01T15:27:02Z", "git": git},
    )
    (tmp_path / "kvtransfer-x.md").write_text("intro\n# Block transfers\n")
    for seed, day in ((0, "02"), (1, "03")):
        run = {
            "command": f"c {seed}",
            "finished_at": f"2026-12-{day}T10:00:00+00:00",
            "git": {"commit": COMMIT},
        }
        _write(tmp_path / "abuse-dir" / f"s{seed}" / "raw.json", {"report": run})
    _write(
        tmp_path / "abuse-dir" / "s0" / "mode" / "report.json",
        {"command": "part", "finished_at": "2027-01-01"},
    )
    (tmp_path / "README.md").write_text("old page\n")
    first, second = rows(tmp_path)
    assert (first.section, first.name) == ("Security / abuse", "abuse-dir")
    assert first.cells[0] == "[abuse-dir/](abuse-dir/)"
    assert first.cells[2] == "2026-12-02 10:00 to 2026-12-03 10:00 (2 files)"
    assert first.cells[3] == "0123456" and first.cells[5] == "`c 0` (+1 more)"
    assert (second.section, second.name) == ("KV transfer", "kvtransfer-x")
    assert second.cells[:4] == (
        "[kvtransfer-x.json](kvtransfer-x.json) · [kvtransfer-x.md](kvtransfer-x.md)",
        "Block transfers",
        "2026-12-01 15:27",
        "0123456 (dirty tree)",
    )
    assert second.cells[5] == "`" + "k" * 97 + "...`"
    page = render(tmp_path)
    assert page.index("## Security / abuse") < page.index("## KV transfer")
    assert render(tmp_path) == page


def test_check_and_write(tmp_path: Path, capsys) -> None:
    _write(tmp_path / "zzz.json", {"date": "2026-12-01T15:27:02+00:00", "git_commit": COMMIT})
    assert results_page.main(["--check", "--results", str(tmp_path)]) == 1
    assert results_page.COMMAND in capsys.readouterr().err
    assert not (tmp_path / "README.md").exists()
    assert results_page.main(["--results", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "zzz.json"]
    assert "## Other" in (tmp_path / "README.md").read_text()
    assert results_page.main(["--check", "--results", str(tmp_path)]) == 0


def test_a_run_inside_a_result_gets_its_own_row(tmp_path: Path) -> None:
    """A sub-directory with its own summary and commit (a later run filed under a result) is a row of its own;
    per-mode parts of the parent's run (no commit of their own) are not."""
    git = {"command": "python -m placement validate", "git": {"commit": "a" * 40}, "machine": {"cpu_model": "X"},
           "finished_at": "2026-12-05T09:00:00+00:00"}
    _write(tmp_path / "prediction-validation" / "results.json", git)
    _write(tmp_path / "prediction-validation" / "replay" / "results.json",
           dict(git, git={"commit": "b" * 40}, command="python -m placement replay-validate"))
    _write(tmp_path / "prediction-validation" / "part" / "report.json", {"command": "see ../report.md"})
    names = [r.name for r in rows(tmp_path)]
    assert names == ["prediction-validation", "prediction-validation/replay"]
    assert "bbbbbbb" in render(tmp_path) and "[prediction-validation/replay/]" in render(tmp_path)
