"""Multi-agent PPO on a PettingZoo parallel environment (``full_rl`` on env kind ``multiagent``).

Every agent learns with PPO (:mod:`.ppo_gym` describes one update). With
``parameter_sharing`` one actor-critic serves all agents, its input the agent's own observation
plus a one-hot agent index (Gupta et al. 2017, https://doi.org/10.1007/978-3-319-71682-4_5;
MAPPO's shared-policy setting, Yu et al. 2022, https://arxiv.org/abs/2103.01955, with a
decentralised critic); without it each agent has its own actor-critic and Adam optimizer
(independent PPO, de Witt et al. 2020, https://arxiv.org/abs/2011.09533).

``num_envs`` copies of the environment are stepped in this process, one after another (no
processes are forked). Each (copy, agent) pair is one stream of the rollout. An episode end
follows gymnasium's ``NEXT_STEP`` autoreset convention (see :mod:`opentinker_trainer.rl.gae`):
the step after the last agent finished resets the copy and is masked out of training; an agent
that finished while others play on is masked out until the reset; a truncated agent bootstraps
from its final observation, a terminated one does not.

Metrics per update, beyond those of the single-agent trainer (whose ``loss/*``, ``ppo/*`` keys
here are means over learners): ``reward/agent/<name>`` (mean return of that agent's episodes
finished in this update, else its last known value), ``reward/team_return_mean`` (sum over
agents of those), ``loss/agent/<name>/{policy,value,entropy}``. ``reward`` is the mean per-agent
episode return over the episodes finished in this update (last known value when none did).

Distributed (a task with several ranks): as :mod:`.ppo_gym`, each rank steps ``num_envs / W``
of the copies with its own action seed, gradients summed over ranks per minibatch of each
learner, episode metrics over all ranks' episodes.

Resume restores policies, optimizers, counts and RNGs; the environment copies restart with
fresh episodes seeded from ``(seed, update)``, as in the single-agent trainer.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from opentinker_common.spec.multiagent import import_parallel_env_module
from opentinker_trainer import distributed
from opentinker_trainer.context import UserError, WorkerContext
from opentinker_trainer.rl.policy import ActorCritic, UnsupportedSpaceError
from opentinker_trainer.workloads import _ppo_common as common
from opentinker_trainer.workloads import _rng
from opentinker_trainer.workloads._lm import get_logger

log = get_logger("opentinker.trainer.full_rl.marl")

SHARED = "shared"


class MultiAgentPPOTrainer:
    """One attempt of multi-agent PPO; :meth:`run` trains to ``total_timesteps`` or a stop.

    Raises (from the constructor):
        UserError: the environment cannot be made, a space is not Box/Discrete, or
            ``parameter_sharing`` is asked for agents whose spaces differ.
    """

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.cfg = cfg = ctx.spec.hyperparameters
        self.env_cfg = env_cfg = ctx.spec.env
        self.device = torch.device(ctx.device)
        self.env_seed = env_cfg.seed if env_cfg.seed is not None else cfg.seed
        common.seed_everything(cfg.seed)
        # Distributed: rank r steps copies r * n .. (r + 1) * n - 1 of the num_envs (n per rank,
        # seeded as those copies are in one rank), with action seed seed + r (as ppo_gym).
        self.dp = distributed.world(ctx)
        self.local_envs = distributed.per_rank_count(cfg.num_envs, self.dp, "hyperparameters.num_envs")
        self.env_offset = 0 if self.dp is None else self.dp.rank * self.local_envs
        try:
            module = import_parallel_env_module(env_cfg.env_id)
            self.envs = [module.parallel_env(**env_cfg.env_kwargs) for _ in range(self.local_envs)]
        except Exception as exc:  # noqa: BLE001 - ImportError, bad kwargs (TypeError, AssertionError ...)
            raise UserError(
                f"env_config {env_cfg.env_id!r}: cannot make the environment: {type(exc).__name__}: {exc}"
            ) from exc
        env0 = self.envs[0]
        self.agents: list[str] = list(env0.possible_agents)
        obs_spaces = [env0.observation_space(a) for a in self.agents]
        act_spaces = [env0.action_space(a) for a in self.agents]
        try:
            if cfg.parameter_sharing:
                if any(o != obs_spaces[0] for o in obs_spaces) or any(a != act_spaces[0] for a in act_spaces):
                    raise UserError(
                        f"hyperparameters.parameter_sharing: the agents of {env_cfg.env_id} have different spaces "
                        f"({', '.join(f'{a}: {o} -> {s}' for a, o, s in zip(self.agents, obs_spaces, act_spaces))}); "
                        "set parameter_sharing to false"
                    )
                learners = {
                    SHARED: ActorCritic(
                        obs_spaces[0], act_spaces[0], cfg.hidden_sizes, cfg.activation, len(self.agents)
                    )
                }
                self.members = {SHARED: list(range(len(self.agents)))}
            else:
                learners = {
                    a: ActorCritic(o, s, cfg.hidden_sizes, cfg.activation)
                    for a, o, s in zip(self.agents, obs_spaces, act_spaces)
                }
                self.members = {a: [i] for i, a in enumerate(self.agents)}
        except UnsupportedSpaceError as exc:
            raise UserError(f"env_config.env_id {env_cfg.env_id!r}: {exc}") from exc
        self.policy = nn.ModuleDict(learners).to(self.device)
        self.optimizers = {
            g: torch.optim.Adam(p.parameters(), lr=cfg.learning_rate, eps=1e-5) for g, p in self.policy.items()
        }
        self.update, self.env_steps, self.last_reward = 0, 0, float("nan")
        self.last_agent_reward = dict.fromkeys(self.agents, float("nan"))
        if self.dp is not None:
            self.dp.broadcast(list(self.policy.parameters()))
            distributed.seed_rank(cfg.seed, self.dp.rank)
        if ctx.resume_from is not None:
            policy_state, state = common.load_checkpoint(ctx.resume_from)
            self.policy.load_state_dict(policy_state)
            for g, opt in self.optimizers.items():
                opt.load_state_dict(state["optimizer"][g])
            _rng.restore_rng_state(state["rng"])
            self.update, self.env_steps = int(state["step"]), int(state["env_steps"])
            self.last_reward = float(state["last_reward"])
            self.last_agent_reward.update({a: float(v) for a, v in state["last_agent_reward"].items()})
            distributed.restore_rank_rng(ctx, state, reseed=cfg.seed + self.update)
            log.info("resumed", task_id=ctx.task_id, checkpoint=str(ctx.resume_from), step=self.update)
        seed = common.env_seed_at(self.env_seed, self.update) + self.env_offset
        # cur_obs[e][i]: the latest observation of agent i in copy e (its final one once it is done).
        self.cur_obs: list[list[np.ndarray]] = []
        for e, env in enumerate(self.envs):
            obs, _ = env.reset(seed=seed + e)
            for i, a in enumerate(self.agents):
                env.action_space(a).seed(seed + e)
            self.cur_obs.append([np.asarray(obs[a]) for a in self.agents])
        self.pending_reset = [False] * self.local_envs
        self.episodes = common.EpisodeTracker(self.local_envs * len(self.agents))
        self.started = time.perf_counter()

    # --- checkpoints --------------------------------------------------------------------------
    def save(self, *, final: bool) -> Path:
        return common.save_update(self, final=final)

    def _write(self, final: bool, extra: dict) -> Path:
        path = Path(self.ctx.checkpoint_dir) / f"step_{self.update}"
        env0 = self.envs[0]
        meta = {
            "format": common.CHECKPOINT_FORMAT,
            "env_id": self.env_cfg.env_id,
            "env_kwargs": dict(self.env_cfg.env_kwargs),
            "agents": self.agents,
            "parameter_sharing": self.cfg.parameter_sharing,
            "learners": list(self.policy),
            "observation_spaces": {a: str(env0.observation_space(a)) for a in self.agents},
            "action_spaces": {a: str(env0.action_space(a)) for a in self.agents},
            "hidden_sizes": list(self.cfg.hidden_sizes),
            "activation": self.cfg.activation,
            "step": self.update,
        }
        state = {
            "step": self.update,
            "env_steps": self.env_steps,
            "optimizer": {g: o.state_dict() for g, o in self.optimizers.items()},
            "rng": _rng.rng_state(),
            "last_reward": self.last_reward,
            "last_agent_reward": dict(self.last_agent_reward),
            "hyperparameters": dataclasses.asdict(self.cfg),
            **extra,
        }
        common.save_checkpoint(path, self.policy.state_dict(), meta, state)
        self.ctx.emit_checkpoint(self.update, path, final=final, fmt=common.CHECKPOINT_FORMAT)
        log.info("checkpoint written", task_id=self.ctx.task_id, step=self.update, path=str(path), final=final)
        return path

    # --- one update ---------------------------------------------------------------------------
    def _learner_obs(self, g: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(obs [E * M, *obs_shape], agent_ids [E * M])`` of learner ``g``'s M member agents."""
        members = self.members[g]
        obs = np.stack([self.cur_obs[e][i] for e in range(len(self.envs)) for i in members])
        ids = torch.tensor([i for _ in self.envs for i in members], device=self.device)
        return torch.as_tensor(obs, device=self.device), ids

    @torch.no_grad()
    def rollout(self) -> dict[str, dict[str, torch.Tensor]]:
        T, E, A = self.cfg.num_steps, len(self.envs), len(self.agents)
        bufs: dict[str, dict[str, list]] = {
            g: {k: [] for k in ("obs", "ids", "actions", "logprobs", "values")} for g in self.policy
        }
        rewards = np.zeros((T, E, A), dtype=np.float32)
        terminated = np.zeros((T, E, A), dtype=bool)
        truncated = np.zeros((T, E, A), dtype=bool)
        valid = np.zeros((T, E, A), dtype=bool)
        for t in range(T):
            for e, env in enumerate(self.envs):
                live = set(env.agents) if not self.pending_reset[e] else set()
                valid[t, e] = [a in live for a in self.agents]
            env_actions: list[dict[str, object]] = [{} for _ in self.envs]
            for g, policy in self.policy.items():
                obs, ids = self._learner_obs(g)
                action, logprob, _, value = policy.get_action_and_value(obs, agent_ids=ids if g == SHARED else None)
                for k, v in zip(("obs", "ids", "actions", "logprobs", "values"), (obs, ids, action, logprob, value)):
                    bufs[g][k].append(v)
                acts = policy.env_action(action)
                members = self.members[g]
                for row, (e, i) in enumerate((e, i) for e in range(E) for i in members):
                    if valid[t, e, i]:
                        env_actions[e][self.agents[i]] = acts[row]
            for e, env in enumerate(self.envs):
                if self.pending_reset[e]:
                    obs, _ = env.reset()
                    self.cur_obs[e] = [np.asarray(obs[a]) for a in self.agents]
                    self.pending_reset[e] = False
                    continue
                obs, rew, term, trunc, _ = env.step(env_actions[e])
                for i, a in enumerate(self.agents):
                    if not valid[t, e, i]:
                        continue
                    rewards[t, e, i] = rew.get(a, 0.0)
                    terminated[t, e, i] = bool(term.get(a, False))
                    truncated[t, e, i] = bool(trunc.get(a, False))
                    if a in obs:
                        self.cur_obs[e][i] = np.asarray(obs[a])
                if not env.agents:
                    self.pending_reset[e] = True
            done = (terminated[t] | truncated[t]).reshape(-1)
            self.episodes.step(rewards[t].reshape(-1).astype(np.float64), done, valid[t].reshape(-1))
        out: dict[str, dict[str, torch.Tensor]] = {}
        for g, policy in self.policy.items():
            members = self.members[g]
            obs, ids = self._learner_obs(g)
            b = {k: torch.stack(v) for k, v in bufs[g].items()}  # [T, E * M, ...]
            sel = lambda x: torch.as_tensor(x[:, :, members].reshape(T, -1), device=self.device)  # noqa: E731
            b.update(
                next_value=policy.get_value(obs, agent_ids=ids if g == SHARED else None),
                rewards=sel(rewards),
                terminated=sel(terminated),
                truncated=sel(truncated),
                valid=sel(valid),
            )
            out[g] = b
        return out

    def _batch(self, g: str, b: dict[str, torch.Tensor]) -> common.Batch:
        keep = b["valid"].reshape(-1)
        ids = common.kept_rows(b["ids"], keep)
        return common.gae_batch(
            b,
            ~b["valid"],
            self.cfg,
            agent_ids=ids if g == SHARED else None,
            groups={self.agents[i]: ids == i for i in self.members[g]},
        )

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = common.annealed_lr(cfg, self.update)
        clip = common.clip_coef_at(cfg, self.update)
        ro = self.rollout()
        t_roll = time.perf_counter() - t0
        per_learner, samples = [], 0
        for g, policy in self.policy.items():
            for group in self.optimizers[g].param_groups:
                group["lr"] = lr
            batch = self._batch(g, ro[g])
            samples += len(batch)
            policy.train()
            per_learner.append(common.ppo_update(policy, self.optimizers[g], batch, cfg, clip, dp=self.dp))
        out = {}
        for key in per_learner[0].keys() | {k for m in per_learner for k in m}:
            vals = [m[key] for m in per_learner if key in m and not math.isnan(m[key])]
            out[key] = float(np.mean(vals)) if vals else math.nan
        self.env_steps += cfg.batch_size
        step_s = time.perf_counter() - t0
        finished = self.episodes.pop()
        if self.dp is not None:  # every rank's episodes (stream e * A + i: agent i) and samples
            finished = [ep for part in self.dp.gather_objects(finished) for ep in part]
            (samples,) = (int(x) for x in self.dp.sum(samples))
        rewards, self.last_reward = common.episode_metrics(finished, self.last_reward)
        A = len(self.agents)
        for i, a in enumerate(self.agents):
            rets = [r for s, r, _ in finished if s % A == i]
            if rets:
                self.last_agent_reward[a] = float(np.mean(rets))
            rewards[f"reward/agent/{a}"] = self.last_agent_reward[a]
        rewards["reward/team_return_mean"] = float(sum(self.last_agent_reward.values()))
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
        def close() -> None:
            for env in self.envs:
                env.close()

        common.run_updates(
            self,
            log,
            close,
            optimizers=self.optimizers.values(),
            counts=("update", "env_steps", "last_reward", "last_agent_reward"),
        )


def run(ctx: WorkerContext) -> None:
    """Run (or resume) one attempt of multi-agent PPO (``full_rl``, kind ``multiagent``).

    Raises:
        UserError: the environment cannot be made or has spaces the policy cannot handle.
    """
    with common.one_intra_op_thread():
        MultiAgentPPOTrainer(ctx).run()
