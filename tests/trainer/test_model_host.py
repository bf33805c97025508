"""A model host's tenants in this process (threads on one tiny base model): a task's reward curve
and final adapter are those of the same task run alone by the ordinary worker path, whoever its
neighbours are; a neighbour that fails ends alone, and a stopped one checkpoints and frees its
adapter; turns go round-robin."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2
from opentinker_common.arithmetic import ArithmeticEnv
from opentinker_trainer.host import ModelHost, RoundRobin, adapter_name, shareable
from opentinker_trainer.workloads import grpo_text

from tests.support.workers import reports, worker_ctx

HP = {"steps": 4, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4, "seed": 11}


@pytest.fixture
def reply_rewards(monkeypatch):
    """Reward = parity of the reply's characters: mixed within groups, so the adapters move, and a
    function of the sampled text alone, so a tenant sampling anything but what it would sample
    alone shows in its curve."""
    monkeypatch.setattr(ArithmeticEnv, "score", lambda self, reply, problem: float(sum(map(ord, reply)) % 2))


def _assign(task_id: str, model: Path, hp: dict, *, attempt: int = 1) -> node_pb2.AssignTask:
    spec = common_pb2.TaskSpec(workload_type="lora_finetune", model=str(model))
    spec.env_config.update({"env_id": "arithmetic"})
    spec.hyperparameters.update(hp)
    return node_pb2.AssignTask(task_id=task_id, attempt=attempt, spec=spec)


def _lines(out: io.StringIO, task_id: str, kind: str) -> list[dict]:
    return [
        m
        for m in (json.loads(x) for x in out.getvalue().splitlines() if x.strip())
        if m.get("task_id") == task_id and m["type"] == kind
    ]


def _curve(metrics: list[dict]) -> list[tuple]:
    keys = ("reward", "loss", "completion/mean_tokens")
    return [(m["step"], *(m["values"][k] for k in keys)) for m in metrics]


def test_a_tenant_trains_as_it_would_alone(tiny_model_dir: Path, tmp_path: Path, reply_rewards) -> None:
    alone = worker_ctx(
        tmp_path,
        "alone",
        workload_type="lora_finetune",
        model=tiny_model_dir,
        env_config={"env_id": "arithmetic"},
        hyperparameters={**HP, "checkpoint_every": 0},
        task_id="x",
    )
    grpo_text.run(alone)
    expected = _curve(reports(alone, "metric"))
    assert len({r for _, r, _, _ in expected}) > 1 or any(loss != 0 for _, _, loss, _ in expected)

    out = io.StringIO()
    host = ModelHost(str(tiny_model_dir), "cpu", "auto", out)
    neighbours = {
        "n-rank8": {**HP, "seed": 3, "lora_rank": 8, "steps": 5},
        "x": {**HP, "checkpoint_every": 0},
        "n-bad": {**HP, "target_modules": ["no_such_proj"]},  # a user error: ends this tenant only
        "n-stop": {**HP, "seed": 4, "steps": 400, "checkpoint_every": 0},
    }
    for tid, hp in neighbours.items():
        path = tmp_path / f"{tid}.pb"
        path.write_bytes(_assign(tid, tiny_model_dir, hp).SerializeToString())
        host.add(path, tmp_path / "host" / tid)
    # Stop the long one once the others are done with their steps: it checkpoints and leaves.
    threading.Thread(target=lambda: (host.threads[("x", 1)].join(), host.stop("n-stop", 1)), daemon=True).start()
    host.join()

    got = _curve(_lines(out, "x", "metric"))
    assert [c[0] for c in got] == [c[0] for c in expected] == [1, 2, 3, 4]
    assert [v for c in got for v in c[1:]] == pytest.approx([v for c in expected for v in c[1:]], abs=1e-6)
    ours = load_file(tmp_path / "host" / "x" / "step_4" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "alone" / "step_4" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)  # the PEFT keys of an adapter alone: no tenant name in them
    assert all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in ours)
    assert (tmp_path / "host/x/step_4/adapter_config.json").read_text() == (
        tmp_path / "alone/step_4/adapter_config.json"
    ).read_text()

    (bad,) = _lines(out, "n-bad", "failed")
    assert not bad["retryable"] and "no_such_proj" in bad["error"]
    assert _lines(out, "n-rank8", "succeeded") and len(_lines(out, "n-rank8", "metric")) == 5
    assert _lines(out, "n-stop", "stopped") and _lines(out, "n-stop", "checkpoint")[-1]["final"] is False
    # Every tenant released its adapter and its turn; the model holds no adapter now.
    released = {m["task_id"] for m in (json.loads(x) for x in out.getvalue().splitlines()) if m["type"] == "released"}
    assert released == set(neighbours) and not host.tenants
    assert list(host.model.peft_config) == []


def test_round_robin_gives_turns_in_the_order_asked() -> None:
    turns = RoundRobin()
    order: list[str] = []
    gate = threading.Event()

    def tenant(name: str, steps: int) -> None:
        for _ in range(steps):
            with turns.turn(name):
                gate.wait()
                order.append(name)

    threads = [threading.Thread(target=tenant, args=(n, 3)) for n in "abc"]
    for t in threads:
        t.start()
        while len(turns._queue) + (turns._holder is not None) < threads.index(t) + 1:
            time.sleep(0.001)  # each asks in turn: a first, then b, then c
    gate.set()
    for t in threads:
        t.join()
    assert order == list("abc" * 3)
    assert turns.turns == 9


def test_shareable_is_lora_grpo_on_text_with_one_rank(tiny_model_dir: Path) -> None:
    one = _assign("t", tiny_model_dir, HP)
    assert shareable(one) == (str(tiny_model_dir), (), "auto")
    one.device_indices.extend([0])
    assert shareable(one) == (str(tiny_model_dir), (0,), "auto")
    two = _assign("t", tiny_model_dir, HP)
    two.device_indices.extend([0, 1])
    assert shareable(two) is None  # two ranks
    full = _assign("t", tiny_model_dir, HP)
    full.spec.workload_type = "full_rl"
    assert shareable(full) is None
    init_full = _assign("t", tiny_model_dir, HP)
    init_full.init_checkpoint.format = "hf_full"
    assert shareable(init_full) is None
    assert adapter_name("task.1", 2) == "ttask_1-a2"
