"""The gateway's calls to the scheduler: one ``lora_session`` task per Tinker model, looked up and
cancelled with the caller's own API key, and the endpoint tokens its worker takes.

The scheduler decides who sees what: a task of another owner is NOT_FOUND here exactly as on the
gRPC API, so the gateway needs no rule of its own.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from google.protobuf import struct_pb2

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker_common.net.bearer import bearer_metadata
from opentinker_common.net.grpc_options import client_keepalive, message_limits
from opentinker_common.net.url import parse_scheduler_address

from opentinker_gateway.errors import ApiError, from_rpc

__all__ = ["Scheduler", "SessionSpec", "TASK_NAME_PREFIX", "is_tinker_model"]

#: Tasks the gateway submits are named ``tinker <model id>``; ``finish`` cancels a session's by it.
TASK_NAME_PREFIX = "tinker "

#: Seconds the gateway keeps the scheduler's ``model_names:`` table before asking again.
NAMES_TTL_S = 10.0
#: Seconds of one scheduler call before it is given up.
CALL_TIMEOUT_S = 30.0

_ENDED = (
    common_pb2.TASK_STATE_SUCCEEDED,
    common_pb2.TASK_STATE_FAILED,
    common_pb2.TASK_STATE_CANCELLED,
)


def is_tinker_model(task: common_pb2.Task) -> bool:
    """Whether ``task`` is a Tinker model: a ``lora_session`` task the gateway submitted."""
    return task.spec.workload_type == "lora_session" and task.spec.name.startswith(TASK_NAME_PREFIX)


@dataclass(frozen=True)
class SessionSpec:
    """What a Tinker ``create_model`` asks for, in the ``lora_session`` task's terms."""

    model_dir: str
    lora_rank: int
    target_modules: tuple[str, ...]
    seed: int
    idle_timeout_s: float
    #: Start from state ``init_state`` of task ``init_from`` (with ``init_optimizer`` its AdamW
    #: state and step too) instead of a fresh adapter.
    init_from: str = ""
    init_state: str = ""
    init_optimizer: bool = False
    #: Seconds the session holds a request ahead of its turn: the gateway's ``gap_timeout_s``.
    held_call_timeout_s: float = 60.0


class Scheduler:
    """An asynchronous connection to the scheduler at ``address`` (``host:port`` or a URL)."""

    def __init__(self, address: str) -> None:
        parsed = parse_scheduler_address(address)
        options = [*client_keepalive(), *message_limits()]
        if parsed.tls:
            self._channel = grpc.aio.secure_channel(parsed.target, grpc.ssl_channel_credentials(), options=options)
        else:
            self._channel = grpc.aio.insecure_channel(parsed.target, options=options)
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)
        self._tokens: dict[tuple[str, str], tuple[str, float]] = {}
        self._names: tuple[dict[str, str], float] = ({}, -NAMES_TTL_S - 1.0)

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: str, request, key: str):
        try:
            return await getattr(self._stub, method)(request, timeout=CALL_TIMEOUT_S, metadata=bearer_metadata(key))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc(exc, "scheduler") from None

    async def submit_session(self, spec: SessionSpec, *, name: str, key: str, request_id: str) -> str:
        """The id of the ``lora_session`` task for ``spec``; ``request_id`` makes a retry return the
        task the first call made."""
        hp = struct_pb2.Struct()
        hp.update(
            {
                "lora": True,
                "lora_rank": spec.lora_rank,
                "lora_alpha": 32.0,
                "target_modules": list(spec.target_modules),
                "seed": spec.seed,
                "idle_timeout_s": spec.idle_timeout_s,
                "held_call_timeout_s": spec.held_call_timeout_s,
            }
        )
        if spec.init_state:
            hp.update({"init_state": spec.init_state, "init_optimizer": spec.init_optimizer})
        task_spec = common_pb2.TaskSpec(
            workload_type="lora_session",
            model=spec.model_dir,
            hyperparameters=hp,
            name=name[:120],
            init_from=spec.init_from,
        )
        response = await self._call(
            "SubmitTask", scheduler_pb2.SubmitTaskRequest(spec=task_spec, request_id=request_id[:128]), key
        )
        return response.task.task_id

    async def get_task(self, task_id: str, key: str) -> common_pb2.Task:
        return (await self._call("GetTask", scheduler_pb2.GetTaskRequest(task_id=task_id), key)).task

    async def wait_serving(self, task_id: str, key: str, *, poll_s: float = 0.2) -> common_pb2.Task:
        """The task once it serves (RUNNING with an endpoint). Raises ApiError when it ended."""
        while True:
            task = await self.get_task(task_id, key)
            if task.state == common_pb2.TASK_STATE_RUNNING and task.endpoint:
                return task
            if task.state in _ENDED:
                reason = task.error or common_pb2.TaskState.Name(task.state)
                raise ApiError(f"model: its session task {task_id} ended: {reason}", status=410, category="server")
            await asyncio.sleep(poll_s)

    async def cancel(self, task_id: str, key: str, reason: str) -> None:
        await self._call("CancelTask", scheduler_pb2.CancelTaskRequest(task_id=task_id, reason=reason), key)

    async def check_key(self, key: str) -> None:
        """Return when the scheduler takes ``key``: one read of its ``model_names:`` table, kept.

        Raises:
            ApiError: 401 for an unknown, revoked or expired key; as :func:`from_rpc` otherwise.
        """
        response = await self._call("ListModelNames", scheduler_pb2.ListModelNamesRequest(), key)
        self._names = ({m.name: m.folder for m in response.model_names}, time.monotonic())

    async def model_names(self, key: str) -> dict[str, str]:
        """The scheduler's ``model_names:`` table, Tinker model name -> local folder, in its order;
        asked again after :data:`NAMES_TTL_S` seconds."""
        if time.monotonic() - self._names[1] > NAMES_TTL_S:
            response = await self._call("ListModelNames", scheduler_pb2.ListModelNamesRequest(), key)
            self._names = ({m.name: m.folder for m in response.model_names}, time.monotonic())
        return self._names[0]

    async def task_named(self, name: str, key: str) -> common_pb2.Task | None:
        """The caller's running or queued task named ``name``, or None."""
        return next((t for t in await self.session_tasks(name, key) if t.spec.name == name), None)

    async def session_tasks(self, name_prefix: str, key: str) -> list[common_pb2.Task]:
        """The caller's running or queued tasks whose name starts with ``name_prefix``."""
        states = [
            common_pb2.TASK_STATE_PENDING,
            common_pb2.TASK_STATE_ASSIGNED,
            common_pb2.TASK_STATE_RUNNING,
        ]
        found: list[common_pb2.Task] = []
        token = ""
        while True:
            page = await self._call(
                "ListTasks", scheduler_pb2.ListTasksRequest(states=states, page_size=1000, page_token=token), key
            )
            found += [t for t in page.tasks if t.spec.name.startswith(name_prefix)]
            token = page.next_page_token
            if not token:
                return found

    async def runs(self, key: str) -> list[common_pb2.Task]:
        """The Tinker models the key sees (its own; every owner's for an admin key), newest first."""
        found: list[common_pb2.Task] = []
        token = ""
        while True:
            page = await self._call("ListTasks", scheduler_pb2.ListTasksRequest(page_size=1000, page_token=token), key)
            found += [t for t in page.tasks if is_tinker_model(t)]
            token = page.next_page_token
            if not token:
                return found

    async def checkpoints(self, task_id: str, key: str) -> scheduler_pb2.ListCheckpointsResponse:
        """The task's checkpoints in the artifact store, oldest first, and the keys of those deleted."""
        return await self._call("ListCheckpoints", scheduler_pb2.ListCheckpointsRequest(task_id=task_id), key)

    async def delete_checkpoint(self, task_id: str, artifact_key: str, key: str) -> None:
        """Delete the task's checkpoint stored as ``artifact_key`` from the artifact store."""
        request = scheduler_pb2.DeleteCheckpointRequest(task_id=task_id, artifact_key=artifact_key)
        await self._call("DeleteCheckpoint", request, key)

    async def set_checkpoint_ttl(self, task_id: str, artifact_key: str, ttl_s: int | None, key: str) -> None:
        """Expire the task's checkpoint stored as ``artifact_key`` in ``ttl_s`` seconds (None: never)."""
        request = scheduler_pb2.SetCheckpointTtlRequest(task_id=task_id, artifact_key=artifact_key)
        if ttl_s is not None:
            request.ttl.FromSeconds(ttl_s)
        await self._call("SetCheckpointTtl", request, key)

    async def download(
        self, task_id: str, artifact_key: str, key: str
    ) -> tuple[scheduler_pb2.CheckpointManifest, AsyncIterator[scheduler_pb2.CheckpointChunk]]:
        """The manifest of the task's checkpoint stored as ``artifact_key``, and its files' chunks
        in manifest order (the rest of one DownloadCheckpoint stream; close it to stop early)."""
        request = scheduler_pb2.DownloadCheckpointRequest(task_id=task_id, artifact_key=artifact_key)
        call = self._stub.DownloadCheckpoint(request, metadata=bearer_metadata(key))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise from_rpc(exc, "scheduler") from None
        if first is grpc.aio.EOF or not first.HasField("manifest"):
            raise ApiError("scheduler: DownloadCheckpoint sent no manifest", status=502, category="server")

        async def chunks() -> AsyncIterator[scheduler_pb2.CheckpointChunk]:
            try:
                while (message := await call.read()) is not grpc.aio.EOF:
                    yield message.chunk
            finally:
                call.cancel()

        return first.manifest, chunks()

    async def endpoint_metadata(self, task_id: str, key: str) -> tuple[tuple[str, str], ...]:
        """``authorization`` metadata for the task's endpoint: an endpoint token asked for with
        ``key`` and kept until a quarter of its hour is left; ``()`` with authentication off."""
        cached = self._tokens.get((key, task_id))
        if cached is None or (cached[1] and cached[1] - time.time() < 900):
            request = scheduler_pb2.IssueEndpointTokenRequest(task_id=task_id)
            request.ttl.FromSeconds(3600)
            response = await self._call("IssueEndpointToken", request, key)
            expire = response.expire_time.ToSeconds() if response.HasField("expire_time") else 0.0
            cached = (response.token, float(expire))
            self._tokens[(key, task_id)] = cached
        return bearer_metadata(cached[0]) if cached[0] else ()
