"""The step loop every workload shares: step, report, checkpoint, stop when asked."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping

import structlog

from opentinker_trainer.context import STORING_PHASE, StepAbandoned, WorkerContext
from opentinker_trainer.workloads._keep import KeptStep, StepKeeper

log = structlog.get_logger("opentinker.trainer")


def run_steps(
    ctx: WorkerContext,
    *,
    done: int,
    total: int,
    step: Callable[[int], Mapping[str, float]],
    save: Callable[..., object],
    checkpoint_every: int,
    keep: StepKeeper | None = None,
    log_step: Callable[[int, Mapping[str, float]], None] | None = None,
    before_first: Callable[[], None] | None = None,
) -> None:
    """Run steps ``done + 1 .. total`` (steps count from 1; ``done`` were run by an earlier attempt).

    Each step: ``metrics = step(n)``, reported with ``ctx.emit_metric(n, metrics)`` and
    ``log_step(n, metrics)``; then the final checkpoint after the last step (``save(final=True)``),
    or a checkpoint and return when a stop was requested (drain, preemption, timeout), or a
    periodic one every ``checkpoint_every`` steps (0 = none). Nothing left to run writes the final
    checkpoint at once; a stop requested before the first step writes nothing.
    ``before_first()`` runs once before the first step of this attempt. An attempt that resumed
    (``done`` > 0: its checkpoint's step) says so first, as the phase ``resumed`` ``from step N``,
    which ``opentinker logs`` and ``watch`` print.
    With ``keep`` (:func:`~opentinker_trainer.workloads._keep.keeper`) a stop abandons the step in
    progress (:meth:`WorkerContext.stop_now`): the copy ``keep`` took after the last completed step
    is put back and checkpointed at once, unless that step is the newest checkpoint already.
    The ranks of a distributed task abandon the same step (:mod:`opentinker_trainer.distributed`):
    a step counts as completed once every rank agreed after taking its copy.
    Each step and each checkpoint runs inside ``ctx.turn()`` (a model host's tenants take turns
    on the shared base model; a worker process's context has nothing to wait for).
    """
    # A distributed rank agrees on stopping with the other ranks (a collective at the same points
    # on every rank), so all of them checkpoint after the same step.
    stop = getattr(ctx, "stop_together", ctx.should_stop)
    # A tenant of a model host steps in turns with its neighbours (WorkerContext.turn).
    turn = getattr(ctx, "turn", contextlib.nullcontext)
    dp = getattr(ctx, "dist", None)  # a rank's collectives (distributed.DataParallel)
    if done >= total:
        log.info("nothing left to train", task_id=ctx.task_id, step=done, steps=total)
        with turn():
            save(final=True)
        return
    if stop():
        log.info("stop requested before the first step", task_id=ctx.task_id, step=done)
        return
    if done > 0:
        ctx.emit_phase("resumed", f"from step {done}")
    if before_first is not None:
        before_first()
    kept: KeptStep | None = None  # the last step this attempt completed, with keep
    saved = done  # the step of the newest checkpoint
    for n in range(done + 1, total + 1):
        try:
            with turn(), ctx.abandonable() if keep is not None else contextlib.nullcontext():
                metrics = step(n)
                ctx.steps_done = n  # still in the turn: the adapter in the model is step n's
                taken = keep.take(n) if keep is not None else None
                if dp is not None:  # step n is completed on every rank or on none
                    dp.agree_to_abandon()
        except StepAbandoned as exc:
            if dp is not None and not exc.together:
                dp.abandon_with_others()
            with turn():
                _store_kept(ctx, keep, kept, saved, save, abandoned=n)
            return
        kept = taken
        ctx.emit_metric(n, metrics)
        if log_step is not None:
            log_step(n, metrics)
        if n >= total:
            with turn():
                save(final=True)
        elif stop():
            log.info("stop requested: checkpointing", task_id=ctx.task_id, step=n)
            ctx.emit_phase(STORING_PHASE, f"step {n}")
            with turn():
                save(final=False)
            return
        elif checkpoint_every and n % checkpoint_every == 0:
            with turn():
                save(final=False)
            saved = n


def _store_kept(
    ctx: WorkerContext,
    keep: StepKeeper | None,
    kept: KeptStep | None,
    saved: int,
    save: Callable[..., object],
    *,
    abandoned: int,
) -> None:
    """Checkpoint the last completed step ``kept`` after a stop abandoned step ``abandoned``;
    nothing when no step completed in this attempt or ``saved``, the newest checkpoint, is it."""
    if keep is None or kept is None or kept.step <= saved:
        log.info("stop requested: step abandoned, its previous step is stored", task_id=ctx.task_id, step=abandoned)
        return
    log.info("stop requested: step abandoned, checkpointing the step before", task_id=ctx.task_id, step=kept.step)
    ctx.emit_phase(STORING_PHASE, f"step {kept.step}")
    keep.put_back(kept)
    ctx.steps_done = kept.step
    save(final=False)


def run_trainer(
    trainer: Any,
    log: Any,
    *,
    total: int,
    checkpoint_every: int,
    fields: Callable[[Mapping[str, float]], Mapping[str, Any]],
    counter: str = "step",
    event: str = "step",
    keep: StepKeeper | None = None,
) -> None:
    """:func:`run_steps` over a trainer object: steps ``trainer.<counter> + 1 .. total``.

    Before step ``n`` the trainer's ``counter`` attribute (``step``, or ``update`` for PPO) is set
    to ``n``; the step is ``trainer.train_step()``, the checkpoint ``trainer.save(final=...)``.
    Each step is logged as ``log.info(event, task_id=..., step=n, **fields(metrics))``.
    ``keep``: as in :func:`run_steps`; the trainer's ``counter`` must be part of its own state.
    """

    def one(n: int) -> Mapping[str, float]:
        setattr(trainer, counter, n)
        return trainer.train_step()

    def log_step(n: int, metrics: Mapping[str, float]) -> None:
        log.info(event, task_id=trainer.ctx.task_id, step=n, **fields(metrics))

    run_steps(
        trainer.ctx,
        done=getattr(trainer, counter),
        total=total,
        step=one,
        save=trainer.save,
        checkpoint_every=checkpoint_every,
        keep=keep,
        log_step=log_step,
    )
