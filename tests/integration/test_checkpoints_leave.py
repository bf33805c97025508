"""Results leave the cluster, through real scheduler and trainer processes and the `opentinker`
command: a cancelled task keeps the checkpoint its worker writes on the way out (downloadable,
mergeable, evaluated through a server, an init_from, each saying which step); an adapter made
elsewhere is uploaded and trained on; a PPO task's policy is evaluated here (mean return ±
standard error) and exported as TorchScript."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opentinker.common.v1 import common_pb2
from opentinker_client import Environment, RLClient
from opentinker_client.models import evaluate_policy, load_policy

from tests.support.procs import Cluster

# Many steps and no periodic checkpoint: any checkpoint the task ends with was written on cancel.
LONG_HP = {"steps": 500, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4}
# 2 envs x 128 steps per update, 2 updates.
PPO_HP = {"total_timesteps": 512, "num_envs": 2, "num_steps": 128, "checkpoint_every": 1, "hidden_sizes": [16]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("leave"))
    c.start_scheduler()
    c.start_trainer("node-a", "--kill-grace", "120")  # a loaded machine still checkpoints within it
    c.wait_nodes(1)
    yield c
    c.close()


def cli(cluster: Cluster, *args: str, rc: int = 0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
    env["COLUMNS"] = "200"
    cmd = [sys.executable, "-m", "opentinker_client", "--scheduler-url", cluster.url, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == rc, (proc.stdout, proc.stderr)
    return proc


def test_an_adapter_made_elsewhere_is_uploaded_and_trained_on(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.save_pretrained(tmp_path / "mine")
    out = cli(cluster, "upload-adapter", str(tmp_path / "mine"), "--name", "from my laptop")
    imported = out.stdout.strip()
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task = client.get_task(imported)
        assert (task.state, task.workload_type, task.model, task.name) == (
            "succeeded",
            "lora_finetune",
            str(tiny_model_dir),  # the adapter's base_model_name_or_path
            "from my laptop",
        )
        assert task.checkpoint_note == "final checkpoint, step 0"
        # The cluster trains on from it (init_from: its rank kept, through the artifact store).
        next_id = client.submit_task(
            workload_type="lora_finetune",
            model=str(tiny_model_dir),
            init_from=imported,
            hyperparameters={"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        )
        cluster.wait_done(client, next_id)
        # A LoRA task's usage counts the tokens it trained on (GRPO's train/tokens), not 0.
        assert client.get_task(next_id).usage["tokens_trained"] > 0
        client.download_checkpoint(next_id, tmp_path / "trained")
    assert json.loads((tmp_path / "trained" / "adapter_config.json").read_text())["r"] == 2

    # A folder whose keys PEFT would not load is refused at upload, naming the file.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((tmp_path / "mine" / "adapter_config.json").read_text())
    weights = load_file(tmp_path / "mine" / "adapter_model.safetensors")
    save_file({k.removeprefix("base_model.model."): v for k, v in weights.items()}, bad / "adapter_model.safetensors")
    err = cli(cluster, "upload-adapter", str(bad), rc=2).stderr
    assert "INVALID_ARGUMENT" in err and "adapter_model.safetensors: expected keys named as PEFT saves them" in err


def test_cancelled_task_keeps_its_last_checkpoint(cluster: Cluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = client.submit_task(workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=LONG_HP)
        cluster.wait_state(
            task_id, common_pb2.TASK_STATE_RUNNING, what=lambda t: client.get_metrics(task_id).get("step", 0) >= 1
        )
        assert not cluster.get(task_id).HasField("latest_checkpoint")
        client.cancel(task_id, reason="enough")
        task = cluster.wait_state(
            task_id, common_pb2.TASK_STATE_CANCELLED, what=lambda t: t.HasField("latest_checkpoint")
        )
        step = task.latest_checkpoint.step
        assert step >= 1 and not task.latest_checkpoint.final and task.latest_checkpoint.format == "peft_lora"
        assert task.latest_checkpoint.artifact.key  # in the artifact store, readable from anywhere
        note = f"last complete checkpoint, step {step} (the task ended CANCELLED)"
        assert client.get_task(task_id).checkpoint_note == note

        out = cli(cluster, "download", task_id, "-o", str(tmp_path / "ck")).stdout
        assert f"downloaded task {task_id}'s {note} to {tmp_path / 'ck'}" in out
        config = json.loads((tmp_path / "ck" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(tiny_model_dir)  # spec.model, as submitted
        state = torch.load(tmp_path / "ck" / "trainer_state.pt", weights_only=False)
        assert state["step"] == step

        out = cli(cluster, "export", task_id, "--merged", str(tmp_path / "merged"), "--dtype", "float32").stdout
        assert f"from task {task_id}'s {note}" in out
        assert (tmp_path / "merged" / "config.json").exists() and not (
            tmp_path / "merged" / "adapter_config.json"
        ).exists()

        # eval serves it (an inference task on the cluster) and says which checkpoint it is: mean
        # reward ± standard error before and after, and what ± means, for an LM task too.
        out = cli(cluster, "eval", task_id, "--episodes", "2", "--max-tokens", "4").stdout
        assert f"adapter {task_id}: {note}" in out, out
        assert re.search(rf"adapter {task_id}: mean reward [\d.]+ ± [\d.]+ over 2 episodes of arithmetic", out), out
        assert "± is one standard error of the mean over the episodes" in out
        for served in client.list_tasks(states=["pending", "assigned", "running"]):
            if served.workload_type == "inference":
                client.cancel(served.task_id)

        # init_from takes it (the scheduler accepts it at submit), and says which checkpoint it starts from.
        yaml = tmp_path / "next.yaml"
        yaml.write_text(
            f"workload_type: lora_finetune\nmodel: {tiny_model_dir}\ninit_from: {task_id}\n"
            "hyperparameters: {steps: 1, prompts_per_step: 2, group_size: 2, max_new_tokens: 4}\n"
        )
        proc = cli(cluster, "submit", str(yaml))
        next_id = proc.stdout.strip()
        assert f"starting from task {task_id}'s {note}" in proc.stderr
        assert client.get_task(next_id).init_from == task_id
        client.cancel(next_id)  # running from init_from checkpoints: tests/integration/test_sft.py


def test_ppo_policy_is_evaluated_and_exported(cluster: Cluster, tmp_path: Path) -> None:
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = client.submit_task(
            env_config=Environment(env_id="CartPole-v1"), workload_type="full_rl", model="mlp", hyperparameters=PPO_HP
        )
        task = cluster.wait_done(client, task_id)
        assert task.checkpoint_note == "final checkpoint, step 2"
        # Served for Act by a policies-only inference task (no language model loaded).
        obs = [[0.01 * i, -0.02, 0.03 * i, 0.0] for i in range(6)]
        with client.serve(task_id, ttl=600) as served:
            acted = served.act(obs)
            server_task = served.task_id
        assert client.get_task(server_task).hyperparameters["policies_only"] is True
        client.cancel(server_task)
    assert (acted.policy, acted.step) == (task_id, 2) and len(acted.values) == 6

    out = cli(cluster, "eval", task_id, "--episodes", "4", "--seed", "3").stdout
    m = re.search(r"mean return ([\d.]+) ± ([\d.]+) over 4 episodes of CartPole-v1", out)
    assert m, out
    assert f"policy of task {task_id} (final checkpoint, step 2)" in out
    assert "± is one standard error of the mean over the episodes" in out

    out = cli(cluster, "export", task_id, "--torchscript", str(tmp_path / "policy.pt")).stdout
    assert f"wrote {tmp_path / 'policy.pt'}" in out
    # The exported file alone (torch.jit.load) plays the same episodes as the CLI's evaluation.
    (tmp_path / "alone").mkdir()
    (tmp_path / "policy.pt").rename(tmp_path / "alone" / "policy.torchscript.pt")
    alone = load_policy(tmp_path / "alone")
    r = evaluate_policy(alone, "CartPole-v1", episodes=4, seed=3)
    assert (f"{r.mean_return:.3f}", f"{r.stderr:.3f}") == m.groups()
    with torch.no_grad():
        actions, values = alone(torch.tensor(obs))
    assert acted.actions == actions.tolist()  # the served policy is the exported one
    assert torch.allclose(torch.tensor(acted.values, dtype=torch.float32), values, atol=1e-5)

    out = cli(cluster, "download", task_id, "--step", "1", "-o", str(tmp_path / "s1")).stdout
    assert f"task {task_id}'s checkpoint at step 1" in out
    assert {"policy.pt", "policy.json", "policy.torchscript.pt", "trainer_state.pt"} <= {
        p.name for p in (tmp_path / "s1").iterdir()
    }
    assert json.loads((tmp_path / "s1" / "policy.json").read_text())["step"] == 1
