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


def test_a_stop_abandons_the_step_in_progress_and_stores_the_step_before(tmp_path) -> None:
    """SIGTERM in the middle of step 3 (after its update began): the kept copy of step 2 is put
    back and saved at once; step 3 is neither reported nor in the saved weights."""
    import os
    import signal

    import torch

    from opentinker_trainer.workloads._keep import keeper

    ctx = worker_ctx(
        tmp_path,
        "abandon",
        workload_type="full_rl",
        model="mlp",
        env_config={"env_id": "CartPole-v1"},
        hyperparameters={},
    )
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    trainer = {"step": 0}
    saved: list[tuple[int, list[float]]] = []

    def step(n: int) -> dict[str, float]:
        trainer["step"] = n
        weight.grad = -torch.ones(4)
        optimizer.step()  # weight = n after step n
        if n == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**8):  # the handler raises in here, at the next bytecode
                weight.data += 100
        return {"loss": float(n)}

    previous = signal.signal(signal.SIGTERM, lambda *_: ctx.stop_now())
    try:
        run_steps(
            ctx,
            done=0,
            total=10,
            step=step,
            save=lambda final: saved.append((trainer["step"], weight.tolist())),
            checkpoint_every=0,
            keep=keeper(ctx, optimizer, state=lambda: trainer["step"], restore=lambda s: trainer.update(step=s)),
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert saved == [(2, [2.0] * 4)]
    out = [json.loads(line) for line in ctx.out.getvalue().splitlines() if line.strip()]
    assert [r["step"] for r in out if r["type"] == "metric"] == [1, 2]


def test_a_stop_during_a_periodic_checkpoint_stores_nothing_twice(tmp_path) -> None:
    import torch

    from opentinker_trainer.workloads._keep import keeper

    ctx = worker_ctx(
        tmp_path,
        "periodic",
        workload_type="full_rl",
        model="mlp",
        env_config={"env_id": "CartPole-v1"},
        hyperparameters={},
    )
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    saved: list[int] = []

    def save(final: bool) -> None:
        saved.append(len(saved) + 2)
        ctx.stop_now()  # outside a step: only asks to stop

    run_steps(
        ctx,
        done=0,
        total=10,
        step=lambda n: {"loss": float(n)},
        save=save,
        checkpoint_every=2,
        keep=keeper(ctx, optimizer),
    )
    assert saved == [2]  # the step-2 checkpoint, not a second copy of it when step 3 was abandoned
