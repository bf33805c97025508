"""``lora_finetune``: GRPO on a causal LM with a PEFT LoRA adapter, on a built-in text environment.

Each step (Shao et al. 2024, DeepSeekMath, https://arxiv.org/abs/2402.03300):

1. draw ``prompts_per_step`` problems and sample ``group_size`` completions of each;
2. score them; advantages are rewards standardised within each group
   (:func:`~opentinker_trainer.rl.grpo.group_advantages`);
3. take ``ppo_epochs`` optimizer steps (AdamW, gradient clipping) on the clipped surrogate
   (:func:`~opentinker_trainer.rl.grpo.pg_loss`), plus ``kl_coef`` times the k3 KL to the
   reference model — the base model, i.e. the same weights with the adapter disabled.

Reports per step (``ctx.emit_metric``, steps from 1):

* ``loss``, ``reward`` (mean sampled reward), ``reward_std``, ``kl``, ``zero_std_frac``,
  ``samples`` (sampled completions so far), ``tokens_per_s``, ``wall_time_s`` (since this
  attempt started);
* ``loss/total``, ``loss/policy``, ``loss/kl`` (the penalty before ``kl_coef``), ``reward/mean``,
  ``reward/std``, ``grpo/zero_std_frac`` (groups with all-equal rewards: no signal),
  ``grpo/clipfrac``, ``grpo/approx_kl`` (k3 of KL(old || new), how far the updates moved),
  ``grpo/kl_ref`` (= ``kl``: k3 of KL(sampling policy || reference) on this step's samples),
  ``completion/mean_tokens``, ``completion/truncated_frac``, ``optim/grad_norm`` (before
  clipping), ``optim/lr``, ``perf/step_s``, ``perf/generate_s``, ``perf/train_s``,
  ``perf/samples`` (completions this step), ``perf/tokens_per_s`` (completion tokens sampled per
  second of the whole step).

Checkpoints (``<checkpoint_dir>/step_<n>``): the adapter in PEFT format plus ``trainer_state.pt``
(step, optimizer, RNG and environment states), every ``checkpoint_every`` steps, when a stop is
requested, and at the end. Resuming from one continues the step count, optimizer and RNGs, so a
resumed run samples what an uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

from opentinker_trainer.context import WorkerContext
from opentinker_common.arithmetic import ArithmeticEnv
from opentinker_trainer.rl.grpo import group_advantages, kl_k3, masked_mean, masked_sum, pg_loss
from opentinker_trainer.rl.rollout import Rollout, generate, left_pad, sequence_logprobs
from opentinker_trainer.workloads import _lm
from opentinker_trainer.workloads._loop import run_steps

CHECKPOINT_FORMAT = "peft_lora"
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
            "loading model", task_id=ctx.task_id, model=ctx.spec.model, device=str(self.device), dtype=str(dtype),
            full_weights=self.full, init_checkpoint=str(ctx.init_checkpoint) if ctx.init_checkpoint else None,
        )  # fmt: skip
        self.tokenizer, self.model = _lm.load_for_training(ctx, cfg, self.device, dtype, full=self.full)
        self.stop_ids = _lm.stop_token_ids(self.tokenizer, self.model)
        self.pad_id = int(self.tokenizer.pad_token_id)
        # KL reference: the adapter switched off (LoRA), or a frozen copy of the starting weights
        # (full weights; only when kl_coef > 0, it costs a second model's memory).
        self.ref_model = (
            _lm.frozen_reference(ctx, cfg, self.model, self.device, dtype) if self.full and cfg.kl_coef > 0 else None
        )
        self.has_reference = not self.full or self.ref_model is not None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self.env = ArithmeticEnv(ctx.spec.env, self.tokenizer, seed=cfg.seed)
        self.step = 0
        if ctx.resume_from is not None:
            state = _lm.load_trainer_state(ctx.resume_from)
            self.optimizer.load_state_dict(state["optimizer"])
            self.env.set_state(_lm.restore_rng(state["rng"]))
            self.step = int(state["step"])
            log.info("resumed", task_id=ctx.task_id, checkpoint=str(ctx.resume_from), step=self.step)
        self.started = time.perf_counter()

    # --- checkpoints --------------------------------------------------------------------------
    def save(self, *, final: bool) -> Path:
        path = Path(self.ctx.checkpoint_dir) / f"step_{self.step}"
        state = {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "rng": _lm.rng_state(self.env.get_state()),
            "model": self.ctx.spec.model,
            "hyperparameters": dataclasses.asdict(self.cfg),
        }
        _lm.save_checkpoint(path, self.model, state, tokenizer=self.tokenizer if self.full else None)
        self.ctx.emit_checkpoint(self.step, path, final=final, fmt=_lm.FORMAT_FULL if self.full else CHECKPOINT_FORMAT)
        log.info("checkpoint written", task_id=self.ctx.task_id, step=self.step, path=str(path), final=final)
        return path

    # --- one GRPO step --------------------------------------------------------------------------
    def rollout(self) -> tuple[Rollout, torch.Tensor]:
        cfg = self.cfg
        problems = self.env.sample(cfg.prompts_per_step)
        prompt_ids, prompt_mask = left_pad([self.env.encode(p) for p in problems], self.pad_id, self.device)
        self.model.eval()
        ro = generate(
            self.model, prompt_ids, prompt_mask,
            max_new_tokens=cfg.max_new_tokens, stop_token_ids=self.stop_ids, pad_token_id=self.pad_id,
            temperature=cfg.temperature, top_p=cfg.top_p, group_size=cfg.group_size,
        )  # fmt: skip
        replies = self.tokenizer.batch_decode(ro.completion_token_lists(), skip_special_tokens=True)
        rewards = [self.env.score(text, problems[i // cfg.group_size]) for i, text in enumerate(replies)]
        if self.step == 0 or cfg.steps <= 20 or self.step % 10 == 0:
            log.debug("sample", problem=problems[0].question, reply=replies[0], reward=rewards[0])
        return ro, torch.tensor(rewards, dtype=torch.float32).view(cfg.prompts_per_step, cfg.group_size)

    def logprobs(self, ro: Rollout, model=None) -> torch.Tensor:
        return sequence_logprobs(
            model if model is not None else self.model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
            temperature=self.cfg.temperature, group_size=self.cfg.group_size,
        )  # fmt: skip

    def chunks(self, n: int) -> list[slice]:
        k = self.cfg.group_size
        size = n if self.cfg.micro_batch_size == 0 else k * max(1, self.cfg.micro_batch_size // k)
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    @torch.no_grad()
    def no_grad_logprobs(self, ro: Rollout, *, reference: bool) -> torch.Tensor:
        self.model.eval()
        parts = []
        for sl in self.chunks(len(ro)):
            if reference and self.ref_model is not None:
                parts.append(self.logprobs(ro.select(sl), model=self.ref_model))
            elif reference:
                with self.model.disable_adapter():
                    parts.append(self.logprobs(ro.select(sl)))
            else:
                parts.append(self.logprobs(ro.select(sl)))
        return torch.cat(parts)

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        ro, rewards = self.rollout()
        t_gen = time.perf_counter() - t0

        adv, zero_std = group_advantages(rewards.to(self.device), scale=cfg.scale_rewards)
        adv = adv.flatten()
        valid = ~torch.isnan(rewards.flatten()).to(self.device)
        mask = ro.completion_mask & valid.unsqueeze(1)
        n_tokens = mask.sum().clamp(min=1).float()
        ref_logp = self.no_grad_logprobs(ro, reference=True) if self.has_reference else None
        # One on-policy epoch: the sampling policy's log-probs are the first forward's, detached.
        old_logp = self.no_grad_logprobs(ro, reference=False) if cfg.ppo_epochs > 1 else None

        self.model.train()
        sums = {"loss/policy": 0.0, "loss/kl": 0.0, "grpo/clipfrac": 0.0, "grpo/approx_kl": 0.0}
        grad_norm = 0.0
        sampling_logp = old_logp
        for epoch in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            epoch_logp = []
            for sl in self.chunks(len(ro)):
                logp = self.logprobs(ro.select(sl))
                epoch_logp.append(logp.detach())
                old = old_logp[sl] if old_logp is not None else logp.detach()
                m = mask[sl]
                policy_loss, stats = pg_loss(logp, old, adv[sl], m, cfg.clip_eps, normalizer=n_tokens)
                kl_loss = (
                    masked_sum(kl_k3(logp, ref_logp[sl]), m) / n_tokens if ref_logp is not None else torch.zeros(())
                )
                loss = policy_loss + cfg.kl_coef * kl_loss if cfg.kl_coef > 0 else policy_loss
                loss.backward()
                weight = (m.sum() / n_tokens).item()
                sums["loss/policy"] += policy_loss.item()
                sums["loss/kl"] += kl_loss.item()
                sums["grpo/clipfrac"] += stats["clipfrac"].item() * weight
                sums["grpo/approx_kl"] += stats["approx_kl"].item() * weight
            if sampling_logp is None:
                sampling_logp = torch.cat(epoch_logp)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm).item()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

        step_s = time.perf_counter() - t0
        avg = {k: v / cfg.ppo_epochs for k, v in sums.items()}
        loss_total = avg["loss/policy"] + cfg.kl_coef * avg["loss/kl"]
        kl_ref = (
            masked_mean(kl_k3(sampling_logp, ref_logp), mask).item() if ref_logp is not None else math.nan
        )  # NaN: not reported
        flat = rewards.flatten()
        finite = flat[~torch.isnan(flat)]
        reward_mean = finite.mean().item() if finite.numel() else math.nan
        reward_std = finite.std(unbiased=False).item() if finite.numel() else math.nan
        completion_tokens = int(ro.completion_lengths.sum())
        zero_std_frac = zero_std.float().mean().item()
        n = len(ro)
        return {
            "loss": loss_total, "reward": reward_mean, "reward_std": reward_std, "kl": kl_ref,
            "zero_std_frac": zero_std_frac, "samples": float(self.step * n),
            "tokens_per_s": completion_tokens / step_s, "wall_time_s": time.perf_counter() - self.started,
            "loss/total": loss_total, **avg, "reward/mean": reward_mean, "reward/std": reward_std,
            "grpo/zero_std_frac": zero_std_frac, "grpo/kl_ref": kl_ref,
            "completion/mean_tokens": completion_tokens / n,
            "completion/truncated_frac": ro.truncated.float().mean().item(),
            "optim/grad_norm": grad_norm, "optim/lr": cfg.learning_rate,
            "perf/step_s": step_s, "perf/generate_s": t_gen, "perf/train_s": step_s - t_gen,
            "perf/samples": float(n), "perf/tokens_per_s": completion_tokens / step_s,
        }  # fmt: skip

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        def one(n: int) -> dict[str, float]:
            self.step = n
            return self.train_step()

        def log_step(n: int, m) -> None:
            log.info(
                "step", task_id=self.ctx.task_id, step=n, reward=round(m["reward"], 4),
                loss=round(m["loss"], 5), kl=round(m["kl"], 5), step_s=round(m["perf/step_s"], 2),
            )  # fmt: skip

        run_steps(
            self.ctx,
            done=self.step,
            total=self.cfg.steps,
            step=one,
            save=self.save,
            checkpoint_every=self.cfg.checkpoint_every,
            log_step=log_step,
        )


def run(ctx: WorkerContext) -> None:
    """Run (or resume) one attempt of GRPO on a text task (``lora_finetune`` with a LoRA adapter,
    or ``full_rl`` on all weights); see the module docstring.

    Raises:
        UserError: the model cannot be loaded, or the hyper-parameters do not fit it.
    """
    _Trainer(ctx).run()
