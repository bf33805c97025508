"""Full weights through the ``s3`` artifact store (a real SeaweedFS): a ``full_rl`` GRPO task on a
text environment stores its final checkpoint (all weights) in the bucket; ``RLClient.serve`` then
serves it as the base model of an inference task, which loads it from the bucket (through the
node's cache), and ``download_checkpoint`` gets the same bytes. (The ``local`` backend's full-weight
serving: test_sft.py.)"""

from __future__ import annotations

import os
from pathlib import Path

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client import RLClient

from tests.support.procs import START_S
from tests.support.waiting import wait_for

HP = {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4}


def test_full_weights_stored_served_and_downloaded_on_s3(cluster, seaweedfs, tiny_model_dir: Path, monkeypatch):
    for k, v in seaweedfs.env().items():  # the scheduler's credentials (trainers use its presigned URLs)
        monkeypatch.setenv(k, v)
    prefix = f"full-{os.getpid()}/"
    cluster.config_path.write_text(
        "heartbeat_interval: 0.5\nlease: 3\n"
        f"artifacts: {{backend: s3, s3: {{endpoint: '{seaweedfs.endpoint}', bucket: {seaweedfs.bucket}, "
        f"prefix: '{prefix}'}}}}\n"
    )
    first = cluster.start_with_trainer("node-a")
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        full_id = client.submit_task(workload_type="full_rl", model=str(tiny_model_dir), hyperparameters=HP)
        task = cluster.wait_done(client, full_id)
        assert task.state == "succeeded", task.error
        ck = task.proto.latest_checkpoint
        assert ck.format == "hf_full" and ck.artifact.backend == "s3"
        listed = seaweedfs.client().list_objects_v2(Bucket=seaweedfs.bucket, Prefix=f"{prefix}{ck.artifact.key}/")
        names = {o["Key"].removeprefix(f"{prefix}{ck.artifact.key}/") for o in listed.get("Contents", ())}
        assert {".manifest.json", ".data/model.safetensors", ".data/config.json"} <= names, names

        got = client.download_checkpoint(full_id, cluster.tmp / "download")
        weights = (got / "model.safetensors").read_bytes()
        # node-a wrote the checkpoint (and keeps it in its cache): serve it from node-b, a cold one
        first.terminate()
        second = cluster.start_trainer("node-b")

        def only_node_b() -> bool:
            nodes = cluster.stub.ListNodes(scheduler_pb2.ListNodesRequest()).nodes
            return [n.node_id for n in nodes if n.connected] == ["node-b"]

        wait_for(only_node_b, START_S, "node-b connected, node-a gone")
        with client.serve(full_id, ttl=120) as llm:
            gen = llm.generate("2 + 3 =", temperature=0, max_tokens=3)
            assert gen.model == full_id and gen.adapter is None and 1 <= len(gen.samples[0].token_ids) <= 3
            server_id = llm.task_id
        client.cancel(server_id)
    mine = [e for e in second.log_events() if e.get("task_id") == server_id]
    loads = [e for e in mine if e.get("event") == "loading model"]
    assert loads and loads[0]["checkpoint_task_id"] == full_id and loads[0]["checkpoint_step"] == ck.step
    served = Path(loads[0]["model"])
    assert "artifact-cache" in str(served) and (served / "model.safetensors").read_bytes() == weights
    # downloaded by its key from the bucket (node-b never saw the files)
    fetched = [e for e in mine if e.get("event") == "artifact cache: fetched"]
    assert [e.get("key") for e in fetched] == [ck.artifact.key], fetched
    assert any("S3 artifact store" in e.get("store", "") for e in fetched)
