"""From training to serving through real scheduler and trainer processes on loopback: train a
tiny LoRA task, serve its adapter with RLClient.serve, generate (gRPC, and the real ``openai``
client streaming a chat completion over the OpenAI-compatible endpoint), download its
checkpoint, cancel."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from opentinker_client import NotFoundError, OpenTinkerError, RLClient, UnavailableError, evaluate

from tests.support.waiting import wait_for

TINY_HP = {
    "steps": 2,
    "prompts_per_step": 2,
    "group_size": 2,
    "max_new_tokens": 4,
    "lora_rank": 4,
    "checkpoint_every": 1,
}
CONFIG = """heartbeat_interval: 0.5
lease: 3
workload_types:
  - type: lora_finetune
    priority: 1
  - type: inference
    priority: 3
"""


@pytest.fixture
def cluster(tmp_path):
    """A scheduler that knows the inference workload, with one trainer connected."""
    from tests.support.procs import Cluster

    cluster = Cluster(tmp_path, CONFIG)
    try:
        cluster.start_with_trainer()
        yield cluster
    finally:
        cluster.close()


def _cli(url: str, *args: str) -> subprocess.CompletedProcess:
    """``opentinker --scheduler-url URL ARGS...`` in a process of its own, 200 columns wide."""
    return subprocess.run(
        [sys.executable, "-m", "opentinker_client.cli.commands", "--scheduler-url", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_trained_adapter_is_served_downloaded_and_the_server_ends_on_cancel(
    cluster, tmp_path, tiny_model_dir: Path
) -> None:
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        trained = client.submit_task(workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=TINY_HP)
        info = cluster.wait_done(client, trained)
        ckpt = Path(info.checkpoint_path)

        # Checkpoints: listed, and downloaded byte for byte.
        assert [c.step for c in client.list_checkpoints(trained)] == [1, 2]
        got = client.download_checkpoint(trained, tmp_path / "download")
        names = sorted(p.name for p in got.iterdir())
        assert "adapter_model.safetensors" in names and names == sorted(p.name for p in ckpt.iterdir())
        assert all(_sha(got / n) == _sha(ckpt / n) for n in names)
        assert got.stat().st_mode & 0o777 == 0o700 and all((got / n).stat().st_mode & 0o777 == 0o600 for n in names)
        first = client.download_checkpoint(trained, tmp_path / "step1", step=1)
        assert _sha(first / "adapter_model.safetensors") == _sha(ckpt.parent / "step_1" / "adapter_model.safetensors")

        # An inference task with the OpenAI-compatible endpoint on any free port; serve() reuses it
        # for the adapter, and the task shows the URL it got.
        client.submit_task(
            workload_type="inference",
            model=str(tiny_model_dir),
            hyperparameters={"ttl_s": 600, "openai_port": 0},
        )
        # One call from a finished task to a served adapter; a second call reuses the server.
        llm = client.serve(trained, ttl=600, timeout=180)
        server_task = client.get_task(llm.task_id)
        assert (
            server_task.workload_type == "inference"
            and server_task.state == "running"
            and server_task.endpoint == llm.endpoint
        )
        openai_url = server_task.openai_endpoint
        host, port = llm.endpoint.rsplit(":", 1)
        assert openai_url == llm.openai_endpoint and openai_url.startswith(f"http://{host}:")
        assert openai_url.endswith("/v1") and int(openai_url.removesuffix("/v1").rsplit(":", 1)[1]) > 0
        import openai

        # Listed right after serve(), before any request: the id a client passes as model.
        with openai.OpenAI(base_url=openai_url, api_key="unused", max_retries=0) as oai:
            assert [m.id for m in oai.models.list().data] == [tiny_model_dir.name, trained]
        shown = _cli(cluster.url, "get", llm.task_id)
        assert shown.returncode == 0 and "endpoint" in shown.stdout and llm.endpoint in shown.stdout
        assert "openai endpoint" in shown.stdout and openai_url in shown.stdout
        # logs: both endpoints once, above the events; none for a task that serves nothing.
        server_log, trained_log = (_cli(cluster.url, "logs", t).stdout.splitlines() for t in (llm.task_id, trained))
        assert server_log[:2] == [f"endpoint {llm.endpoint}", f"openai endpoint {openai_url}"]
        assert sum("endpoint" in line for line in server_log) == 2 and "#1" in server_log[2]
        assert trained_log and not any("endpoint" in line for line in trained_log)
        out = llm.generate("What is 2 + 3?", temperature=0, max_tokens=5)
        assert out.adapter == trained and 1 <= len(out.samples[0].token_ids) <= 5
        assert llm.generate("What is 2 + 3?", temperature=0, max_tokens=5).samples == out.samples
        assert [a.name for a in llm.list_adapters()] == [trained]
        assert llm.generate("What is 2 + 3?", adapter=None, temperature=0, max_tokens=5).adapter is None
        # The trained adapter through the real openai client: a streamed chat completion.
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        expected = llm.generate(messages=messages, temperature=0, max_tokens=6)
        with openai.OpenAI(base_url=openai_url, api_key="unused", max_retries=0) as oai:
            assert [m.id for m in oai.models.list().data] == [tiny_model_dir.name, trained]
            chunks = list(
                oai.chat.completions.create(model=trained, messages=messages, temperature=0, max_tokens=6, stream=True)
            )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
        assert chunks[-1].choices[0].finish_reason == expected.samples[0].finish_reason
        again = client.serve(trained, timeout=60)
        assert again.task_id == llm.task_id
        report = evaluate(llm, episodes=3, max_tokens=4)
        assert report.episodes == 3 and 0.0 <= report.mean_reward <= 1.0 and report.adapter == trained

        # Unknown adapter (task), and an inference task is no adapter.
        with pytest.raises(NotFoundError, match="task-unknown"):
            llm.generate("hi", adapter="task-unknown", max_tokens=2)
        with pytest.raises(OpenTinkerError, match="only lora_finetune, sft and lora_session tasks"):
            llm.generate("hi", adapter=llm.task_id, max_tokens=2)

        # The server also answers grpcurl-style health checks and reflection.
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(llm.endpoint) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="opentinker.inference.v1.InferenceService"), timeout=10
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING

        # Cancel ends the server.
        client.cancel(llm.task_id)
        task = cluster.wait_state(llm.task_id, 6)
        assert task.endpoint == ""

        def gone() -> bool:
            try:
                llm.list_adapters()
            except UnavailableError:
                return True
            return False

        # The agent stops the worker (SIGTERM, SIGKILL after its 3 s grace): a fixed wait.
        wait_for(gone, timeout=60, what="the inference server stops answering after its task was cancelled")


def test_inference_task_ends_succeeded_when_its_ttl_runs_out(cluster, tmp_path, tiny_model_dir: Path) -> None:
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = client.submit_task(workload_type="inference", model=str(tiny_model_dir), hyperparameters={"ttl_s": 3})
        info = cluster.wait_done(client, task_id)
        assert info.state == "succeeded" and info.endpoint == ""
