"""Uploaded datasets (validation while streaming, content-addressed storage, limits) and the
references a spec makes at submit (dataset_id, init_from) and at assignment (init_checkpoint)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker.scheduler.v1 import scheduler_pb2 as S
from opentinker_scheduler.config import PoolNode, SchedulerConfig
from opentinker_scheduler.state.core import SchedulerCore
from opentinker_scheduler.data.datasets import DatasetStore, LineValidator, receive_upload, validate_chat_jsonl
from opentinker_scheduler.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from opentinker_scheduler.admission.refs import check_references
from tests.support.stores import make_store


def example(q: str, a: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})


DATA = ("\n".join(example(f"What is {i} + 1?", str(i + 1)) for i in range(5)) + "\n").encode()


def test_validate_counts_examples_and_names_bad_lines() -> None:
    assert validate_chat_jsonl(DATA.decode().splitlines()) == 5
    with pytest.raises(InvalidArgument, match=r"^dataset line 2: expected a JSON object such as"):
        validate_chat_jsonl([example("a", "b"), "{oops"])
    with pytest.raises(InvalidArgument, match=r"^dataset: expected at least one example"):
        validate_chat_jsonl(["", ""])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(DATA)), max_size=8))
def test_any_chunking_gives_the_same_answer(cuts: list[int]) -> None:
    """Lines may span chunks: the count and the first bad line do not depend on where chunks end."""
    bad = DATA + b'{"messages": [{"role": "user", "content": "x"}]}\n' + DATA
    for data, want in ((DATA, 5), (bad, "dataset line 6: ")):
        bounds = [0, *sorted(set(cuts)), len(data)]
        v = LineValidator()
        try:
            for a, b in zip(bounds, bounds[1:]):
                v.feed(data[a:b])
            got: int | str = v.finish()
        except InvalidArgument as exc:
            got = str(exc)[: len("dataset line 6: ")]
        assert got == want


def upload(
    store: DatasetStore, data: bytes, *, name: str = "d.jsonl", total: int | None = None, chunk: int = 7
) -> S.DatasetInfo:
    async def requests():
        yield S.UploadDatasetRequest(name=name, total_bytes=len(data) if total is None else total, chunk=data[:chunk])
        for i in range(chunk, len(data), chunk):
            yield S.UploadDatasetRequest(chunk=data[i : i + chunk])

    return asyncio.run(receive_upload(store, requests()))


def test_upload_is_content_addressed_idempotent_and_downloadable(tmp_path) -> None:
    store = DatasetStore(tmp_path / "datasets")
    info = upload(store, DATA)
    hex_ = hashlib.sha256(DATA).hexdigest()
    assert (
        info.dataset_id == f"sha256:{hex_}"
        and info.num_examples == 5
        and info.size_bytes == len(DATA)
        and info.name == "d.jsonl"
    )
    assert store.exists(info.dataset_id) and store.path(info.dataset_id).read_bytes() == DATA
    again = upload(store, DATA, name="other.jsonl", chunk=1000)
    # Same bytes, same dataset, stored once; the answer carries this upload's own name.
    assert again.dataset_id == info.dataset_id and again.name == "other.jsonl" and again.size_bytes == info.size_bytes
    assert sorted(p.name for p in store.root.iterdir()) == [f"{hex_}.json", f"{hex_}.jsonl"]
    assert b"".join(store.chunks(info.dataset_id, size=10)) == DATA
    assert all(len(c) <= 10 for c in store.chunks(info.dataset_id, size=10))
    assert store.info(info.dataset_id) == info
    with pytest.raises(NotFound, match="not found"):
        store.info("sha256:" + "0" * 64)
    with pytest.raises(InvalidArgument, match="dataset_id: expected sha256:<64 lowercase hex digits>"):
        store.path("../../etc/passwd")
    # Stale temporary files of a crashed upload are removed at start.
    (store.root / "upload-dead.part").write_bytes(b"x")
    DatasetStore(store.root)
    assert not list(store.root.glob("upload-*"))


@pytest.mark.parametrize(
    ("data", "total", "error", "message"),
    [
        (DATA + b"{bad\n" + DATA, None, InvalidArgument, "dataset d.jsonl:6:2: expected a JSON object"),
        (b"\n\n  \n", None, InvalidArgument, "dataset d.jsonl: expected at least one example"),
        (b"", 0, InvalidArgument, "total_bytes: expected the file's size in bytes (> 0)"),
        (DATA, len(DATA) - 3, InvalidArgument, f"total_bytes: announced {len(DATA) - 3} bytes, received more"),
        (DATA, len(DATA) + 3, InvalidArgument, f"total_bytes: announced {len(DATA) + 3} bytes, received {len(DATA)}"),
        (DATA, 10**12, ResourceExhausted, "over this scheduler's dataset limit of 4000 bytes"),
        (DATA * 10, 4000, ResourceExhausted, "larger than this scheduler's limit of 4000 bytes"),
    ],
)
def test_bad_uploads_are_refused_and_leave_nothing(tmp_path, data: bytes, total, error, message: str) -> None:
    store = DatasetStore(tmp_path / "datasets", max_bytes=4000)
    with pytest.raises(error) as err:
        upload(store, data, total=total)
    assert message in str(err.value)
    assert list(store.root.iterdir()) == []


def test_upload_stream_needs_a_header_first(tmp_path) -> None:
    store = DatasetStore(tmp_path)

    async def empty():
        return
        yield  # pragma: no cover

    async def two_headers():
        yield S.UploadDatasetRequest(name="a", total_bytes=len(DATA), chunk=DATA[:5])
        yield S.UploadDatasetRequest(name="b", chunk=DATA[5:])

    with pytest.raises(InvalidArgument, match="expected a first message with name and total_bytes"):
        asyncio.run(receive_upload(store, empty()))
    with pytest.raises(InvalidArgument, match="name, total_bytes, format: expected only in the first message"):
        asyncio.run(receive_upload(store, two_headers()))
    with pytest.raises(InvalidArgument, match=r"name: expected a name without control characters, got U\+000A"):
        store.begin("a\nb", 10)
    with pytest.raises(InvalidArgument, match="name: expected at most 256 characters"):
        store.begin("a" * 257, 10)
    assert not [p for p in store.root.iterdir() if p.is_file()]


# ------------------------------------------------------------------------------------ references


def make_core(tmp: Path) -> SchedulerCore:
    cfg = SchedulerConfig(resource_pool=(PoolNode("node-a", 0, 8),), state_dir=tmp, default_model="/models/m")
    return SchedulerCore(cfg, make_store(tmp))


def lm_spec(model: str = "/models/m", init_from: str = "") -> C.TaskSpec:
    s = C.TaskSpec(workload_type="lora_finetune", model=model, init_from=init_from)
    h = struct_pb2.Struct()
    h.update({"steps": 2})
    s.hyperparameters.CopyFrom(h)
    return s


def finish(
    core: SchedulerCore, node, task_id: str, state=C.TASK_STATE_SUCCEEDED, checkpoint: C.Checkpoint | None = None
) -> None:
    assert core.schedule() >= 1
    core.node_report(node, N.TaskReport(task_id=task_id, attempt=1, state=C.TASK_STATE_RUNNING))
    kw = {"checkpoint": checkpoint} if checkpoint is not None else {}
    core.node_report(node, N.TaskReport(task_id=task_id, attempt=1, state=state, **kw))


@pytest.fixture
def env(tmp_path):
    core = make_core(tmp_path / "state")
    node, _ = core.node_register(N.Register(node_id="node-a", max_tasks=8))
    store = DatasetStore(tmp_path / "datasets")

    def check(spec: C.TaskSpec) -> None:
        check_references(
            spec, datasets=store, get_task=core.api.get, owner="u", default_model=core.config.default_model
        )

    return core, node, store, check


def test_dataset_id_must_be_uploaded(env) -> None:
    core, node, store, check = env
    info = upload(store, DATA)
    spec = C.TaskSpec(workload_type="sft", model="/models/m")
    spec.env_config.update({"env_id": "chat_jsonl", "dataset_id": info.dataset_id})
    check(spec)
    spec.env_config.update({"dataset_id": "sha256:" + "1" * 64})
    with pytest.raises(NotFound, match=r"spec.env_config.dataset_id: dataset sha256:1+ not found on this scheduler"):
        check(spec)


def test_init_from_needs_an_ended_task_with_an_lm_checkpoint_of_the_same_model(env) -> None:
    core, node, store, check = env
    with pytest.raises(NotFound, match="spec.init_from: task 'task-nope' not found"):
        check(lm_spec(init_from="task-nope"))

    running = core.api.submit(lm_spec(), owner="u")
    core.schedule()
    with pytest.raises(
        FailedPrecondition,
        match=f"spec.init_from: task {running.task_id} is ASSIGNED; a task can only start from one that has ended",
    ):
        check(lm_spec(init_from=running.task_id))

    failed = core.api.submit(lm_spec(), owner="u")
    core.node_report(node, N.TaskReport(task_id=running.task_id, attempt=1, state=C.TASK_STATE_SUCCEEDED))
    finish(core, node, failed.task_id, C.TASK_STATE_FAILED)
    with pytest.raises(
        FailedPrecondition, match=r"\(FAILED\) has no checkpoint; expected a checkpoint in one of peft_lora, hf_full"
    ):
        check(lm_spec(init_from=failed.task_id))
    with pytest.raises(
        FailedPrecondition,
        match=r"\(SUCCEEDED\) has no checkpoint; expected a final checkpoint in one of peft_lora, hf_full",
    ):
        check(lm_spec(init_from=running.task_id))

    # A FAILED (or timed-out) or CANCELLED task's last checkpoint will do, final or not.
    ended = core.api.submit(lm_spec(), owner="u")
    ck1 = C.Checkpoint(step=1, path="/ck/e/step_1", format="peft_lora")
    finish(core, node, ended.task_id, C.TASK_STATE_FAILED, checkpoint=ck1)
    check(lm_spec(init_from=ended.task_id))
    cut = core.api.submit(lm_spec(), owner="u")
    core.schedule()
    core.node_report(node, N.TaskReport(task_id=cut.task_id, attempt=1, state=C.TASK_STATE_RUNNING))
    core.api.cancel(cut.task_id)
    core.node_report(  # the checkpoint its worker wrote on SIGTERM, after the cancel
        node,
        N.TaskReport(
            task_id=cut.task_id, attempt=1, checkpoint=C.Checkpoint(step=3, path="/ck/c/step_3", format="peft_lora")
        ),
    )
    check(lm_spec(init_from=cut.task_id))
    assert core.api.get(cut.task_id).latest_checkpoint.step == 3

    odd = core.api.submit(lm_spec(), owner="u")
    finish(core, node, odd.task_id, checkpoint=C.Checkpoint(step=2, path="/ck/odd", final=True, format="torch_state"))
    with pytest.raises(FailedPrecondition, match="has a final torch_state checkpoint"):
        check(lm_spec(init_from=odd.task_id))

    good = core.api.submit(lm_spec(), owner="u")
    ck = C.Checkpoint(step=2, path="/ck/sft/step_2", final=True, format="peft_lora")
    finish(core, node, good.task_id, checkpoint=ck)
    check(lm_spec(init_from=good.task_id))
    check(lm_spec(model="", init_from=good.task_id))  # "" = the default model, the same one
    with pytest.raises(
        InvalidArgument, match=r"spec.model: expected '/models/m', the model task .* trained, got '/models/other'"
    ):
        check(lm_spec(model="/models/other", init_from=good.task_id))

    # A training session writes no final checkpoint; its newest (a state or sampler weights) will
    # do once it has ended, idle (SUCCEEDED) or cancelled.
    session_spec = C.TaskSpec(workload_type="lora_session", model="/models/m")
    session = core.api.submit(session_spec, owner="u")
    sampler = C.Checkpoint(step=4, path="/ck/s/sampler_w", format="peft_lora")
    finish(core, node, session.task_id, checkpoint=sampler)
    assert core.api.get(session.task_id).state == C.TASK_STATE_SUCCEEDED and not sampler.final
    check(lm_spec(init_from=session.task_id))
    still = core.api.submit(session_spec, owner="u")
    core.schedule()
    core.node_report(node, N.TaskReport(task_id=still.task_id, attempt=1, state=C.TASK_STATE_RUNNING, checkpoint=ck1))
    with pytest.raises(FailedPrecondition, match=f"task {still.task_id} is RUNNING"):
        check(lm_spec(init_from=still.task_id))

    # At assignment the worker gets the init_from task's final checkpoint.
    task = core.api.submit(lm_spec(init_from=good.task_id), owner="u")
    while not node.outbox.empty():
        node.outbox.get_nowait()
    assert core.schedule() == 1
    assign = node.outbox.get_nowait().assign_task
    assert assign.task_id == task.task_id
    assert assign.init_checkpoint.path == "/ck/sft/step_2" and assign.init_checkpoint.format == "peft_lora"
    assert assign.init_checkpoint.task_id == good.task_id
    assert not assign.HasField("resume_from")


def test_an_inference_task_serves_only_its_owners_full_weights(env) -> None:
    core, node, store, check = env

    def serving(task_id: str) -> C.TaskSpec:
        s = C.TaskSpec(workload_type="inference", model="/models/m")
        s.hyperparameters.update({"checkpoint_task_id": task_id})
        return s

    mine = core.api.submit(lm_spec(), owner="u")
    theirs = core.api.submit(lm_spec(), owner="v")
    check(serving(mine.task_id))
    check(C.TaskSpec(workload_type="inference", model="/models/m"))  # the base model: nothing to check
    for other in (theirs.task_id, "task-nope"):  # another owner's task reads as no task at all
        with pytest.raises(NotFound, match=rf"^spec.hyperparameters.checkpoint_task_id: task '{other}' not found$"):
            check(serving(other))
