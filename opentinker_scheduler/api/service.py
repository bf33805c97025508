"""gRPC servicers: thin adapters from protobuf to :class:`~opentinker_scheduler.state.core.SchedulerCore`
and :func:`~opentinker_scheduler.admission.admit.admit`; errors, durability and audit in :mod:`.rpc`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from typing import AsyncIterator

import grpc
import structlog

from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2, node_pb2_grpc
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from opentinker_scheduler.admission.admit import admit, admit_dry_run, check_submit_rate
from opentinker_scheduler.admission.load import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_WAIT_S, SubmitGate
from opentinker_scheduler.api.rpc import Call, abort_mapped, record, rpc
from opentinker_scheduler.api.streams import read_ahead
from opentinker_common.artifacts import checkpoint_key
from opentinker_common.spec.sft import is_dataset_id

from opentinker_scheduler.data import checkpoints
from opentinker_scheduler.data.adapters import receive_adapter
from opentinker_scheduler.data.datasets import DatasetStore, receive_upload
from opentinker_scheduler.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from opentinker_scheduler.security import endpoint_tokens
from opentinker_scheduler.security.auth import caller, owner_scope
from opentinker_scheduler.security.bundle import Security
from opentinker_scheduler.state.client_api import new_task_id
from opentinker_scheduler.state.core import SchedulerCore
from opentinker_scheduler.state.store import TaskRow

#: Longest checkpoint TTL (SetCheckpointTtl), in seconds: ten years.
MAX_CHECKPOINT_TTL_S = 10 * 365 * 86400

log = structlog.get_logger("opentinker.scheduler")

#: Owner of tasks submitted without authentication (API keys arrive with the security work).
ANONYMOUS = "anonymous"

#: Workload types whose tasks serve endpoints on trainer nodes, which take endpoint tokens.
ENDPOINT_WORKLOADS = ("inference", "lora_session")

#: Seconds between a follower's looks at a watched task's events (it is not told of changes).
FOLLOWER_WATCH_POLL_S = 0.25


def _ts(msg, seconds: float | None) -> None:
    if seconds:
        msg.FromNanoseconds(int(seconds * 1e9))


def task_to_proto(task: TaskRow, pending_reason: str = "", *, into=common_pb2.Task) -> common_pb2.Task:
    """Domain task row -> ``opentinker.common.v1.Task``. ``into``: what makes the message from its
    fields; a page's ``response.tasks.add`` builds it inside the response, which then need not
    copy it."""
    out = into(
        task_id=task.task_id,
        owner=task.owner,
        spec=task.spec,
        state=task.state,
        attempt=task.attempt,
        priority=task.priority,
        node_id=task.node_id,
        device_indices=task.device_indices,
        pending_reason=pending_reason if task.state == common_pb2.TASK_STATE_PENDING else "",
        error=task.error,
        latest_metrics=task.latest_metrics,
        latest_step=task.latest_step,
        handed_back=task.handed_back,
    )
    _ts(out.create_time, task.create_time)
    _ts(out.update_time, task.update_time)
    _ts(out.start_time, task.start_time)
    _ts(out.end_time, task.end_time)
    if task.latest_checkpoint is not None:
        out.latest_checkpoint.CopyFrom(task.latest_checkpoint)
    return out


#: Rows of a ListTasks page read from the store at once (the page is built from several reads).
LIST_SLICE_ROWS = 25
#: Seconds of work a ListTasks page does between two turns of the event loop. Calls of other
#: owners that arrived meanwhile run first, so a page holds them about this long at most, not
#: for its whole build.
LIST_TURN_S = 0.0005


class LoopTurn:
    """Work on the event loop that gives the loop a turn every ``seconds`` of it: ``await
    turn.share()`` between two pieces of the work yields once that long has passed since the
    work began or last yielded, and returns at once otherwise."""

    def __init__(self, seconds: float, *, clock=time.perf_counter) -> None:
        self.seconds = seconds
        self.clock = clock
        self._end = clock() + seconds

    async def share(self) -> None:
        if self.clock() >= self._end:
            await asyncio.sleep(0)  # the calls that are ready run, then this work goes on
            self._end = self.clock() + self.seconds


class SchedulerService(scheduler_pb2_grpc.SchedulerServiceServicer):
    """``opentinker.scheduler.v1.SchedulerService``."""

    def __init__(
        self, core: SchedulerCore, *, datasets: DatasetStore | None = None, security: Security | None = None
    ) -> None:
        self.core = core
        self._datasets = datasets
        self.security = security  # API keys, limits, audit (security/bundle.py); None in bare unit tests
        #: The artifact store (data/artifacts.py) DownloadCheckpoint reads; None in bare unit tests.
        self.artifacts = None
        cfg = security.limits.config if security is not None else None
        most, wait = (cfg.max_submits_in_flight, cfg.max_submit_wait) if cfg is not None else (None, None)
        #: SubmitTask calls in progress, and the refusal of those over the limits (admission/load.py).
        self.gate = SubmitGate(
            DEFAULT_MAX_IN_FLIGHT if most is None else most, max_wait_s=DEFAULT_MAX_WAIT_S if wait is None else wait
        )

    async def durable(self) -> None:
        """Return once everything written so far is committed (:meth:`SchedulerCore.durable`)."""
        await self.core.durable()

    @property
    def datasets(self) -> DatasetStore:
        """Uploaded datasets, under ``<state_dir>/datasets`` unless given (made on first use)."""
        if self._datasets is None:
            # An s3 artifact store keeps every dataset too, for schedulers without this disk.
            store = self.artifacts.store if self.artifacts is not None else None
            mirror = store if store is not None and store.backend == "s3" else None
            self._datasets = DatasetStore(self.core.config.state_dir / "datasets", mirror=mirror)
        return self._datasets

    async def _dataset_here(self, dataset_id: str) -> None:
        """Fetch ``dataset_id`` from the artifact store when this scheduler's disk lacks it
        (uploaded to another scheduler of the cluster); nothing when it is here or unknown."""
        datasets = self.datasets
        if datasets.mirror is not None and is_dataset_id(dataset_id) and not datasets.exists(dataset_id):
            if await asyncio.to_thread(datasets.restore, dataset_id):
                log.info("dataset fetched from the artifact store", dataset_id=dataset_id)

    def _task(self, task: TaskRow, *, into=common_pb2.Task) -> common_pb2.Task:
        if task.state != common_pb2.TASK_STATE_PENDING:
            out = task_to_proto(task, into=into)
            if task.state == common_pb2.TASK_STATE_RUNNING:
                endpoint = self.core.store.endpoint(task.task_id)
                if endpoint is not None and endpoint[0] == task.attempt:
                    out.endpoint, out.openai_endpoint = endpoint[1], endpoint[2]
            return out
        reason = self.core.reasons.reason(task.task_id) or "waiting for the next placement round"
        return task_to_proto(task, reason, into=into)

    @rpc(action="task.submit", gate="gate")
    async def SubmitTask(self, request, call: Call):
        call.detail.update(workload_type=request.spec.workload_type[:64])
        self.core.require_leader()  # a follower: UNAVAILABLE naming the leader, before any work
        if not request.HasField("spec"):
            raise InvalidArgument("spec: expected a task spec, got nothing")
        if request.spec.HasField("env_config"):  # a dataset uploaded to another scheduler: from the store
            value = request.spec.env_config.fields.get("dataset_id")
            if value is not None and value.WhichOneof("kind") == "string_value":
                await self._dataset_here(value.string_value)
        if request.dry_run:
            call.detail.update(dry_run=True)
            row, usage, basis = await admit_dry_run(  # the same checks as a submit, then an estimate
                request.spec,
                call.who,
                core=self.core,
                datasets=self.datasets,
                limits=self.security.limits if self.security is not None else None,
                dataset_visible=self._dataset_visible,
                dataset_uploaded_at_submit=request.dataset_uploaded_at_submit,
            )
            out = task_to_proto(row)
            out.queue = self.core.queues.book.queue_of(row.owner)
            out.pending_reason = row.error
            out.error = ""
            return scheduler_pb2.SubmitTaskResponse(task=out, estimate=usage, estimate_basis=basis)
        task = await admit(  # every check, in order, then the write (opentinker_scheduler/admission/admit.py)
            request.spec,
            call.who,
            core=self.core,
            datasets=self.datasets,
            limits=self.security.limits if self.security is not None else None,
            dataset_visible=self._dataset_visible,
            request_id=request.request_id,
            gate=self.gate,
        )
        # Placed already when it could be (the group commit that wrote it ran a placement round).
        call.detail.update(task_id=task.task_id, gpu_count=task.gpu_count, priority=task.priority)
        return scheduler_pb2.SubmitTaskResponse(task=self._task(task))

    @rpc()
    async def GetTask(self, request, call: Call):
        task = self.core.api.get(request.task_id, owner=owner_scope())
        out = self._task(task)
        out.usage.CopyFrom(self.core.usage.task_usage(task))
        out.queue = self.core.queues.book.queue_of(task.owner)
        return scheduler_pb2.GetTaskResponse(task=out)

    @rpc()
    async def IssueEndpointToken(self, request, call: Call):
        task = self.core.api.get(request.task_id, owner=owner_scope())
        if task.workload_type not in ENDPOINT_WORKLOADS:
            raise FailedPrecondition(
                f"task_id: task {request.task_id} is a {task.workload_type} task, which serves no endpoint; "
                f"endpoint tokens are for {' and '.join(ENDPOINT_WORKLOADS)} tasks"
            )
        ttl = endpoint_tokens.ttl_seconds(request.ttl.ToNanoseconds() / 1e9)
        if self.security is None or not self.security.enabled:
            return scheduler_pb2.IssueEndpointTokenResponse()
        token, expire = endpoint_tokens.issue(self.security.keys, call.who, task.task_id, ttl)
        out = scheduler_pb2.IssueEndpointTokenResponse(token=token)
        _ts(out.expire_time, expire)
        return out

    @rpc()
    async def AuthorizeEndpoint(self, request, call: Call):
        who = call.who
        scope = owner_scope()
        if who.role == endpoint_tokens.ENDPOINT_ROLE:
            if request.endpoint_task_id != who.endpoint_task:
                raise PermissionDenied(
                    f"this endpoint token is for task {who.endpoint_task}, not for task {request.endpoint_task_id}"
                )
            scope = None if who.endpoint_admin else who.owner
        self.core.api.get(request.endpoint_task_id, owner=scope)  # the task changed hands: NOT_FOUND
        if request.task_id and request.task_id != request.endpoint_task_id:
            self.core.api.get(request.task_id, owner=scope)
        return scheduler_pb2.AuthorizeEndpointResponse()

    @rpc()
    async def GetUsage(self, request, call: Call):
        scope = owner_scope()
        owner = request.owner or scope
        if scope is not None and owner != scope:
            raise PermissionDenied(
                f"API key {call.who.key_prefix} (role {call.who.role}) may not read the usage of another owner: "
                "user keys read their own owner's only (leave owner empty)"
            )
        since = request.since.ToNanoseconds() / 1e9 if request.HasField("since") else None
        by_owner, by_queue, queues = self.core.usage.rollup(self.core.active.values(), owner=owner, since=since)
        return scheduler_pb2.GetUsageResponse(
            owners=[
                scheduler_pb2.UsageRow(name=k, usage=v, queue=queues.get(k, "")) for k, v in sorted(by_owner.items())
            ],
            queues=[scheduler_pb2.UsageRow(name=k, usage=v) for k, v in sorted(by_queue.items())],
            currency=self.core.config.usage.currency,
        )

    @rpc()
    async def ListTasks(self, request, call: Call):
        size = request.page_size or 100
        if not 1 <= size <= 1000:
            raise InvalidArgument(f"page_size: expected 1..1000, got {request.page_size}")
        before = None
        if request.page_token:
            try:
                created, task_id = base64.urlsafe_b64decode(request.page_token.encode()).decode().split("|", 1)
                before = (float(created), task_id)
            except Exception:  # noqa: BLE001 - any garbage token
                raise InvalidArgument("page_token: expected a token from a previous ListTasks response") from None
        for s in request.states:
            if s not in common_pb2.TaskState.values() or s == common_pb2.TASK_STATE_UNSPECIFIED:
                raise InvalidArgument(f"states: expected TASK_STATE_PENDING..TASK_STATE_CANCELLED, got {s}")
        owner = owner_scope()
        rows, out = [], scheduler_pb2.ListTasksResponse()
        tasks = out.tasks  # each built in place: the response copies none
        turn = LoopTurn(LIST_TURN_S)
        async with self._heavy_read(call.who.owner):
            while len(rows) <= size:  # one row past the page says whether there is a next page
                await turn.share()
                want = min(LIST_SLICE_ROWS, size + 1 - len(rows))
                part = self.core.store.list_tasks(  # unfinished tasks: the core's rows, not decoded again
                    request.states, limit=want, before=before, owner=owner, held=self.core.tasks.get
                )
                rows += part
                for task in part[: max(0, size - len(tasks))]:
                    await turn.share()
                    self._task(task, into=tasks.add)
                if len(part) < want:
                    break
                before = (part[-1].create_time, part[-1].task_id)
        if len(rows) > size:
            last = rows[size - 1]
            out.next_page_token = base64.urlsafe_b64encode(f"{last.create_time!r}|{last.task_id}".encode()).decode()
        return out

    def _heavy_read(self, owner: str):
        """One of ``owner``'s heavy reads at a time (:meth:`Limits.heavy_read`); no bound without limits."""
        if self.security is None:
            return contextlib.nullcontext()
        return self.security.limits.heavy_read(owner)

    @rpc(action="task.cancel")
    async def CancelTask(self, request, call: Call):
        call.detail.update(task_id=request.task_id[:128])
        self.core.require_leader()
        task = self.core.api.cancel(request.task_id, owner=owner_scope(), reason=request.reason)
        call.detail.update(task_id=task.task_id, reason=request.reason[:500])
        self.core.schedule()
        return scheduler_pb2.CancelTaskResponse(task=self._task(task))

    @rpc(action="task.delete_artifacts")
    async def DeleteTaskArtifacts(self, request, call: Call):
        call.detail.update(task_id=request.task_id[:128])
        self.core.require_leader()
        task = self.core.api.artifacts_deletable(request.task_id, owner=owner_scope())  # owner rules, task ended
        if self.artifacts is None:
            raise FailedPrecondition("DeleteTaskArtifacts: this scheduler has no artifact store")
        self.core.table.artifacts_deleting(task.task_id)  # no init_from or assignment takes it while it goes
        keys, size = await asyncio.to_thread(self.artifacts.delete_task, task.task_id)
        task = self.core.table.artifacts_deleted(task.task_id, keys=len(keys), size_bytes=size, by=call.who.owner)
        call.detail.update(keys=len(keys), bytes=size)
        log.info("task artifacts deleted", task_id=task.task_id, keys=len(keys), bytes=size)
        return scheduler_pb2.DeleteTaskArtifactsResponse(task=self._task(task), deleted_keys=keys, deleted_bytes=size)

    def _stored_checkpoint(self, request, call: Call, what: str) -> TaskRow:
        """The task of a request naming one of its checkpoints by ``artifact_key``, checked: owner
        rules, an artifact store, the key listed for the task."""
        call.detail.update(task_id=request.task_id[:128], artifact_key=request.artifact_key[:256])
        self.core.require_leader()
        task = self.core.api.get(request.task_id, owner=owner_scope())  # another owner's task: NOT_FOUND
        if not request.artifact_key:
            raise InvalidArgument("artifact_key: expected a checkpoint's artifact key (ListCheckpoints), got ''")
        if self.artifacts is None:
            raise FailedPrecondition(f"{what}: this scheduler has no artifact store")
        key = request.artifact_key
        if not any(c.artifact.key == key for c in self.core.store.checkpoints(task.task_id)):
            raise NotFound(
                f"artifact_key: task {task.task_id} has no checkpoint {key[:256]!r} (deleted, or never saved)"
            )
        return task

    @rpc(action="checkpoint.set_ttl")
    async def SetCheckpointTtl(self, request, call: Call):
        task = self._stored_checkpoint(request, call, "SetCheckpointTtl")
        expire_time = None
        if request.HasField("ttl"):
            ttl = request.ttl.ToNanoseconds() / 1e9
            if not 1 <= ttl <= MAX_CHECKPOINT_TTL_S:
                raise InvalidArgument(f"ttl: expected 1 s to 10 years, or none to never expire, got {ttl:g} s")
            expire_time = time.time() + ttl
        self.core.checkpoint_expiry(task.task_id, request.artifact_key, expire_time)
        call.detail.update(ttl_s=round(expire_time - time.time(), 3) if expire_time is not None else None)
        response = scheduler_pb2.SetCheckpointTtlResponse()
        if expire_time is not None:
            response.expire_time.FromNanoseconds(int(expire_time * 1e9))
        return response

    @rpc(action="checkpoint.delete")
    async def DeleteCheckpoint(self, request, call: Call):
        task = self._stored_checkpoint(request, call, "DeleteCheckpoint")
        key = request.artifact_key
        size = await asyncio.to_thread(self.artifacts.delete_checkpoint, key)
        self.core.checkpoint_deleted(task.task_id, key, size_bytes=size, by=call.who.owner)
        call.detail.update(bytes=size)
        log.info("checkpoint deleted", task_id=task.task_id, key=key, bytes=size)
        return scheduler_pb2.DeleteCheckpointResponse(deleted_bytes=size)

    async def WatchTask(self, request, context) -> AsyncIterator[scheduler_pb2.WatchTaskResponse]:
        """The task's events after ``after_sequence``; unless ``history_only``, held open until
        the task has ended and its terminal event was sent. A store error ends the stream with
        UNAVAILABLE (``STORE_UNAVAILABLE``): the client resumes after the last sequence it got."""
        try:
            self.core.api.get(request.task_id, owner=owner_scope())
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await abort_mapped(context, exc)
        # Headers now, not with the first event: a client can tell a quiet watch from a frozen
        # scheduler (SchedulerConnection.stream's answer_timeout) without reopening it.
        await context.send_initial_metadata(())
        seq = max(0, request.after_sequence)
        while True:
            try:
                # The task first, its events second: on a follower they are two reads, and a
                # transition the leader commits between them is then in the events read. The
                # other order could see an ended task whose terminal event it never read. The
                # same holds for a worker still stopping, whose last checkpoint may yet come.
                stopping = request.task_id in self.core.table.stopping
                task = self.core.store.get_task(request.task_id)
                events = self.core.store.events_after(request.task_id, seq, limit=500)
                if events:
                    await self.core.durable()  # the reads may include this turn's uncommitted events
            except Exception as exc:  # noqa: BLE001 - mapped or re-raised
                await abort_mapped(context, exc)
            for ev in events:
                seq = ev.sequence
                yield scheduler_pb2.WatchTaskResponse(event=ev)
            if events:
                continue
            if request.history_only:
                return
            # An ended task whose worker is still stopping (cancel, max_runtime) may still record
            # its last checkpoint (and the step it finished): the stream stays open for it.
            if task is None or (task.terminal and not stopping):
                return
            # A follower is never told of changes (the leader writes them): it looks again soon.
            await self.core.changes.wait_changed(timeout=1.0 if self.core.leading else FOLLOWER_WATCH_POLL_S)

    @rpc()
    async def GetMetrics(self, request, call: Call):
        task = self.core.api.get(request.task_id, owner=owner_scope())
        resp = scheduler_pb2.GetMetricsResponse(
            task_id=task.task_id, latest=task.latest_metrics, latest_step=task.latest_step
        )
        if request.include_history:
            resp.points.extend(self.core.store.metric_points(task.task_id, request.after_step))
        return resp

    async def UploadDataset(self, request_iterator, context):
        owner = caller().owner
        try:
            self.core.require_leader()
            cfg = self.security.limits.config if self.security is not None else None
            quota = (cfg.max_dataset_bytes_per_owner or 0) if cfg is not None else 0
            info = await receive_upload(
                self.datasets,
                request_iterator,
                owner=owner,
                stored_bytes=self.core.store.dataset_bytes(owner) if quota else 0,
                max_owner_bytes=quota,
                min_free_bytes=(cfg.min_free_disk_bytes or 0) if cfg is not None else 0,
            )
            # Into the s3 artifact store too before it counts as uploaded (other schedulers read it there).
            await asyncio.to_thread(self.datasets.publish, info.dataset_id)
            # Names are per owner: the answer carries the name this uploader gave (receive_upload),
            # never another owner's name for the same bytes.
            self.core.store.add_dataset_owner(info.dataset_id, owner, name=info.name, size_bytes=info.size_bytes)
            await self.core.durable()
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await abort_mapped(context, exc)
        log.info(
            "dataset uploaded",
            dataset_id=info.dataset_id,
            name=info.name,
            size_bytes=info.size_bytes,
            examples=info.num_examples,
        )
        return scheduler_pb2.UploadDatasetResponse(dataset=info)

    def _dataset_visible(self, dataset_id: str) -> bool:
        """Whether the caller may see ``dataset_id``: admins all, others what they uploaded."""
        scope = owner_scope()
        return scope is None or self.core.store.dataset_visible(dataset_id, scope)

    def _refuse_hidden_dataset(self, dataset_id: str) -> None:
        """Raises NotFound, worded as for a missing dataset, when ``dataset_id`` exists but the
        caller may not see it (another owner's)."""
        if self.datasets.exists(dataset_id) and not self._dataset_visible(dataset_id):
            raise NotFound(f"dataset {dataset_id} not found (upload it first with UploadDataset)")

    async def DownloadDataset(self, request, context):
        try:
            await self._dataset_here(request.dataset_id)
            self._refuse_hidden_dataset(request.dataset_id)
            info = self.datasets.info(request.dataset_id)
            own_name = self.core.store.dataset_name(request.dataset_id, caller().owner)
            if own_name is not None:
                info.name = own_name  # the caller's name for it, not the first uploader's
            elif owner_scope() is not None:
                info.name = ""  # stored before names were kept per owner: whose name it is is unknown
            chunks = self.datasets.chunks(request.dataset_id)
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await abort_mapped(context, exc)
        first = True
        for chunk in chunks:
            yield scheduler_pb2.DownloadDatasetResponse(dataset=info if first else None, chunk=chunk)
            first = False

    @rpc()
    async def ListCheckpoints(self, request, call: Call):
        if owner_scope() is not None:
            self.core.api.get(request.task_id, owner=owner_scope())  # another owner's task: NOT_FOUND
        return scheduler_pb2.ListCheckpointsResponse(
            checkpoints=checkpoints.list_checkpoints(self.core.store, request.task_id),
            artifacts_deleted=self.core.store.artifacts_deleted(request.task_id),
            deleted_keys=self.core.store.deleted_checkpoint_keys(request.task_id),
        )

    async def DownloadCheckpoint(self, request, context):
        try:
            if owner_scope() is not None:
                self.core.api.get(request.task_id, owner=owner_scope())  # another owner's task: NOT_FOUND
            if request.artifact_key:
                ckpt = checkpoints.checkpoint_with_key(self.core.store, request.task_id, request.artifact_key)
            else:
                ckpt = checkpoints.pick_checkpoint(self.core.store, request.task_id, request.step)
            store = self.artifacts.store if self.artifacts is not None else None
            manifest = await asyncio.to_thread(checkpoints.build_manifest, ckpt, store)
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await abort_mapped(context, exc)
        yield scheduler_pb2.DownloadCheckpointResponse(manifest=manifest.message)
        try:
            async for chunk in read_ahead(checkpoints.read_chunks(manifest)):
                yield scheduler_pb2.DownloadCheckpointResponse(chunk=chunk)
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await abort_mapped(context, exc)

    async def ImportAdapter(self, request_iterator, context):
        """A new task of the caller's, as a submit is: it takes a submit-rate token of the key
        (before any byte is read) and is audited as ``adapter.import``, refusals included."""
        who = caller()
        detail: dict = {}
        received = None
        try:
            self.core.require_leader()
            if self.security is not None:
                check_submit_rate(self.security.limits, who, core=self.core)
            store = self.artifacts.store if self.artifacts is not None else None
            if store is None:
                raise FailedPrecondition("ImportAdapter: this scheduler has no artifact store to keep the adapter in")
            received = await receive_adapter(
                request_iterator, self.core.config.state_dir / "imports", default_model=self.core.config.default_model
            )
            detail.update(model=received.model[:256], name=received.name[:256])
            task_id = new_task_id()
            key = checkpoint_key(task_id, 1, 0, final=True)
            ref = await asyncio.to_thread(
                store.put_folder, key, received.folder, meta={"format": "peft_lora", "step": "0"}
            )
            ck = common_pb2.Checkpoint(task_id=task_id, step=0, path=ref.key, final=True, format="peft_lora", attempt=1)
            ck.create_time.GetCurrentTime()
            ck.artifact.key, ck.artifact.manifest_sha256 = ref.key, ref.manifest_sha256
            ck.artifact.total_bytes = ref.total_bytes
            ck.artifact.backend = self.core.config.artifacts.backend
            detail.update(total_bytes=ref.total_bytes)
            task = self.core.api.import_adapter(
                task_id=task_id, owner=who.owner, model=received.model, name=received.name, checkpoint=ck
            )
            detail.update(task_id=task.task_id)
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            record(self.security, "adapter.import", who, exc, **detail)
            await abort_mapped(context, exc)
        finally:
            if received is not None:
                received.discard()
        record(self.security, "adapter.import", who, None, **detail)
        await self.core.durable()
        return scheduler_pb2.ImportAdapterResponse(task=self._task(task))

    @rpc()
    async def ListModelNames(self, request, call: Call):
        return scheduler_pb2.ListModelNamesResponse(
            model_names=[scheduler_pb2.ModelName(name=m.name, folder=m.folder) for m in self.core.config.model_names]
        )

    @rpc()
    async def ListNodes(self, request, call: Call):
        self.core.require_leader()  # nodes and their telemetry live in the leader's memory
        nodes = []
        for n in self.core.ledger.nodes.values():  # sorted below, with the pool nodes not seen
            cap = n.capacity()
            msg = scheduler_pb2.Node(
                node_id=n.node_id,
                connected=n.connected,
                devices=n.register.devices,
                gpu_count=n.gpu_count,
                gpus_free=len(cap.free_gpus),
                max_tasks=n.max_tasks,
                running_task_ids=sorted(n.allocations),
                telemetry=n.telemetry,
                version=n.register.version,
                notes=self.core.node_notes(n),
                host=n.host,
                model_hosts=[_with_estimate(n, h) for h in n.model_hosts],
                gpu_memory_estimates=[
                    scheduler_pb2.GpuMemoryEstimate(index=d, booked_bytes=cap.gpu_booked[d], total_bytes=total)
                    for d, total in sorted(cap.gpu_memory.items())
                    if d in cap.gpu_booked
                ],
            )
            _ts(msg.last_heartbeat_time, n.last_heartbeat_time)
            nodes.append(msg)
        for p in self.core.pool_nodes_not_seen():
            nodes.append(
                scheduler_pb2.Node(
                    node_id=p.node_id,
                    connected=False,
                    gpu_count=p.gpu_count,
                    max_tasks=p.max_tasks,
                    notes=["in resource_pool; has not connected since this scheduler started"],
                )
            )
        nodes.sort(key=lambda m: m.node_id)
        return scheduler_pb2.ListNodesResponse(nodes=nodes)


def _with_estimate(node, host: common_pb2.ModelHost) -> common_pb2.ModelHost:
    """A copy of a node's ``host`` with the scheduler's memory estimate of its tenants: the base
    once (the largest a tenant booked) and the sum of their tenant bytes (0 where unknown)."""
    out = common_pb2.ModelHost()
    out.CopyFrom(host)
    needs = [m for m in (node.memory_of(t) for t in host.task_ids) if m is not None]
    out.base_bytes_estimate = max((m.base_bytes for m in needs), default=0)
    out.tenant_bytes_estimate = sum(m.tenant_bytes for m in needs)
    return out


class NodeService(node_pb2_grpc.NodeServiceServicer):
    """``opentinker.node.v1.NodeService``: one bidirectional stream per trainer node."""

    def __init__(
        self,
        core: SchedulerCore,
        *,
        register_timeout_s: float = 30.0,
        security: Security | None = None,
        scheduler_service: "SchedulerService | None" = None,
    ) -> None:
        self.core = core
        self.scheduler_service = scheduler_service  # task views and datasets shared with it
        self.register_timeout_s = register_timeout_s
        self.security = security

    def _check_cert_names_node(self, node_id: str) -> None:
        """mTLS with ``tls.node_id_must_match_cert``: ``node_id`` must be the common name of the
        node's verified client certificate or one of its DNS subject alternative names.

        Raises:
            PermissionDenied: it is neither (the certificate belongs to another node).
        """
        if self.security is None or not self.security.node_id_must_match_cert:
            return
        who = caller()
        if node_id == who.peer_cn or node_id in who.peer_dns:
            return
        names = f"CN {who.peer_cn!r}" + (
            f", DNS names {', '.join(repr(n) for n in who.peer_dns[:8])}" if who.peer_dns else ""
        )
        raise PermissionDenied(
            f"node id {node_id[:128]!r} does not match its certificate ({names}); "
            "register under a name the certificate carries, or give this node its own certificate "
            "(tls.node_id_must_match_cert)"
        )

    def _audit_join(self, register, exc: BaseException | None) -> None:
        who = caller()
        record(
            self.security,
            "node.join",
            who,
            exc,
            node_id=register.node_id[:128],
            cert_cn=who.peer_cn,
            hostname=register.hostname[:256],
        )

    async def durable(self) -> None:
        """Return once everything written so far is committed (:meth:`SchedulerCore.durable`)."""
        await self.core.durable()

    async def Connect(self, request_iterator, context):
        it = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(it.__anext__(), timeout=self.register_timeout_s)
        except (StopAsyncIteration, asyncio.TimeoutError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first message: expected register")
        if first.WhichOneof("message") != "register":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"first message: expected register, got {first.WhichOneof('message')}"
            )
        try:
            self.core.require_leader()  # node streams go to the leader; the node follows the error's leader
            self._check_cert_names_node(first.register.node_id)
            node, registered = self.core.node_register(first.register)
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            self._audit_join(first.register, exc)
            await abort_mapped(context, exc)
        self._audit_join(first.register, None)
        gen = node.generation
        outbox = node.outbox
        state = {"goodbye": False}
        await self.core.durable()
        yield node_pb2.ConnectResponse(registered=registered)
        self.core.schedule()
        reader = asyncio.create_task(self._read(node, gen, it, state))
        reader.add_done_callback(lambda _: outbox.put_nowait(None))  # the node stopped sending: end
        try:
            while True:
                command = await outbox.get()
                if command is None:
                    break
                yield command
        finally:
            if not reader.done():
                reader.cancel()
            self.core.node_disconnected(node, gen, goodbye=state["goodbye"])
            self.core.schedule()

    async def _read(self, node, gen: int, it, state: dict) -> None:
        bound = log.bind(node_id=node.node_id)
        try:
            async for msg in it:
                if node.generation != gen:
                    return
                kind = msg.WhichOneof("message")
                if kind == "heartbeat":
                    self.core.node_heartbeat(node, msg.heartbeat)
                elif kind == "task_report":
                    self.core.node_report(node, msg.task_report)
                    if msg.task_report.seq:
                        # Held until the report's writes commit (NodeSession.push): an ack means durable.
                        node.push(node_pb2.ConnectResponse(report_ack=node_pb2.ReportAck(seq=msg.task_report.seq)))
                    if msg.task_report.state in (
                        common_pb2.TASK_STATE_SUCCEEDED,
                        common_pb2.TASK_STATE_FAILED,
                        common_pb2.TASK_STATE_CANCELLED,
                    ):
                        self.core.schedule()
                elif kind == "goodbye":
                    state["goodbye"] = True
                    bound.info("node said goodbye", reason=msg.goodbye.reason)
                    return
                else:
                    bound.warning("unexpected message on node stream", kind=kind)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken stream ends the session
            bound.warning("node stream read failed", error=repr(exc))

    # ---- reads for task workers (their attempt credentials; a node key reads nothing) ----------
    @property
    def _views(self) -> "SchedulerService":
        if self.scheduler_service is None:
            self.scheduler_service = SchedulerService(self.core, security=self.security)
        return self.scheduler_service

    def _attempt_live(self) -> None:
        """Raises PermissionDenied when the caller is a task worker whose attempt has ended or
        moved on: its credential reads only while its attempt runs."""
        scope = caller().attempt
        refusal = self.core.api.attempt_refusal(scope) if scope is not None else None
        if refusal is not None:
            raise PermissionDenied(f"{refusal}; its credential reads nothing more")

    @rpc()
    async def LookupTask(self, request, call: Call):
        self._attempt_live()
        if not request.task_id:
            raise InvalidArgument("task_id: expected a task id, got an empty string")
        # a task worker looks up its owner's tasks only; another owner's is NOT_FOUND
        task = self._views._task(self.core.api.get(request.task_id, owner=owner_scope()))
        deleted = None if task.HasField("latest_checkpoint") else self.core.store.artifacts_deleted(task.task_id)
        listed = checkpoints.list_checkpoints(self.core.store, task.task_id) if request.include_checkpoints else []
        return node_pb2.LookupTaskResponse(task=task, artifacts_deleted=deleted, checkpoints=listed)

    async def FetchDataset(self, request, context):
        datasets = self._views.datasets
        try:
            self._attempt_live()
            await self._views._dataset_here(request.dataset_id)
            self._views._refuse_hidden_dataset(request.dataset_id)  # a worker reads its owner's only
            info = datasets.info(request.dataset_id)
            chunks = datasets.chunks(request.dataset_id)
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await abort_mapped(context, exc)
        # With the s3 store, trainers read datasets from the bucket; this is for the local store
        # (and datasets the bucket lacks). Logged so an operator sees who still asks here.
        log.info("dataset sent to a trainer", dataset_id=request.dataset_id, size_bytes=info.size_bytes)
        for chunk in chunks:
            yield node_pb2.FetchDatasetResponse(chunk=chunk, size_bytes=info.size_bytes)
