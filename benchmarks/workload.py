"""Workloads (request lengths), open-loop arrivals, and locally generated prompts.

A workload says how long each request's input and output are; arrivals say when requests are sent.
Arrivals are open-loop: gamma-distributed gaps with mean 1/rate and coefficient of variation
``burstiness_cv`` (1.0 is Poisson; >1 burstier; <1 more regular). The same seed gives the same lengths,
prompts and (rate-scaled) gaps at every rate, so steps of a sweep differ only in rate.

The lengths, arrivals and trace files come from ``placement.workload``, the one generator the planner
and the benchmarks share; this module adds the benchmark's request type and prompts.

Prompts are random common English words, each one token (with its leading space) in GPT-2/Llama-style
BPE vocabularies such as SmolLM2's, so a prompt of n words is about n tokens; the report uses the
server's own ``usage`` counts, not this estimate.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from placement import workload as shared
from placement.workload import MAX_REQUESTS, arrival_times

__all__ = ["MAX_REQUESTS", "WORKLOADS", "ChatWorkload", "LongDocWorkload", "MixedWorkload", "MultiTurnWorkload",
           "PromptSetWorkload", "RequestSpec", "TraceWorkload", "Workload", "arrival_times", "build_requests",
           "make_prompt"]
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have "
    "an they you were her she there would their we him been has when who will more no if out so said what "
    "up its about into than them can only other new some could time these two may then do first any my now "
    "such like our over man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day same another know "
    "while last might us great old year off come since against go came right used take three"
).split()


@dataclass(frozen=True)
class RequestSpec:
    index: int
    input_len: int
    output_len: int
    arrival_s: float
    prompt: str


class Workload(ABC):
    """Request lengths. ``lengths(n, rng)`` returns n (input_len, output_len) pairs, each >= 1."""

    name: str

    @abstractmethod
    def lengths(self, n: int, rng: np.random.Generator) -> list[tuple[int, int]]: ...

    def trace_arrivals(self) -> list[float] | None:
        """Recorded arrival times (seconds from start), when the workload carries its own timing."""
        return None

    def prompts(self, n: int, rng: np.random.Generator) -> list[str] | None:
        """Prompts of its own (shared prefixes, templates), one per request, matching ``lengths``; None:
        random words, ``input_len`` of them."""
        return None


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be > 0")


@dataclass(frozen=True)
class ChatWorkload(Workload):
    """Chatbot-like: lognormal input and output lengths (medians and log-space sigmas), clipped."""

    input_median: int = 256
    input_sigma: float = 0.6
    output_median: int = 128
    output_sigma: float = 0.6
    max_input: int = 4096
    max_output: int = 1024
    name: str = "chat"

    def __post_init__(self) -> None:
        _check_positive(input_median=self.input_median, output_median=self.output_median,
                        max_input=self.max_input, max_output=self.max_output)

    def lengths(self, n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
        ins = shared.lognormal_lengths(math.log(self.input_median), self.input_sigma, n, rng, 1, self.max_input)
        outs = shared.lognormal_lengths(math.log(self.output_median), self.output_sigma, n, rng, 1, self.max_output)
        return [(int(i), int(o)) for i, o in zip(ins, outs, strict=True)]


@dataclass(frozen=True)
class LongDocWorkload(Workload):
    """Long-document: long input, short output; each length uniform within +-jitter of its value."""

    input_len: int = 2048
    output_len: int = 32
    jitter: float = 0.1
    name: str = "longdoc"

    def __post_init__(self) -> None:
        _check_positive(input_len=self.input_len, output_len=self.output_len)
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter={self.jitter!r} must be in [0, 1), e.g. 0.1")

    def lengths(self, n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
        return shared.jittered_lengths(self.input_len, self.output_len, self.jitter, n, rng)


@dataclass(frozen=True)
class MixedWorkload(Workload):
    """Chat with long documents among it: each request is a long document with probability `long_share`
    (else chat), drawn from its own random stream, so the chat requests' lengths do not depend on the share."""

    chat_input_median: int = 256
    chat_output_median: int = 64
    chat_sigma: float = 0.6
    long_input_len: int = 1536
    long_output_len: int = 32
    long_share: float = 0.25
    name: str = "mixed"

    def __post_init__(self) -> None:
        if not 0 <= self.long_share <= 1:
            raise ValueError(f"long_share={self.long_share!r} must be in [0, 1], e.g. 0.25")

    def lengths(self, n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
        pick = np.random.default_rng(rng.integers(2**32))
        chat = ChatWorkload(self.chat_input_median, self.chat_sigma, self.chat_output_median,
                            self.chat_sigma).lengths(n, rng)
        long = LongDocWorkload(self.long_input_len, self.long_output_len).lengths(n, rng)
        return [long[i] if pick.random() < self.long_share else chat[i] for i in range(n)]


@dataclass(frozen=True)
class MultiTurnWorkload(Workload):
    """Multi-turn chat: ``conversations`` interleaved conversations, each a system prompt of its own
    (``system_len`` words) and one more user turn (``turn_len`` words) per request; request i is turn
    i // conversations of conversation i % conversations and repeats that conversation's whole history, so
    a follow-up turn's prompt begins with the previous turn's (what prefix caching reuses)."""

    conversations: int = 4
    system_len: int = 384
    turn_len: int = 24
    output_len: int = 24
    name: str = "multiturn"

    def __post_init__(self) -> None:
        _check_positive(conversations=self.conversations, system_len=self.system_len, turn_len=self.turn_len,
                        output_len=self.output_len)

    def lengths(self, n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
        return [(self.system_len + (i // self.conversations + 1) * self.turn_len, self.output_len) for i in range(n)]

    def prompts(self, n: int, rng: np.random.Generator) -> list[str]:
        systems = [make_prompt(self.system_len, rng) for _ in range(self.conversations)]
        turns = [make_prompt(self.turn_len, rng) for _ in range(n)]  # NOTE: turn t of conversation c: index i
        return [" ".join([systems[i % self.conversations],
                          *(turns[j] for j in range(i % self.conversations, i + 1, self.conversations))])
                for i in range(n)]


@dataclass(frozen=True)
class PromptSetWorkload(Workload):
    """Given prompts and output lengths, cycled (e.g. templated text whose continuation the prompt holds);
    ``input_len`` is the prompt's word count, an estimate (reports use the server's usage counts)."""

    items: tuple[tuple[str, int], ...]
    name: str = "prompts"

    def __post_init__(self) -> None:
        if not self.items or any(not p or n < 1 for p, n in self.items):
            raise ValueError(f"{self.name}: give at least one (prompt, output_len >= 1) pair")

    @classmethod
    def labelled(cls, rows: Sequence[tuple[str, str, int]], name: str) -> PromptSetWorkload:
        """From (label, prompt, output_len) rows, as benchmarks.speculation's prompt sets come."""
        return cls(tuple((p, n) for _, p, n in rows), name)

    def lengths(self, n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
        picked = (self.items[i % len(self.items)] for i in range(n))
        return [(len(prompt.split()), out) for prompt, out in picked]

    def prompts(self, n: int, rng: np.random.Generator) -> list[str]:
        return [self.items[i % len(self.items)][0] for i in range(n)]


@dataclass(frozen=True)
class TraceWorkload(Workload):
    """Rows of (input_len, output_len[, arrival_s]) from a CSV (with header) or JSONL file; cycled."""

    rows: tuple[tuple[int, int, float | None], ...]
    source: str = ""
    name: str = "trace"

    @classmethod
    def from_file(cls, path: str | Path) -> TraceWorkload:
        """Read with placement.workload.load_trace (raises ValueError naming the bad row)."""
        reqs = shared.load_trace(path)
        return cls(tuple((r.input_len, r.output_len, r.arrival_s if r.arrival_s >= 0 else None) for r in reqs),
                   str(path))

    def lengths(self, n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
        return [self.rows[i % len(self.rows)][:2] for i in range(n)]  # type: ignore[misc]

    def trace_arrivals(self) -> list[float] | None:
        if self.rows[0][2] is None:
            return None
        return [float(r[2]) for r in self.rows]  # type: ignore[arg-type]


def make_prompt(n_tokens: int, rng: np.random.Generator) -> str:
    return " ".join(_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), n_tokens))


def build_requests(workload: Workload, rate: float | None, num_requests: int | None,
                   duration_s: float | None, burstiness_cv: float = 1.0, seed: int = 0,
                   max_total_len: int | None = None) -> list[RequestSpec]:
    """The requests of one rate step. ``rate=None`` replays a trace's own arrival times."""
    if num_requests is None and duration_s is None:
        raise ValueError("bound the run: give num_requests, duration_s, or both")
    if rate is None:
        arrivals = workload.trace_arrivals()
        if arrivals is None:
            raise ValueError(f"workload {workload.name!r} has no arrival times; give a rate (requests/s)")
        limit = min(num_requests or MAX_REQUESTS, MAX_REQUESTS, len(arrivals))
        times = [a for a in arrivals[:limit] if duration_s is None or a < duration_s]
    else:
        times = arrival_times(rate, num_requests, duration_s, burstiness_cv, np.random.default_rng([seed, 1]))
    lengths = workload.lengths(len(times), np.random.default_rng([seed, 2]))
    prompt_rng = np.random.default_rng([seed, 3])
    own = workload.prompts(len(times), prompt_rng)
    specs = []
    for i, (t, (n_in, n_out)) in enumerate(zip(times, lengths, strict=True)):
        if own is not None:  # NOTE: the workload's own prompts fit its lengths; they are never cut
            specs.append(RequestSpec(i, n_in, n_out, t, own[i]))
            continue
        if max_total_len is not None and n_in + n_out > max_total_len:
            n_in = max(1, max_total_len - n_out)
            n_out = min(n_out, max_total_len - n_in)
        specs.append(RequestSpec(i, n_in, n_out, t, make_prompt(n_in, prompt_rng)))
    return specs


WORKLOADS = {"chat": ChatWorkload, "longdoc": LongDocWorkload, "trace": TraceWorkload}
