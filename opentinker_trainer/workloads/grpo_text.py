"""``lora_finetune``: GRPO on a causal LM with a PEFT LoRA adapter, on a text environment.

The environment comes from :data:`TEXT_ENVS` by ``env_id``: ``arithmetic`` (the built-in sums,
:mod:`opentinker_common.arithmetic`) or ``prompts`` (the prompts of a user's JSONL dataset scored
by a built-in verifier or the client's own reward, :mod:`opentinker_common.prompts`,
:mod:`opentinker_trainer.envs.client_reward`).

Each step (Shao et al. 2024, DeepSeekMath, https://arxiv.org/abs/2402.03300):

1. draw ``prompts_per_step`` problems and sample ``group_size`` completions of each;
2. score them; advantages are rewards standardised within each group
   (:func:`~opentinker_trainer.rl.grpo.group_advantages`);
3. take ``ppo_epochs`` optimizer steps (AdamW, gradient clipping) on the clipped surrogate
   (:func:`~opentinker_trainer.rl.grpo.pg_loss`), plus ``kl_coef`` times the k3 KL to the
   reference model — the base model, i.e. the same weights with the adapter disabled (LoRA), or a
   frozen copy of the starting weights (``full_rl`` with ``kl_coef > 0``). That update is
   :func:`~opentinker_trainer.rl.grpo.grpo_update`, shared with the game trainer, with its rules
   on groups without signal, missing rewards and the reported KL.

Reports per step (``ctx.emit_metric``, steps from 1):

* ``loss``, ``reward`` (mean sampled reward), ``reward_std``, ``kl``, ``zero_std_frac``,
  ``samples`` (sampled completions so far), ``tokens_per_s``, ``wall_time_s`` (since this
  attempt started);
* ``loss/total``, ``loss/policy``, ``loss/kl`` (the penalty before ``kl_coef``), ``reward/mean``,
  ``reward/std``, ``grpo/zero_std_frac`` (groups with all-equal rewards: no signal),
  ``grpo/clipfrac``, ``grpo/approx_kl`` (k3 of KL(old || new), how far the updates moved),
  ``grpo/kl_ref`` (= ``kl``: k3 of KL(sampling policy || reference) on this step's samples; not
  reported at ``kl_coef`` 0, where no reference forward runs), ``grpo/no_signal``,
  ``grpo/missing_rewards``, ``grpo/tokens``, ``train/tokens``,
  ``completion/mean_tokens``, ``completion/truncated_frac``, ``optim/grad_norm`` (before
  clipping), ``optim/lr``, ``perf/step_s``, ``perf/generate_s``, ``perf/train_s``,
  ``perf/samples`` (completions this step), ``perf/tokens_per_s`` (completion tokens sampled per
  second of the whole step). Times are wall time of this attempt's thread: on a model host that
  batches its tenants' rollouts and update passes (:meth:`opentinker_trainer.host.Tenant.generate`,
  :meth:`~opentinker_trainer.host.Tenant.update_pass`) ``perf/step_s``, ``perf/generate_s`` and
  ``perf/train_s`` include the turns of neighbours it waited for within its step.

On ``prompts`` also: ``data/skipped_lines`` (lines the reward cannot score, left out),
``reward/client_failures`` and ``reward/client_missing`` (a client reward's failed calls and
items without a reward this step, the evaluation's included), and every ``eval_every`` steps and
after the last the held-out split answered greedily: ``eval/accuracy``, ``eval/reward``,
``eval/prompts`` (:meth:`_Trainer.evaluate`); with step 1 of a fresh run also
``eval/accuracy_start`` and ``eval/reward_start``, the same evaluation of the starting model
before any update.

Distributed (a task with several ranks, :mod:`opentinker_trainer.distributed`): data-parallel.
Every rank holds the adapter (all weights: sharded with FSDP2, :mod:`opentinker_trainer.fsdp`,
the frozen KL reference too; sampling and evaluation synced across ranks), draws the step's ``prompts_per_step``
problems from the same environment stream and rolls out its contiguous share of the groups with
its own sampling seed (``seed + rank``); the loss is normalised over the global batch and the
gradients summed over ranks before clipping (:func:`~opentinker_trainer.rl.grpo.grpo_update`
with ``dp``), and the metrics are of the global batch (``perf/samples`` = all ranks' completions).

Checkpoints (``<checkpoint_dir>/step_<n>``): the adapter in PEFT format plus ``trainer_state.pt``
(step, optimizer, RNG and environment states), every ``checkpoint_every`` steps, when a stop is
requested, and at the end. Resuming from one continues the step count, optimizer and RNGs, so a
resumed run samples what an uninterrupted one would have. A distributed task's checkpoint is
written once, by rank 0, with every rank's RNG state (``rng_ranks``): a resume with the same
world size is exact; with another world size it works, but is not bit-exact (ranks beyond the
saved ones are reseeded).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable

import torch

from opentinker_trainer import distributed, fsdp
from opentinker_trainer.context import UserError, WorkerContext
from opentinker_common.arithmetic import ArithmeticEnv
from opentinker_common.prompts import PromptsEnv
from opentinker_common.spec.prompts import parse_prompt_line
from opentinker_trainer.rl.grpo import ADAPTER_OFF, GRPOBatch, grpo_update, headline_metrics, rewards_tensor
from opentinker_trainer.rl.rollout import Rollout, generate, left_pad, pad_completions, sequence_logprobs
from opentinker_trainer.workloads import _lm
from opentinker_trainer.workloads import _keep
from opentinker_trainer.workloads._loop import run_trainer

log = _lm.get_logger("opentinker.trainer.lora_finetune")

#: Held-out prompts answered per forward batch of an evaluation.
EVAL_BATCH = 16


def _arithmetic_env(trainer: "_Trainer") -> ArithmeticEnv:
    return ArithmeticEnv(trainer.ctx.spec.env, trainer.tokenizer, seed=trainer.cfg.seed)


def _prompts_env(trainer: "_Trainer") -> PromptsEnv:
    """The ``prompts`` environment: the dataset read (or fetched), its prompts checked against the
    model's context, the client reward connected when the reward is the client's.

    Raises:
        UserError: the dataset cannot be read or has a bad line; no line the reward can score; a
            prompt with ``max_new_tokens`` longer than the model's context (naming the lines).
    """
    from opentinker_trainer.workloads.sft_data import read_jsonl, task_dataset

    ctx, cfg, env = trainer.ctx, trainer.cfg, trainer.ctx.spec.env
    if env.path is not None:
        file = Path(env.path)
    else:
        file = task_dataset(ctx, env.dataset_id)
    lines = read_jsonl(file, parse_prompt_line)
    scorer = None
    if env.reward.is_client:
        from opentinker_trainer.envs.client_reward import ClientReward

        scorer = trainer.client_reward = ClientReward(env.reward)
    try:
        prompts = PromptsEnv(env, lines, trainer.tokenizer, scorer=scorer)
    except ValueError as exc:
        raise UserError(f"env_config.dataset: {exc}") from None
    context = getattr(trainer.model.config, "max_position_embeddings", None)
    if context:
        limit = int(context) - cfg.max_new_tokens
        long = prompts.too_long(limit)
        if long:
            shown = ", ".join(f"line {n} ({t} tokens)" for n, t in long[:5])
            raise UserError(
                f"env_config.dataset: {len(long)} prompt(s) do not fit the model's context of {context} tokens with "
                f"max_new_tokens={cfg.max_new_tokens} (at most {limit} prompt tokens): {shown}"
                + (f" and {len(long) - 5} more" if len(long) > 5 else "")
            )
    if prompts.skipped:
        log.warning(
            "prompt lines skipped: the reward cannot score them",
            task_id=ctx.task_id,
            skipped=prompts.skipped,
            first_lines=prompts.skipped_lines[:10],
        )
    return prompts


#: Text environments by ``env_id``: a builder taking the trainer (model and tokenizer loaded).
TEXT_ENVS: dict[str, Callable[["_Trainer"], Any]] = {"arithmetic": _arithmetic_env, "prompts": _prompts_env}


class _Trainer:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.cfg = cfg = ctx.spec.hyperparameters
        self.device = torch.device(ctx.device)
        dtype = _lm.resolve_dtype(cfg.dtype, self.device)
        # full_rl on a text environment: the same GRPO, all weights trained (no adapter).
        self.full = ctx.spec.workload_type == "full_rl"
        log.info(
            "loading model",
            task_id=ctx.task_id,
            model=ctx.spec.model,
            device=str(self.device),
            dtype=str(dtype),
            full_weights=self.full,
            init_checkpoint=str(ctx.init_checkpoint) if ctx.init_checkpoint else None,
        )
        # A tenant of a model host: the host's shared base model with this attempt's own adapter.
        tenant = getattr(ctx, "tenant", None)
        # Its rollouts and update passes go through the host (batched with its neighbours').
        self.generate = tenant.generate if tenant is not None else generate
        self.tenant = tenant
        if tenant is not None:
            self.tokenizer, self.model = tenant.attach(cfg)
        else:
            self.tokenizer, self.model = _lm.load_for_training(ctx, cfg, self.device, dtype, full=self.full)
        self.stop_ids = _lm.stop_token_ids(self.tokenizer, self.model)
        self.pad_id = int(self.tokenizer.pad_token_id)
        # KL reference, only with kl_coef > 0: the adapter switched off (LoRA), or a frozen copy of
        # the starting weights (full weights: a second model's memory). At kl_coef 0 no reference
        # forward runs and kl is not reported, as TRL does at beta 0.
        self.ref_model = (
            _lm.frozen_reference(ctx, cfg, self.model, self.device, dtype) if self.full and cfg.kl_coef > 0 else None
        )
        self.has_reference = cfg.kl_coef > 0
        # Distributed: every rank draws the step's problems from the same environment stream and
        # rolls out its own share of the groups, sampling with its own seed (seed + rank). All
        # weights (full_rl) are sharded with FSDP2 (opentinker_trainer/fsdp.py), the reference
        # copy too; an adapter is replicated and its gradients all-reduced.
        self.dp = distributed.world(ctx)
        self.fsdp = self.dp is not None and self.full and tenant is None
        if self.fsdp:
            fsdp.shard_model(self.model)
            if self.ref_model is not None:
                fsdp.shard_model(self.ref_model)
        self.params = (
            tenant.parameters() if tenant is not None else [p for p in self.model.parameters() if p.requires_grad]
        )
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self.client_reward = None
        self.eval_right: list[bool] = []  # the last held-out evaluation, per problem (evaluate)
        self.env = TEXT_ENVS[ctx.spec.env.env_id](self)
        if self.dp is not None:
            if cfg.prompts_per_step < self.dp.world_size:
                raise UserError(
                    f"hyperparameters.prompts_per_step {cfg.prompts_per_step}: fewer groups than the task's "
                    f"{self.dp.world_size} ranks (each rank rolls out whole groups)"
                )
            if not self.fsdp:  # sharded weights are loaded from the same files on every rank
                self.dp.broadcast(self.params)
            distributed.seed_rank(cfg.seed, self.dp.rank)
        resumable = fsdp.ShardedOptimizerState(self.model, self.optimizer) if self.fsdp else self.optimizer
        self.step, env_state = _lm.resume_step(ctx, resumable, log)
        if ctx.resume_from is not None:
            self.env.set_state(env_state)
            distributed.restore_rank_rng(ctx, _lm.load_trainer_state(ctx.resume_from), reseed=cfg.seed + self.step)
        self.started = time.perf_counter()

    # --- checkpoints --------------------------------------------------------------------------
    def save(self, *, final: bool) -> Path:
        fmt = _lm.FORMAT_FULL if self.full else _lm.FORMAT_LORA
        # FSDP: the full weights and optimizer state, gathered on every rank for rank 0 to write.
        full = fsdp.FullState(self.model, self.optimizer) if self.fsdp else None
        return distributed.save_once(
            self.ctx,
            lambda extra: _lm.save_step(
                self.ctx,
                self.step,
                full or self.model,
                full or self.optimizer,
                self.cfg,
                fmt=fmt,
                log=log,
                final=final,
                tokenizer=self.tokenizer,
                env_state=self.env.get_state(),
                **({"extra_state": extra} if extra else {}),
            ),
            step=self.step,
            final=final,
            fmt=fmt,
        )

    # --- one GRPO step --------------------------------------------------------------------------
    def rollout(self) -> tuple[Rollout, torch.Tensor]:
        cfg = self.cfg
        problems = self.env.sample(cfg.prompts_per_step)
        if self.dp is not None:  # this rank's groups (whole groups: advantages stay per group)
            problems = [problems[i] for i in self.dp.shard(len(problems))]
        prompt_ids, prompt_mask = left_pad([self.env.encode(p) for p in problems], self.pad_id, self.device)
        self.model.eval()
        ro = self.generate(
            self.model,
            prompt_ids,
            prompt_mask,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=self.stop_ids,
            pad_token_id=self.pad_id,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            group_size=cfg.group_size,
            synced=self.fsdp,
        )
        if self.fsdp:  # the same completion width on every rank: the same forwards' shapes
            ro = pad_completions(ro, int(self.dp.max(ro.completion_ids.shape[1])[0]), self.pad_id)
        replies = self.tokenizer.batch_decode(ro.completion_token_lists(), skip_special_tokens=True)
        rewards = self.env.score_batch(replies, [problems[i // cfg.group_size] for i in range(len(replies))])
        if self.step == 0 or cfg.steps <= 20 or self.step % 10 == 0:
            log.debug("sample", problem=problems[0].question, reply=replies[0], reward=rewards[0])
        return ro, rewards_tensor(rewards, len(problems), cfg.group_size)

    def logprobs(self, ro: Rollout, model=None) -> torch.Tensor:
        return sequence_logprobs(
            model if model is not None else self.model,
            ro.prompt_ids,
            ro.prompt_mask,
            ro.completion_ids,
            ro.completion_mask,
            temperature=self.cfg.temperature,
            group_size=self.cfg.group_size,
        )

    def chunks(self, n: int) -> list[slice]:
        k = self.cfg.group_size
        size = n if self.cfg.micro_batch_size == 0 else k * max(1, self.cfg.micro_batch_size // k)
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        start = self.eval_start()
        t0 = time.perf_counter()
        ro, rewards = self.rollout()
        t_gen = time.perf_counter() - t0

        batch = GRPOBatch(rewards=rewards.to(self.device), mask=ro.completion_mask, chunks=self.chunks(len(ro)))
        reference = (self.ref_model if self.full else ADAPTER_OFF) if self.has_reference else None
        chunk_pass = None
        if self.tenant is not None:

            def chunk_pass(sl: slice, loss_of) -> torch.Tensor:
                return self.tenant.update_pass(ro.select(sl), self.params, loss_of, cfg.temperature, cfg.group_size)

        out = grpo_update(
            self.model,
            self.optimizer,
            batch,
            lambda model, sl: self.logprobs(ro.select(sl), model=model),
            cfg,
            reference=reference,
            dp=self.dp,
            sharded=self.fsdp,
            chunk_pass=chunk_pass,
        )

        step_s = time.perf_counter() - t0
        completion_tokens = int(ro.completion_lengths.sum())
        n = len(ro)
        truncated = float(ro.truncated.float().sum())
        if self.dp is not None:  # the global batch's numbers
            completion_tokens, n, truncated = (int(x) for x in self.dp.sum(completion_tokens, n, truncated))
        extra = {**start, **self.env_metrics()}
        return {
            **headline_metrics(out),
            **extra,
            "samples": float(self.step * n),
            "tokens_per_s": completion_tokens / step_s,
            "wall_time_s": time.perf_counter() - self.started,
            **out,
            "completion/mean_tokens": completion_tokens / n,
            "completion/truncated_frac": truncated / n,
            "optim/lr": cfg.learning_rate,
            "perf/step_s": step_s,
            "perf/generate_s": t_gen,
            "perf/train_s": step_s - t_gen,
            "perf/samples": float(n),
            "perf/tokens_per_s": completion_tokens / step_s,
        }

    # --- prompts: data counts and the held-out evaluation ---------------------------------------
    def eval_start(self) -> dict[str, float]:
        """Before the first update of a fresh run: the held-out evaluation of the starting model,
        as ``eval/accuracy_start``, ``eval/reward_start`` (reported with step 1)."""
        if self.step != 1 or not isinstance(self.env, PromptsEnv) or not self.env.eval_problems:
            return {}
        if not self._reports() and not self.fsdp:
            return {}
        out = self.evaluate(updates=0)  # sharded: every rank generates, rank 0 alone scores
        return {f"{k}_start": v for k, v in out.items() if k != "eval/prompts"}

    def env_metrics(self) -> dict[str, float]:
        if not isinstance(self.env, PromptsEnv):
            return {}
        out = {"data/skipped_lines": float(self.env.skipped)}
        every = self.env.config.eval_every
        if self.env.eval_problems and ((every and self.step % every == 0) or self.step == self.cfg.steps):
            if self._reports() or self.fsdp:  # only rank 0 reports; sharded, every rank generates
                out.update(self.evaluate(updates=self.step))
        if self.client_reward is not None:  # this step's calls, the evaluation's included
            out.update(self.client_reward.take_counts())
        return out

    def _reports(self) -> bool:
        """Whether this rank reports the evaluation (rank 0, or the only rank)."""
        return self.dp is None or self.dp.rank == 0

    @torch.no_grad()
    def evaluate(self, updates: int) -> dict[str, float]:
        """Greedy replies to the held-out prompts (``max_new_tokens`` each), scored by the reward.

        Returns ``eval/accuracy`` (share judged right: the verifier alone gives 1.0; for a
        client reward, reward >= ``eval_threshold``), ``eval/reward`` (mean reward, verifier and
        shaping terms; missing client rewards left out), ``eval/prompts``. ``updates``: how many
        steps the model has been trained for (for the log line). Sharded (FSDP), every rank
        generates (each forward a collective, ``synced_gpus``) and only rank 0 scores: the others
        return ``{}``.

        Also keeps the per-problem judgements on ``self.eval_right`` (one bool per held-out
        problem, in ``env.eval_problems`` order, the same problems every evaluation) for a paired
        comparison between evaluations (``scripts/bench_rlvr.py``); not a metric.
        """
        env: PromptsEnv = self.env
        problems = env.eval_problems
        self.model.eval()
        replies: list[str] = []
        for i in range(0, len(problems), EVAL_BATCH):
            batch = problems[i : i + EVAL_BATCH]
            ids, mask = left_pad([env.encode(p) for p in batch], self.pad_id, self.device)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask.long(),
                do_sample=False,
                max_new_tokens=self.cfg.max_new_tokens,
                eos_token_id=list(self.stop_ids),
                pad_token_id=self.pad_id,
                temperature=None,
                top_p=None,
                top_k=None,
                **({"synced_gpus": True} if self.fsdp else {}),
            )
            replies.extend(self.tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True))
        if not self._reports():
            return {}
        rewards = env.score_batch(replies, problems)
        if env.config.reward.is_client:
            right = [r is not None and r >= env.config.eval_threshold for r in rewards]
        else:
            right = [env.correct(r, p) for r, p in zip(replies, problems)]
        self.eval_right = right
        got = [r for r in rewards if r is not None]
        out = {"eval/accuracy": sum(right) / len(problems), "eval/prompts": float(len(problems))}
        if got:  # none when every client reward of the evaluation is missing
            out["eval/reward"] = sum(got) / len(got)
        log.info("eval", task_id=self.ctx.task_id, updates=updates, accuracy=round(out["eval/accuracy"], 4))
        return out

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        def restore(own) -> None:
            self.step = own[0]
            self.env.set_state(own[1])

        run_trainer(
            self,
            log,
            total=self.cfg.steps,
            checkpoint_every=self.cfg.checkpoint_every,
            keep=_keep.keeper(
                self.ctx, self.optimizer, state=lambda: (self.step, self.env.get_state()), restore=restore
            ),
            fields=lambda m: {
                "reward": round(m["reward"], 4),
                "loss": round(m["loss"], 5),
                "kl": round(m["kl"], 5),
                "step_s": round(m["perf/step_s"], 2),
            },
        )


def run(ctx: WorkerContext) -> None:
    """Run (or resume) one attempt of GRPO on a text task (``lora_finetune`` with a LoRA adapter,
    or ``full_rl`` on all weights); see the module docstring.

    Raises:
        UserError: the model cannot be loaded, or the hyper-parameters do not fit it.
    """
    turn = getattr(ctx, "turn", contextlib.nullcontext)  # a model host's tenant: build it in its turn
    with turn():
        trainer = _Trainer(ctx)
    trainer.run()
