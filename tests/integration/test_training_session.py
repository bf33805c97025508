"""A training session through real scheduler and trainer processes on loopback: the client-side
SFT and GRPO examples run on a tiny model, the loss falls, a saved state becomes a checkpoint of
the task in the artifact store and survives the loss of the node (kill -9):
resume_training_session continues from it on another node; while it runs, its sampler saves are
served by an inference task (the greedy tokens those of the session's own Sample at the same
weights; a later save is a newer version, served when asked for); the sampler weights it saves
last are served once the session has ended, and a new task starts from them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2
from opentinker_client import RLClient
from opentinker_client.cli.commands import main as cli_main
from opentinker_client.errors import FailedPreconditionError, NotFoundError
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """heartbeat_interval: 0.5
lease: 3
workload_types:
  - type: lora_session
    priority: 3
  - type: inference
    priority: 3
  - type: lora_finetune
    priority: 1
"""


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cluster(tmp_path):
    from tests.support.procs import Cluster

    cluster = Cluster(tmp_path, CONFIG)
    try:
        yield cluster
    finally:
        cluster.close()


def test_own_loops_train_a_session_that_resumes_after_its_node_is_lost(cluster, tiny_model_dir: Path, capsys) -> None:
    from transformers import AutoTokenizer

    cluster.start_scheduler()
    first = cluster.start_trainer("node-a")
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        session = client.create_training_session(str(tiny_model_dir), lora_rank=4, max_attempts=3, timeout=300)
        task = client.get_task(session.task_id)
        assert task.workload_type == "lora_session" and task.state == "running" and task.endpoint == session.endpoint

        # SFT client-side: the same kind of batch, step after step; the loss falls.
        sft = example("own_loop_sft")
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        losses = sft.train(
            session,
            tokenizer,
            steps=4,
            batch_size=4,
            learning_rate=2e-2,
            log=lambda _: None,
        )
        assert losses[-1] < losses[0]
        # GRPO client-side: sample, score, importance_sampling, optim_step.
        rewards = example("own_loop_rl").train(
            session, steps=2, problems_per_step=2, group_size=4, max_tokens=4, log=lambda _: None
        )
        assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
        saved = session.save_state("after-sft").result(timeout=120)
        assert saved.step == session.get_info().step >= 4 and saved.artifact_key
        # The state is a checkpoint of the task in the artifact store (what a resumed attempt loads).
        # (recorded once the node's report arrives, just after the save returns)
        wait_for(
            lambda: [c.step for c in client.list_checkpoints(session.task_id)][-1:] == [saved.step],
            what="the saved state recorded as the task's newest checkpoint",
        )
        info = session.get_info()
        session.close()

        # The node dies; the task is requeued and resumes from the saved state on another node.
        first.kill9()
        cluster.wait_state(session.task_id, common_pb2.TASK_STATE_PENDING)
        cluster.start_trainer("node-b")
        resumed = client.resume_training_session(session.task_id, timeout=300)
        again = resumed.get_info()
        assert (again.attempt, again.step, again.resumed_from) == (2, saved.step, "after-sft")
        assert again.next_sequence == saved.sequence + 1 == info.next_sequence
        more = sft.train(resumed, tokenizer, steps=1, batch_size=4, log=lambda _: None)  # step 1's batch again
        assert more[0] < losses[0] and resumed.get_info().step == saved.step + 1
        # A running session serves its sampler saves only: a SaveState ("after-sft") is not one.
        with pytest.raises(FailedPreconditionError, match="no sampler save yet; call SaveWeightsForSampler"):
            client.serve(session.task_id, timeout=60)
        sampler = resumed.save_weights_for_sampler("for-serving").result(timeout=120)
        assert sampler.step == saved.step + 1 and sampler.artifact_key
        assert sampler.adapter == f"{session.task_id}@{sampler.step}"
        # The scheduler records it as the task's newest checkpoint once the node's report arrives.
        newest = wait_for(
            lambda: [c for c in client.list_checkpoints(session.task_id)[-1:] if c.step == sampler.step],
            what="the sampler weights recorded as the newest checkpoint",
        )[0]
        assert (Path(newest.path).name, newest.format) == ("sampler_for-serving", "peft_lora")

        # Served while the session runs: its newest sampler save, greedy tokens equal to the
        # session's own Sample at those weights (a near-zero temperature is greedy there).
        prompt = "What is 2 + 3?"
        prompt_tokens = tokenizer(prompt)["input_ids"]

        def greedy_pair(llm) -> tuple[list[int], list[int]]:
            served = list(llm.generate(prompt, max_tokens=6, temperature=0).samples[0].token_ids)
            own = resumed.sample(prompt_tokens, max_tokens=6, temperature=1e-6, seed=0).result(timeout=120)
            own_tokens = own.samples[0].tokens
            k = min(len(served), len(own_tokens))  # either may stop at an end-of-sequence token
            assert k >= 1
            return served[:k], own_tokens[:k]

        llm = client.serve(session.task_id, timeout=300)
        assert llm.adapter == sampler.adapter
        served, own = greedy_pair(llm)
        assert served == own
        # Another optimizer step and save: a newer version, served when asked for by its step
        # (on the same inference task, next to the version loaded first).
        sft.train(resumed, tokenizer, steps=1, batch_size=4, log=lambda _: None)
        newer = resumed.save_weights_for_sampler("newer").result(timeout=120)
        assert newer.step == sampler.step + 1 and newer.adapter == f"{session.task_id}@{newer.step}"
        llm2 = client.serve(session.task_id, step=newer.step, timeout=300)
        assert (llm2.task_id, llm2.adapter) == (llm.task_id, newer.adapter)
        served, own = greedy_pair(llm2)
        assert served == own
        assert {a.name for a in llm2.list_adapters()} == {sampler.adapter, newer.adapter}
        steps = f"{sampler.step}, {newer.step}"  # the sampler saves, not the SaveState
        with pytest.raises(NotFoundError, match=rf"no sampler save at step 99; steps with one: {steps}"):
            client.serve(session.task_id, step=99, timeout=1)  # (waited for a second: none comes)
        capsys.readouterr()
        assert cli_main(["--scheduler-url", cluster.url, "serve", session.task_id]) == 0  # the newest: `newer`
        assert (
            f"adapter {newer.adapter} (the running session's sampler save at step {newer.step}) "
            f"served by inference task {llm.task_id} at "
        ) in capsys.readouterr().out
        answer = llm.generate(prompt, max_tokens=2, temperature=0)  # the old client keeps its version
        assert answer.adapter == sampler.adapter
        llm2.close()
        resumed.close()
        client.cancel(session.task_id)
        cluster.wait_state(session.task_id, common_pb2.TASK_STATE_CANCELLED)
        assert client.get_task(session.task_id).node_id == "node-b"
        # A new task starts from the ended session's newest save (init_from): it continues its
        # rank-4 adapter (checked below, after serving).
        rl_id = client.submit_task(
            workload_type="lora_finetune",
            model=str(tiny_model_dir),
            hyperparameters={"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
            init_from=session.task_id,
        )

        # The ended session's sampler weights (its newest checkpoint) served by an inference task.
        llm.close()
        llm = client.serve(session.task_id, timeout=300)  # the same inference task, its plain name now
        answer = llm.generate(messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=4, temperature=0)
        assert answer.adapter == session.task_id and answer.completion_tokens >= 1
        adapters = {a.name: a for a in llm.list_adapters()}
        assert set(adapters) == {session.task_id, sampler.adapter, newer.adapter}
        assert adapters[session.task_id].size_bytes > 0
        llm.close()
        client.cancel(llm.task_id)

        rl_task = cluster.wait_done(client, rl_id)  # submitted above, run meanwhile
        assert rl_task.state == "succeeded", rl_task.error
        assert json.loads((Path(rl_task.checkpoint_path) / "adapter_config.json").read_text())["r"] == 4
