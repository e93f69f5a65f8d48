"""The NIXL handshake side channel survives malformed requests (kvtransfer/side_channel.py), and vLLM's own
listener does not (the xfail cases: if one starts passing, vLLM fixed it and the override may go).

No engine: the listener functions run in a thread on a free 127.0.0.1 port with fake handshake metadata,
and a client speaks vLLM's own handshake wire format (REQ, msgpack (GET_META_MSG, pp_rank, tp_rank))."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlHandshakePayload, NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

from kvtransfer import side_channel
from kvtransfer.config import free_port
from kvtransfer.side_channel import guarded_handshake_listener

HOST = "127.0.0.1"
PAYLOAD = b"fake-nixl-handshake-payload"
VLLM_LISTENER = NixlBaseConnectorScheduler._nixl_handshake_listener
encode = msgspec.msgpack.encode

# What one peer sends: (socket type, frames). A REQ socket adds the empty delimiter frame itself; a DEALER
# does not, so its frames arrive at the ROUTER as they are (after the identity).
GARBAGE: dict[str, tuple[int, list[bytes]]] = {
    "one frame, no delimiter": (zmq.DEALER, [os.urandom(64)]),
    "extra frame": (zmq.DEALER, [b"", encode((GET_META_MSG, 0, 0)), b"more"]),
    "random bytes": (zmq.REQ, [b"\xc1" + os.urandom(63)]),  # 0xc1: never valid msgpack
    "empty message": (zmq.REQ, [b""]),
    "msgpack int": (zmq.REQ, [encode(7)]),
    "msgpack pair": (zmq.REQ, [encode((GET_META_MSG, 0))]),
    "msgpack map": (zmq.REQ, [encode({"a": 1})]),
    "rank pair not served": (zmq.REQ, [encode((GET_META_MSG, 3, 9))]),
    "unhashable ranks": (zmq.REQ, [encode((GET_META_MSG, [0], 0))]),
}
# Bad requests vLLM's listener survives, but answers with its metadata (it only logs the unknown type).
ANSWERED_BY_VLLM: dict[str, tuple[int, list[bytes]]] = {
    "unknown message type": (zmq.REQ, [encode((b"not_get_meta", 0, 0))]),
    "delimiter not empty": (zmq.DEALER, [b"x", encode((GET_META_MSG, 0, 0))]),
}


LISTENERS = [
    pytest.param(guarded_handshake_listener, id="ours"),
    pytest.param(VLLM_LISTENER, id="vllm", marks=[
        pytest.mark.xfail(strict=True, raises=AssertionError,
                          reason="vLLM's listener thread dies on a malformed request"),
        pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning"),
    ]),
]


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


_running: list[tuple[threading.Thread, threading.Event]] = []


@pytest.fixture(scope="module", autouse=True)
def _stop_listeners() -> Iterator[None]:
    """Stops every listener thread at the end of the module, all at once: each takes up to its 1 s receive
    timeout to see its stop event, so joining each at the end of its own test would cost a second a test."""
    yield
    for _, stop in _running:
        stop.set()
    for t, _ in _running:
        t.join(5)
    assert not any(t.is_alive() for t, _ in _running)


def start(listener: Callable, port: int) -> threading.Thread:
    ready, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=listener, args=({(0, 0): PAYLOAD}, ready, stop, HOST, port), daemon=True)
    t.start()
    _running.append((t, stop))
    assert ready.wait(5)
    return t


def send(ctx: zmq.Context, port: int, kind: int, frames: list[bytes]) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{HOST}:{port}")
    s.send_multipart(frames)
    return s


def handshake(ctx: zmq.Context, port: int, thread: threading.Thread, timeout_s: float = 3.0) -> list[bytes] | None:
    """vLLM's decode-side request (base_worker.py's _nixl_handshake); its answer, or None once the listener
    thread is dead or `timeout_s` passed."""
    s = send(ctx, port, zmq.REQ, [encode((GET_META_MSG, 0, 0))])
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if s.poll(50):
                return s.recv_multipart()
            if not thread.is_alive():
                return None
        return None
    finally:
        s.close()


def assert_serves(ctx: zmq.Context, port: int, thread: threading.Thread) -> None:
    reply = handshake(ctx, port, thread)
    assert reply is not None, f"no answer (listener thread alive: {thread.is_alive()})"
    assert reply[0] == PAYLOAD and len(reply) == 2
    assert isinstance(msgspec.msgpack.decode(reply[1]), float)  # the listener's perf_counter
    assert thread.is_alive()


def replies_after(ctx: zmq.Context, port: int, thread: threading.Thread, kind: int, frames: list[bytes],
                  timeout_s: float = 3.0) -> list[list[bytes]]:
    """Sends a bad request then a valid one on one connection (so the listener takes them in that order: ZMQ
    keeps order within a connection, not across them); the answers it got before the listener died or went
    quiet for 0.2 s after the first one, at most `timeout_s` in all."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{HOST}:{port}")
    s.send_multipart(([b""] if kind == zmq.REQ else []) + frames)  # NOTE: a REQ socket's envelope, by hand
    s.send_multipart([b"", encode((GET_META_MSG, 0, 0))])
    got: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and (thread.is_alive() or s.poll(0)):
            if s.poll(200 if got else 50):
                got.append(s.recv_multipart())
            elif got:
                break
        return got
    finally:
        s.close()


def is_answer(reply: list[bytes]) -> bool:
    return len(reply) == 3 and reply[:2] == [b"", PAYLOAD] and isinstance(msgspec.msgpack.decode(reply[2]), float)


@pytest.mark.parametrize("garbage", list(GARBAGE))
@pytest.mark.parametrize("listener", LISTENERS)
def test_listener_survives_a_malformed_request(listener: Callable, garbage: str, ctx: zmq.Context,
                                               caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    thread = start(listener, port)
    assert_serves(ctx, port, thread)
    got = replies_after(ctx, port, thread, *GARBAGE[garbage])
    assert thread.is_alive(), "the listener thread died"
    assert len(got) == 1 and is_answer(got[0])  # the valid request's answer; none to the bad one
    assert_serves(ctx, port, thread)  # and a new connection's handshake
    if listener is guarded_handshake_listener:
        lines = [r.getMessage() for r in caplog.records if "dropped a bad handshake request" in r.getMessage()]
        assert len(lines) == 1 and len(lines[0]) < 300, lines


def test_all_garbage_then_a_valid_handshake(ctx: zmq.Context, caplog: pytest.LogCaptureFixture) -> None:
    """Every kind above five times over, a frame over the size limit and raw non-ZMTP TCP bytes, from many
    peers at once; each peer's valid request after its garbage is answered, and the drops are reported in
    at most a line a second."""
    t0 = time.monotonic()
    port = free_port()
    thread = start(guarded_handshake_listener, port)
    big = send(ctx, port, zmq.DEALER, [b"", b"\x93" + b"\0" * (side_channel.MAX_REQUEST_BYTES + 1)])
    with socket.create_connection((HOST, port), timeout=2) as raw:
        raw.sendall(os.urandom(512))
    kinds = {**GARBAGE, **ANSWERED_BY_VLLM}
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda k: replies_after(ctx, port, thread, *kinds[k]), list(kinds) * 5))
    assert all(len(got) == 1 and is_answer(got[0]) for got in results), results
    assert_serves(ctx, port, thread)
    assert not big.poll(0)
    lines = [r for r in caplog.records if "dropped a bad handshake request" in r.getMessage()]
    assert 1 <= len(lines) <= 1 + (time.monotonic() - t0) / side_channel.LOG_INTERVAL_S
    assert all(len(r.getMessage()) < 300 for r in lines)


@pytest.mark.parametrize("garbage", list(ANSWERED_BY_VLLM))
@pytest.mark.parametrize("listener", [guarded_handshake_listener, VLLM_LISTENER], ids=["ours", "vllm"])
def test_answers_only_valid_requests(listener: Callable, garbage: str, ctx: zmq.Context) -> None:
    """vLLM answers these with its metadata (an unknown type only logs a warning); ours drops them."""
    port = free_port()
    thread = start(listener, port)
    got = replies_after(ctx, port, thread, *ANSWERED_BY_VLLM[garbage])
    assert got and all(is_answer(r) for r in got)
    assert len(got) == (2 if listener is VLLM_LISTENER else 1)
    assert thread.is_alive()


def test_same_signature_as_vllms() -> None:
    import inspect

    assert list(inspect.signature(guarded_handshake_listener).parameters) == list(
        inspect.signature(VLLM_LISTENER).parameters)


def test_connector_scheduler_starts_the_guarded_listener(ctx: zmq.Context) -> None:
    """vLLM's own start path (set_xfer_handshake_metadata, on a scheduler hardened as our connector does)
    binds the configured host and port and serves vLLM's encoded payload through garbage."""
    sched = NixlPullConnectorScheduler.__new__(NixlPullConnectorScheduler)  # NOTE: no vllm config needed
    sched._nixl_handshake_listener_t, sched._stop_event = None, threading.Event()
    sched.side_channel_host, sched.side_channel_port = HOST, free_port()
    side_channel.harden(sched)
    side_channel.harden(None)  # the worker-side connector has no scheduler
    sched.set_xfer_handshake_metadata({(0, 0): NixlHandshakePayload("hash", b"agent-md")})
    thread = sched._nixl_handshake_listener_t
    try:
        assert thread is not None and thread.is_alive()
        assert sched._nixl_handshake_listener is guarded_handshake_listener
        replies = replies_after(ctx, sched.side_channel_port, thread, zmq.REQ, [b"\xc1"])
        assert len(replies) == 1 and thread.is_alive()
        got = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(replies[0][1])
        assert (got.compatibility_hash, got.agent_metadata_bytes) == ("hash", b"agent-md")
    finally:
        sched.shutdown()  # NOTE: joins the thread; it sees the stop event within its 1 s receive timeout
    assert not thread.is_alive()


def test_our_connector_hardens_its_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvtransfer.connector.NixlConnector (what vLLM loads through kv_connector_module_path) installs the guarded
    listener on its scheduler-side part, and leaves the worker side (no scheduler) alone."""
    from kvtransfer import connector

    def fake_init(self, scheduler: object) -> None:  # NOTE: vLLM's needs a whole VllmConfig
        self.connector_scheduler = scheduler

    monkeypatch.setattr(connector._VllmNixlConnector, "__init__", fake_init)
    sched = NixlPullConnectorScheduler.__new__(NixlPullConnectorScheduler)
    connector.NixlConnector(sched)
    assert sched._nixl_handshake_listener is guarded_handshake_listener
    assert NixlBaseConnectorScheduler._nixl_handshake_listener is VLLM_LISTENER  # vLLM's class untouched
    assert connector.NixlConnector(None).connector_scheduler is None


def test_our_connector_counts_every_reader_of_one_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """The n completions of one prompt pull one prefill's KV: the scheduler side passes each decode request's
    `saaf_readers` to the workers in the connector metadata, and the worker side multiplies the consumer count
    of every read's "done reading" notification by it (the prefill engine frees the blocks at that count)."""
    from types import SimpleNamespace

    from kvtransfer import connector
    from kvtransfer.handoff import READERS

    reads: list[tuple[str, int]] = []

    def fake_init(self, worker: object, scheduler: object = None) -> None:
        self.connector_worker, self.connector_scheduler = worker, scheduler
        self._connector_metadata = None

    monkeypatch.setattr(connector._VllmNixlConnector, "__init__", fake_init)
    monkeypatch.setattr(connector._VllmNixlConnector, "build_connector_meta", lambda self, out: SimpleNamespace())
    monkeypatch.setattr(connector._VllmNixlConnector, "start_load_kv", lambda self, ctx, **kw: None)
    monkeypatch.setattr(connector.side_channel, "harden", lambda scheduler: None)  # NOTE: tested above
    worker = SimpleNamespace(_read_blocks=lambda **kw: reads.append((kw["request_id"], kw["expected_consumers"])))
    sched = SimpleNamespace(_reqs_need_recv={
        "c1": (SimpleNamespace(kv_transfer_params={"do_remote_prefill": True, READERS: 4}), [], (), True),
        "solo": (SimpleNamespace(kv_transfer_params={"do_remote_prefill": True}), [], (), True)})
    meta = connector.NixlConnector(None, sched).build_connector_meta(None)
    assert meta.saaf_readers == {"c1": 4}  # travels to the workers; a lone reader adds nothing
    conn = connector.NixlConnector(worker)
    conn._connector_metadata = meta
    conn.start_load_kv(None)
    conn.connector_worker._read_blocks(request_id="c1", expected_consumers=2)  # e.g. two prefill TP ranks
    conn.connector_worker._read_blocks(request_id="solo", expected_consumers=1)
    assert reads == [("c1", 8), ("solo", 1)]


def test_our_connector_checks_pulled_blocks_against_the_prefills_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    """transfer.integrity: the scheduler side passes each pull's digests (same TP only) to the workers; the
    worker side hashes the received blocks when the pull completes and reports the bad ones to vLLM as failed
    loads, and the request (with the blocks to redo) in its stats."""
    import queue
    from types import SimpleNamespace

    import torch

    from kvtransfer import connector, integrity

    def fake_init(self, worker: object, scheduler: object = None, tp: int = 1) -> None:
        self.connector_worker, self.connector_scheduler = worker, scheduler
        self._connector_metadata = None
        self._kv_transfer_config = SimpleNamespace(kv_connector_extra_config={"saaf_integrity": True})
        self._vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp))

    caches = {f"l{i}": torch.randn(2, 8, 2, 16, 4) for i in range(2)}
    monkeypatch.setattr(integrity, "LOCAL", integrity._Local())
    integrity.register(caches, 8, 1)
    digests = integrity.block_digests(caches, [3, 5, 6], 8)  # as if the prefill wrote these; pulled into 3, 5, 6
    monkeypatch.setattr(connector._VllmNixlConnector, "__init__", fake_init)
    monkeypatch.setattr(connector._VllmNixlConnector, "build_connector_meta",
                        lambda self, out: SimpleNamespace(reqs_to_recv={
                            "d1": SimpleNamespace(local_block_ids=[[3, 5, 6]]),
                            "d2": SimpleNamespace(local_block_ids=[[1]])}))
    monkeypatch.setattr(connector._VllmNixlConnector, "start_load_kv", lambda self, ctx, **kw: None)
    monkeypatch.setattr(connector._VllmNixlConnector, "get_transfer_results",
                        lambda self, ids: SimpleNamespace(finished_recving={"d1", "d2"}, finished_sending=set()))
    monkeypatch.setattr(connector._VllmNixlConnector, "get_kv_connector_stats", lambda self: None)
    monkeypatch.setattr(connector.side_channel, "harden", lambda scheduler: None)
    params = {"do_remote_prefill": True, "tp_size": 1, integrity.DIGEST: digests}
    sched = SimpleNamespace(_reqs_need_recv={"d1": (SimpleNamespace(kv_transfer_params=params), [], (), True),
                                             "d2": (SimpleNamespace(kv_transfer_params={"tp_size": 1}), [], (), True)})
    meta = connector.NixlConnector(None, sched).build_connector_meta(None)
    assert meta.saaf_checks == {"d1": (digests, False)}  # d2 has no digest: nothing to check
    # NOTE: a decode engine of another TP size holds other slices of the heads: it compares nothing
    monkeypatch.setattr(connector._VllmNixlConnector, "__init__", lambda self, w, s=None: fake_init(self, w, s, tp=2))
    assert not hasattr(connector.NixlConnector(None, sched).build_connector_meta(None), "saaf_checks")
    monkeypatch.setattr(connector._VllmNixlConnector, "__init__", fake_init)

    worker = SimpleNamespace(_read_blocks=lambda **kw: None, _invalid_block_ids=queue.Queue())
    conn = connector.NixlConnector(worker)
    conn._connector_metadata = meta
    conn.start_load_kv(None)
    caches["l1"][1, 5, 0, 0, 0] += 1  # block 5 changed between the prefill's write and the decode's check
    conn.get_transfer_results(set())
    assert worker._invalid_block_ids.get_nowait() == {5}
    stats = conn.get_kv_connector_stats()
    assert stats.data[integrity.MISMATCH] == [["d1", 2]]  # recomputed from block 5 on: 2 of the 3 pulled blocks
    assert not conn.get_kv_connector_stats()  # reported once
