"""``full_rl``: reinforcement learning that updates all weights of the policy.

Dispatches on the kind of the task's environment
(:func:`opentinker_client.spec.env_kind`):

* ``gym`` — PPO with an MLP actor-critic on a gymnasium id
  (:mod:`opentinker_trainer.workloads._ppo_trainer`);
* ``multiagent`` — PPO for every agent of a PettingZoo parallel environment, parameter-shared or
  independent (:mod:`opentinker_trainer.workloads._marl_trainer`);
* ``text`` — GRPO on a causal LM with all weights trainable (:mod:`.lora_finetune`, which reads
  ``ctx.spec.workload_type``).

Checkpoints of the PPO trainers have format ``torch_ppo``: ``step_<n>/policy.pt`` (state dict),
``policy.json`` and ``trainer_state.pt``.
"""

from __future__ import annotations

import torch

from opentinker_client.spec import env_kind
from opentinker_trainer.context import UserError, WorkerContext


def run(ctx: WorkerContext) -> None:
    """Run (or resume) one attempt of a ``full_rl`` task.

    Raises:
        UserError: the environment cannot be made or has spaces the policy cannot handle, or the
            environment kind has no ``full_rl`` trainer.
    """
    kind = env_kind(ctx.spec.env)
    if kind in ("gym", "multiagent"):
        # Small MLPs on small batches: one intra-op thread is ~10x faster than two threads that
        # contend with the environment and other processes for the cores (measured, 2 cores).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if kind == "gym":
                from opentinker_trainer.workloads._ppo_trainer import PPOTrainer

                PPOTrainer(ctx).run()
            else:
                from opentinker_trainer.workloads._marl_trainer import MultiAgentPPOTrainer

                MultiAgentPPOTrainer(ctx).run()
        finally:
            torch.set_num_threads(threads)
    elif kind == "text":
        from opentinker_trainer.workloads import lora_finetune

        return lora_finetune.run(ctx)
    else:
        raise UserError(f"spec.env_config.env_id {ctx.spec.env.env_id!r}: full_rl has no trainer for environments of kind {kind!r}")
