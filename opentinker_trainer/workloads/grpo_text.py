"""``lora_finetune``: GRPO on a causal LM with a PEFT LoRA adapter, on a built-in text environment.

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
  reported without a reference), ``grpo/no_signal``, ``grpo/missing_rewards``, ``grpo/tokens``,
  ``completion/mean_tokens``, ``completion/truncated_frac``, ``optim/grad_norm`` (before
  clipping), ``optim/lr``, ``perf/step_s``, ``perf/generate_s``, ``perf/train_s``,
  ``perf/samples`` (completions this step), ``perf/tokens_per_s`` (completion tokens sampled per
  second of the whole step).

Distributed (a task with several ranks, :mod:`opentinker_trainer.distributed`): data-parallel.
Every rank holds the adapter (or all weights, replicated), draws the step's ``prompts_per_step``
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

import torch

from opentinker_trainer import distributed
from opentinker_trainer.context import UserError, WorkerContext
from opentinker_common.arithmetic import ArithmeticEnv
from opentinker_trainer.rl.grpo import ADAPTER_OFF, GRPOBatch, grpo_update, headline_metrics, rewards_tensor
from opentinker_trainer.rl.rollout import Rollout, generate, left_pad, sequence_logprobs
from opentinker_trainer.workloads import _lm
from opentinker_trainer.workloads._loop import run_trainer

log = _lm.get_logger("opentinker.trainer.lora_finetune")


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
        if tenant is not None:
            self.tokenizer, self.model = tenant.attach(cfg)
        else:
            self.tokenizer, self.model = _lm.load_for_training(ctx, cfg, self.device, dtype, full=self.full)
        self.stop_ids = _lm.stop_token_ids(self.tokenizer, self.model)
        self.pad_id = int(self.tokenizer.pad_token_id)
        # KL reference: the adapter switched off (LoRA), or a frozen copy of the starting weights
        # (full weights; only when kl_coef > 0, it costs a second model's memory).
        self.ref_model = (
            _lm.frozen_reference(ctx, cfg, self.model, self.device, dtype) if self.full and cfg.kl_coef > 0 else None
        )
        self.has_reference = not self.full or self.ref_model is not None
        self.params = (
            tenant.parameters() if tenant is not None else [p for p in self.model.parameters() if p.requires_grad]
        )
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self.env = ArithmeticEnv(ctx.spec.env, self.tokenizer, seed=cfg.seed)
        # Distributed: every rank draws the step's problems from the same environment stream and
        # rolls out its own share of the groups, sampling with its own seed (seed + rank).
        self.dp = distributed.world(ctx)
        if self.dp is not None:
            if cfg.prompts_per_step < self.dp.world_size:
                raise UserError(
                    f"hyperparameters.prompts_per_step {cfg.prompts_per_step}: fewer groups than the task's "
                    f"{self.dp.world_size} ranks (each rank rolls out whole groups)"
                )
            self.dp.broadcast(self.params)
            distributed.seed_rank(cfg.seed, self.dp.rank)
        self.step, env_state = _lm.resume_step(ctx, self.optimizer, log)
        if ctx.resume_from is not None:
            self.env.set_state(env_state)
            distributed.restore_rank_rng(ctx, _lm.load_trainer_state(ctx.resume_from), reseed=cfg.seed + self.step)
        self.started = time.perf_counter()

    # --- checkpoints --------------------------------------------------------------------------
    def save(self, *, final: bool) -> Path:
        fmt = _lm.FORMAT_FULL if self.full else _lm.FORMAT_LORA
        return distributed.save_once(
            self.ctx,
            lambda extra: _lm.save_step(
                self.ctx,
                self.step,
                self.model,
                self.optimizer,
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
        ro = generate(
            self.model,
            prompt_ids,
            prompt_mask,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=self.stop_ids,
            pad_token_id=self.pad_id,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            group_size=cfg.group_size,
        )
        replies = self.tokenizer.batch_decode(ro.completion_token_lists(), skip_special_tokens=True)
        rewards = [self.env.score(text, problems[i // cfg.group_size]) for i, text in enumerate(replies)]
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
        t0 = time.perf_counter()
        ro, rewards = self.rollout()
        t_gen = time.perf_counter() - t0

        batch = GRPOBatch(rewards=rewards.to(self.device), mask=ro.completion_mask, chunks=self.chunks(len(ro)))
        reference = (self.ref_model if self.full else ADAPTER_OFF) if self.has_reference else None
        out = grpo_update(
            self.model,
            self.optimizer,
            batch,
            lambda model, sl: self.logprobs(ro.select(sl), model=model),
            cfg,
            reference=reference,
            dp=self.dp,
        )

        step_s = time.perf_counter() - t0
        completion_tokens = int(ro.completion_lengths.sum())
        n = len(ro)
        truncated = float(ro.truncated.float().sum())
        if self.dp is not None:  # the global batch's numbers
            completion_tokens, n, truncated = (int(x) for x in self.dp.sum(completion_tokens, n, truncated))
        return {
            **headline_metrics(out),
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

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        run_trainer(
            self,
            log,
            total=self.cfg.steps,
            checkpoint_every=self.cfg.checkpoint_every,
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
