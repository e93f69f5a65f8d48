"""The ingress's calls to its workers over Ray: submit, wait within a bound, and turn Ray's failures into ours.

Leg (cluster/serve/leg.py) keeps one completion's state machine and calls these, and membership polls stats
through them; nothing else in serve/ calls a worker. What each call returns is the worker contract
(engine/contract.py):

    prefill()  -> ObjectRef of a PrefillResult;  prefill_result() awaits it
    decode()   -> the decode_stream() generator of DecodeEvents;  generate() -> generate_stream()'s
    events()   -> the items of such a generator, each within its timeout, DecodeQueued beats consumed
    release()  -> the prefill engine frees a handoff's blocks that no decode will pull
    stats()    -> ObjectRef of the worker's WorkerStats

A worker that is gone is a WorkerDied (the leg retries elsewhere); one that answers with an error is a 502;
one that does not answer in time is a 504.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from cluster.errors import ServeError
from engine.contract import DecodeQueued, PrefillResult
from kvtransfer.handoff import KVHandoff

if TYPE_CHECKING:
    from vllm import SamplingParams

    from engine.contract import DecodeEvent

logger = logging.getLogger(__name__)
DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)
RELEASE_TIMEOUT_S = 10.0


class WorkerDied(Exception):
    def __init__(self, worker: str, cause: BaseException) -> None:
        super().__init__(worker)
        self.worker, self.cause = worker, cause


def timed_out(what: str, seconds: float) -> ServeError:
    return ServeError(504, f"{what} exceeded {seconds:.0f}s; request aborted", type_="timeout", code="timeout")


def prefill(handle: Any, rid: str, ids: list[int], params: SamplingParams, sample_first: bool) -> Any:
    return handle.prefill.remote(rid, ids, params, sample_first)


def decode(handle: Any, rid: str, ids: list[int], params: SamplingParams, handoff: KVHandoff) -> Any:
    return handle.decode_stream.options(num_returns="streaming").remote(rid, ids, params, handoff)


def generate(handle: Any, rid: str, ids: list[int], params: SamplingParams) -> Any:
    return handle.generate_stream.options(num_returns="streaming").remote(rid, ids, params)


def stats(handle: Any) -> Any:
    return handle.stats.remote()


def cancel(ref: Any) -> None:
    with contextlib.suppress(Exception):
        ray.cancel(ref)


async def prefill_result(ref: Any, worker: str | None, left_s: float, request_timeout_s: float) -> PrefillResult:
    try:
        return await asyncio.wait_for(ref, timeout=max(left_s, 0.001))
    except DEAD as e:
        raise WorkerDied(str(worker), e) from None
    except TimeoutError:
        raise timed_out("prefill", request_timeout_s) from None
    except RayTaskError as e:
        raise ServeError(502, f"prefill failed on {worker}: {getattr(e, 'cause', e)}", type_="engine_error",
                         code="engine_error") from None


async def events(gen: Any, worker: str | None, timeout: float, left: Callable[[], float], request_timeout_s: float,
                 token_timeout_s: float, first_timeout: bool = False) -> AsyncIterator[DecodeEvent]:
    """Items of a streaming worker call, each within `timeout` (after the first, `token_timeout_s` when
    `first_timeout`) and all within the request's deadline (`left()` seconds from now)."""
    while True:
        remaining = left()
        if remaining <= 0:
            raise timed_out("request", request_timeout_s)
        try:
            ref = await asyncio.wait_for(gen.__anext__(), timeout=min(timeout, remaining))
            item = await ref
        except StopAsyncIteration:
            return
        except TimeoutError:
            if remaining <= timeout:
                raise timed_out("request", request_timeout_s) from None
            raise ServeError(504, f"no token from {worker} for {timeout:.0f}s; request aborted",
                             type_="timeout", code="timeout") from None
        except DEAD as e:
            raise WorkerDied(str(worker), e) from None
        except RayTaskError as e:
            raise ServeError(502, f"{worker} failed: {getattr(e, 'cause', e)}", type_="engine_error",
                             code="kv_transfer_error" if first_timeout else "engine_error") from None
        if isinstance(item, DecodeQueued):  # NOTE: still queued on the decode engine, alive: the wait for
            continue  # its first token starts again, with the same timeout
        if first_timeout:
            timeout = token_timeout_s
        yield item


async def release(handle: Any, handoff: KVHandoff) -> None:
    try:
        await asyncio.wait_for(handle.release.remote(handoff), timeout=RELEASE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - the lease frees the blocks anyway (kv_lease_s)
        logger.info("release of %s's KV on %s failed (%s); its lease frees it", handoff.request_id,
                    handoff.prefill_worker, e)


async def release_late(ref: Any, handle: Any) -> None:
    """A cancelled prefill that finished anyway has pinned its KV for a decode that will never come."""
    try:
        result = await asyncio.wait_for(ref, timeout=RELEASE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - cancelled in time (the engine aborted it), or the worker is gone
        return
    await release(handle, result.handoff)
