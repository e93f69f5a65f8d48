"""benchmarks/compare/seeds.py: several compare runs judged together, per rate over arrival seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.compare import seeds


def _run(root: Path, mode: str, seed: int, disagg: dict[str, int], colo: dict[str, int], **over) -> Path:
    d = root / f"{mode}-{seed}"
    d.mkdir()
    report = {"disaggregation": mode, "seed": seed, "git": {"commit": "abc1234" * 5 + "ab", "dirty": False},
              "workload": {"name": "chat"}, "slo": {"ttft_s": 2.0, "tpot_s": 0.15}, "rates": [0.5, 3.0],
              "num_requests": 30, "model": "smollm2", "policy": "goodput", "failure": None,
              "outcomes": {"disaggregated": {k: {"met": v, "late": 1} for k, v in disagg.items()},
                           "colocated": {k: {"met": v, "late": 0} for k, v in colo.items()}}}
    report.update(over)
    (d / "report.json").write_text(json.dumps(report))
    return d


def test_met_is_summed_per_rate_and_auto_is_judged_seed_by_seed(tmp_path: Path, capsys) -> None:
    dirs = [_run(tmp_path, "auto", 0, {"0.5": 30, "3.0": 20}, {"0.5": 30, "3.0": 21}),
            _run(tmp_path, "always", 0, {"0.5": 29, "3.0": 15}, {"0.5": 30, "3.0": 22}),
            _run(tmp_path, "auto", 1, {"0.5": 28, "3.0": 18}, {"0.5": 27, "3.0": 12}),
            _run(tmp_path, "always", 1, {"0.5": 28, "3.0": 16}, {"0.5": 30, "3.0": 14})]
    rows = seeds.summarise(seeds.load(dirs))["rows"]
    low, high = rows
    assert (low["rate"], low["auto"], low["always"], low["auto_at_least_both"]) == (0.5, [30, 28], [29, 28], [0, 1])
    # NOTE: seed 0 at 3 req/s: colocated met 21 in auto's own run: auto's 20 is not enough
    assert (high["auto"], high["colocated_in_auto_runs"], high["auto_at_least_both"]) == ([20, 18], [21, 12], [1])
    assert seeds.main([str(d) for d in dirs]) == 0
    out = capsys.readouterr().out
    assert "| 3 | **38** (20, 18) | 31 (15, 16) | 33 (21, 12) | 36 (22, 14) | 2 / 2 | 1 of 2 |" in out


def test_runs_of_different_workloads_are_refused(tmp_path: Path) -> None:
    dirs = [_run(tmp_path, "auto", 0, {"0.5": 30, "3.0": 20}, {"0.5": 30, "3.0": 21}),
            _run(tmp_path, "always", 0, {"0.5": 29, "3.0": 15}, {"0.5": 30, "3.0": 22}, workload={"name": "mixed"})]
    with pytest.raises(SystemExit, match="workload"):
        seeds.load(dirs)
    with pytest.raises(SystemExit, match="not found"):
        seeds.load([tmp_path / "nothing"])


def test_lone_request_ttft_is_judged_on_the_idle_probes_of_every_seed_pooled(tmp_path: Path, capsys) -> None:
    def probes(colo: list[float], dis: list[float]) -> dict:
        return {"modes": {"colocated": {"idle_probe": {"ttft_s": colo}},
                          "disaggregated": {"idle_probe": {"ttft_s": dis}}}}

    # NOTE: seed 1's probe alone is 20% slow (one slow moment); pooled, the shapes are 2% apart
    dirs = [_run(tmp_path, "auto", 0, {"0.5": 30, "3.0": 20}, {"0.5": 30, "3.0": 21},
                 **probes([0.40, 0.41, 0.42], [0.40, 0.41, 0.42])),
            _run(tmp_path, "auto", 1, {"0.5": 30, "3.0": 20}, {"0.5": 30, "3.0": 21},
                 **probes([0.40, 0.40, 0.41], [0.48, 0.49, 0.41])),
            _run(tmp_path, "always", 0, {"0.5": 29, "3.0": 15}, {"0.5": 30, "3.0": 22})]  # an old run: no probe
    lone = seeds.summarise(seeds.load(dirs))["lone"]
    assert lone == [{"mode": "auto", "requests": [6, 6], "colocated_ttft_p50_s": 0.405,
                     "disaggregated_ttft_p50_s": 0.415, "ratio": 1.025}]
    assert seeds.main([str(d) for d in dirs]) == 0
    assert "`auto` runs: TTFT p50 disaggregated 0.415 s (6 requests) vs colocated 0.405 s (6): 1.025x" in \
        capsys.readouterr().out


def test_step_rows_print_each_run_and_rate_from_its_report(tmp_path: Path, capsys) -> None:
    def counts(met: int, late: int, refused: int, p50: float | None, mx: float | None, usd: float) -> dict:
        return {"met": met, "late": late, "refused": refused, "refusal_p50_s": p50, "refusal_max_s": mx,
                "dollars_per_m_tokens": usd}

    lat = {"ttft_p50": 0.6234, "ttft_p99": 1.4099, "itl_p50": 0.0781, "itl_p99": 0.2844, "tpot_p50": 0.0834,
           "tpot_p99": 0.1094}
    router = {"rows": [{"rate": 1.5, "mode": "colocated", "ttft": {"p50_ratio": 9.0}, "tpot": {}},
                       {"rate": 1.5, "mode": "disaggregated",
                        "ttft": {"p50_ratio": 1.333, "p90_ratio": 0.99, "log_error_mean": -0.012,
                                 "log_error_sd": 0.27},
                        "tpot": {"p50_ratio": 1.0, "p90_ratio": 1.04, "log_error_mean": 0.031,
                                 "log_error_sd": 0.208}}]}
    over = {"rates": [1.5], "rows": [{"rate": 1.5, "disaggregated": lat}], "router": router}
    d = _run(tmp_path, "auto", 3, {}, {}, **over)
    rep = json.loads((d / "report.json").read_text())
    rep["outcomes"] = {"colocated": {"1.5": counts(30, 0, 0, None, None, 0.0806)},
                       "disaggregated": {"1.5": counts(29, 0, 1, 0.4675, 0.4679, 0.0836)}}
    (d / "report.json").write_text(json.dumps(rep))
    out = seeds.step_rows(seeds.load([d]))
    head, rule, row = out.splitlines()
    assert head.startswith("| router mode, arrival seed | rate req/s | met both targets (of 30)") and rule.count("---") == 12
    assert row == ("| `auto`, seed 3 | 1.5 | 30 / **29** | 0 / 0 | 0 / 1 (468 / 468) | 0.62 / 1.41 | 78 / 284 | 83 / 109 "
                   "| 0.08 / 0.08 | 1.33 / 0.99 | 1.00 / 1.04 | -0.01 / 0.27; +0.03 / 0.21 |")


def test_host_steal_over_every_step_is_reported_where_the_runs_recorded_it(tmp_path: Path, capsys) -> None:
    def res(*steal: float | None) -> dict:
        return {"resources": {"colocated": {"0.5": {"machine_steal_cores": steal[0]}, "3.0": {}},
                              "disaggregated": {"0.5": {"machine_steal_cores": steal[1]},
                                                "3.0": {"machine_steal_cores": steal[2]}}}}

    dirs = [_run(tmp_path, "auto", 0, {"0.5": 30, "3.0": 20}, {"0.5": 30, "3.0": 21}, **res(0.1, 0.4, 0.2)),
            _run(tmp_path, "always", 0, {"0.5": 29, "3.0": 15}, {"0.5": 30, "3.0": 22})]  # an old run: none
    assert seeds.summarise(seeds.load(dirs))["steal"] == {"steps": 3, "median_cores": 0.2, "max_cores": 0.4}
    assert seeds.main([str(d) for d in dirs]) == 0
    assert "over the 3 steps: median 0.20, max 0.40" in capsys.readouterr().out
    assert seeds.summarise(seeds.load(dirs[1:]))["steal"] is None
