"""A copy of a trainer's state after each completed step, so that a stop abandons the step in
progress and stores the last completed one at once.

The copy holds what a checkpoint holds: the trainable parameters, the optimizer states, the
global RNG states and the trainer's own state (its step counter, its environment's state). It
stays on the parameters' device. For a LoRA adapter that is a few MB to a few hundred MB, copied
at each step's end; a PPO policy is smaller still. Full weights of a language model are too big
to copy every step: no keeper, and a stop lets their step finish before the checkpoint.

The ranks of a distributed task keep their copies too and abandon the same step: their
collectives inside a step agree first whether any rank was stopped
(:meth:`opentinker_trainer.distributed.DataParallel.agree_to_abandon`), so every rank stores the
same last completed step. A model host's tenant, whose stop comes from another thread and no
signal, abandons its step at the step's next abandon point
(:func:`opentinker_trainer.context.abandon_point`): before and after its rollout, while it waits
for a client's reward or environment, and before each micro-batch of its update. A rollout
batched with its neighbours' runs to its end.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from opentinker_trainer.workloads import _rng

#: Trainable state (parameters and two AdamW moments each) above this many bytes is not copied.
KEEP_MAX_BYTES = 2**30


@dataclass(frozen=True)
class KeptStep:
    """The state after ``step``: parameters, optimizer states, RNG states, the trainer's own."""

    step: int
    params: list[torch.Tensor]
    optimizers: list[dict[str, Any]]
    rng: dict[str, Any]
    own: Any


class StepKeeper:
    """Takes a :class:`KeptStep` after each step and puts one back before the exit checkpoint.

    Args:
        optimizers: the trainer's optimizers (one, or one per learner); their parameter groups
            name the trainable parameters.
        state: the trainer's own state to keep (e.g. its step counter, its environment's state).
        restore: puts ``state()``'s value back.
    """

    def __init__(
        self, optimizers: list[torch.optim.Optimizer], state: Callable[[], Any], restore: Callable[[Any], None]
    ):
        self.optimizers = optimizers
        self.params = _params(optimizers)
        self.state = state
        self.restore = restore

    def take(self, step: int) -> KeptStep:
        """A copy of the state after ``step``, sharing nothing with the live trainer."""
        with torch.no_grad():
            params = [p.detach().clone() for p in self.params]
        return KeptStep(
            step=step,
            params=params,
            optimizers=[copy.deepcopy(o.state_dict()) for o in self.optimizers],
            rng=_rng.rng_state(),
            own=copy.deepcopy(self.state()),
        )

    def put_back(self, kept: KeptStep) -> None:
        """Make the live trainer what it was when ``kept`` was taken."""
        with torch.no_grad():
            for p, saved in zip(self.params, kept.params, strict=True):
                p.copy_(saved)
        for o, saved_state in zip(self.optimizers, kept.optimizers, strict=True):
            o.load_state_dict(saved_state)
        _rng.restore_rng_state(kept.rng)
        self.restore(kept.own)


def keeper(
    ctx: Any,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    state: Callable[[], Any] = lambda: None,
    restore: Callable[[Any], None] = lambda _: None,
) -> StepKeeper | None:
    """A :class:`StepKeeper` for a trainer of ``ctx`` with ``optimizer`` (one, or several), or
    None where a step is not abandoned: parameters sharded across ranks (FSDP: its forward and
    backward passes are collectives no rank can leave alone) and trainable state over
    :data:`KEEP_MAX_BYTES` (full weights)."""
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    params = _params(optimizers)
    if any(isinstance(p, DTensor) for p in params):
        return None
    if 3 * sum(p.numel() * p.element_size() for p in params) > KEEP_MAX_BYTES:
        return None
    return StepKeeper(optimizers, state, restore)


def _params(optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    return [p for o in optimizers for group in o.param_groups for p in group["params"]]
