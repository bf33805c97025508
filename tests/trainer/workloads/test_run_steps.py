"""workloads._loop.run_steps, the step loop every trainer runs: an attempt that resumed says from
which step before its first one (the ``resumed`` phase `opentinker logs` prints); a fresh one
says nothing of the kind."""

from __future__ import annotations

import json

from opentinker_trainer.workloads._loop import run_steps

from tests.support.workers import worker_ctx


def _run(tmp_path, name: str, done: int) -> list[dict]:
    ctx = worker_ctx(
        tmp_path,
        name,
        workload_type="full_rl",
        model="mlp",
        env_config={"env_id": "CartPole-v1"},
        hyperparameters={},
    )
    run_steps(ctx, done=done, total=5, step=lambda n: {"loss": float(n)}, save=lambda final: None, checkpoint_every=0)
    return [json.loads(line) for line in ctx.out.getvalue().splitlines() if line.strip()]


def test_a_resumed_attempt_says_from_which_step_before_its_first(tmp_path) -> None:
    out = _run(tmp_path, "resumed", done=3)
    assert [(r["type"], r.get("phase") or r.get("step")) for r in out] == [
        ("phase", "resumed"),
        ("metric", 4),
        ("metric", 5),
    ]
    assert out[0]["detail"] == "from step 3"
    fresh = _run(tmp_path, "fresh", done=0)
    assert [r["type"] for r in fresh] == ["metric"] * 5
