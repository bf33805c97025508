"""Limits: each one reached through the real SubmitTask / WatchTask on a loopback scheduler gives
RESOURCE_EXHAUSTED naming the limit, and nothing is stored; plus the limiter units."""

from __future__ import annotations

import asyncio
import contextvars
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_client import InvalidArgumentError, RLClient, ResourceExhaustedError
from opentinker_scheduler.config import ConfigError, parse_config
from opentinker_scheduler.api.service import LIST_SLICE_ROWS, LIST_TURN_S, SchedulerService
from opentinker_scheduler.errors import ResourceExhausted
from opentinker_scheduler.state import store as store_module
from opentinker_scheduler.state.worker_credentials import AttemptScope
from opentinker_scheduler.security.limits import (
    CHECKPOINT_UPLOADS,
    READ_TOKEN_BYTES,
    USER_UPLOADS,
    Limits,
    LimitsConfig,
    TokenBucket,
)

from tests.support.security import LoopbackScheduler, metadata
from tests.support.waiting import wait_for


def _submit(client: RLClient, **kw) -> str:
    return client.submit_task(workload_type="lora_finetune", model="/models/m", **kw)


@pytest.fixture
def make(tmp_path):
    made = []

    def _make(text: str) -> LoopbackScheduler:
        s = LoopbackScheduler(
            tmp_path / f"state{len(made)}", text + "paths: {model_dirs: [/models]}\n"
        )  # specs name /models/m
        made.append(s)
        return s

    yield _make
    for s in made:
        s.close()


def test_pending_per_owner_limit_counts_each_owner_separately(make) -> None:
    s = make("auth: {enabled: true}\nlimits: {max_pending_per_owner: 2}\n")
    with RLClient(s.target, api_key=s.admin_key) as root:
        _, alice_key = root.keys.create("alice", "user")
        _, bob_key = root.keys.create("bob", "user")
    with RLClient(s.target, api_key=alice_key) as alice, RLClient(s.target, api_key=bob_key) as bob:
        first = _submit(alice)
        _submit(alice)
        with pytest.raises(
            ResourceExhaustedError,
            match=r"already has 2 PENDING task\(s\), the limit is 2 \(limits.max_pending_per_owner\)",
        ):
            _submit(alice)
        assert len(alice.list_tasks()) == 2  # nothing stored for the refused one
        _submit(bob)  # another owner is not affected
        alice.cancel(first)
        _submit(alice)  # room again


def test_submit_rate_is_one_token_bucket_per_owner_over_all_its_keys(make) -> None:
    s = make("auth: {enabled: true}\nlimits: {submit_rate: 0.001, submit_burst: 2}\n")
    with RLClient(s.target, api_key=s.admin_key) as root:
        _, k1 = root.keys.create("alice", "user")
        _, k2 = root.keys.create("alice", "user")  # same owner, another key: the same bucket
        _, k3 = root.keys.create("bob", "user")
    with RLClient(s.target, api_key=k1) as a, RLClient(s.target, api_key=k2) as b, RLClient(s.target, api_key=k3) as c:
        _submit(a)
        _submit(a)
        for client in (a, b):
            with pytest.raises(
                ResourceExhaustedError, match=r"per second per owner .* \(limits.submit_rate\); retry in"
            ):
                _submit(client)
        _submit(c)  # another owner has its own bucket
        assert len(a.list_tasks()) == 2


def test_spec_size_limit(make) -> None:
    s = make("limits: {max_spec_bytes: 1024}\n")
    with grpc.insecure_channel(s.target) as ch:  # raw stub: RLClient would refuse the name locally
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        spec = C.TaskSpec(workload_type="lora_finetune", model="/models/m", name="x" * 2000)
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitTask(S.SubmitTaskRequest(spec=spec))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "more than the limit of 1024 (limits.max_spec_bytes)" in err.value.details()
        assert not stub.ListTasks(S.ListTasksRequest()).tasks
        stub.SubmitTask(
            S.SubmitTaskRequest(spec=C.TaskSpec(workload_type="lora_finetune", model="/models/m", name="small"))
        )


def test_message_size_limit_applies_to_what_the_server_receives(make) -> None:
    s = make("limits: {max_message_bytes: 65536}\n")
    with grpc.insecure_channel(s.target) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        spec = C.TaskSpec(workload_type="lora_finetune", model="/models/m", name="x" * 100_000)
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitTask(S.SubmitTaskRequest(spec=spec), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in err.value.details()
        assert not stub.ListTasks(S.ListTasksRequest()).tasks


def test_concurrent_streams_count_per_owner_so_a_rotated_key_adds_none(make) -> None:
    s = make("auth: {enabled: true}\nlimits: {max_streams_per_owner: 1}\n")
    with RLClient(s.target, api_key=s.admin_key) as root:
        _, key = root.keys.create("alice", "user")
        _, other = root.keys.create("bob", "user")
        _, rotated, _ = root.keys.rotate(key[:12], grace=600)  # both keys stay valid for the grace period
    with RLClient(s.target, api_key=key) as alice:
        own = _submit(alice)  # pending for good (no nodes), so a watch of it stays open
    with grpc.insecure_channel(s.target) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        req = S.WatchTaskRequest(task_id=own)
        first = stub.WatchTask(req, metadata=metadata(key))
        assert next(first).event.state_change.to_state == C.TASK_STATE_PENDING  # the stream is open
        for k in (key, rotated):  # the old key and its successor share alice's one slot
            with pytest.raises(grpc.RpcError) as err:
                next(stub.WatchTask(req, metadata=metadata(k)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            assert "1 open for owner 'alice', the limit is 1 (limits.max_streams_per_owner)" in err.value.details()
        # Another owner has its own slots (bob's watch of a task he cannot see is NOT_FOUND, not exhausted).
        with pytest.raises(grpc.RpcError) as err:
            next(stub.WatchTask(req, metadata=metadata(other)))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        first.cancel()
        wait_for(lambda: not s.security.limits.open_streams("alice"), what="alice's stream slot released")
        again = stub.WatchTask(req, metadata=metadata(rotated))
        assert next(again).event.state_change.to_state == C.TASK_STATE_PENDING
        again.cancel()


def test_one_owners_read_flood_is_refused_with_retry_info_while_another_owner_reads(make) -> None:
    s = make("auth: {enabled: true}\nlimits: {read_rate: 0.001, read_burst: 20, rate_wait: 0}\n")
    with RLClient(s.target, api_key=s.admin_key) as root:
        _, flooder = root.keys.create("mallory", "user")
        _, second = root.keys.create("mallory", "user")
        _, victim = root.keys.create("bob", "user")
    with RLClient(s.target, api_key=victim) as bob:
        task_id = _submit(bob)
    with grpc.insecure_channel(s.target) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        codes = []
        for i in range(40):  # the flood: reads from two keys of one owner
            try:
                stub.ListTasks(S.ListTasksRequest(), metadata=metadata((flooder, second)[i % 2]))
                codes.append("OK")
            except grpc.RpcError as err:
                codes.append(err.code().name)
                refused = err
        assert codes[:20] == ["OK"] * 20 and set(codes[20:]) == {"RESOURCE_EXHAUSTED"}
        assert "(limits.read_rate): ListTasks refused; retry in" in refused.details()
        status = rpc_status.from_call(refused)
        retry = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
        assert len(retry) == 1
        with pytest.raises(grpc.RpcError) as err:  # a stream's open is a read too
            next(stub.WatchTask(S.WatchTaskRequest(task_id=task_id), metadata=metadata(flooder)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Another owner's reads have their own bucket.
        got = stub.GetTask(S.GetTaskRequest(task_id=task_id), metadata=metadata(victim))
        assert got.task.task_id == task_id


def test_a_read_over_the_rate_waits_for_its_token_and_a_refusal_is_held(make) -> None:
    s = make(
        "auth: {enabled: true}\n"
        "limits: {read_rate: 4, read_burst: 1, rate_wait: 1, submit_rate: 0.001, submit_burst: 1}\n"
    )
    with RLClient(s.target, api_key=s.admin_key) as root:
        _, key = root.keys.create("alice", "user")
    with RLClient(s.target, api_key=key) as alice:
        task_id = _submit(alice)
    with grpc.insecure_channel(s.target) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        started = time.monotonic()
        for _ in range(3):  # the burst, then two owed tokens, 0.25 s apart: all answered
            assert stub.GetTask(S.GetTaskRequest(task_id=task_id), metadata=metadata(key)).task.task_id == task_id
        assert time.monotonic() - started >= 0.45
        started = time.monotonic()
        spec = C.TaskSpec(workload_type="lora_finetune", model="/models/m")
        with pytest.raises(grpc.RpcError) as err:  # no token for a day: refused, its answer held rate_wait
            stub.SubmitTask(S.SubmitTaskRequest(spec=spec), metadata=metadata(key))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "(limits.submit_rate)" in err.value.details()
        assert time.monotonic() - started >= 1.0


def test_spec_fields_are_bounded_with_invalid_argument(make) -> None:
    s = make("")
    with RLClient(s.target) as c:
        for kw, field in (
            ({"name": "n" * 300}, "spec.name"),
            ({"hyperparameters": {"steps": 10**12}}, "spec.hyperparameters.steps"),
            ({"model": "m" * 2000}, "spec.model"),
        ):
            with pytest.raises(InvalidArgumentError) as err:
                c.submit_task(workload_type="lora_finetune", **{"model": "/models/m", **kw})
            assert err.value.field == field, err.value
        assert c.list_tasks() == []


def test_defaults_depend_on_auth_and_explicit_values_always_apply() -> None:
    off = LimitsConfig().resolved(auth_enabled=False)
    on = LimitsConfig().resolved(auth_enabled=True)
    assert (off.submit_rate, off.max_pending_per_owner, off.max_streams_per_owner) == (0, 0, 0)
    assert on.submit_rate > 0 and on.max_pending_per_owner > 0 and on.max_streams_per_owner > 0
    assert off.max_message_bytes == on.max_message_bytes == 64 * 1024 * 1024
    assert LimitsConfig(submit_rate=3).resolved(auth_enabled=False).submit_rate == 3


def test_limits_config_errors_name_the_key() -> None:
    for text, key in (
        ("limits: {submit_rate: -1}\n", "limits.submit_rate"),
        ("limits: {max_message_bytes: 10}\n", "limits.max_message_bytes"),
        ("limits: {max_pending_per_owner: many}\n", "limits.max_pending_per_owner"),
        ("limits: [1]\n", "limits"),
    ):
        with pytest.raises(ConfigError, match=rf"x\.yaml:1:\d+: {key}"):
            parse_config(text, "x.yaml")


def test_token_bucket_refills_at_its_rate() -> None:
    b = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [b.reserve(0.0, 0.0) for _ in range(3)] == [(0.0, True)] * 3
    assert b.reserve(0.0, 0.0) == (pytest.approx(0.5), False)  # none stored, none owed: nothing taken
    assert b.reserve(0.5, 0.0) == (0.0, True)  # one token came back after 0.5 s
    assert b.reserve(10.0, 0.0) == (0.0, True) and b.tokens == pytest.approx(2.0)  # capped at burst
    assert b.reserve(10.0, 1.0) == (0.0, True) and b.reserve(10.0, 1.0) == (0.0, True)
    assert b.reserve(10.0, 1.0) == (pytest.approx(0.5), True)  # owed: the caller waits 0.5 s
    assert b.reserve(10.0, 1.0) == (pytest.approx(1.0), True)
    assert b.reserve(10.0, 1.0) == (pytest.approx(1.5), False)  # later than most_wait: refused


def test_limits_unit_streams_release_and_rate_with_a_fake_clock() -> None:
    now = [0.0]
    lim = Limits(
        LimitsConfig(
            submit_rate=1.0, submit_burst=1, max_streams_per_owner=2, max_spec_bytes=10, max_pending_per_owner=1
        ),
        clock=lambda: now[0],
    )
    lim.take_submit("k")
    with pytest.raises(ResourceExhausted, match="retry in 1.00 s"):
        lim.take_submit("k")
    now[0] = 1.0
    lim.take_submit("k")
    with lim.stream("k"), lim.stream("k"):
        with pytest.raises(ResourceExhausted):
            lim.acquire_stream("k")
        lim.acquire_stream("other")
    assert lim.open_streams("k") == 0
    with pytest.raises(ResourceExhausted):
        lim.check_spec_size(11)
    lim.check_pending("o", lambda: 0)
    with pytest.raises(ResourceExhausted):
        lim.check_pending("o", lambda: 1)


def test_reads_owe_tokens_up_to_rate_wait_and_are_charged_by_answer_size() -> None:
    now = [0.0]
    lim = Limits(LimitsConfig(read_rate=2.0, read_burst=1, rate_wait=1.0), clock=lambda: now[0])
    read = "/opentinker.scheduler.v1.SchedulerService/GetTask"
    assert lim.take_read("o", read) == 0.0
    assert lim.take_read("o", read) == pytest.approx(0.5)  # owed: the call waits for its token
    assert lim.take_read("o", read) == pytest.approx(1.0)
    with pytest.raises(ResourceExhausted, match=r"\(limits.read_rate\): GetTask refused; retry in 1.50 s") as err:
        lim.take_read("o", read)  # a token 1.5 s away: over rate_wait
    assert err.value.retry_after == pytest.approx(1.5)
    assert lim.take_read("other", read) == 0.0  # another owner's bucket
    now[0] = 10.0
    assert lim.take_read("o", read) == 0.0
    lim.charge_read("o", READ_TOKEN_BYTES + 100)  # an answer of over 4 KiB: one more token owed
    assert lim.take_read("o", read) == pytest.approx(1.0)
    with lim.refusal_wait("o") as hold:
        assert hold == 1.0


def test_a_rate_refusal_marked_on_the_test_thread_holds_no_refusal_of_a_loopback_scheduler(tmp_path) -> None:
    """A rate refusal marks its caller's context, so that the call's answer is held. A loopback
    scheduler started later on the same thread answers its own refusals at once: it runs in an
    empty context, as a scheduler process does."""

    def refused_then_submit() -> grpc.StatusCode:
        lim = Limits(LimitsConfig(submit_rate=1.0, submit_burst=1, rate_wait=60.0), clock=lambda: 0.0)
        lim.take_submit("o")
        with pytest.raises(ResourceExhausted):
            lim.take_submit("o")  # marked: a refusal that inherits the mark is held 60 s
        with LoopbackScheduler(tmp_path / "state") as s, grpc.insecure_channel(s.target) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.SubmitTask(S.SubmitTaskRequest(spec=C.TaskSpec(workload_type="nope")), timeout=30)
        return err.value.code()

    # In a copy of the test thread's context, so the mark ends with this test.
    assert contextvars.copy_context().run(refused_then_submit) == grpc.StatusCode.INVALID_ARGUMENT


def test_upload_pools_unit() -> None:
    lim = Limits(LimitsConfig(max_uploads=2, max_uploads_per_owner=1, max_checkpoint_uploads=1))
    lim.acquire_upload("a")
    with pytest.raises(ResourceExhausted, match=r"limits.max_uploads_per_owner"):
        lim.acquire_upload("a")
    lim.acquire_upload("b")
    with pytest.raises(ResourceExhausted, match=r"limits.max_uploads\)"):
        lim.acquire_upload("c")
    lim.acquire_upload("node", CHECKPOINT_UPLOADS)  # a pool of its own
    with pytest.raises(ResourceExhausted, match=r"limits.max_checkpoint_uploads"):
        lim.acquire_upload("node", CHECKPOINT_UPLOADS)
    lim.release_upload("a")
    lim.acquire_upload("c")
    assert (lim.open_uploads(USER_UPLOADS), lim.open_uploads(CHECKPOINT_UPLOADS)) == (2, 1)


def test_checkpoint_uploads_per_node_and_attempt_unit() -> None:
    """A released upload gives back its node's and its attempt's slot too."""
    lim = Limits(
        LimitsConfig(max_checkpoint_uploads=10, max_checkpoint_uploads_per_node=2, max_checkpoint_uploads_per_attempt=1)
    )
    a1, a2, a3 = (AttemptScope(f"t{i}", 1, "n1", "o") for i in range(3))
    lim.acquire_upload("o", CHECKPOINT_UPLOADS, attempt=a1)
    with pytest.raises(ResourceExhausted, match=r"1 open for attempt 1 of task t0 on node n1.*_per_attempt"):
        lim.acquire_upload("o", CHECKPOINT_UPLOADS, attempt=a1)
    lim.acquire_upload("o", CHECKPOINT_UPLOADS, attempt=a2)
    with pytest.raises(ResourceExhausted, match=r"2 open for node 'n1'.*_per_node"):
        lim.acquire_upload("o", CHECKPOINT_UPLOADS, attempt=a3)
    lim.acquire_upload("o", CHECKPOINT_UPLOADS, attempt=AttemptScope("t9", 1, "n2", "o"))  # another node
    lim.release_upload("o", CHECKPOINT_UPLOADS, attempt=a1)
    lim.acquire_upload("o", CHECKPOINT_UPLOADS, attempt=a3)
    lim.acquire_upload("o", CHECKPOINT_UPLOADS)  # an admin's upload holds the pool only
    assert lim.open_uploads(CHECKPOINT_UPLOADS) == 4


def test_a_task_list_is_read_in_slices_one_call_of_an_owner_at_a_time(make) -> None:
    """A ListTasks page is read LIST_SLICE_ROWS rows at a time, and one owner's concurrent pages
    are built one after another, so a flood of big pages has one page at a time on the event
    loop. Pages stay whole."""
    s = make("auth: {enabled: true}\nlimits: {submit_rate: 0, read_rate: 0, max_pending_per_owner: 0}\n")
    with RLClient(s.target, api_key=s.admin_key) as root:
        mallory, bob = root.keys.create("mallory", "user")[1], root.keys.create("bob", "user")[1]
    with RLClient(s.target, api_key=mallory) as m, RLClient(s.target, api_key=bob) as b:
        mine = {_submit(m, gpu_count=0) for _ in range(130)}
        theirs = _submit(b, gpu_count=0)
    store = s.core.store
    read = store.list_tasks
    events: list[tuple] = []
    calls: dict = {}  # the task of each call, kept so that none is confused with a later one

    def recorded(*args, **kwargs):
        rows = read(*args, **kwargs)
        call = calls.setdefault(asyncio.current_task(), len(calls))  # one task per call
        events.append(("slice", call, kwargs["limit"], kwargs["owner"]))
        return rows

    store.list_tasks = recorded
    try:
        with s.channel() as ch, ThreadPoolExecutor(3) as pool:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)

            def pages(key: str, size: int) -> list[list[str]]:
                out, token = [], ""
                while True:
                    got = stub.ListTasks(S.ListTasksRequest(page_size=size, page_token=token), metadata=metadata(key))
                    out.append([t.task_id for t in got.tasks])
                    if not (token := got.next_page_token):
                        return out

            listed = list(pool.map(lambda _: pages(mallory, 60), range(3)))
            assert pages(bob, 60) == [[theirs]]
    finally:
        store.list_tasks = read
    for got in listed:
        assert [len(p) for p in got] == [60, 60, 10] and {t for p in got for t in p} == mine
    slices = [e for e in events if e[0] == "slice"]
    assert max(limit for _, _, limit, _ in slices) == LIST_SLICE_ROWS
    # One call of mallory's at a time: its slices come in runs, one run per call.
    runs = [
        call
        for i, (_, call, _, owner) in enumerate(slices)
        if owner == "mallory" and (i == 0 or slices[i - 1][1] != call)
    ]
    assert len(runs) == 9  # 3 callers x 3 pages


def test_a_task_list_page_gives_the_event_loop_a_turn_after_each_turns_worth_of_rows(make, monkeypatch) -> None:
    """A ListTasks page whose rows take longer to build than LIST_TURN_S lets the event loop turn
    between every two rows, so another owner's call waits for one row, not for a slice of them."""
    s = make("auth: {enabled: true}\nlimits: {submit_rate: 0, read_rate: 0, max_pending_per_owner: 0}\n")
    with RLClient(s.target, api_key=s.admin_key) as root:
        mallory = root.keys.create("mallory", "user")[1]
    with RLClient(s.target, api_key=mallory) as m:
        mine = {_submit(m, gpu_count=0) for _ in range(40)}
    events: list[str] = []
    probing = []
    build = SchedulerService._task

    async def probe() -> None:  # one event per turn of the loop
        while probing:
            events.append("turn")
            await asyncio.sleep(0)

    def slow_row(self, task, **kw):
        if not probing:
            probing.append(asyncio.get_running_loop().create_task(probe()))
        time.sleep(2 * LIST_TURN_S)  # a row that costs two turns' worth of work
        events.append("row")
        return build(self, task, **kw)

    monkeypatch.setattr(SchedulerService, "_task", slow_row)
    try:
        with s.channel() as ch:
            got = scheduler_pb2_grpc.SchedulerServiceStub(ch).ListTasks(
                S.ListTasksRequest(page_size=30), metadata=metadata(mallory)
            )
    finally:
        probing.clear()
    assert len(got.tasks) == 30 and {t.task_id for t in got.tasks} <= mine and got.next_page_token
    rows = [i for i, e in enumerate(events) if e == "row"]
    assert len(rows) == 30
    assert all("turn" in events[a:b] for a, b in zip(rows, rows[1:])), "".join(e[0] for e in events[: rows[-1] + 1])


def test_a_task_list_page_decodes_only_finished_tasks_from_the_store(make, monkeypatch) -> None:
    """A ListTasks page shows an unfinished task from the core's own row and decodes from the
    store only the rows of finished tasks, which the core no longer holds."""
    s = make("auth: {enabled: true}\n")
    with RLClient(s.target, api_key=s.admin_key) as root:
        ids = [_submit(root, gpu_count=0) for _ in range(3)]
        root.cancel(ids[0])
        decoded = []
        row_to_task = store_module._row_to_task
        monkeypatch.setattr(store_module, "_row_to_task", lambda r: decoded.append(r["task_id"]) or row_to_task(r))
        listed = root.list_tasks()
    assert {t.task_id: t.state for t in listed} == {
        ids[0]: "cancelled",
        ids[1]: "pending",
        ids[2]: "pending",
    }
    assert decoded == [ids[0]]


def test_heavy_reads_run_one_at_a_time_per_owner_and_never_wait_on_another_owner() -> None:
    limits = Limits(LimitsConfig())

    async def run() -> list[str]:
        order: list[str] = []
        hold = asyncio.Event()

        async def read(owner: str, name: str, until: asyncio.Event | None = None) -> None:
            async with limits.heavy_read(owner):
                order.append(f"{name} in")
                if until is not None:
                    await until.wait()
                order.append(f"{name} out")

        first = asyncio.create_task(read("mallory", "a", hold))
        second = asyncio.create_task(read("mallory", "b"))
        while not order and not first.done():
            await asyncio.sleep(0)
        assert order == ["a in"], first
        await read("bob", "c")  # not behind mallory's
        hold.set()
        await asyncio.gather(first, second)
        assert limits._heavy == {}  # nothing kept once no one reads
        return order

    assert asyncio.run(run()) == ["a in", "c in", "c out", "a out", "b in", "b out"]
