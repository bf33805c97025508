"""``sft``: supervised fine-tuning of a causal LM on chat examples, LoRA or all weights.

Each optimizer step takes ``batch_size`` examples of the training split (seeded epochs, see
:func:`~opentinker_trainer.workloads.sft_data.batch_indices`), lays each out with the model's
chat template, and minimises the mean next-token cross-entropy over the assistant tokens only
(:func:`~opentinker_trainer.workloads.sft_data.assistant_label_mask`; every other label is
``-100``), i.e. the negative log-likelihood of the replies given their conversations. The
gradient is accumulated over micro-batches and normalised by the batch's assistant-token count,
so ``micro_batch_size`` changes memory use, not the update. AdamW with gradient clipping;
learning rate warmed up linearly over ``warmup_steps``, then ``constant``, ``linear`` or
``cosine`` decay as transformers' schedulers decay (:func:`lr_at`): the last step's rate is above 0.

Distributed (a task with several ranks, :mod:`opentinker_trainer.distributed`): data-parallel;
each rank trains on its contiguous share of every batch (normalised by the whole batch's
assistant tokens) and evaluates its share of the held-out split; gradients and the metrics' sums
are summed over ranks, so a step of W ranks is the step of one rank on the same batch.

Data: ``env_config.dataset_id`` (uploaded; fetched from the scheduler with ``NodeService.FetchDataset``
into the node's dataset cache) or ``env_config.path`` (a file on the node). Bad lines end the
task FAILED, not retried, naming each (up to ``MAX_BAD_LINES``) with its number.

Reports per step (``ctx.emit_metric``, steps from 1):

* ``loss`` (= ``loss/train``: mean cross-entropy per assistant token of this step's batch, nats);
* ``reward`` (= ``train/token_accuracy``): the fraction of this batch's assistant tokens that the
  model's most likely next token got right, in [0, 1], measured in the training forward pass.
  SFT has no reward; this is the always-present, higher-is-better number the seed's
  ``get_metrics`` loop prints;
* ``loss/eval`` and ``eval/token_accuracy`` (the same two on up to ``max_eval_examples`` held-out
  examples) every ``eval_every`` steps and after the last step; ``loss/eval_start`` with step 1
  of a fresh run (the held-out loss before any update);
* ``train/tokens`` (assistant tokens in the batch), ``train/epoch`` (passes over the training
  split so far), ``samples`` (examples so far), ``optim/lr``, ``optim/grad_norm`` (before
  clipping), ``perf/step_s``, ``perf/tokens_per_s`` and ``tokens_per_s`` (all tokens forwarded
  per second), ``perf/examples_per_s``, ``wall_time_s``.

Checkpoints (``<checkpoint_dir>/step_<n>``): with LoRA the adapter in PEFT format (format
``peft_lora``), else a transformers ``save_pretrained`` folder with the tokenizer (format
``hf_full``); both with ``trainer_state.pt`` (step, optimizer, RNG), so a resumed attempt continues
the step count, optimizer and RNG, and reads the batches an uninterrupted run would have. An RL
task starts from one with ``init_from`` (see :func:`opentinker_trainer.workloads._lm.load_for_training`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from opentinker_trainer import distributed, fsdp
from opentinker_trainer.context import UserError, WorkerContext
from opentinker_trainer.workloads import _lm
from opentinker_trainer.workloads import _keep
from opentinker_trainer.workloads._loop import run_steps
from opentinker_trainer.workloads.sft_data import (
    IGNORE_INDEX,
    Encoded,
    batch_indices,
    collate,
    encode_chat,
    read_chat_jsonl,
    split_indices,
    task_dataset,
)

log = _lm.get_logger("opentinker.trainer.sft")

__all__ = ["lr_at", "run", "token_nll"]


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token negative log-likelihood of the labelled tokens.

    Args:
        logits: ``[batch, seq, vocab]``, the model's output at each position.
        labels: ``[batch, seq]`` token ids, ``-100`` where not trained on; position ``t`` is
            predicted from the logits at ``t - 1`` (the usual causal-LM shift).

    Returns:
        ``(nll_sum, correct, count)``: the summed cross-entropy in nats (a scalar with grad), the
        number of labelled tokens the argmax got right, and the number of labelled tokens.
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    nll_sum = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    valid = shift_labels != IGNORE_INDEX
    correct = ((shift_logits.argmax(-1) == shift_labels) & valid).sum()
    return nll_sum, correct, valid.sum()


def lr_at(step: int, total: int, base: float, warmup: int, schedule: str) -> float:
    """Learning rate of optimizer step ``step`` (from 1) of ``total``.

    Warmup rises linearly over ``warmup`` steps and reaches ``base`` at step ``warmup``. Then
    ``constant`` keeps ``base``; ``linear`` and ``cosine`` decay as transformers'
    ``get_linear_schedule_with_warmup`` and ``get_cosine_schedule_with_warmup`` do: step ``s``
    uses their factor at ``s - 1``, so the first decaying step has ``base`` and the last step a
    rate above 0. Every optimizer step changes the weights.
    """
    if warmup and step <= warmup:
        return base * step / warmup
    if schedule == "constant" or total <= warmup:
        return base
    progress = max(0.0, (step - 1 - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return base * max(0.0, 1.0 - progress)
    return base * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


class _SFTTrainer:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.cfg = cfg = ctx.spec.hyperparameters
        self.env = env = ctx.spec.env
        self.device = torch.device(ctx.device)
        dtype = _lm.resolve_dtype(cfg.dtype, self.device)
        self.examples = read_chat_jsonl(self._dataset_file())
        self.train_idx, self.eval_idx = split_indices(len(self.examples), env.eval_fraction, env.seed)
        self.eval_idx = self.eval_idx[: cfg.max_eval_examples]
        self.total_steps = cfg.steps or cfg.epochs * math.ceil(len(self.train_idx) / cfg.batch_size)
        log.info(
            "loading model",
            task_id=ctx.task_id,
            model=ctx.spec.model,
            device=str(self.device),
            dtype=str(dtype),
            lora=cfg.lora,
            examples=len(self.examples),
            train=len(self.train_idx),
            eval=len(self.eval_idx),
            steps=self.total_steps,
            init_checkpoint=str(ctx.init_checkpoint) if ctx.init_checkpoint else None,
        )
        self.tokenizer, self.model = _lm.load_for_training(ctx, cfg, self.device, dtype, full=not cfg.lora)
        self.pad_id = int(self.tokenizer.pad_token_id)
        # Distributed: each rank trains on its contiguous share of every batch (and evaluates its
        # share of the held-out split); sums of tokens, losses and gradients are over ranks. All
        # weights (lora: false) are sharded with FSDP2 (opentinker_trainer/fsdp.py); an adapter
        # is replicated and its gradients all-reduced.
        self.dp = distributed.world(ctx)
        self.fsdp = self.dp is not None and not cfg.lora
        if self.fsdp:
            fsdp.shard_model(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self._encoded: dict[int, Encoded] = {}
        torch.manual_seed(cfg.seed)
        if self.dp is not None:
            if not self.fsdp:
                self.dp.broadcast(self.params)
            distributed.seed_rank(cfg.seed, self.dp.rank)
        resumable = fsdp.ShardedOptimizerState(self.model, self.optimizer) if self.fsdp else self.optimizer
        self.step, _ = _lm.resume_step(ctx, resumable, log)
        if ctx.resume_from is not None:
            distributed.restore_rank_rng(ctx, _lm.load_trainer_state(ctx.resume_from), reseed=cfg.seed + self.step)
        self.fresh = self.step == 0
        self.started = time.perf_counter()

    def _dataset_file(self) -> Path:
        if self.env.path is not None:
            return Path(self.env.path)
        return task_dataset(self.ctx, self.env.dataset_id)

    def encoded(self, i: int) -> Encoded:
        enc = self._encoded.get(i)
        if enc is None:
            enc = self._encoded[i] = encode_chat(self.tokenizer, self.examples[i], self.env.max_seq_len)
        return enc

    # --- checkpoints --------------------------------------------------------------------------
    def save(self, *, final: bool) -> Path:
        fmt = _lm.FORMAT_LORA if self.cfg.lora else _lm.FORMAT_FULL
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
                **({"extra_state": extra} if extra else {}),
            ),
            step=self.step,
            final=final,
            fmt=fmt,
        )

    def _mine(self, items: list[int]) -> list[int]:
        """This rank's contiguous share of ``items`` (all of them on one rank)."""
        return items if self.dp is None else [items[k] for k in self.dp.shard(len(items))]

    def _parts(self, items: list[int], size: int) -> list[tuple[list[int], bool]]:
        """This rank's share of ``items`` in micro-batches of ``size``, each with ``True``; under
        FSDP padded with dummy ones (``False``) so every rank runs as many passes."""
        mine = self._mine(items)
        if not self.fsdp:
            return [(mine[i : i + size], True) for i in range(0, len(mine), size)]
        counts = [len(distributed.shard(len(items), r, self.dp.world_size)) for r in range(self.dp.world_size)]
        return fsdp.equal_chunks(mine, size, counts, items[:1])

    # --- steps ----------------------------------------------------------------------------------
    def chunks(self, items: list[int]) -> list[list[int]]:
        size = self.cfg.micro_batch_size or len(items)
        return [items[i : i + size] for i in range(0, len(items), size)]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """``loss/eval`` and ``eval/token_accuracy`` on the held-out split (empty when none)."""
        if not self.eval_idx:
            return {}
        self.model.eval()
        nll = correct = count = 0.0
        size = self.cfg.micro_batch_size or self.cfg.batch_size
        for part, real in self._parts(self.eval_idx, size):
            ids, attn, labels = collate([self.encoded(i) for i in part], self.pad_id, self.device)
            s, c, n = token_nll(self.model(input_ids=ids, attention_mask=attn).logits, labels)
            if real:
                nll, correct, count = nll + s.item(), correct + c.item(), count + n.item()
        if self.dp is not None:
            nll, correct, count = self.dp.sum(nll, correct, count)
        if count == 0:
            return {}
        return {"loss/eval": nll / count, "eval/token_accuracy": correct / count}

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.total_steps, cfg.learning_rate, cfg.warmup_steps, cfg.lr_schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = [
            self.train_idx[k] for k in batch_indices(self.step, cfg.batch_size, len(self.train_idx), self.env.seed)
        ]
        encoded = [self.encoded(i) for i in batch]
        # Normalise by the whole batch's trained tokens, so micro-batches add up to its mean.
        n_tokens = max(1, sum(e.trained_tokens for e in encoded))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        nll = correct = 0.0
        seen_tokens = 0
        scale = fsdp.loss_scale(self.dp) if self.fsdp else 1.0  # FSDP averages the ranks' gradients
        for part, real in self._parts(list(range(len(encoded))), cfg.micro_batch_size or len(encoded)):
            ids, attn, labels = collate([encoded[j] for j in part], self.pad_id, self.device)
            s, c, _ = token_nll(self.model(input_ids=ids, attention_mask=attn).logits, labels)
            (s / n_tokens * (scale if real else 0.0)).backward()
            if real:
                nll, correct = nll + s.item(), correct + c.item()
                seen_tokens += int(attn.sum())
        if self.dp is not None:  # gradients and numbers of the whole batch
            if not self.fsdp:
                self.dp.all_reduce_grads(self.params)
            nll, correct, seen_tokens = self.dp.sum(nll, correct, seen_tokens)
        grad_norm = fsdp.grad_norm(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        step_s = time.perf_counter() - t0
        loss, acc = nll / n_tokens, correct / n_tokens
        return {
            "loss": loss,
            "reward": acc,
            "loss/train": loss,
            "train/token_accuracy": acc,
            "train/tokens": float(n_tokens),
            "train/epoch": self.step * cfg.batch_size / len(self.train_idx),
            "samples": float(self.step * cfg.batch_size),
            "optim/lr": lr,
            "optim/grad_norm": grad_norm,
            "perf/step_s": step_s,
            "perf/tokens_per_s": seen_tokens / step_s,
            "tokens_per_s": seen_tokens / step_s,
            "perf/examples_per_s": len(batch) / step_s,
            "wall_time_s": time.perf_counter() - self.started,
        }

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        start_eval: dict[str, float] = {}

        def first() -> None:
            if self.fresh:
                start_eval.update(self.evaluate())

        def one(n: int) -> dict[str, float]:
            self.step = n
            metrics = self.train_step()
            if n == 1 and "loss/eval" in start_eval:
                metrics["loss/eval_start"] = start_eval["loss/eval"]
            if n >= self.total_steps or (cfg.eval_every and n % cfg.eval_every == 0):
                metrics.update(self.evaluate())
            return metrics

        def log_step(n: int, m) -> None:
            log.info(
                "step",
                task_id=self.ctx.task_id,
                step=n,
                loss=round(m["loss"], 4),
                token_accuracy=round(m["reward"], 4),
                eval_loss=round(m["loss/eval"], 4) if "loss/eval" in m else None,
                step_s=round(m["perf/step_s"], 2),
            )

        run_steps(
            self.ctx,
            done=self.step,
            total=self.total_steps,
            step=one,
            save=self.save,
            checkpoint_every=cfg.checkpoint_every,
            keep=_keep.keeper(
                self.ctx, self.optimizer, state=lambda: self.step, restore=lambda step: setattr(self, "step", step)
            ),
            log_step=log_step,
            before_first=first,
        )


def run(ctx: WorkerContext) -> None:
    """Run (or resume) one attempt of an ``sft`` task; see the module docstring.

    Raises:
        UserError: the dataset has a bad line (named) or cannot be read or fetched, the model or
            an ``init_from`` checkpoint cannot be loaded, or the tokenizer has no chat template.
    """
    if ctx.spec.env.path is None and ctx.spec.env.dataset_id is None:  # pragma: no cover - the spec check refuses it
        raise UserError("env_config: expected dataset_id or path")
    _SFTTrainer(ctx).run()
