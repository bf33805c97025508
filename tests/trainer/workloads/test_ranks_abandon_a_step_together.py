"""Two gloo ranks running the step loop with a kept step: one rank is stopped in the middle of
step 3, between two collectives, while the other goes on into the next collective. Both abandon
step 3 and store step 2, the same parameters on both ranks, and nothing waits for ever."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from tests.support.distributed import run_ranks


def _stop_in_step_three(dp, stopped_rank: int) -> list[tuple[int, list[float], bool]]:
    """Rank ``stopped_rank`` is stopped after step 3's optimizer step (a SIGTERM between two
    collectives); returns this rank's checkpoints as ``(step, parameters, final)``."""
    from opentinker_trainer import distributed
    from opentinker_trainer.context import WorkerContext
    from opentinker_trainer.workloads._keep import keeper
    from opentinker_trainer.workloads._loop import run_steps

    ctx = distributed.rank_context(WorkerContext("t", 1, None, "cpu", Path("unused")), dp, out=io.StringIO())
    w = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([w], lr=1.0)
    saved: list[tuple[int, list[float], bool]] = []

    def step(n: int) -> dict[str, float]:
        optimizer.zero_grad()
        w.sum().backward()
        dp.all_reduce_grads([w])  # both ranks: a gradient of 2 per element
        optimizer.step()
        if n == 3 and dp.rank == stopped_rank:
            ctx.stop_now()  # what the SIGTERM handler calls; raises here, on this rank alone
        (loss,) = dp.sum(float(w.sum()))  # the other rank is here when its neighbour stops
        return {"loss": loss}

    def save(*, final: bool) -> None:
        saved.append((ctx.steps_done, w.detach().tolist(), final))

    run_steps(
        ctx,
        done=0,
        total=10,
        step=step,
        save=save,
        checkpoint_every=0,
        keep=keeper(ctx, optimizer),
    )
    return saved


def _each_rank_stopped_in_turn(dp) -> list[list[tuple[int, list[float], bool]]]:
    return [_stop_in_step_three(dp, stopped_rank) for stopped_rank in (0, 1)]


def test_a_rank_stopped_between_collectives_and_the_rank_waiting_store_the_same_step(tmp_path: Path) -> None:
    both = run_ranks(_each_rank_stopped_in_turn, 2, tmp_path)
    # Step 3 is abandoned on both ranks; step 2's parameters (two steps of -2) are stored once,
    # whichever rank was stopped.
    assert both == [[[(2, [-4.0, -4.0, -4.0], False)]] * 2] * 2
