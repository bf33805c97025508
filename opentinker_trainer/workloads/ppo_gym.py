"""PPO on a gymnasium environment (``full_rl`` on env kind ``gym``).

Each update (Schulman et al. 2017, https://arxiv.org/abs/1707.06347; CleanRL ``ppo.py``):

1. roll the policy out for ``num_steps`` steps in ``num_envs`` sub-environments of a vector env
   (``AutoresetMode.NEXT_STEP``; autoreset steps are recorded and masked out);
2. GAE advantages and returns (:func:`~opentinker_trainer.rl.gae.gae`): a terminal step does
   not bootstrap, a truncated one bootstraps from the true final observation;
3. ``update_epochs`` x ``num_minibatches`` Adam steps on the clipped surrogate, value loss and
   entropy bonus (:func:`~opentinker_trainer.workloads._ppo_common.ppo_update`), fewer when a
   minibatch's ``approx_kl`` exceeds ``target_kl``; the learning rate (``anneal_lr``) and the clip
   coefficient (``clip_schedule``) of the update follow their schedules.

Metrics per update (``step`` = update number, from 1): ``loss``, ``reward`` (mean return of the
episodes that finished in this update; when none did, the last known value, with
``reward/stale = 1``), ``loss/total``, ``loss/policy``, ``loss/value``, ``loss/entropy``,
``ppo/approx_kl``, ``ppo/clipfrac``, ``ppo/explained_variance``, ``ppo/epochs``,
``ppo/minibatches``, ``ppo/early_stop``, ``ppo/clip_coef``,
``reward/episode_return_mean`` (= ``reward``), ``reward/episode_return_{std,min,max}``,
``reward/episode_length_mean``, ``reward/episodes``, ``reward/stale``, ``optim/lr``,
``optim/grad_norm``, ``env_steps`` (so far), ``wall_time_s``, ``perf/env_steps_per_s`` (of the
whole update), ``perf/step_s``, ``perf/rollout_s``, ``perf/train_s``.

Distributed (a task with several ranks, :mod:`opentinker_trainer.distributed`; CleanRL's
multi-GPU PPO): rank ``r`` of ``W`` steps ``num_envs / W`` of the sub-environments (those numbered
``r * num_envs / W ..``, seeded as in one rank) with its own action-sampling seed (``seed + r``);
gradients are summed over ranks per minibatch
(:func:`~opentinker_trainer.workloads._ppo_common.ppo_update` with ``dp``), so the update's batch
is still ``num_steps * num_envs`` env steps; ``num_envs`` must be a multiple of ``W``. Episode
metrics are over all ranks' episodes.

Determinism and resume: a fresh run seeds Python, numpy and torch with ``seed`` and resets the
vector env with the env config's ``seed`` (else ``seed``; sub-env ``i`` gets ``+ i``), so the same
seed gives the same first rollout. A checkpoint (``torch_ppo``, every ``checkpoint_every``
updates, on a stop request and at the end) holds the policy, Adam state, update and env-step
counts and the RNG states. A vector env's state cannot be pickled in general, so resuming at
update ``u`` restarts the environments with fresh episodes seeded from ``(seed, u)``
(:func:`~opentinker_trainer.workloads._ppo_common.env_seed_at`): the resumed run is deterministic
and continues the step count, optimizer and RNGs, but the episodes in flight at the checkpoint
are dropped, not continued.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import gymnasium
import numpy as np
import torch

from opentinker_trainer import distributed
from opentinker_trainer.context import UserError, WorkerContext
from opentinker_trainer.envs.gym import make_vector_env
from opentinker_trainer.rl.gae import autoreset_mask
from opentinker_trainer.rl.policy import ActorCritic, UnsupportedSpaceError
from opentinker_trainer.rl.policy_export import ACTING_FILE, export_torchscript
from opentinker_trainer.workloads import _ppo_common as common
from opentinker_trainer.workloads import _rng
from opentinker_trainer.workloads._lm import get_logger

log = get_logger("opentinker.trainer.full_rl.ppo")


class PPOTrainer:
    """One attempt of PPO on a gymnasium id; :meth:`run` trains to ``total_timesteps`` or a stop.

    Raises (from the constructor):
        UserError: gymnasium cannot make the environment, or its spaces are not Box/Discrete.
    """

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.cfg = cfg = ctx.spec.hyperparameters
        self.env_cfg = ctx.spec.env
        self.device = torch.device(ctx.device)
        env_seed = getattr(self.env_cfg, "seed", None)  # the client-hosted env config has one too
        self.env_seed = env_seed if env_seed is not None else cfg.seed
        common.seed_everything(cfg.seed)
        # Distributed: rank r steps sub-envs r * n .. (r + 1) * n - 1 of the task's num_envs (n per
        # rank, seeded as those sub-envs are in one rank) and samples actions with seed + rank.
        self.dp = distributed.world(ctx)
        self.local_envs = distributed.per_rank_count(cfg.num_envs, self.dp, "hyperparameters.num_envs")
        self.env_offset = 0 if self.dp is None else self.dp.rank * self.local_envs
        try:
            self.envs = make_vector_env(
                self.env_cfg, num_envs=self.local_envs, seed=None, mode=cfg.vector_mode, context=cfg.async_context
            )
        except (gymnasium.error.Error, TypeError, ValueError, ImportError, AttributeError) as exc:
            raise UserError(f"env_config.env_id {self.env_cfg.env_id!r}: gymnasium cannot make it: {exc}") from exc
        try:
            obs_space, act_space = self.envs.single_observation_space, self.envs.single_action_space
            self.policy = ActorCritic(obs_space, act_space, cfg.hidden_sizes, cfg.activation).to(self.device)
        except UnsupportedSpaceError as exc:
            self.envs.close()
            raise UserError(f"env_config.env_id {self.env_cfg.env_id!r}: {exc}") from exc
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=cfg.learning_rate, eps=1e-5)
        self.update, self.env_steps, self.last_reward = 0, 0, float("nan")
        if self.dp is not None:
            self.dp.broadcast(list(self.policy.parameters()))
            distributed.seed_rank(cfg.seed, self.dp.rank)
        if ctx.resume_from is not None:
            policy_state, state = common.load_checkpoint(ctx.resume_from)
            self.policy.load_state_dict(policy_state)
            self.optimizer.load_state_dict(state["optimizer"])
            _rng.restore_rng_state(state["rng"])
            self.update, self.env_steps = int(state["step"]), int(state["env_steps"])
            self.last_reward = float(state["last_reward"])
            distributed.restore_rank_rng(ctx, state, reseed=cfg.seed + self.update)
            log.info(
                "resumed",
                task_id=ctx.task_id,
                checkpoint=str(ctx.resume_from),
                step=self.update,
                env_steps=self.env_steps,
            )
        seed = common.env_seed_at(self.env_seed, self.update) + self.env_offset
        obs, _ = self.envs.reset(seed=seed)
        self.envs.action_space.seed(seed)
        self.next_obs = self._tensor(obs)
        self.prev_done = torch.zeros(self.local_envs, dtype=torch.bool)
        self.episodes = common.EpisodeTracker(self.local_envs)
        self.started = time.perf_counter()

    def _tensor(self, obs: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(obs), device=self.device)

    # --- checkpoints --------------------------------------------------------------------------
    def save(self, *, final: bool) -> Path:
        return common.save_update(self, final=final)

    def _write(self, final: bool, extra: dict) -> Path:
        path = Path(self.ctx.checkpoint_dir) / f"step_{self.update}"
        meta = {
            "format": common.CHECKPOINT_FORMAT,
            "env_id": self.env_cfg.env_id,
            "observation_space": str(self.envs.single_observation_space),
            "observation_shape": list(self.envs.single_observation_space.shape or ()),
            "action_space": str(self.envs.single_action_space),
            "hidden_sizes": list(self.cfg.hidden_sizes),
            "activation": self.cfg.activation,
            "step": self.update,
            "acting": ACTING_FILE,  # torch.jit.load it: obs [B, ...] -> (greedy action, value)
        }
        state = {
            "step": self.update,
            "env_steps": self.env_steps,
            "optimizer": self.optimizer.state_dict(),
            "rng": _rng.rng_state(),
            "last_reward": self.last_reward,
            "hyperparameters": dataclasses.asdict(self.cfg),
            **extra,
        }
        example = self.next_obs[:1]
        common.save_checkpoint(
            path,
            self.policy.state_dict(),
            meta,
            state,
            extra=lambda folder: export_torchscript(self.policy, folder / ACTING_FILE, example),
        )
        self.ctx.emit_checkpoint(self.update, path, final=final, fmt=common.CHECKPOINT_FORMAT)
        log.info("checkpoint written", task_id=self.ctx.task_id, step=self.update, path=str(path), final=final)
        return path

    # --- one update ---------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self) -> dict[str, torch.Tensor]:
        """``num_steps`` vector steps; returns ``[T, N, ...]`` buffers plus ``next_value [N]``."""
        T, N = self.cfg.num_steps, self.local_envs
        obs_buf = torch.zeros((T, *self.next_obs.shape), dtype=self.next_obs.dtype, device=self.device)
        actions, logprobs, values = [], torch.zeros(T, N, device=self.device), torch.zeros(T, N, device=self.device)
        rewards = torch.zeros(T, N, device=self.device)
        terminated = torch.zeros(T, N, dtype=torch.bool, device=self.device)
        truncated = torch.zeros(T, N, dtype=torch.bool, device=self.device)
        valid_prev = ~self.prev_done.numpy()
        for t in range(T):
            obs_buf[t] = self.next_obs
            action, logprobs[t], _, values[t] = self.policy.get_action_and_value(self.next_obs)
            actions.append(action)
            obs, reward, term, trunc, _ = self.envs.step(self.policy.env_action(action))
            self.next_obs = self._tensor(obs)
            rewards[t] = torch.as_tensor(reward, dtype=torch.float32, device=self.device)
            terminated[t] = torch.as_tensor(term, device=self.device)
            truncated[t] = torch.as_tensor(trunc, device=self.device)
            done = np.logical_or(term, trunc)
            self.episodes.step(np.asarray(reward, dtype=np.float64), done, valid_prev)
            valid_prev = ~done
        reset = autoreset_mask((terminated | truncated).cpu(), self.prev_done).to(self.device)
        self.prev_done = (terminated[-1] | truncated[-1]).cpu()
        next_value = self.policy.get_value(self.next_obs)
        return {
            "obs": obs_buf,
            "actions": torch.stack(actions),
            "logprobs": logprobs,
            "values": values,
            "rewards": rewards,
            "terminated": terminated,
            "truncated": truncated,
            "reset": reset,
            "next_value": next_value,
        }

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = common.annealed_lr(cfg, self.update)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        ro = self.rollout()
        t_roll = time.perf_counter() - t0
        batch = common.gae_batch(ro, ro["reset"], cfg)
        self.policy.train()
        out = common.ppo_update(
            self.policy, self.optimizer, batch, cfg, common.clip_coef_at(cfg, self.update), dp=self.dp
        )
        self.env_steps += cfg.batch_size
        step_s = time.perf_counter() - t0
        finished, samples = self.episodes.pop(), len(batch)
        if self.dp is not None:  # every rank's episodes and samples
            finished = [e for part in self.dp.gather_objects(finished) for e in part]
            (samples,) = (int(x) for x in self.dp.sum(samples))
        rewards, self.last_reward = common.episode_metrics(finished, self.last_reward)
        return common.update_metrics(
            out,
            rewards,
            lr=lr,
            env_steps=self.env_steps,
            started=self.started,
            batch_size=cfg.batch_size,
            step_s=step_s,
            rollout_s=t_roll,
            samples=samples,
        )

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        common.run_updates(
            self, log, self.envs.close, optimizers=self.optimizer, counts=("update", "env_steps", "last_reward")
        )


def run(ctx: WorkerContext) -> None:
    """Run (or resume) one attempt of PPO on a gymnasium environment (``full_rl``, kind ``gym``).

    Raises:
        UserError: the environment cannot be made or has spaces the policy cannot handle.
    """
    with common.one_intra_op_thread():
        PPOTrainer(ctx).run()
