"""``lora_finetune`` on a Discrete environment: a causal LM with LoRA plays a game, trained by GRPO.

An episode (multi-turn): the observation is rendered to text
(:mod:`opentinker_trainer.envs.text_render`), the LM samples a short reply, the reply is parsed to
an action and the environment steps, until it terminates, truncates, or ``max_turns`` replies
were made. Each turn's prompt holds only the current observation (the games are Markov), so a
turn is one (prompt, completion) pair.

The prompt ends with a short ``reply_prefix`` inside the assistant's turn (FrozenLake: ``Move:``)
that the model continues, so that a small model answers with a direction rather than restating
the question; only the continuation is parsed and trained on.

A reply that names no action is an *invalid action*: the environment is not stepped, the turn is
used up and ``invalid_action_reward`` (default -0.1) is added to the episode's return.

Return of an episode = sum of the environment's rewards + invalid-action penalties + (with
``reward_shaping: distance``) the potential-based shaping ``Φ(s_T) - Φ(s_0)`` (Ng, Harada &
Russell 1999, "Policy invariance under reward transformations": ``F = Φ(s') - Φ(s)`` per step with
``γ = 1`` telescopes to this; Φ is minus the grid distance to the goal scaled to [-1, 0]).

GRPO over episodes (Shao et al. 2024, https://arxiv.org/abs/2402.03300): a step plays
``groups_per_step`` groups of ``episodes_per_step`` episodes, each group from one start seed;
advantages are the returns standardised within the group
(:func:`~opentinker_trainer.rl.grpo.group_advantages`) and every token the LM wrote in an
episode gets its episode's advantage. The update is
:func:`~opentinker_trainer.rl.grpo.grpo_update` (the same as the text trainer's, with its rules on
groups without signal, missing returns and the reported KL): the clipped surrogate, a token mean
over all turns of the step, plus ``kl_coef`` times the k3 KL to the base model (the adapter off).

Start seeds are a function of (seed, step, group), and the RNG states are checkpointed, so a
resumed run plays and samples what an uninterrupted one would have.

Distributed (a task with several ranks, :mod:`opentinker_trainer.distributed`): data-parallel,
as the text trainer. Every rank holds the adapter and plays its contiguous share of the step's
``groups_per_step`` groups (whole groups, with the start seeds of their global group numbers, so
advantages stay per group), sampling with its own seed (``seed + rank``); the loss is normalised
over all ranks' turns and the gradients summed before clipping
(:func:`~opentinker_trainer.rl.grpo.grpo_update` with ``dp``), and every metric is of the global
step (``perf/turns`` = all ranks' turns). Checkpoints are written once, by rank 0, with every
rank's RNG state (a resume at the same world size is exact; at another it works, not bit-exact).

Metrics per step: ``loss``, ``reward`` (mean episode return), ``reward_std``, ``zero_std_frac``,
``loss/policy``, ``loss/kl``, ``kl`` (= ``grpo/kl_ref``: k3 of KL(sampling policy || base model) on
this step's turns; with ``kl_coef`` > 0 only), ``grpo/no_signal``, ``grpo/missing_rewards``, ``grpo/tokens`` (see
:func:`~opentinker_trainer.rl.grpo.grpo_update`), ``reward/mean``, ``reward/std``,
``episode/env_return`` (the environment's own rewards only), ``episode/success_rate`` (episodes
whose environment return is > 0), ``episode/turns``, ``episode/terminated_frac``,
``episode/invalid_action_frac`` (invalid replies / all replies), ``grpo/zero_std_frac``,
``grpo/clipfrac``, ``grpo/approx_kl``, ``optim/grad_norm``, ``optim/lr``, ``perf/step_s``,
``perf/generate_s``, ``perf/env_s``, ``perf/train_s``, ``perf/turns``, ``perf/tokens_per_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from opentinker_common.spec.gym import space_size
from opentinker_trainer import distributed
from opentinker_trainer.context import UserError, WorkerContext
from opentinker_trainer.envs.text_render import parse_action, renderer_for
from opentinker_trainer.rl.grpo import ADAPTER_OFF, GRPOBatch, grpo_update, headline_metrics, rewards_tensor
from opentinker_trainer.rl.rollout import generate, left_pad, right_pad
from opentinker_trainer.rl.shared_prompts import shared_prompt_logprobs
from opentinker_trainer.workloads import _lm
from opentinker_trainer.workloads import _keep
from opentinker_trainer.workloads._loop import run_trainer

log = _lm.get_logger("opentinker.trainer.lm_game")


@dataclass
class Episodes:
    """One step's play: per-turn token lists and per-episode outcomes.

    Attributes:
        prompts, completions: token lists of every turn (``len == turns``).
        turn_episode: ``[turns]`` long, the episode each turn belongs to.
        returns: ``[N]`` episode returns (what GRPO compares), N = groups * episodes per group.
        env_returns: ``[N]`` the environment's rewards only.
        turns, invalid: ``[N]`` replies and invalid replies per episode.
        terminated: ``[N]`` bool.
        replies: the decoded replies (for logs and tests).
    """

    prompts: list[list[int]] = field(default_factory=list)
    completions: list[list[int]] = field(default_factory=list)
    turn_episode: list[int] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    env_returns: list[float] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    invalid: list[int] = field(default_factory=list)
    terminated: list[bool] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    truncated_replies: int = 0


def start_seed(base: int, step: int, group: int, groups_per_step: int) -> int:
    """Start seed of ``group`` at ``step`` (from 1): distinct per (step, group), reproducible."""
    return (base * 1_000_003 + (step - 1) * groups_per_step + group) % (2**31)


class GameTrainer:
    """One attempt of ``lora_finetune`` on a ``gym``-kind environment; see the module docstring."""

    def __init__(self, ctx: WorkerContext) -> None:
        from opentinker_trainer.envs.gym import make_env

        self.ctx = ctx
        self.cfg = cfg = ctx.spec.hyperparameters
        # Distributed: this rank plays its contiguous share of the step's groups (whole groups).
        self.dp = distributed.world(ctx)
        if self.dp is not None and cfg.groups_per_step < self.dp.world_size:
            raise UserError(
                f"hyperparameters.groups_per_step {cfg.groups_per_step}: fewer groups than the task's "
                f"{self.dp.world_size} ranks (each rank plays whole groups)"
            )
        self.groups = range(cfg.groups_per_step) if self.dp is None else self.dp.shard(cfg.groups_per_step)
        self.n_envs = len(self.groups) * cfg.episodes_per_step
        env_cfg = ctx.spec.env
        try:
            self.envs = [make_env(env_cfg, seed=None) for _ in range(self.n_envs)]
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - gymnasium raises many types for bad ids/kwargs
            raise UserError(f"env_config: cannot make {env_cfg.env_id}: {type(exc).__name__}: {exc}") from exc
        self._check_spaces(self.envs[0])
        try:
            self.renderer = renderer_for(self.envs[0], getattr(env_cfg, "action_names", ()) or ())
        except ValueError as exc:
            raise UserError(f"env_config.env_id {env_cfg.env_id}: {exc}") from exc
        if cfg.reward_shaping == "distance":
            try:
                self.renderer.potential(0)
            except ValueError as exc:
                raise UserError(f"hyperparameters.reward_shaping: {exc}") from exc
        self.seed_base = env_cfg.seed if getattr(env_cfg, "seed", None) is not None else cfg.seed

        self.device = torch.device(ctx.device)
        dtype = _lm.resolve_dtype(cfg.dtype, self.device)
        log.info(
            "loading model", task_id=ctx.task_id, model=ctx.spec.model, device=str(self.device), env=env_cfg.env_id
        )
        # LoRA on spec.model; the adapter from resume_from, or an init_from (SFT) checkpoint, or fresh.
        self.tokenizer, self.model = _lm.load_for_training(ctx, cfg, self.device, dtype, full=False)
        self.stop_ids = _lm.stop_token_ids(self.tokenizer, self.model)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self.system_prompt = cfg.system_prompt if cfg.system_prompt is not None else self.renderer.system_prompt()
        self.reply_prefix = cfg.reply_prefix if cfg.reply_prefix is not None else self.renderer.reply_prefix
        self._prompt_cache: dict[Any, list[int]] = {}
        if self.dp is not None:
            self.dp.broadcast(self.params)
            distributed.seed_rank(cfg.seed, self.dp.rank)
        self.step, _ = _lm.resume_step(ctx, self.optimizer, log)
        if ctx.resume_from is not None:
            distributed.restore_rank_rng(ctx, _lm.load_trainer_state(ctx.resume_from), reseed=cfg.seed + self.step)
        self.started = time.perf_counter()

    def _check_spaces(self, env) -> None:
        """The trainer's own check of the declared sizes against the real spaces."""
        import gymnasium

        env_cfg = self.ctx.spec.env
        if not isinstance(env.action_space, gymnasium.spaces.Discrete):
            raise UserError(
                f"env_config.env_id {env_cfg.env_id}: an LM chooses among Discrete actions; this environment's "
                f"action space is {env.action_space} (use full_rl for it)"
            )
        for name, space in (("action_space", env.action_space), ("observation_space", env.observation_space)):
            declared = getattr(env_cfg, name, None)
            if declared is not None and declared != space_size(space):
                raise UserError(f"env_config.{name}: declared {declared}, but {env_cfg.env_id}'s {name} is {space}")

    # --- prompts ------------------------------------------------------------------------------
    def encode(self, observation: Any) -> list[int]:
        """Token ids of the chat prompt for ``observation`` (cached for hashable observations)."""
        key = observation if isinstance(observation, int) else None
        if key is not None and key in self._prompt_cache:
            return self._prompt_cache[key]
        user = self.renderer.render(observation)
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = f"{self.system_prompt}\n\n{user}\n"
        text += self.reply_prefix
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        if key is not None:
            self._prompt_cache[key] = ids
        return ids

    # --- playing ------------------------------------------------------------------------------
    @staticmethod
    def _obs(observation: Any) -> Any:
        """Discrete observations as plain ints (prompt cache keys); others unchanged."""
        if isinstance(observation, (int, np.integer)) or (
            isinstance(observation, np.ndarray) and observation.shape == ()
        ):
            return int(observation)
        return observation

    def play(self) -> tuple[Episodes, float, float]:
        """Play this step's episodes, all turns batched across episodes.

        Returns:
            ``(episodes, generate_s, env_s)``.
        """
        cfg = self.cfg
        n, k = self.n_envs, cfg.episodes_per_step
        ep = Episodes(returns=[0.0] * n, env_returns=[0.0] * n, turns=[0] * n, invalid=[0] * n, terminated=[False] * n)
        t_gen = t_env = 0.0
        t0 = time.perf_counter()
        obs = []
        for i, env in enumerate(self.envs):
            group = self.groups.start + i // k  # the global group number
            o, _ = env.reset(seed=start_seed(self.seed_base, self.step, group, cfg.groups_per_step))
            obs.append(self._obs(o))
        shaping = cfg.reward_shaping == "distance"
        start_pot = [self.renderer.potential(o) for o in obs] if shaping else None
        t_env += time.perf_counter() - t0
        active = list(range(n))
        names = self.renderer.action_names
        self.model.eval()
        for _turn in range(cfg.max_turns):
            if not active:
                break
            prompts = [self.encode(obs[i]) for i in active]
            # All prompts alike (every episode's first turn): prefill once, sample len(active) replies.
            same = all(p == prompts[0] for p in prompts)
            ids, mask = left_pad(prompts[:1] if same else prompts, self.pad_id, self.device)
            t0 = time.perf_counter()
            ro = generate(
                self.model,
                ids,
                mask,
                max_new_tokens=cfg.max_new_tokens,
                stop_token_ids=self.stop_ids,
                pad_token_id=self.pad_id,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                group_size=len(prompts) if same else 1,
            )
            t_gen += time.perf_counter() - t0
            completions = ro.completion_token_lists()
            replies = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
            ep.truncated_replies += int(ro.truncated.sum())
            t0 = time.perf_counter()
            still = []
            for j, i in enumerate(active):
                ep.prompts.append(prompts[j])
                ep.completions.append(completions[j])
                ep.turn_episode.append(i)
                ep.replies.append(replies[j])
                ep.turns[i] += 1
                action = parse_action(replies[j], names)
                if action is None:
                    ep.invalid[i] += 1
                    ep.returns[i] += cfg.invalid_action_reward
                    still.append(i)
                    continue
                o, r, terminated, truncated, _ = self.envs[i].step(action)
                obs[i] = self._obs(o)
                ep.returns[i] += float(r)
                ep.env_returns[i] += float(r)
                if terminated or truncated:
                    ep.terminated[i] = bool(terminated)
                else:
                    still.append(i)
            t_env += time.perf_counter() - t0
            active = still
        if shaping:
            for i in range(n):
                ep.returns[i] += self.renderer.potential(obs[i]) - start_pot[i]
        return ep, t_gen, t_env

    # --- training -----------------------------------------------------------------------------
    def batch(self, ep: Episodes) -> tuple[torch.Tensor, torch.Tensor]:
        """Completions of all turns of a step, right-padded: ``(ids [turns, T], mask [turns, T])``."""
        return right_pad(ep.completions, self.pad_id, self.device)

    def chunks(self, n: int) -> list[slice]:
        size = n if self.cfg.micro_batch_size == 0 else self.cfg.micro_batch_size
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def logprobs(self, prompts: list[list[int]], ids: torch.Tensor, mask: torch.Tensor, model=None) -> torch.Tensor:
        """``[turns, T]`` log-probs under ``model`` (default: the policy); each distinct prompt of
        the chunk runs once."""
        return shared_prompt_logprobs(
            model if model is not None else self.model,
            prompts,
            ids,
            mask,
            pad_token_id=self.pad_id,
            temperature=self.cfg.temperature,
        )

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        ep, t_gen, t_env = self.play()
        t_play = time.perf_counter() - t0
        ids, mask = self.batch(ep)
        batch = GRPOBatch(
            rewards=rewards_tensor(ep.returns, len(self.groups), cfg.episodes_per_step),
            mask=mask,
            chunks=self.chunks(len(ep.prompts)),
            sample_of_row=torch.tensor(ep.turn_episode, dtype=torch.long),
        )
        out = grpo_update(
            self.model,
            self.optimizer,
            batch,
            lambda model, sl: self.logprobs(ep.prompts[sl], ids[sl], mask[sl], model=model),
            cfg,
            reference=ADAPTER_OFF if cfg.kl_coef > 0 else None,  # no reference forward at kl_coef 0
            dp=self.dp,
        )

        step_s = time.perf_counter() - t0
        totals = [
            float(len(ep.env_returns)),
            sum(ep.env_returns),
            float(sum(r > 0 for r in ep.env_returns)),
            float(sum(ep.turns)),
            float(sum(ep.terminated)),
            float(sum(ep.invalid)),
            float(len(ep.prompts)),
            float(mask.sum()),
            float(ep.truncated_replies),
        ]
        if self.dp is not None:  # the global step's numbers
            totals = self.dp.sum(*totals)
        episodes, env_return, successes, turns, terminated, invalid, n_turns, tokens, truncated = totals
        out = {
            **headline_metrics(out),
            **out,
            "episode/env_return": env_return / episodes,
            "episode/success_rate": successes / episodes,
            "episode/turns": turns / episodes,
            "episode/terminated_frac": terminated / episodes,
            "episode/invalid_action_frac": invalid / max(1, n_turns),
            "completion/mean_tokens": tokens / max(1, n_turns),
            "completion/truncated_frac": truncated / max(1, n_turns),
            "optim/lr": cfg.learning_rate,
            "perf/step_s": step_s,
            "perf/generate_s": t_gen,
            "perf/env_s": t_env,
            "perf/train_s": step_s - t_play,
            "perf/turns": n_turns,
            "perf/tokens_per_s": tokens / step_s,
        }
        if self.step <= 2 or self.step % 10 == 0:
            log.debug("sample replies", step=self.step, replies=ep.replies[:4], returns=ep.returns[:4])
        return out

    # --- checkpoints and the loop -------------------------------------------------------------
    def save(self, *, final: bool) -> Path:
        return distributed.save_once(
            self.ctx,
            lambda extra: _lm.save_step(
                self.ctx,
                self.step,
                self.model,
                self.optimizer,
                self.cfg,
                fmt=_lm.FORMAT_LORA,
                log=log,
                final=final,
                **({"extra_state": extra} if extra else {}),
            ),
            step=self.step,
            final=final,
            fmt=_lm.FORMAT_LORA,
        )

    def run(self) -> None:
        run_trainer(
            self,
            log,
            total=self.cfg.steps,
            checkpoint_every=self.cfg.checkpoint_every,
            keep=_keep.keeper(
                self.ctx, self.optimizer, state=lambda: self.step, restore=lambda step: setattr(self, "step", step)
            ),
            fields=lambda m: {
                "reward": round(m["reward"], 4),
                "success": round(m["episode/success_rate"], 3),
                "invalid": round(m["episode/invalid_action_frac"], 3),
                "step_s": round(m["perf/step_s"], 2),
            },
        )

    def close(self) -> None:
        for env in self.envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - best effort
                pass
        if getattr(self.ctx.spec.env, "env_id", "") == "client":
            from opentinker_trainer.envs.remote import close_all_sessions

            close_all_sessions()


def run(ctx: WorkerContext) -> None:
    """Run (or resume) one attempt of ``lora_finetune`` on a Discrete ``gym``-kind environment.

    Raises:
        UserError: the environment cannot be made, is not Discrete-action, disagrees with the
            declared sizes, fails/times out/disappears (client-hosted); the model cannot be loaded.
    """
    trainer = GameTrainer(ctx)
    try:
        trainer.run()
    finally:
        trainer.close()
