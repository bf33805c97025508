"""One Tinker model: a ``lora_session`` task, the order of its requests and its futures.

Tinker numbers a model's requests (``seq_id`` 1, 2, 3 ...) and may send them at once, the
chunks of one step in any order; they apply in ``seq_id`` order. A request whose predecessor
does not arrive within ``gap_timeout_s`` fails as a ``seq_id`` gap, and so do the ones queued
after it. A retried request (a ``seq_id`` already taken) gets the future of the first.

The session worker numbers its own calls (``sequence``); every call of the model, samples too,
goes through :meth:`Model.call`, which keeps the worker's number and follows it when the worker
says another is expected.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc
from google.rpc import error_details_pb2, status_pb2

from opentinker.training.v1 import training_pb2, training_pb2_grpc
from opentinker_common.net.grpc_options import client_keepalive, message_limits
from opentinker_common.net.url import parse_scheduler_address

from opentinker_gateway.errors import ApiError, from_rpc

__all__ = ["Model", "Outcome"]

log = logging.getLogger(__name__)

#: Times a worker call is sent again after UNAVAILABLE (the worker restarting) before it fails.
_UNAVAILABLE_TRIES = 5


@dataclass
class Outcome:
    """A finished future: a protobuf payload, a JSON payload or a failure."""

    proto: bytes | None = None
    json: dict | None = None
    error: ApiError | None = None


@dataclass
class _Queued:
    seq_id: int
    run: Callable[[], Awaitable[Outcome]]
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Model:
    """A Tinker model served by session task ``task_id`` at ``endpoint``.

    Args:
        metadata: awaitable giving the ``authorization`` metadata for the worker (an endpoint token).
        first_seq_id: the ``seq_id`` its first training request carries.
        gap_timeout_s: seconds a request waits for a missing predecessor.
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
        first_seq_id: int = 1,
        gap_timeout_s: float = 60.0,
    ) -> None:
        self.model_id = model_id
        self.task_id = task_id
        self.endpoint = endpoint
        self.base_model = base_model
        self.model_dir = model_dir
        self.lora_rank = lora_rank
        self._metadata = metadata
        self.gap_timeout_s = gap_timeout_s
        address = parse_scheduler_address(endpoint)
        options = [*client_keepalive(), *message_limits()]
        if address.tls:
            self._channel = grpc.aio.secure_channel(address.target, grpc.ssl_channel_credentials(), options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address.target, options=options)
        self.stub = training_pb2_grpc.TrainingServiceStub(self._channel)
        self._next_seq_id = first_seq_id
        self._queued: dict[int, _Queued] = {}
        self._futures: dict[int, asyncio.Future] = {}
        self._gap_failed: set[int] = set()
        self._wake = asyncio.Event()
        self._worker_sequence: int | None = None
        self._worker_lock = asyncio.Lock()
        self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch())

    async def close(self) -> None:
        self._dispatcher.cancel()
        await self._channel.close()

    # --- the order of Tinker requests ---------------------------------------------------------
    def submit(self, seq_id: int, run: Callable[[], Awaitable[Outcome]]) -> asyncio.Future:
        """The future of request ``seq_id``: ``run()`` once every earlier ``seq_id`` has run.
        A ``seq_id`` already taken returns the first request's future and runs nothing, unless
        it failed as a gap: then it runs in its turn."""
        if seq_id in self._futures and seq_id not in self._gap_failed:
            return self._futures[seq_id]
        self._gap_failed.discard(seq_id)
        if seq_id < self._next_seq_id:
            raise ApiError(
                f"seq_id: request {seq_id} of model {self.model_id} ran already and its answer is no longer kept"
            )
        item = _Queued(seq_id, run)
        self._queued[seq_id] = item
        self._futures[seq_id] = item.future
        while len(self._futures) > 256:
            oldest = min(self._futures)
            if not self._futures[oldest].done():
                break
            del self._futures[oldest]
        self._wake.set()
        return item.future

    def future(self, seq_id: int) -> asyncio.Future | None:
        return self._futures.get(seq_id)

    async def _dispatch(self) -> None:
        while True:
            item = self._queued.pop(self._next_seq_id, None)
            if item is None:
                self._wake.clear()
                if not self._queued:
                    await self._wake.wait()
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=self.gap_timeout_s)
                except asyncio.TimeoutError:
                    self._fail_gap()
                continue
            self._next_seq_id += 1
            try:
                outcome = await item.run()
            except ApiError as exc:
                outcome = Outcome(error=exc)
            except Exception as exc:  # noqa: BLE001 - a future answers every request
                log.exception("request %s of model %s failed", item.seq_id, self.model_id)
                outcome = Outcome(error=ApiError(f"internal error: {exc}", status=500, category="server"))
            item.future.set_result(outcome)

    def _fail_gap(self) -> None:
        """Fail every queued request: seq_id ``_next_seq_id`` never came."""
        waiting = sorted(self._queued)
        for seq_id in waiting:
            item = self._queued.pop(seq_id)
            self._gap_failed.add(seq_id)
            item.future.set_result(
                Outcome(
                    error=ApiError(
                        f"seq_id: model {self.model_id} expected request {self._next_seq_id} next, got "
                        f"{waiting[0]}; request {self._next_seq_id} did not arrive within "
                        f"{self.gap_timeout_s:g} s"
                    )
                )
            )

    # --- the worker's numbers -------------------------------------------------------------------
    async def call(self, what: str, send: Callable[[int, tuple], Awaitable[Any]]) -> Any:
        """``await send(sequence, metadata)`` as the worker's next call; ``what`` names it in errors.

        Raises:
            ApiError: the worker refused it (its gRPC status mapped), or stayed unavailable.
        """
        async with self._worker_lock:
            metadata = await self._metadata()
            if self._worker_sequence is None:
                self._worker_sequence = await self._info_sequence(metadata)
            unavailable = 0
            while True:
                try:
                    response = await send(self._worker_sequence, metadata)
                except grpc.aio.AioRpcError as exc:
                    expected = _expected_sequence(exc)
                    if expected is not None and expected != self._worker_sequence:
                        self._worker_sequence = expected
                        continue
                    if exc.code() == grpc.StatusCode.UNAVAILABLE and unavailable < _UNAVAILABLE_TRIES:
                        unavailable += 1
                        await asyncio.sleep(0.2 * 2**unavailable)
                        continue
                    raise from_rpc(exc, what) from None
                self._worker_sequence += 1
                return response

    async def info(self):
        metadata = await self._metadata()
        try:
            return await self.stub.GetInfo(training_pb2.GetInfoRequest(), timeout=60, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc(exc, "get_info") from None

    async def _info_sequence(self, metadata) -> int:
        try:
            info = await self.stub.GetInfo(training_pb2.GetInfoRequest(), timeout=60, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc(exc, "get_info") from None
        return info.next_sequence


def _expected_sequence(exc: grpc.aio.AioRpcError) -> int | None:
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
