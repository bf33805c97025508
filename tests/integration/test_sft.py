"""sft through real scheduler and trainer processes: upload a dataset, fine-tune the tiny model,
then start an RL task from its checkpoint (``init_from``), serve the full-weight SFT checkpoint as
a base model (``RLClient.serve``) and check it answers as the checkpoint loaded with
transformers does; refusals over the wire."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client import RLClient, TaskFailedError
from opentinker_client.cli.commands import main as cli_main
from opentinker_client.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError

from tests.support.datasets import arithmetic_chat_jsonl
from tests.support.procs import Cluster

CONFIG = """heartbeat_interval: 0.5
lease: 3
workload_types:
  - type: lora_finetune
    priority: 1
  - type: full_rl
    priority: 1
  - type: sft
    priority: 1
  - type: inference
    priority: 3
"""

SFT_HP = {"steps": 3, "batch_size": 4, "lora_rank": 2, "learning_rate": 1e-2, "eval_every": 3}
RL_HP = {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4}


@pytest.fixture
def sft_cluster(tmp_path):
    c = Cluster(tmp_path, CONFIG)
    yield c
    c.close()


def test_sft_then_rl_from_its_checkpoint(
    sft_cluster: Cluster, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    trainer = sft_cluster.start_with_trainer()
    data = arithmetic_chat_jsonl(tmp_path / "train.jsonl", n=12)
    with RLClient(scheduler_url=sft_cluster.url, min_poll_interval=0) as client:
        info = client.upload_dataset(data)
        assert info.dataset_id.startswith("sha256:") and info.num_examples == 12 and info.name == "train.jsonl"
        assert client.upload_dataset(data, name="again").dataset_id == info.dataset_id  # content-addressed

        sft_id = client.submit_task(
            {"env_id": "chat_jsonl", "dataset_id": info.dataset_id, "eval_fraction": 0.25},
            workload_type="sft", model=str(tiny_model_dir), hyperparameters=SFT_HP,
        )  # fmt: skip
        sft_task = sft_cluster.wait_done(client, sft_id)
        assert sft_task.state == "succeeded", sft_task.error
        history = client.get_metric_history(sft_id)
        assert [s for s, _ in history] == [1, 2, 3]
        assert all({"loss", "reward", "loss/train", "train/token_accuracy"} <= set(v) for _, v in history)
        assert "loss/eval_start" in history[0][1] and "loss/eval" in history[-1][1]
        sft_ckpt = Path(sft_task.checkpoint_path)
        assert (sft_ckpt / "adapter_config.json").exists() and sft_task.proto.latest_checkpoint.format == "peft_lora"

        # Refusals at submit, before anything is queued.
        running = client.submit_task(
            workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters={**RL_HP, "steps": 500}
        )
        with pytest.raises(
            FailedPreconditionError,
            match=rf"spec.init_from: task {running} is (PENDING|ASSIGNED|RUNNING); "
            r"a task can only start from one that has ended",
        ):
            client.submit_task(
                workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=RL_HP, init_from=running
            )
        client.cancel(running)
        with pytest.raises(NotFoundError, match="spec.init_from: task 'task-00000000000000000000' not found"):
            client.submit_task(
                workload_type="lora_finetune",
                model=str(tiny_model_dir),
                hyperparameters=RL_HP,
                init_from="task-00000000000000000000",
            )
        with pytest.raises(InvalidArgumentError, match="spec.model: expected"):
            client.submit_task(
                workload_type="lora_finetune", model="/some/other/model", hyperparameters=RL_HP, init_from=sft_id
            )

        # SFT warm start, then RL: the RL task continues the SFT adapter (rank 2, not its own 16).
        rl_id = client.submit_task(
            workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=RL_HP, init_from=sft_id
        )
        rl_task = sft_cluster.wait_done(client, rl_id)
        assert rl_task.state == "succeeded", rl_task.error
        assert rl_task.init_from == sft_id
        rl_config = json.loads((Path(rl_task.checkpoint_path) / "adapter_config.json").read_text())
        assert rl_config["r"] == 2
        loads = [e for e in trainer.log_events() if e.get("event") == "loading model" and e.get("task_id") == rl_id]
        # init_from comes through the artifact store (the node-local cache), with the SFT adapter's bytes
        assert loads and "artifact-cache" in loads[0]["init_checkpoint"]
        init_dir = Path(loads[0]["init_checkpoint"])
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            assert (init_dir / name).read_bytes() == (Path(sft_ckpt) / name).read_bytes()

        # submit_task(dataset=...) uploads first; a full-weight SFT writes a transformers folder.
        full_id = client.submit_task(
            workload_type="sft", model=str(tiny_model_dir), dataset=data,
            hyperparameters={"steps": 1, "batch_size": 4, "lora": False, "learning_rate": 1e-3},
        )  # fmt: skip
        full = sft_cluster.wait_done(client, full_id)
        assert full.state == "succeeded", full.error
        assert full.env_config["dataset_id"] == info.dataset_id
        assert (
            full.proto.latest_checkpoint.format == "hf_full" and (Path(full.checkpoint_path) / "config.json").exists()
        )
        _serve_full_weights(sft_cluster, client, full_id, Path(full.checkpoint_path), trainer, sft_id, capsys)

        # full_rl on a text environment from those weights: GRPO on all of them, a full checkpoint.
        grpo_id = client.submit_task(
            workload_type="full_rl", model=str(tiny_model_dir), init_from=full_id,
            hyperparameters={**RL_HP, "learning_rate": 1e-4},
        )  # fmt: skip
        grpo = sft_cluster.wait_done(client, grpo_id)
        assert grpo.state == "succeeded", grpo.error
        assert {"loss", "reward", "loss/policy"} <= set(client.get_metrics(grpo_id))
        assert (
            grpo.proto.latest_checkpoint.format == "hf_full"
            and (Path(grpo.checkpoint_path) / "model.safetensors").exists()
        )
        loads = [e for e in trainer.log_events() if e.get("event") == "loading model" and e.get("task_id") == grpo_id]
        assert loads and loads[0]["full_weights"] is True and "artifact-cache" in loads[0]["init_checkpoint"]
        init_dir = Path(loads[0]["init_checkpoint"])  # the full weights, through the artifact store
        assert (init_dir / "model.safetensors").read_bytes() == (
            Path(full.checkpoint_path) / "model.safetensors"
        ).read_bytes()

        # Once its artifacts are deleted, a full-weight task has no weights to serve.
        client.delete_artifacts(full_id)
        with pytest.raises(
            FailedPreconditionError, match=rf"task {full_id} has no checkpoint: its artifacts were deleted .*weights"
        ):
            client.serve(full_id)
        # So has the full_rl GRPO task on a text environment: its weights, not a PPO "policy".
        client.delete_artifacts(grpo_id)
        with pytest.raises(
            FailedPreconditionError, match=rf"task {grpo_id} has no checkpoint: .*; there are no weights"
        ):
            client.serve(grpo_id)


def _greedy_reference(folder: Path, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from the checkpoint loaded with transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids, logprobs = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt_ids) :], logprobs


def _serve_full_weights(cluster, client, full_id: str, ckpt: Path, trainer, adapter_task: str, capsys) -> None:
    """A full-weight SFT checkpoint served as the base model: the served greedy tokens and their
    log-probabilities equal those of the checkpoint loaded directly; the server is reused for the
    same checkpoint; a missing step or an adapter task's step is refused."""
    from transformers import AutoTokenizer

    llm = client.serve(full_id, ttl=120)
    try:
        gen = llm.generate("2 + 3 =", temperature=0, max_tokens=6)
        assert gen.model == full_id and gen.adapter is None
        got = gen.samples[0]
        prompt_ids = AutoTokenizer.from_pretrained(str(ckpt))("2 + 3 =")["input_ids"]
        want_ids, want_lp = _greedy_reference(ckpt, prompt_ids, len(got.token_ids))
        assert list(got.token_ids) == want_ids
        assert got.logprobs == pytest.approx(want_lp, abs=1e-4)
        # the weights came through the artifact store (the node-local cache), at the final step
        loads = [
            e for e in trainer.log_events() if e.get("event") == "loading model" and e.get("task_id") == llm.task_id
        ]
        assert loads and loads[0]["checkpoint_task_id"] == full_id and loads[0]["checkpoint_step"] == 1
        assert "artifact-cache" in loads[0]["model"]
        assert (Path(loads[0]["model"]) / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
        again = client.serve(full_id, step=1, ttl=120)  # the same checkpoint: the same server
        assert again.task_id == llm.task_id
        again.close()
        capsys.readouterr()
        assert cli_main(["--scheduler-url", cluster.url, "serve", full_id, "--step", "1"]) == 0
        assert f"model {full_id} (step 1) served by inference task {llm.task_id} at " in capsys.readouterr().out
        with pytest.raises(NotFoundError, match=rf"task {full_id} has no checkpoint at step 7; steps with one: 1"):
            client.serve(full_id, step=7)
        with pytest.raises(FailedPreconditionError, match=rf"task {adapter_task} step 3: .*'peft_lora', not full"):
            client.serve(adapter_task, step=3)
    finally:
        llm.close()
        client.cancel(llm.task_id)
    cluster.wait_state(llm.task_id, 6)  # CANCELLED


def test_dataset_refusals_over_the_wire(sft_cluster: Cluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    sft_cluster.start_with_trainer()
    bad = tmp_path / "bad.jsonl"
    good_line = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    bad.write_text(f'{good_line}\n\n{{"messages": [{{"role": "user", "content": "no reply"}}]}}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with RLClient(scheduler_url=sft_cluster.url, min_poll_interval=0) as client:
        # The client checks the file first, so the error names it: file:line(:column).
        with pytest.raises(InvalidArgumentError, match=f"^INVALID_ARGUMENT: {bad}:3: expected at least one assistant"):
            client.upload_dataset(bad)
        with pytest.raises(InvalidArgumentError, match=f"^INVALID_ARGUMENT: {empty}: expected at least one example"):
            client.upload_dataset(empty)
        broken = tmp_path / "broken.jsonl"
        broken.write_text(good_line + "\n" + good_line[:-1] + "\n")
        with pytest.raises(
            InvalidArgumentError, match=f"^INVALID_ARGUMENT: {broken}:2:{len(good_line)}: expected a JSON"
        ):
            client.upload_dataset(broken)
        # The scheduler checks the bytes it receives just the same (a client that skips the check).
        stub = sft_cluster.stub
        for data, want in (
            # ... and its errors name the file as uploaded, the line and (for JSON syntax) the column.
            (bad.read_bytes(), "dataset x.jsonl:3: expected at least one assistant message"),
            (empty.read_bytes(), "dataset x.jsonl: expected at least one example"),
            (broken.read_bytes(), f"dataset x.jsonl:2:{len(good_line)}: expected a JSON"),
            (b"", "total_bytes: expected the file's size in bytes"),
        ):
            with pytest.raises(grpc.RpcError) as rpc_err:
                stub.UploadDataset(
                    iter([scheduler_pb2.UploadDatasetRequest(name="x.jsonl", total_bytes=len(data), chunk=data)])
                )
            assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and want in rpc_err.value.details()
        assert not [p for p in (sft_cluster.state_dir / "datasets").iterdir()]  # nothing half-written stays

        # Over the limit: refused from the announced size, before any byte is stored.
        with pytest.raises(grpc.RpcError) as rpc_err:
            stub.UploadDataset(
                iter([scheduler_pb2.UploadDatasetRequest(name="huge", total_bytes=300 * 1024 * 1024, chunk=b"{")])
            )
        assert rpc_err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "dataset limit" in rpc_err.value.details()
        with pytest.raises(grpc.RpcError) as rpc_err:
            list(stub.DownloadDataset(scheduler_pb2.DownloadDatasetRequest(dataset_id="sha256:" + "0" * 64)))
        assert rpc_err.value.code() == grpc.StatusCode.NOT_FOUND

        with pytest.raises(NotFoundError, match="spec.env_config.dataset_id: dataset sha256:0+ not found"):
            client.submit_task(
                {"env_id": "chat_jsonl", "dataset_id": "sha256:" + "0" * 64},
                workload_type="sft",
                model=str(tiny_model_dir),
            )

        # A path the trainer reads: a bad line fails the task at once (no retry), naming the line.
        task_id = client.submit_task(
            {"env_id": "chat_jsonl", "path": str(bad)},
            workload_type="sft",
            model=str(tiny_model_dir),
            hyperparameters={"steps": 1},
        )
        with pytest.raises(TaskFailedError) as failed:
            sft_cluster.wait_done(client, task_id)
        assert failed.value.task.attempt == 1
        assert f"dataset {bad}:3: expected at least one assistant message" in failed.value.task.error
    assert sft_cluster.health() == {"status": "ok"}
