"""A NIXL side channel (handshake listener) that a malformed request cannot stop.

vLLM's NixlConnector serves its handshake metadata on a ZMQ ROUTER socket bound to
VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT (+ data-parallel index), from a thread running
``NixlBaseConnectorScheduler._nixl_handshake_listener`` (vllm 0.32, nixl/base_scheduler.py:337-378). A request
is one REQ frame: msgpack ``(GET_META_MSG, pp_rank, tp_rank)``; the answer is ``(payload, perf_counter)``.
That loop unpacks and decodes each request with no error handling, so any one unauthenticated frame it
cannot unpack (wrong frame count, non-msgpack, msgpack of another shape, a rank pair it does not serve)
raises, ends the thread and closes the socket: from then on no decode engine can handshake with that
prefill engine, and every transfer from it fails until the engine restarts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.utils.network_utils import is_valid_ipv6_address, make_zmq_path

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 4096  # a real request is ~20 bytes; larger frames make libzmq drop the peer unread
LOG_INTERVAL_S = 1.0  # at most one warning a second for dropped requests (a flood must not flood the log)

_decode_request = msgspec.msgpack.Decoder(tuple[bytes, int, int]).decode


def check_request(frames: list[bytes], served: Any) -> tuple[int, int] | str:
    """The (pp_rank, tp_rank) a ROUTER-received request asks for, or why it is dropped (short, no payload)."""
    if len(frames) != 3 or frames[1]:
        return f"{len(frames)} frames, not a REQ envelope of one frame"
    try:
        kind, pp_rank, tp_rank = _decode_request(frames[2])
    except msgspec.MsgspecError as e:
        return f"not a (GET_META_MSG, pp, tp) msgpack ({len(frames[2])} bytes, {type(e).__name__})"
    if kind != GET_META_MSG:
        return f"unknown message type ({len(kind)} bytes)"
    if (pp_rank, tp_rank) not in served:
        return f"no metadata for pp rank {pp_rank}, tp rank {tp_rank}"
    return pp_rank, tp_rank


@contextlib.contextmanager
def _router(path: str, host: str) -> Iterator[zmq.Socket]:
    # NOTE: not vLLM's zmq_ctx: MAX_REQUEST_BYTES must be set before bind (libzmq copies a listener's options
    # when it binds), and vLLM's socket has no receive queue limit (RCVHWM 0); ZMQ's default of 1000 stays.
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        sock.setsockopt(zmq.RCVTIMEO, 1000)
        sock.setsockopt(zmq.LINGER, 0)
        if is_valid_ipv6_address(host):
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(path)
        yield sock
    finally:
        ctx.destroy(linger=0)


def guarded_handshake_listener(
    encoded_data: dict[tuple[int, int], Any],
    ready_event: threading.Event,
    stop_event: threading.Event,
    host: str,
    port: int,
) -> None:
    """Drop-in for ``NixlBaseConnectorScheduler._nixl_handshake_listener`` (same arguments, same answers to
    valid requests) that logs and drops a bad request instead of dying on it.

    NOTE: a replacement, not a wrapper: vLLM's loop decodes inline (module-level msgspec call), so there is
    no smaller piece to override, and restarting its thread after a crash would leave the port closed in
    between. Like vLLM's, it must run in the scheduler process: the perf_counter it echoes is compared with
    the block-expiry deadlines stamped there."""
    path = make_zmq_path("tcp", host, port)
    dropped, last_log = 0, 0.0
    with _router(path, host) as sock:
        ready_event.set()
        while not stop_event.is_set():
            try:
                frames = sock.recv_multipart()
            except zmq.Again:
                continue
            try:
                ranks = check_request(frames, encoded_data)
                if isinstance(ranks, tuple):
                    ts = msgspec.msgpack.encode(time.perf_counter())
                    sock.send_multipart((frames[0], b"", encoded_data[ranks], ts))
                    continue
                why = ranks
            except Exception as e:  # NOTE: last resort: nothing a peer sends may end the listener
                why = f"{type(e).__name__} answering it"
            dropped += 1
            now = time.monotonic()
            if now - last_log >= LOG_INTERVAL_S:
                logger.warning("NIXL side channel %s dropped a bad handshake request: %s (%d dropped since the "
                               "last report)", path, why, dropped)
                dropped, last_log = 0, now


def harden(scheduler: Any) -> None:
    """Make a NIXL connector scheduler (vLLM's NixlBaseConnectorScheduler, or None on the worker side) start
    guarded_handshake_listener instead of vLLM's listener. Per instance: vLLM's class stays as it is."""
    if scheduler is None:
        return
    if not hasattr(scheduler, "_nixl_handshake_listener"):
        raise RuntimeError("vLLM's NIXL scheduler has no _nixl_handshake_listener: update kvtransfer/side_channel.py")
    host = getattr(scheduler, "side_channel_host", None)
    if host in ("", "*", "0.0.0.0", "::"):
        logger.warning("NIXL side channel binds every interface (VLLM_NIXL_SIDE_CHANNEL_HOST=%r): it is "
                       "unauthenticated; set transfer.side_channel_host to the fabric address", host)
    # NOTE: set_xfer_handshake_metadata starts `target=self._nixl_handshake_listener`; vLLM's is a staticmethod
    # (a non-data descriptor), so this instance attribute wins and is called with the same arguments.
    scheduler._nixl_handshake_listener = guarded_handshake_listener
