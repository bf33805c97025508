"""The artifact store failing under a running task, with real parts: a scheduler and two
trainers whose ``s3`` store is a real SeaweedFS reached through a loopback TCP proxy the test
cuts. One task lives through both faults (each worker start costs seconds):

1. A trainer killed (kill -9) while its checkpoint upload hangs in a silent network: that
   half-written checkpoint is never offered; the task resumes on the other node from the
   previous complete one, downloaded from S3.
2. The store gone mid-task (every connection closed at once, as when SeaweedFS dies): each
   checkpoint that cannot be stored after its retries is a ``checkpoint_failed`` task event while
   training goes on; after ``max_failed_checkpoints`` in a row the task ends FAILED with the
   reason naming the endpoint, its last complete checkpoint kept in the store and downloadable
   once the store is back. Retention (keep 2) deletes attempt 1's checkpoints on the way (and
   ListCheckpoints lists them no more).
"""

from __future__ import annotations

import uuid

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_client import RLClient

from tests.support.procs import Cluster
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_for

HP = {"steps": 400, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4, "checkpoint_every": 2}


@pytest.fixture(scope="module")
def store_cluster(seaweedfs, tmp_path_factory):
    proxy = TcpProxy("127.0.0.1", seaweedfs.s3_port)
    prefix = f"faults-{uuid.uuid4().hex[:8]}/"
    config = (
        "heartbeat_interval: 0.5\nlease: 3\n"
        "artifacts: {backend: s3, keep_checkpoints: 2, checkpoint_retries: 2, max_failed_checkpoints: 2, "
        f"s3: {{endpoint: 'http://127.0.0.1:{proxy.port}', bucket: {seaweedfs.bucket}, prefix: '{prefix}'}}}}\n"
    )
    with pytest.MonkeyPatch.context() as mp:
        for k, v in seaweedfs.env().items():  # the scheduler's credentials (trainers use its presigned URLs)
            mp.setenv(k, v)
        cluster = Cluster(tmp_path_factory.mktemp("store-faults"), config)
        try:
            cluster.start_scheduler()
            cluster.proxy, cluster.prefix, cluster.s3 = proxy, prefix, seaweedfs.client()
            cluster.bucket = seaweedfs.bucket
            yield cluster
        finally:
            cluster.close()
            proxy.close()


def _committed(cluster, task_id: str) -> list[str]:
    """Keys of the task's committed artifacts, read from SeaweedFS directly (not through the proxy)."""
    resp = cluster.s3.list_objects_v2(Bucket=cluster.bucket, Prefix=f"{cluster.prefix}tasks/{task_id}/")
    names = [o["Key"][len(cluster.prefix) :] for o in resp.get("Contents", ())]
    return sorted(n.removesuffix("/.manifest.json") for n in names if n.endswith("/.manifest.json"))


def _uploads(proc) -> tuple[set[int], set[int]]:
    """Steps whose upload the worker began, and those it stored (its log)."""
    events = proc.log_events()
    began = {e["step"] for e in events if e.get("event") == "checkpoint upload"}
    return began, {e["step"] for e in events if e.get("event") == "checkpoint stored"}


def test_a_kill_during_an_upload_then_the_store_going_away(store_cluster, tiny_model_dir) -> None:
    cluster, proxy = store_cluster, store_cluster.proxy
    running = C.TASK_STATE_RUNNING
    first = cluster.start_trainer("node-a")
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = client.submit_task(
            workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=HP, max_attempts=3
        )
        cluster.wait_state(task_id, running, what=lambda t: t.node_id == "node-a")
        second = cluster.start_trainer("node-b")  # ready to take over (it loads while node-a trains)
        cluster.wait_state(task_id, running, what=lambda t: t.latest_checkpoint.step >= 2)

        # 1. kill -9 of the trainer while its upload hangs in a silent network
        proxy.pause()  # an upload with bytes still to send from here on cannot finish

        def held() -> int | None:
            """The step of the upload begun and not stored while the network holds its bytes (one
            begun before the pause counts too: it may have been caught mid-way)."""
            began, stored = _uploads(first)
            pending = began - stored
            return min(pending) if pending and proxy.unread_bytes() > 0 else None

        cluster.wait_state(task_id, running, what=lambda t: held() is not None)
        half = held()
        prev = max(_uploads(first)[1])  # the worker stores one checkpoint at a time: all before it
        assert prev < half
        cluster.wait_state(task_id, running, what=lambda t: t.latest_checkpoint.step == prev)
        first.kill9()  # the machine dies mid-upload
        proxy.resume()
        assert f"tasks/{task_id}/a1/step_{half}" not in _committed(cluster, task_id)  # half-written: invisible
        # the task resumes on node-b from the previous complete checkpoint, read from S3 (a cold cache)
        cluster.wait_state(task_id, running, what=lambda t: t.attempt == 2 and len(_uploads(second)[1]) >= 2)
        # retention on s3 (keep 2): once node-b stored two, attempt 1's are deleted
        wait_for(
            lambda: not [k for k in _committed(cluster, task_id) if "/a1/" in k], what="attempt 1's checkpoints retired"
        )

        # and listed no more (the scheduler records what retention deleted)
        def listed() -> set[int]:
            return {c.attempt for c in client.list_checkpoints(task_id)}

        wait_for(lambda: listed() == {2}, what="attempt 1's checkpoints unlisted")
        resumed = [e for e in second.log_events() if e.get("event") == "resumed"]
        assert resumed and resumed[0]["step"] == prev
        assert not [e for e in second.log_events() if e.get("event") == "artifact cache: hit"]

        # 2. the store goes away: checkpoint_failed events while training goes on, then FAILED
        proxy.refuse()
        task = cluster.wait_state(task_id, C.TASK_STATE_FAILED)
        proxy.resume()
        kept = task.latest_checkpoint
        assert kept.attempt == 2 and kept.step == max(_uploads(second)[1])
        assert "2 checkpoints in a row could not be stored" in task.error, task.error
        assert f"the last complete checkpoint is step {kept.step}" in task.error, task.error
        assert f"127.0.0.1:{proxy.port}" in task.error  # names the endpoint
        events = list(client.watch(task_id))
        assert kept.artifact.key in _committed(cluster, task_id)  # the last complete one stays

        # 3. the last complete checkpoint is there to use: downloaded from S3 (every file's SHA-256
        # checked against its manifest; init_from and serving fetch it as the resume above did)
        got = client.download_checkpoint(task_id, cluster.tmp / "kept")
        assert (got / "adapter_model.safetensors").exists() and (got / "trainer_state.pt").exists()
    lost = max(i for i, e in enumerate(events) if e.kind == "state" and e.reason == "NODE_LOST")
    after = [e.step for e in events[lost:] if e.kind == "metric"]
    assert after[0] == prev + 1, (prev, half, after[:5])  # resumed from the previous complete one
    failed = [e for e in events if e.kind == "checkpoint_failed"]
    assert [(e.attempt, e.fatal, e.failures_in_a_row) for e in failed] == [(2, False, 1), (2, True, 2)], failed
    assert all(e.step > kept.step and "unreachable" in e.message and e.node_id == "node-b" for e in failed)
    trained_on = [e.step for e in events[lost:] if e.kind == "metric" and failed[0].step < e.step <= failed[1].step]
    assert trained_on, "training went on after the first checkpoint that could not be stored"
