"""One Tinker model: a ``lora_session`` task, the order of its requests and its futures.

Tinker numbers a model's requests (``seq_id`` 1, 2, 3 ...) and may send several at once, the
chunks of one step in any order. Request ``seq_id`` is the session worker's call ``seq_id - 1``:
the worker applies its calls in that order, answers a repeated number with the first answer and
holds a call ahead of the one it expects, to run it in its turn. So any gateway instance may send
any request of a model, and a retried request (same ``seq_id``) never applies twice.

The gateway gives out a future (``<model id>#<seq_id>#<kind>``) only once the worker answered
its call, or holds it: the worker says so at once in the call's initial metadata, and a held call
runs and keeps its answer even if the gateway dies. Only a streamed call (forward_backward,
forward) shows it at once: grpc.aio gives a unary call's initial metadata with its answer, so a
unary request ahead waits for its answer like any other (408, and the SDK sends it again). A
gateway that dies before gave no answer, the SDK sends the request again to any instance, and
the worker answers that ``seq_id`` once (a call it started or holds runs to its end and keeps its
answer). The SDK sends the first chunk of a batch only after the others got their futures;
held, those chunks survive their gateway.

A held call whose turn does not come within the worker's ``held_call_timeout_s`` (the gateway
sets it to ``gap_timeout_s``) fails as a ``seq_id`` gap and may be sent again. A worker that holds
as much as it may refuses a call ahead: such a request gets its future at once, since the SDK
waits for it before it sends the first chunk, and this instance sends it again until the worker
reaches it; after ``gap_timeout_s`` of that it fails as a gap. Such a request is lost with its
gateway. A request the worker refuses uses up its ``seq_id``, as on Tinker; so does one the
gateway refuses: it sends the worker, in that request's turn, a payload the worker refuses. A
``seq_id`` sent again with another body is refused (409).

The instance that sent a request answers its future from memory; any other instance (or after
a restart) answers with the worker's kept answer of call ``seq_id - 1``: once the worker's next
call (GetInfo) is past it, the same RPC with a refused payload gets the kept answer. A future
whose request the worker still waits for after ``gap_timeout_s``, and that no request of this
instance carries, never reached the worker: it fails, and uses up its ``seq_id`` so the model
goes on.

A worker that goes away (``kill -9``, a lost node) makes the scheduler requeue its task; the
next attempt resumes from the task's newest ``save_state`` at a new endpoint. A request that finds
the worker unavailable follows the task there. The resumed worker expects the request after that
save; those the lost worker answered after it are gone, so a request past them fails at once as
a ``seq_id`` gap that names the save, rather than after ``gap_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc
from google.rpc import error_details_pb2, status_pb2

from opentinker.training.v1 import training_pb2, training_pb2_grpc
from opentinker_common.net.grpc_options import client_keepalive, message_limits
from opentinker_common.net.url import parse_scheduler_address
from opentinker_common.spec.session import HELD_METADATA

from opentinker_gateway.errors import SERVER, ApiError, from_rpc

__all__ = ["Model", "Outcome", "NotYet"]

log = logging.getLogger(__name__)

#: Seconds between tries of a call whose worker is unavailable: first, most.
_UNAVAILABLE_WAIT = (0.2, 2.0)
#: Seconds between tries of a call the worker is not ready for yet: first, growth, most.
_AHEAD_WAIT = (0.01, 1.5, 0.2)


@dataclass
class Outcome:
    """A finished future: a protobuf payload, a JSON payload or a failure."""

    proto: bytes | None = None
    json: dict | None = None
    error: ApiError | None = None


class NotYet(Exception):
    """The worker has not run the call a future names (yet): answer ``try_again``.

    Args:
        next_is_it: the worker's next call is this one: it waits for this request.
    """

    def __init__(self, next_is_it: bool = False) -> None:
        super().__init__()
        self.next_is_it = next_is_it


class Model:
    """A Tinker model served by session task ``task_id`` at ``endpoint``.

    Args:
        metadata: awaitable giving the ``authorization`` metadata for the worker (an endpoint token).
        serving: awaitable giving the task once it serves (RUNNING with an endpoint); raises
            :class:`ApiError` when it ended.
        gap_timeout_s: seconds a request waits for the worker to reach it, or to serve again.
    """

    def __init__(
        self,
        model_id: str,
        task_id: str,
        endpoint: str,
        *,
        base_model: str,
        model_dir: str,
        lora_rank: int,
        metadata: Callable[[], Awaitable[tuple]],
        serving: Callable[[], Awaitable[Any]],
        gap_timeout_s: float = 60.0,
    ) -> None:
        self.model_id = model_id
        self.task_id = task_id
        self.endpoint = endpoint
        self.base_model = base_model
        self.model_dir = model_dir
        self.lora_rank = lora_rank
        self.metadata = metadata
        self.serving = serving
        self.gap_timeout_s = gap_timeout_s
        self._channels: list[grpc.aio.Channel] = []
        self._connect(endpoint)
        self._futures: dict[int, asyncio.Future] = {}
        self._digests: dict[int, str] = {}
        #: seq_id -> set once the worker holds the request for its turn, or refused to hold it.
        self._ahead: dict[int, asyncio.Event] = {}
        #: seq_id -> when this instance first saw the worker wait for it, holding no request of it.
        self._missing: dict[int, float] = {}
        self._gap_failed: set[int] = set()
        self._follow_lock = asyncio.Lock()
        #: After the task resumed at a new endpoint: the highest request the lost worker answered,
        #: and the save the resumed attempt started from.
        self.lost_up_to = 0
        self.resumed_from = ""

    def _connect(self, endpoint: str) -> None:
        address = parse_scheduler_address(endpoint)
        options = [*client_keepalive(), *message_limits()]
        if address.tls:
            channel = grpc.aio.secure_channel(address.target, grpc.ssl_channel_credentials(), options=options)
        else:
            channel = grpc.aio.insecure_channel(address.target, options=options)
        self._channels.append(channel)  # older ones close with the model: calls may still use them
        self.endpoint = endpoint
        self.stub = training_pb2_grpc.TrainingServiceStub(channel)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def follow(self, endpoint: str) -> bool:
        """Whether the task serves at another endpoint than ``endpoint``, the one a call found
        unavailable; if so the model's calls go there from now on.

        Raises:
            ApiError: the task ended.
        """
        async with self._follow_lock:
            if self.endpoint != endpoint:  # a concurrent call followed it already
                return True
            task = await self.serving()
            if task.endpoint == endpoint:
                return False
            ran = [n for n, f in self._futures.items() if f.done() and f.result().error is None]
            self.lost_up_to = max(ran, default=0)
            self._connect(task.endpoint)
            try:
                self.resumed_from = (await self.info()).resumed_from
            except ApiError:
                self.resumed_from = ""
            log.info(
                "model %s follows its task to %s (resumed from %r)", self.model_id, task.endpoint, self.resumed_from
            )
            return True

    def submit(
        self,
        seq_id: int,
        what: str,
        send: Callable[[int, tuple], Awaitable[Any]],
        answer,
        *,
        digest: str | None,
        refused: ApiError | None = None,
    ) -> asyncio.Future:
        """The future of request ``seq_id``: ``answer(await send(seq_id - 1, metadata))`` once the
        worker takes it. A ``seq_id`` this instance holds already returns that future and sends
        nothing, unless it failed as a gap: then it is sent again.

        Args:
            digest: a hash of the request's body (None: not known): a held ``seq_id`` with another
                body is refused.
            refused: the gateway refused the request with this error: ``send`` carries a payload
                the worker refuses, in the request's turn, and the future's answer is ``refused``.

        Raises:
            ApiError: 409, ``seq_id`` was sent with another body.
        """
        held = self._digests.get(seq_id)
        if held is not None and digest is not None and held != digest:
            raise ApiError(
                f"seq_id: request {seq_id} of model {self.model_id} was sent before with another body; "
                "a seq_id names one request (send a new request with the next seq_id)",
                status=409,
            )
        if seq_id in self._futures and seq_id not in self._gap_failed:
            return self._futures[seq_id]
        self._gap_failed.discard(seq_id)
        if digest is not None:
            self._digests[seq_id] = digest
        self._ahead[seq_id] = asyncio.Event()

        async def run() -> Outcome:
            try:
                return answer(await self.call(seq_id, what, send))
            except ApiError as exc:
                if exc.message.startswith("seq_id:"):
                    self._gap_failed.add(seq_id)
                    return Outcome(error=exc)
                return Outcome(error=refused or exc)
            except Exception as exc:  # noqa: BLE001 - a future answers every request
                log.exception("request %s of model %s failed", seq_id, self.model_id)
                return Outcome(error=ApiError(f"internal error: {exc}", status=500, category=SERVER))

        future = asyncio.ensure_future(run())
        self._futures[seq_id] = future
        while len(self._futures) > 256:
            oldest = min(self._futures)
            if not self._futures[oldest].done():
                break
            del self._futures[oldest]
            self._digests.pop(oldest, None)
            self._ahead.pop(oldest, None)
        return future

    async def taken(self, seq_id: int, timeout: float) -> bool:
        """Wait until the worker answered request ``seq_id``, which this instance holds, or holds
        it for its turn, or refused to hold it: the SDK sends the first chunk of a batch after the
        others, so a request ahead cannot wait for its answer. False after ``timeout`` seconds."""
        waiter = asyncio.ensure_future(self._ahead[seq_id].wait())
        try:
            pending = [self._futures[seq_id], waiter]
            done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        return bool(done)

    def future(self, seq_id: int) -> asyncio.Future | None:
        return self._futures.get(seq_id)

    async def call(self, seq_id: int, what: str, send: Callable[[int, tuple], Any]) -> Any:
        """``await send(seq_id - 1, metadata)``, sent again while the worker neither takes nor
        holds it.

        Raises:
            ApiError: the worker refused it (its gRPC status mapped), stayed unavailable, or did
                not reach it within ``gap_timeout_s`` (a ``seq_id`` gap).
        """
        sequence = seq_id - 1
        wait, grow, most = _AHEAD_WAIT
        first_refusal = first_unavailable = None
        unavailable_wait = _UNAVAILABLE_WAIT[0]
        while True:
            endpoint = self.endpoint
            if self.lost_up_to:  # the worker would hold a request past the lost ones, never to run it
                try:
                    expected = (await self.info()).next_sequence
                except ApiError:  # unreachable now: the call below finds out
                    expected = None
                if expected is not None:
                    self._check_not_lost(seq_id, expected)
            call = send(sequence, await self.metadata())
            held = asyncio.ensure_future(self._held(seq_id, call))
            try:
                return await call
            except grpc.aio.AioRpcError as exc:
                expected = expected_sequence(exc)
                if expected is not None and expected < sequence and await held:  # held, then expired
                    raise ApiError(
                        f"seq_id: model {self.model_id} expected request {expected + 1} next, got "
                        f"{seq_id}; request {expected + 1} did not arrive within {self.gap_timeout_s:g} s"
                    ) from None
                if expected is not None:
                    self._check_not_lost(seq_id, expected)
                if expected is not None and expected < sequence:  # ahead, and the worker holds enough
                    self._ahead[seq_id].set()
                    now = time.monotonic()
                    first_refusal = first_refusal or now
                    if now - first_refusal > self.gap_timeout_s:
                        raise ApiError(
                            f"seq_id: model {self.model_id} expected request {expected + 1} next, got "
                            f"{seq_id}; request {expected + 1} did not arrive within {self.gap_timeout_s:g} s"
                        ) from None
                    await asyncio.sleep(wait)
                    wait = min(wait * grow, most)
                    continue
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    # The worker restarting, or gone: its task requeued, to serve at a new endpoint.
                    now = time.monotonic()
                    first_unavailable = first_unavailable or now
                    if await self.follow(endpoint):
                        first_unavailable, unavailable_wait = None, _UNAVAILABLE_WAIT[0]
                        continue
                    if now - first_unavailable > self.gap_timeout_s:
                        raise from_rpc(exc, what) from None
                    await asyncio.sleep(unavailable_wait)
                    unavailable_wait = min(unavailable_wait * 2, _UNAVAILABLE_WAIT[1])
                    continue
                raise from_rpc(exc, what) from None
            finally:
                held.cancel()

    def _check_not_lost(self, seq_id: int, expected: int) -> None:
        """Raise the ``seq_id`` gap error when request ``seq_id`` comes after requests the lost
        worker ran: the resumed worker, which expects sequence ``expected``, lost them.

        Raises:
            ApiError: the request cannot run.
        """
        if expected < seq_id - 1 and expected < self.lost_up_to:
            raise ApiError(
                f"seq_id: model {self.model_id} lost its session worker and resumed from its newest "
                f"save_state {self.resumed_from or '(none: a fresh session)'}, which expects request "
                f"{expected + 1} next; requests {expected + 1} to {self.lost_up_to} ran on the lost worker "
                f"and are gone, so request {seq_id} cannot run: restart the run from that save"
            )

    async def _held(self, seq_id: int, call) -> bool:
        """Whether the worker holds ``call``, of request ``seq_id``, for its turn: its initial
        metadata says so at once. The request's POST may then be answered."""
        try:
            metadata = await call.initial_metadata()
        except grpc.aio.AioRpcError:
            return False
        held = any(key == HELD_METADATA for key, _ in metadata or ())
        if held and seq_id in self._ahead:
            self._ahead[seq_id].set()
        return held

    async def kept(self, seq_id: int, what: str, probe: Callable[[int, tuple], Awaitable[Any]], answer) -> Outcome:
        """The outcome of request ``seq_id`` from the worker's kept answer: ``answer(response)``,
        or the refusal the worker kept. ``probe`` sends the same RPC with a payload the worker
        refuses; it goes only once the worker is past the call, since sent in the call's turn its
        refusal would use up the ``seq_id``.

        Raises:
            NotYet: the worker has not run it. ApiError: its answer is no longer kept.
        """
        try:
            next_sequence = (await self.info()).next_sequence
        except ApiError as exc:
            if exc.status == 503:
                raise NotYet() from None
            raise
        if next_sequence <= seq_id - 1:
            raise NotYet(next_is_it=next_sequence == seq_id - 1)
        try:
            return answer(await probe(seq_id - 1, await self.metadata()))
        except grpc.aio.AioRpcError as exc:
            if expected_sequence(exc) is not None:
                raise ApiError(
                    f"request_id: request {seq_id} of model {self.model_id} ran and its answer is no longer kept",
                    status=410,
                    category=SERVER,
                ) from None
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise NotYet() from None
            return Outcome(error=from_rpc(exc, what))

    def missing(self, seq_id: int) -> bool:
        """Whether request ``seq_id``, which the worker waits for and this instance never sent,
        has been missing for ``gap_timeout_s`` since this instance first saw it missing."""
        now = time.monotonic()
        return now - self._missing.setdefault(seq_id, now) > self.gap_timeout_s

    async def info(self) -> training_pb2.GetInfoResponse:
        try:
            return await self.stub.GetInfo(training_pb2.GetInfoRequest(), timeout=60, metadata=await self.metadata())
        except grpc.aio.AioRpcError as exc:
            raise from_rpc(exc, "get_info") from None


def expected_sequence(exc: grpc.aio.AioRpcError) -> int | None:
    """The worker's expected sequence number of an OUT_OF_ORDER refusal, else None."""
    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key != "grpc-status-details-bin":
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if info.reason == "OUT_OF_ORDER":
                    return int(info.metadata.get("expected_sequence", "-1"))
    return None
