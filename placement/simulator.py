"""Discrete-event simulator of a disaggregated deployment (prefill pool -> KV transfer -> decode pool)
and of the colocated baseline (each instance interleaves prefill batches and decode steps).

Request life cycle (disaggregated):

    arrive --dispatch--> prefill queue --batch--> prefill done --KV transfer--> first token (TTFT)
           \\-> rejected                                                          |
                                     decode waiting (KV full?) --admit--> decode steps --> finish

TTFT = first token - arrival (includes queueing, prefill and KV transfer). TPOT = (finish - first
token) / (output_len - 1), so decode queueing counts against TPOT; requests with one output token
finish at the first token. Open loop: requests arrive at their `arrival_s`. Closed loop (`clients=C`):
client i sends its first request at i * ramp_s / C (ramp_s = 0: all at once, a burst; or ramp_s[i]) and each
completion or rejection sends that client's next one. A request reaches the engine
`request_overhead(input_len, in_flight)` (the serving front-end's share of TTFT; it grows with the prompt
and with the requests in flight when it is sent) after it is sent. Modes "prefill" and
"decode" simulate one pool alone (used by the search).

Decode lanes that have their instance to themselves run steps back to back up to the next finish or
the next outside event in one event (`DecodeLane.run_until`), which gives the same times as one event
per step at a fraction of the cost.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import cast

from placement.dispatch import DispatchPolicy, InstanceView, RoundRobinDispatch
from placement.latency import LatencyModel
from placement.sim_instances import ColocatedInstance, DecodeLane, Pipeline, PrefillInstance, ReqState
from placement.sim_result import SimResult
from placement.workload import Request

logger = logging.getLogger(__name__)

_ARRIVE, _P_DONE, _P_FREE, _XFER_DONE, _D_STEP, _C_DONE, _L_DONE, _SEND = range(8)
SameNode = Callable[[int, int], bool]


class _Sim:
    def __init__(self, requests: Sequence[Request], clients: int | None, ramp_s: float | Sequence[float] = 0.0,
                 entry_delay: Callable[[int, float], float] | None = None, front_ends: int = 1) -> None:
        self.reqs = [ReqState(r.arrival_s, r.input_len, r.output_len) for r in requests]
        self.events: list[tuple[float, int, int, int, object]] = []
        self.seq = 0
        self.next_closed = 0
        self.clients = clients
        # NOTE: a prompt's front-end time (LatencyModel.request_overhead) from its length and the requests in
        # flight when it is sent; so a send is an event of its own (_SEND), which becomes the arrival at the
        # engine after that delay (events_in_order() handles it). Each engine that streams tokens (a colocated
        # or decode instance) has a front end of its own and the requests spread evenly over them.
        self.delay = entry_delay or (lambda _tokens, _in_flight: 0.0)
        self.front_ends = max(front_ends, 1)
        self.in_flight = 0
        if clients is None:
            for rid, r in enumerate(self.reqs):
                self.push(r.arrival, _SEND, rid, None)
        else:
            first = min(clients, len(self.reqs))
            starts = [i * ramp_s / clients for i in range(first)] if isinstance(ramp_s, float | int) else list(ramp_s)
            for rid in range(first):
                self.reqs[rid].arrival = starts[rid]
                self.push(starts[rid], _SEND, rid, None)
            self.next_closed = first

    def push(self, t: float, kind: int, a: int, b: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def next_time(self) -> float:
        return self.events[0][0] if self.events else math.inf

    def events_in_order(self) -> Iterator[tuple[float, int, int, object]]:
        """(time, kind, a, b) of every event but the sends, in time order, while there are any."""
        while self.events:
            now, _, kind, a, b = heapq.heappop(self.events)
            if kind == _SEND:
                self.push(now + self.delay(self.reqs[a].input_len, self.in_flight / self.front_ends), _ARRIVE, a, None)
                self.in_flight += 1
                continue
            yield now, kind, a, b

    def completed(self, now: float) -> None:
        """A request finished or was rejected; in a closed loop that frees its client for the next one."""
        self.in_flight -= 1
        if self.clients is not None and self.next_closed < len(self.reqs):
            rid = self.next_closed
            self.next_closed += 1
            self.reqs[rid].arrival = now
            self.push(now, _SEND, rid, None)


def simulate_disaggregated(prefill_lat: LatencyModel, decode_lat: LatencyModel, n_prefill: int, n_decode: int,
                           requests: Sequence[Request], *, dispatch: DispatchPolicy | None = None,
                           same_node: bool | SameNode = False, max_prefill_tokens: int = 4096,
                           clients: int | None = None, mode: str = "both",
                           ramp_s: float | Sequence[float] = 0.0, local_prefill_tokens: int = 0,
                           first_token_from_prefill: bool = False) -> SimResult:
    """Simulate `n_prefill` prefill and `n_decode` decode instances serving `requests`.

    `mode="prefill"` stops at the first token (decode not simulated); `mode="decode"` sends requests
    straight to decode at their arrival (first token = arrival). `same_node(p, d)` says whether the
    KV of prefill p to decode d moves over NVLink (True) or the NIC (False).

    `local_prefill_tokens`: prompts of at most this many tokens prefill on the decode instance the dispatch
    picks (the router's `auto` placement sends short prompts there): whole, FIFO, in one step with that
    instance's running decodes (`mixed_step_time_s`, so the streams there pay for it), no KV transfer. Only
    for pp=1 decode instances; `mode` "both" or "decode".

    `first_token_from_prefill`: the prefill engine's first token goes to the client as soon as it is sampled
    (Saaf Infer's own P/D), so TTFT ends at the prefill and the KV transfer delays the second token (it counts
    in TPOT). Off: the decode engine samples token 1 after the transfer (DistServe's convention, and what
    the engines' own P/D proxies measure), so TTFT includes the transfer.
    """
    if n_prefill < 1 or n_decode < 1:
        raise ValueError(f"need at least one prefill and one decode instance, got {n_prefill}, {n_decode}")
    sim = _Sim(requests, clients, ramp_s, None if mode == "decode" else prefill_lat.request_overhead, n_decode)
    reqs = sim.reqs
    policy = dispatch or RoundRobinDispatch()
    pre = [PrefillInstance(prefill_lat, max_prefill_tokens, pipe=Pipeline.of(prefill_lat.pp, prefill_lat),
                           kv_cap=prefill_lat.kv_capacity_tokens()) for _ in range(n_prefill)]
    held = [False] * len(reqs)  # the prompt's KV is still on its prefill instance
    lanes_per = decode_lat.pp
    lane_cap = decode_lat.kv_capacity_tokens() // lanes_per
    pipes = [Pipeline.of(lanes_per, decode_lat) for _ in range(n_decode)]
    lanes = [[DecodeLane(decode_lat, lane_cap, pipes[i]) for _ in range(lanes_per)] for i in range(n_decode)]
    lane_rr = [0] * n_decode
    near = same_node if callable(same_node) else (lambda p, d, _v=bool(same_node): _v)
    rejected = 0
    if local_prefill_tokens and (mode == "prefill" or lanes_per != 1):
        raise ValueError("local prefill needs mode 'both' or 'decode' and pp=1 decode instances")
    local: list[deque[int]] = [deque() for _ in range(n_decode)]

    def views() -> tuple[list[InstanceView], list[InstanceView]]:
        pv = [InstanceView(i, "prefill", len(p.queue), p.queued_tokens, p.in_flight, 0, 0, 0)
              for i, p in enumerate(pre)]
        dv = [InstanceView(i, "decode", sum(len(ln.waiting) for ln in ls) + len(local[i]),
                           sum(ln.waiting_tokens for ln in ls) + sum(reqs[r].input_len for r in local[i]),
                           sum(ln.batch for ln in ls), sum(ln.context_tokens() for ln in ls),
                           sum(ln.kv_used for ln in ls), lane_cap * lanes_per) for i, ls in enumerate(lanes)]
        return pv, dv

    def kick_prefill(i: int, now: float) -> None:
        p = pre[i]
        if not p.queue or p.pipe.free_at[0] > now:
            return
        batch, dt = p.take_batch(reqs)
        if not batch:  # NOTE: its KV is full of prompts no decode instance has taken yet: kicked on release
            return
        for rid in batch:
            held[rid] = True
        p.in_flight += 1
        sim.push(p.pipe.run(now, dt, sum(reqs[rid].input_len for rid in batch)), _P_DONE, i, batch)
        if prefill_lat.pp > 1:
            sim.push(p.pipe.free_at[0], _P_FREE, i, None)

    def release(rid: int, now: float) -> None:
        """The prompt's KV leaves its prefill instance (taken by decode, or needing no decode)."""
        if held[rid]:
            held[rid] = False
            r = reqs[rid]
            pre[r.prefill_idx].kv_held -= r.input_len
            kick_prefill(r.prefill_idx, now)

    def kick_lane(ln: DecodeLane, key: tuple[int, int], now: float) -> None:
        if ln.busy:
            return
        for rid in ln.admit_waiting(reqs, now):
            release(rid, now)
        if local[key[0]]:
            take, dt = _take_local(ln, local[key[0]], reqs, max_prefill_tokens)
            if take:
                ln.busy = True
                sim.push(now + dt, _L_DONE, key[0], take)
                return
        if not ln.batch:
            return
        ln.busy = True
        if lanes_per == 1:
            end, k = ln.run_until(now, sim.next_time())
            sim.push(end, _D_STEP, key[0], (key[1], k))
        else:
            sim.push(ln.pipe.run(now, ln.step_time(), ln.batch), _D_STEP, key[0], (key[1], 1))

    def to_decode(rid: int, now: float) -> None:
        r = reqs[rid]
        if r.output_len <= 1:
            release(rid, now)
            r.finish = now
            sim.completed(now)
            return
        d = r.decode_idx
        j = lane_rr[d] % lanes_per
        lane_rr[d] += 1
        ln = lanes[d][j]
        if r.input_len + r.output_len > ln.capacity:
            release(rid, now)
            r.rejected = True
            sim.completed(now)
            return
        ln.waiting.append(rid)
        ln.waiting_tokens += r.input_len
        kick_lane(ln, (d, j), now)

    def to_local(rid: int, now: float) -> None:
        """Queue a local prefill on its decode instance (rejected if it cannot fit even an empty lane)."""
        r = reqs[rid]
        if r.input_len + r.output_len > lane_cap:
            r.rejected = True
            sim.completed(now)
            return
        local[r.decode_idx].append(rid)
        kick_lane(lanes[r.decode_idx][0], (r.decode_idx, 0), now)

    for now, kind, a, b in sim.events_in_order():
        if kind == _ARRIVE:
            r = reqs[a]
            if mode == "decode":
                r.decode_idx = lane_rr.index(min(lane_rr)) if n_decode > 1 else 0
                if r.input_len <= local_prefill_tokens:  # NOTE: prefilled there, its first token from that step
                    lane_rr[r.decode_idx] += 1
                    to_local(a, now)
                    continue
                r.first_token = now
                to_decode(a, now)
                continue
            choice = policy.choose(now, r.input_len, r.output_len, *views())
            if choice is None:
                r.rejected = True
                rejected += 1
                sim.completed(now)
                continue
            r.prefill_idx, r.decode_idx = choice
            if r.input_len <= local_prefill_tokens:
                r.prefill_idx = -1
                to_local(a, now)
                continue
            p = pre[r.prefill_idx]
            p.queue.append(a)
            p.queued_tokens += r.input_len
            kick_prefill(r.prefill_idx, now)
        elif kind == _P_DONE:
            pre[a].in_flight -= 1
            for rid in b:  # type: ignore[attr-defined]
                r = reqs[rid]
                xfer = prefill_lat.kv_transfer_time_s(r.input_len, near(r.prefill_idx, r.decode_idx))
                first = now if first_token_from_prefill else now + xfer
                if mode == "prefill":
                    release(rid, now)
                    r.first_token = r.finish = first
                    sim.completed(first)
                else:
                    r.first_token = first
                    sim.push(now + xfer, _XFER_DONE, rid, None)
            kick_prefill(a, now)
        elif kind == _P_FREE:
            kick_prefill(a, now)
        elif kind == _XFER_DONE:
            to_decode(a, now)
        elif kind == _L_DONE:
            ln = lanes[a][0]
            ln.busy = False
            if ln.batch:  # NOTE: the step also advanced every running decode by one token
                for _rid in ln.finish_step(reqs, now):
                    sim.completed(now)
            for rid in cast(list[int], b):
                r = reqs[rid]
                r.first_token = r.decode_start = now
                if r.output_len <= 1:
                    r.finish = now
                    sim.completed(now)
                else:
                    ln.admit(rid, r)
            kick_lane(ln, (a, 0), now)
        elif kind == _D_STEP:
            j, k = cast(tuple[int, int], b)
            ln = lanes[a][j]
            ln.busy = False
            for _rid in ln.finish_step(reqs, now, k):
                sim.completed(now)
            kick_lane(ln, (a, j), now)
    assert not any(held) and all(p.kv_held == 0 for p in pre), "prefill KV not released"
    for ls in lanes:
        for ln in ls:
            assert ln.kv_used == 0 and ln.batch == 0, f"decode lane not drained: kv={ln.kv_used} batch={ln.batch}"
    assert not any(local), "local prefill queue not drained"
    return SimResult.from_states(reqs, policy_rejected=rejected)


def _take_local(ln: DecodeLane, queue: deque[int], reqs: list[ReqState], max_tokens: int
                ) -> tuple[list[int], float]:
    """Local prefills for the decode lane's next step: whole prompts, FIFO, while their KV fits the lane and
    their tokens the step's budget left by the running decodes (at least one). Returns (ids, step time)."""
    take: list[int] = []
    total = sq = 0
    kv = ln.kv_used
    while queue:
        r = reqs[queue[0]]
        need = r.input_len + r.output_len
        if kv + need > ln.capacity or (take and total + r.input_len > max_tokens - ln.batch):
            break
        take.append(queue.popleft())
        kv += need
        total += r.input_len
        sq += r.input_len * r.input_len
    if not take:
        return take, 0.0
    return take, ln.lat.mixed_step_time_s(total, sq, ln.batch, ln.context_tokens())


def simulate_colocated(lat: LatencyModel, n_instances: int, requests: Sequence[Request], *,
                       max_prefill_tokens: int = 4096, clients: int | None = None, chunked_prefill: bool = False,
                       ramp_s: float | Sequence[float] = 0.0) -> SimResult:
    """Colocated baseline: `n_instances` engines, round-robin arrivals. Without chunked prefill a prefill
    batch (up to `max_prefill_tokens` prompt tokens) preempts the decodes; with it, each step carries the
    running decodes plus prompt chunks up to `max_prefill_tokens` tokens in all (see ColocatedInstance)."""
    if n_instances < 1:
        raise ValueError(f"need at least one colocated instance, got {n_instances}")
    if lat.pp != 1:
        raise ValueError(f"the colocated simulator runs pp=1 engines, got pp={lat.pp}")
    sim = _Sim(requests, clients, ramp_s, lat.request_overhead, n_instances)
    reqs = sim.reqs
    insts = [ColocatedInstance(DecodeLane(lat, lat.kv_capacity_tokens(), Pipeline.of(1)), max_prefill_tokens,
                               chunked_prefill) for _ in range(n_instances)]
    rr = 0

    def start_decode(lane: DecodeLane, rid: int, now: float) -> None:
        r = reqs[rid]
        r.first_token = r.decode_start = now
        lane.kv_used -= r.input_len + r.output_len
        if r.output_len <= 1:
            r.finish = now
            sim.completed(now)
        else:
            lane.admit(rid, r)

    def kick(i: int, now: float) -> None:
        inst = insts[i]
        if inst.busy:
            return
        lane = inst.lane
        if inst.chunked:
            chunks, dt = inst.take_chunks(reqs)
            if chunks:
                inst.busy = True
                sim.push(now + dt, _C_DONE, i, chunks)
                return
        else:
            batch, dt = inst.take_prefill(reqs)
            if batch:
                inst.busy = True
                sim.push(now + dt, _C_DONE, i, batch)
                return
        if lane.batch:
            inst.busy = True
            end, k = lane.run_until(now, sim.next_time())
            sim.push(end, _D_STEP, i, k)

    for now, kind, a, b in sim.events_in_order():
        if kind == _ARRIVE:
            r = reqs[a]
            i = rr % n_instances
            rr += 1
            lane = insts[i].lane
            if r.input_len + r.output_len > lane.capacity:
                r.rejected = True
                sim.completed(now)
                continue
            r.prefill_idx = r.decode_idx = i
            lane.waiting.append(a)
            lane.waiting_tokens += r.input_len
            kick(i, now)
        elif kind == _C_DONE:
            inst = insts[a]
            inst.busy = False
            if inst.chunked:
                # NOTE: the step also advanced every running decode by one token.
                if inst.lane.batch:
                    for _rid in inst.lane.finish_step(reqs, now):
                        sim.completed(now)
                for rid in inst.finish_chunks(reqs, b):  # type: ignore[arg-type]
                    start_decode(inst.lane, rid, now)
            else:
                for rid in b:  # type: ignore[attr-defined]
                    start_decode(inst.lane, rid, now)
            kick(a, now)
        elif kind == _D_STEP:
            insts[a].busy = False
            for _rid in insts[a].lane.finish_step(reqs, now, int(b)):  # type: ignore[call-overload]
                sim.completed(now)
            kick(a, now)
    for inst in insts:
        assert inst.lane.kv_used == 0 and inst.lane.batch == 0 and not inst.prefilling, "colocated engine not drained"
    return SimResult.from_states(reqs, policy_rejected=0)
