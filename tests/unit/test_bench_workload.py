"""Workload lengths, open-loop arrivals, trace files and local prompts."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest

from benchmarks.workload import (
    ChatWorkload,
    LongDocWorkload,
    TraceWorkload,
    arrival_times,
    build_requests,
    make_prompt,
)


def test_poisson_arrivals_have_the_rate_and_cv_one() -> None:
    times = arrival_times(4.0, 20000, None, 1.0, np.random.default_rng(0))
    gaps = np.diff(times)
    assert len(times) == 20000 and times[0] == 0.0
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)


def test_gamma_arrivals_have_the_requested_burstiness() -> None:
    gaps = np.diff(arrival_times(2.0, 20000, None, 3.0, np.random.default_rng(1)))
    assert np.mean(gaps) == pytest.approx(0.5, rel=0.1)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(3.0, rel=0.1)


def test_arrivals_stop_at_the_first_bound() -> None:
    assert len(arrival_times(10.0, 5, 100.0, 1.0, np.random.default_rng(0))) == 5
    times = arrival_times(10.0, None, 2.0, 1.0, np.random.default_rng(0))
    assert max(times) < 2.0 and 10 < len(times) < 40
    with pytest.raises(ValueError, match="rate"):
        arrival_times(0.0, 5, None, 1.0, np.random.default_rng(0))


def test_chat_lengths_are_lognormal_and_clipped() -> None:
    w = ChatWorkload(input_median=100, input_sigma=0.5, output_median=20, output_sigma=0.5, max_input=150)
    lengths = w.lengths(4000, np.random.default_rng(0))
    ins = [i for i, _ in lengths]
    assert max(ins) == 150 and min(ins) >= 1
    assert statistics.median(ins) == pytest.approx(100, rel=0.05)
    assert statistics.median(o for _, o in lengths) == pytest.approx(20, rel=0.1)


def test_longdoc_lengths_stay_within_jitter() -> None:
    lengths = LongDocWorkload(1000, 10, jitter=0.1).lengths(500, np.random.default_rng(0))
    assert all(900 <= i <= 1100 and 9 <= o <= 11 for i, o in lengths)
    with pytest.raises(ValueError, match="jitter"):
        LongDocWorkload(1000, 10, jitter=1.5)


def test_prompt_has_one_word_per_token() -> None:
    prompt = make_prompt(37, np.random.default_rng(0))
    assert len(prompt.split()) == 37
    assert make_prompt(5, np.random.default_rng(1)) != make_prompt(5, np.random.default_rng(2))


def test_build_requests_same_seed_same_lengths_at_every_rate() -> None:
    w = ChatWorkload(64, 0.5, 16, 0.5)
    slow = build_requests(w, 1.0, 20, None, seed=7)
    fast = build_requests(w, 4.0, 20, None, seed=7)
    assert [(s.input_len, s.output_len, s.prompt) for s in slow] == [(s.input_len, s.output_len, s.prompt) for s in fast]
    assert fast[-1].arrival_s == pytest.approx(slow[-1].arrival_s / 4)
    with pytest.raises(ValueError, match="bound the run"):
        build_requests(w, 1.0, None, None)


def test_max_total_len_clips_input_then_output() -> None:
    specs = build_requests(LongDocWorkload(1000, 100, jitter=0.0), 1.0, 3, None, max_total_len=512)
    assert all(s.input_len == 412 and s.output_len == 100 for s in specs)
    specs = build_requests(LongDocWorkload(10, 600, jitter=0.0), 1.0, 1, None, max_total_len=512)
    assert (specs[0].input_len, specs[0].output_len) == (1, 511)


def test_trace_csv_with_arrivals_is_replayed(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("input_len,output_len,arrival_s\n10,5,0.0\n20,6,0.5\n30,7,1.5\n")
    w = TraceWorkload.from_file(path)
    specs = build_requests(w, None, None, 1.0)  # duration bound drops the 1.5 s arrival
    assert [(s.input_len, s.output_len, s.arrival_s) for s in specs] == [(10, 5, 0.0), (20, 6, 0.5)]
    cycled = build_requests(w, 2.0, 5, None)  # with a rate, lengths cycle and arrivals are generated
    assert [s.input_len for s in cycled] == [10, 20, 30, 10, 20]


def test_trace_jsonl_without_arrivals_needs_a_rate(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_len": 4, "output_len": 2}\n{"input_len": 8, "output_len": 3}\n')
    with pytest.raises(ValueError, match="give a rate"):
        build_requests(TraceWorkload.from_file(path), None, 2, None)


@pytest.mark.parametrize(("text", "match"), [
    ("input_len,output_len\n10,x\n", "row 1"),
    ("input_len\n10\n", "row 1"),
    ("input_len,output_len,arrival_s\n1,1,0\n1,1,\n", "some rows only"),
    ("input_len,output_len,arrival_s\n1,1,2\n1,1,1\n", "non-decreasing"),
    ("input_len,output_len\n", "no rows"),
    ("input_len,output_len\n0,3\n", ">= 1"),
])
def test_bad_trace_files_name_the_problem(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        TraceWorkload.from_file(path)
    with pytest.raises(ValueError, match="does not exist"):
        TraceWorkload.from_file(tmp_path / "missing.csv")


def test_mixed_workload_holds_long_documents_at_their_share_and_is_deterministic():
    from benchmarks.workload import MixedWorkload

    w = MixedWorkload(256, 32, 0.0, 1536, 32, long_share=0.25)
    got = w.lengths(400, np.random.default_rng(3))
    long = [i for i, (n, _) in enumerate(got) if n > 1000]
    assert 0.18 < len(long) / 400 < 0.32
    assert all(n == 256 for i, (n, _) in enumerate(got) if i not in long)  # sigma 0: chat exactly 256
    assert got == w.lengths(400, np.random.default_rng(3))
    assert all(n < 1000 for n, _ in MixedWorkload(long_share=0.0).lengths(50, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="long_share"):
        MixedWorkload(long_share=1.5)


def test_multiturn_follow_up_turns_begin_with_the_previous_turn():
    from benchmarks.workload import MultiTurnWorkload

    wl = MultiTurnWorkload(conversations=3, system_len=40, turn_len=5, output_len=7)
    specs = build_requests(wl, 1.0, 9, None, seed=4)
    for s in specs:
        turn = s.index // 3
        assert s.input_len == 40 + 5 * (turn + 1) == len(s.prompt.split()) and s.output_len == 7
        if turn:
            prev = specs[s.index - 3].prompt
            assert s.prompt.startswith(prev + " ") and len(s.prompt.split()) == len(prev.split()) + 5
    # conversations differ from the first word (each its own system prompt); same seed, same prompts
    assert len({s.prompt.split()[:40].__str__() for s in specs[:3]}) == 3
    assert [s.prompt for s in build_requests(wl, 2.0, 9, None, seed=4)] == [s.prompt for s in specs]


def test_prompt_set_workload_cycles_its_prompts_uncut():
    from benchmarks.workload import PromptSetWorkload

    wl = PromptSetWorkload((("a b c", 4), ("d " * 30, 6)), "set")
    specs = build_requests(wl, 1.0, 5, None, max_total_len=10)  # NOTE: its own prompts are never cut
    assert [s.prompt for s in specs] == ["a b c", "d " * 30] * 2 + ["a b c"]
    assert [(s.input_len, s.output_len) for s in specs[:2]] == [(3, 4), (30, 6)]
    with pytest.raises(ValueError, match="at least one"):
        PromptSetWorkload(())
