"""Instance state machines used by the simulator (one prefill instance, one decode lane, one colocated instance).

Requests live in the simulator's `ReqState` table; instances hold only request ids and counters.
A decode lane reserves `input_len + output_len` KV tokens at admission (no preemption), so
`kv_used <= kv_capacity` always holds; a request that cannot fit even an empty lane is rejected.

Decode lane bookkeeping is O(log n) per step: the running context is `base_sum + batch * step`, where
each running request contributes `input_len + 1 - admitted_step`; finishing steps sit in a heap.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from placement.latency import LatencyModel


@dataclass(slots=True)
class ReqState:
    arrival: float
    input_len: int
    output_len: int
    prefill_idx: int = -1
    decode_idx: int = -1
    first_token: float = -1.0
    finish: float = -1.0
    decode_start: float = -1.0
    rejected: bool = False


@dataclass(slots=True)
class Pipeline:
    """Stage occupancy of a pp-stage instance: a batch enters stage s+1 when it leaves stage s (plus the
    hop between them) and stage s+1 is free, so batches of unequal size and unequal stages leave bubbles
    (exact for in-order pipelines). The driver schedules one micro-batch at a time (`driver_free`)."""

    free_at: list[float]
    lat: LatencyModel | None = None
    driver_free: float = 0.0

    @classmethod
    def of(cls, pp: int, lat: LatencyModel | None = None) -> Pipeline:
        return cls([0.0] * pp, lat)

    def run(self, now: float, total_s: float, tokens: int = 0) -> float:
        """Schedule a batch whose end-to-end latency alone is `total_s`; return its completion time."""
        free = self.free_at
        if len(free) == 1 or self.lat is None:
            stage = total_s / len(free)
            t = now
            for s, f in enumerate(free):
                t = (t if t > f else f) + stage
                free[s] = t
            return t
        serial, stages, hop = self.lat.stage_split(total_s, tokens)
        t = (now if now > self.driver_free else self.driver_free) + serial
        self.driver_free = t
        for s, dur in enumerate(stages):
            if s:
                t += hop
            f = free[s]
            t = (t if t > f else f) + dur
            free[s] = t
        return t


@dataclass(slots=True)
class PrefillInstance:
    """FIFO prefill with batches of up to `max_tokens` prompt tokens; `pp` batches may be in flight. A prompt's
    KV stays in the instance's `kv_cap` tokens from its batch until a decode instance takes it (`kv_held`):
    when decode memory is full, finished prompts pile up here and new batches wait (DistServe's context stage,
    and vLLM's NIXL connector, where the prefill side frees its blocks once the decode side has read them)."""

    lat: LatencyModel
    max_tokens: int
    queue: deque[int] = field(default_factory=deque)
    queued_tokens: int = 0
    in_flight: int = 0
    pipe: Pipeline = field(default_factory=lambda: Pipeline.of(1))
    kv_cap: int = 1 << 62
    kv_held: int = 0

    def take_batch(self, reqs: list[ReqState]) -> tuple[list[int], float]:
        """Pop a batch and return it with its end-to-end latency; empty while the KV of the queue's head does
        not fit beside what the instance holds (a prompt alone is always taken by an empty instance)."""
        batch: list[int] = []
        total = 0
        sq = 0
        free = self.kv_cap - self.kv_held
        while self.queue:
            rid = self.queue[0]
            n = reqs[rid].input_len
            if batch and total + n > self.max_tokens:
                break
            if total + n > free and (batch or self.kv_held):
                break
            self.queue.popleft()
            batch.append(rid)
            total += n
            sq += n * n
        self.queued_tokens -= total
        self.kv_held += total
        return batch, self.lat.prefill_time_from_sums(total, sq) if batch else 0.0


@dataclass(slots=True)
class DecodeLane:
    """Continuous batching with KV reservation. An instance with pp stages runs pp lanes (micro-batches)
    that share one `Pipeline`."""

    lat: LatencyModel
    capacity: int
    pipe: Pipeline
    waiting: deque[int] = field(default_factory=deque)
    waiting_tokens: int = 0
    finishing: list[tuple[int, int]] = field(default_factory=list)
    batch: int = 0
    base_sum: int = 0
    step: int = 0
    kv_used: int = 0
    busy: bool = False
    admitted_step: dict[int, int] = field(default_factory=dict)

    def context_tokens(self) -> int:
        return self.base_sum + self.batch * self.step

    def admit(self, rid: int, r: ReqState) -> None:
        need = r.input_len + r.output_len
        self.kv_used += need
        self.batch += 1
        self.base_sum += r.input_len + 1 - self.step
        self.admitted_step[rid] = self.step
        heapq.heappush(self.finishing, (self.step + r.output_len - 1, rid))

    def admit_waiting(self, reqs: list[ReqState], now: float) -> list[int]:
        """Admit waiting requests in order while their KV fits; return their ids."""
        taken: list[int] = []
        while self.waiting:
            rid = self.waiting[0]
            r = reqs[rid]
            if self.kv_used + r.input_len + r.output_len > self.capacity:
                break
            self.waiting.popleft()
            self.waiting_tokens -= r.input_len
            r.decode_start = now
            self.admit(rid, r)
            taken.append(rid)
        return taken

    def step_time(self) -> float:
        return self.lat.decode_step_time_s(self.batch, self.context_tokens())

    def run_until(self, now: float, until: float) -> tuple[float, int]:
        """Decode steps back to back from `now`, stopping after the step in which a request finishes or
        which ends at or after `until` (the next outside event); returns (end time, steps). Only for a
        lane that has its instance to itself (pp = 1)."""
        left = self.finishing[0][0] - self.step
        b, ctx, t, k = self.batch, self.context_tokens(), now, 0
        step = self.lat.decode_step_time_s
        while k < left:
            t += step(b, ctx)
            k += 1
            ctx += b
            if t >= until:
                break
        return t, k

    def finish_step(self, reqs: list[ReqState], now: float, steps: int = 1) -> list[int]:
        """Advance `steps` steps; return the ids of requests that produced their last token."""
        self.step += steps
        done: list[int] = []
        while self.finishing and self.finishing[0][0] <= self.step:
            _, rid = heapq.heappop(self.finishing)
            r = reqs[rid]
            r.finish = now
            self.kv_used -= r.input_len + r.output_len
            self.batch -= 1
            self.base_sum -= r.input_len + 1 - self.admitted_step.pop(rid)
            done.append(rid)
        return done


@dataclass(slots=True)
class ColocatedInstance:
    """One engine doing both phases. Without chunked prefill (vLLM <= 0.5's default, SGLang): a prefill
    batch of whole prompts runs whenever waiting requests fit the KV cache, stalling every running
    decode. With chunked prefill (vLLM v1, TensorRT-LLM): every step carries all running decodes plus
    prompt chunks up to `max_tokens` tokens, so prefill slows the decode steps it shares instead."""

    lane: DecodeLane
    max_tokens: int
    chunked: bool = False
    busy: bool = False
    prefilling: deque[int] = field(default_factory=deque)
    done_tokens: dict[int, int] = field(default_factory=dict)

    def take_prefill(self, reqs: list[ReqState]) -> tuple[list[int], float]:
        lane = self.lane
        batch: list[int] = []
        total = 0
        sq = 0
        while lane.waiting:
            rid = lane.waiting[0]
            r = reqs[rid]
            if lane.kv_used + r.input_len + r.output_len > lane.capacity:
                break
            if batch and total + r.input_len > self.max_tokens:
                break
            lane.waiting.popleft()
            lane.waiting_tokens -= r.input_len
            lane.kv_used += r.input_len + r.output_len  # reserved now, admitted to the batch at prefill end
            batch.append(rid)
            total += r.input_len
            sq += r.input_len * r.input_len
        return batch, lane.lat.prefill_time_from_sums(total, sq)

    def take_chunks(self, reqs: list[ReqState]) -> tuple[list[tuple[int, int]], float]:
        """Chunked prefill: admit waiting requests whose KV fits, then fill the step's token budget left
        by the running decodes with prompt chunks, oldest first. Returns ([(rid, tokens)], step time);
        an empty list means a decode-only step."""
        lane = self.lane
        while lane.waiting:
            rid = lane.waiting[0]
            r = reqs[rid]
            if lane.kv_used + r.input_len + r.output_len > lane.capacity:
                break
            lane.waiting.popleft()
            lane.waiting_tokens -= r.input_len
            lane.kv_used += r.input_len + r.output_len
            self.prefilling.append(rid)
            self.done_tokens[rid] = 0
        budget = self.max_tokens - lane.batch
        chunks: list[tuple[int, int]] = []
        total = 0
        sq = 0
        for rid in self.prefilling:
            if budget <= 0:
                break
            done = self.done_tokens[rid]
            n = min(reqs[rid].input_len - done, budget)
            chunks.append((rid, n))
            total += n
            sq += (done + n) * (done + n) - done * done
            budget -= n
        if not chunks:
            return chunks, 0.0
        return chunks, lane.lat.mixed_step_time_s(total, sq, lane.batch, lane.context_tokens())

    def finish_chunks(self, reqs: list[ReqState], chunks: list[tuple[int, int]]) -> list[int]:
        """Record the step's chunks; return the ids whose prompt is now complete (in FIFO order)."""
        complete: list[int] = []
        for rid, n in chunks:
            self.done_tokens[rid] += n
            if self.done_tokens[rid] >= reqs[rid].input_len:
                del self.done_tokens[rid]
                complete.append(rid)
        for _ in complete:
            self.prefilling.popleft()
        return complete
