"""ListCheckpoints / DownloadCheckpoint: the core's records, and the chunked stream through a real
scheduler gRPC server on loopback (RLClient on the other end)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client import FailedPreconditionError, NotFoundError, OpenTinkerError, RLClient
from opentinker_scheduler.data import checkpoints
from opentinker_scheduler.config import PoolNode, SchedulerConfig
from opentinker_scheduler.state.core import SchedulerCore
from opentinker_scheduler.errors import FailedPrecondition, InvalidArgument, NotFound
from opentinker_scheduler.server import start_scheduler
from tests.support.stores import make_store, with_store


def _spec() -> C.TaskSpec:
    return C.TaskSpec(workload_type="lora_finetune", model="/models/m", resources=C.Resources(gpu_count=0))


def _run_task_with_checkpoints(core: SchedulerCore, folders: dict[int, Path], endpoint: str = "") -> str:
    """Submit, place on a node, report RUNNING and a checkpoint per step; returns the task id."""
    node, _ = core.node_register(N.Register(node_id="n1", max_tasks=4))
    task = core.api.submit(_spec(), owner="u")
    core.schedule()
    core.node_report(node, N.TaskReport(task_id=task.task_id, attempt=1, state=C.TASK_STATE_RUNNING, endpoint=endpoint))
    for step, folder in folders.items():
        core.node_report(
            node,
            N.TaskReport(
                task_id=task.task_id,
                attempt=1,
                checkpoint=C.Checkpoint(step=step, path=str(folder), format="peft_lora"),
            ),
        )
    return task.task_id


def _folder(root: Path, name: str, files: dict[str, bytes]) -> Path:
    d = root / name
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return d


def test_list_and_pick_checkpoints_with_not_found_cases(tmp_path) -> None:
    core = SchedulerCore(
        SchedulerConfig(resource_pool=(PoolNode("n1", 0, 4),), state_dir=tmp_path / "state"),
        make_store(tmp_path / "state"),
    )
    a = _folder(tmp_path, "step_2", {"a.bin": b"x"})
    b = _folder(tmp_path, "step_4", {"a.bin": b"y"})
    task_id = _run_task_with_checkpoints(core, {2: a, 4: b})
    cks = checkpoints.list_checkpoints(core.store, task_id)
    assert [c.step for c in cks] == [2, 4] and cks[0].path == str(a) and cks[0].task_id == task_id
    assert checkpoints.pick_checkpoint(core.store, task_id, 0).step == 4
    assert checkpoints.pick_checkpoint(core.store, task_id, 2).path == str(a)
    with pytest.raises(NotFound, match=r"no checkpoint at step 3; steps with one: 2, 4"):
        checkpoints.pick_checkpoint(core.store, task_id, 3)
    with pytest.raises(NotFound, match="not found"):
        checkpoints.list_checkpoints(core.store, "task-nope")
    with pytest.raises(InvalidArgument, match="task_id"):
        checkpoints.list_checkpoints(core.store, "")
    with pytest.raises(InvalidArgument, match="step"):
        checkpoints.pick_checkpoint(core.store, task_id, -1)
    # A folder the scheduler cannot see is a precondition failure naming the folder.
    gone = checkpoints.pick_checkpoint(core.store, task_id, 2)
    gone.path = str(tmp_path / "elsewhere")
    with pytest.raises(FailedPrecondition, match="not readable from the scheduler"):
        checkpoints.build_manifest(gone)


def test_manifest_and_chunks_cover_every_byte_in_pieces_of_at_most_1_mib(tmp_path) -> None:
    big = os.urandom(2 * checkpoints.CHUNK_BYTES + 123)
    folder = _folder(tmp_path, "ck", {"big.bin": big, "sub/small.json": b"{}", "empty": b""})
    m = checkpoints.build_manifest(C.Checkpoint(step=1, path=str(folder)))
    assert [f.path for f in m.message.files] == ["big.bin", "empty", "sub/small.json"]
    assert m.message.files[0].sha256 == hashlib.sha256(big).hexdigest()
    assert m.message.total_bytes == len(big) + 2
    chunks = list(checkpoints.read_chunks(m))
    assert max(len(c.data) for c in chunks) <= checkpoints.CHUNK_BYTES
    assert b"".join(c.data for c in chunks if c.file_index == 0) == big
    assert [c.offset for c in chunks if c.file_index == 0] == [0, checkpoints.CHUNK_BYTES, 2 * checkpoints.CHUNK_BYTES]
    assert any(c.file_index == 1 and c.data == b"" for c in chunks)


class _SchedulerThread:
    def __init__(self, state_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = with_store(SchedulerConfig(resource_pool=(PoolNode("n1", 0, 4),), state_dir=state_dir))
        self.running = self.call(start_scheduler(cfg, host="127.0.0.1", port=0, http_port=None))
        self.core = self.running.core

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def do(self, fn, *args):
        async def run():
            out = fn(*args)
            await self.core.durable()
            return out

        return self.call(run())

    def close(self) -> None:
        self.call(self.running.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def scheduler(tmp_path):
    s = _SchedulerThread(tmp_path / "state")
    yield s
    s.close()


def test_download_through_grpc_matches_file_hashes_and_endpoint_shows_while_running(scheduler, tmp_path) -> None:
    big = os.urandom(3 * checkpoints.CHUNK_BYTES + 7)
    folder = _folder(tmp_path, "step_3", {"adapter_model.safetensors": big, "adapter_config.json": b'{"r": 4}'})
    task_id = scheduler.do(_run_task_with_checkpoints, scheduler.core, {3: folder}, "127.0.0.1:5555")
    with RLClient(f"127.0.0.1:{scheduler.running.port}", min_poll_interval=0) as client:
        assert client.get_task(task_id).endpoint == "127.0.0.1:5555"
        infos = client.list_checkpoints(task_id)
        assert [(c.step, c.path, c.format) for c in infos] == [(3, str(folder), "peft_lora")]
        dest = client.download_checkpoint(task_id, tmp_path / "got")
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            assert (
                hashlib.sha256((dest / name).read_bytes()).digest()
                == hashlib.sha256((folder / name).read_bytes()).digest()
            )
        with pytest.raises(FileExistsError):
            client.download_checkpoint(task_id, tmp_path / "got")
        with pytest.raises(NotFoundError, match="no checkpoint at step 9"):
            client.download_checkpoint(task_id, tmp_path / "x", step=9)
        with pytest.raises(NotFoundError):
            client.download_checkpoint("task-unknown", tmp_path / "y")
        with pytest.raises(NotFoundError):
            client.list_checkpoints("task-unknown")
        assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()  # nothing half-written
        (folder / "adapter_config.json").unlink()
        folder.rename(tmp_path / "moved")
        with pytest.raises(FailedPreconditionError, match="not readable from the scheduler"):
            client.download_checkpoint(task_id, tmp_path / "z")
        assert not (tmp_path / "z").exists()
        # Every message of the raw stream fits well under gRPC's limits.
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(big)
        sizes = [
            m.ByteSize()
            for m in client._connection.stub.DownloadCheckpoint(
                scheduler_pb2.DownloadCheckpointRequest(task_id=task_id)
            )
        ]
        assert len(sizes) == 1 + 4 and max(sizes) <= checkpoints.CHUNK_BYTES + 64
    # The endpoint is only shown while the task runs.
    scheduler.do(scheduler.core.api.cancel, task_id)
    with RLClient(f"127.0.0.1:{scheduler.running.port}", min_poll_interval=0) as client:
        assert client.get_task(task_id).endpoint == ""


def test_damaged_download_is_refused_and_leaves_nothing(tmp_path) -> None:
    from opentinker_client.client_data import _safe_relative

    for bad in ("/etc/passwd", "../x", "a/../../b", ""):
        with pytest.raises(OpenTinkerError, match="unsafe file path"):
            _safe_relative(bad)
    assert str(_safe_relative("sub/a.json")) == "sub/a.json"
