"""Uploaded datasets live in the ``s3`` artifact store too: a dataset uploaded to one scheduler
is usable through another that never had it on its disk (a second scheduler of the cluster, or
the one after a failover): a submit naming it passes, and a trainer's FetchDataset gets the
same bytes. Real schedulers on loopback, a real SeaweedFS; separate state dirs, one bucket."""

from __future__ import annotations

import hashlib
import uuid

from opentinker.node.v1 import node_pb2, node_pb2_grpc
from opentinker_client import RLClient

from tests.support.datasets import arithmetic_chat_jsonl
from tests.support.security import LoopbackScheduler

MODEL = "HuggingFaceTB/SmolLM2-135M"


def test_a_dataset_uploaded_to_one_scheduler_is_served_by_another(seaweedfs, tmp_path, monkeypatch) -> None:
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    s3 = f"{{endpoint: '{seaweedfs.endpoint}', bucket: {seaweedfs.bucket}, prefix: 'ds-{uuid.uuid4().hex[:8]}/'}}"
    config = f"artifacts: {{backend: s3, s3: {s3}}}\n"
    data = arithmetic_chat_jsonl(tmp_path / "train.jsonl", n=6)
    hex_ = hashlib.sha256(data.read_bytes()).hexdigest()
    with LoopbackScheduler(tmp_path / "a", config) as a:
        with RLClient(a.target) as client:
            info = client.upload_dataset(data)
        assert info.dataset_id == f"sha256:{hex_}"
        assert a.running.artifacts.store.list("datasets/") == [f"datasets/{hex_}"]
    with LoopbackScheduler(tmp_path / "b", config) as b:
        assert not (tmp_path / "b" / "datasets" / f"{hex_}.jsonl").exists()
        with RLClient(b.target) as client:
            task_id = client.submit_task(
                {"env_id": "chat_jsonl", "dataset_id": info.dataset_id}, workload_type="sft", model=MODEL
            )
            assert client.get_task(task_id).state == "pending"
        with b.channel() as ch:
            chunks = node_pb2_grpc.NodeServiceStub(ch).FetchDataset(
                node_pb2.FetchDatasetRequest(dataset_id=info.dataset_id)
            )
            assert b"".join(c.chunk for c in chunks) == data.read_bytes()
        assert (tmp_path / "b" / "datasets" / f"{hex_}.jsonl").read_bytes() == data.read_bytes()
