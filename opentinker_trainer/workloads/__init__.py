"""The trainers, one module per thing trained, and the table that picks one for a task.

:data:`TRAINERS` maps ``(workload_type, env kind)`` — the same keys as the spec registry
(:func:`opentinker_common.spec.registry.workload_env_kinds`), checked equal by a test — to the
function that runs one attempt. Modules are imported only when their trainer is chosen, so a
serving task never imports the PPO code and this table imports no torch.

A new workload: register its hyper-parameter class in :mod:`opentinker_common.spec`, write a
module here with ``run(ctx: WorkerContext) -> None`` (the step loop is
:func:`opentinker_trainer.workloads._loop.run_steps`), add its row below.
"""

from __future__ import annotations

import importlib
from typing import Callable

from opentinker_common.spec import env_kind
from opentinker_trainer.context import UserError, WorkerContext

__all__ = ["TRAINERS", "trainer_for", "run_task"]

#: ``(workload_type, env kind) -> "module:function"`` running one attempt of such a task.
TRAINERS: dict[tuple[str, str], str] = {
    ("lora_finetune", "text"): "opentinker_trainer.workloads.grpo_text:run",  # GRPO, LoRA, text tasks
    ("lora_finetune", "gym"): "opentinker_trainer.workloads.grpo_game:run",  # GRPO, LoRA, an LM playing a game
    ("full_rl", "text"): "opentinker_trainer.workloads.grpo_text:run",  # GRPO on all weights of an LM
    ("full_rl", "gym"): "opentinker_trainer.workloads.ppo_gym:run",  # PPO, MLP policy, gymnasium
    ("full_rl", "multiagent"): "opentinker_trainer.workloads.ppo_multiagent:run",  # PPO per agent, PettingZoo
    ("sft", "dataset"): "opentinker_trainer.workloads.sft:run",  # supervised fine-tuning, LoRA or full
    ("inference", "text"): "opentinker_trainer.workloads.serving:run",  # a base model and its adapters
    ("lora_session", "text"): "opentinker_trainer.workloads.lora_session:run",  # TrainingService primitives
}


def trainer_for(workload_type: str, kind: str) -> Callable[[WorkerContext], None]:
    """The function running one attempt of a ``workload_type`` task on a ``kind`` environment.

    Raises:
        UserError: no trainer for that pair (the spec check refuses such a task at submit, so
            this means a scheduler newer than this trainer).
    """
    target = TRAINERS.get((workload_type, kind))
    if target is None:
        raise UserError(
            f"spec.workload_type {workload_type!r}: this trainer has no trainer for environments of kind {kind!r}"
        )
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def run_task(ctx: WorkerContext) -> None:
    """Run (or resume) one attempt of ``ctx.spec`` with the trainer :data:`TRAINERS` names."""
    trainer_for(ctx.spec.workload_type, env_kind(ctx.spec.env))(ctx)
