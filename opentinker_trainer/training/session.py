"""One training session: a LoRA adapter on a base model, trained by its owner's calls.

Usable without a channel (the tests drive it directly); :mod:`.server` adapts it to gRPC and
:mod:`opentinker_trainer.workloads.lora_session` runs it as a task.

* :meth:`TrainingSession.forward_backward` adds the gradient of a loss (:mod:`.losses`) over a
  batch of datums (:mod:`.datums`) to the session's accumulated gradient; calls add up until
  :meth:`~TrainingSession.optim_step` applies AdamW (decoupled weight decay, Loshchilov & Hutter
  2019, ``torch.optim.AdamW``) after clipping the global gradient norm. A refused call (a bad
  datum, a non-finite loss, an error half-way through the micro-batches) leaves the accumulated
  gradient as it was: the call's gradient is built apart and added only once all of it exists.
* :meth:`~TrainingSession.forward` returns log-probabilities only; :meth:`~TrainingSession.sample`
  draws completions from the current weights and :meth:`~TrainingSession.sample_snapshot` from a
  sampler save or the base model, several prompts in one batch (:mod:`.sampling`), recording the
  samples for ``stable_reinforce`` when asked (:mod:`.provenance`).
* :meth:`~TrainingSession.save_state` / :meth:`~TrainingSession.load_state` write and read a
  checkpoint folder: the adapter in PEFT format (``adapter_config.json`` +
  ``adapter_model.safetensors``) and ``trainer_state.pt`` (step, AdamW state, the name, the
  next sequence number), the folder a ``lora_finetune`` task writes.

On a model host (:mod:`opentinker_trainer.host`) the model is the host's shared base with this
session's adapter among other tenants' (``adapter_name``, ``params``); every call that uses the
model then runs inside the tenant's turn (``turn``): its adapter active, its RNG streams in place,
no other tenant's step in between.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from opentinker_common.spec.session import STATE_NAME

from opentinker_trainer.rl.grpo import token_logprobs
from opentinker_trainer.rl.rollout import left_pad, prefix_logprobs, right_pad
from opentinker_trainer.training.datums import Datum, Limits, check_batch
from opentinker_trainer.training.errors import BadRequest, NotReady, OverLimit, StateNotFound
from opentinker_trainer.training.losses import datum_loss, loss_config
from opentinker_trainer.training.provenance import Recorded, SequenceRecords, first_sampled
from opentinker_trainer.training.sampling import PromptSamples, Sampled, SampleParams, sample_prompts
from opentinker_trainer.workloads import _lm

__all__ = [
    "AdamParams",
    "ForwardBackwardResult",
    "PromptSamples",
    "Sampled",
    "SampleParams",
    "SampleResult",
    "SavedState",
    "TrainingSession",
    "check_state_name",
]

#: ``trainer_state.pt`` ``kind`` of a full state and of a frozen copy for a sampler.
KIND_STATE, KIND_SAMPLER = "session_state", "sampler_weights"


def _in_turn(method):
    """Run ``method`` inside the session's turn on the model (once: a call within a call, such as
    :meth:`TrainingSession.adopt` loading a state, holds the turn it is in)."""

    @functools.wraps(method)
    def in_turn(self: "TrainingSession", *args, **kwargs):
        if self._holding:
            return method(self, *args, **kwargs)
        with self._turn():
            self._holding = True
            try:
                return method(self, *args, **kwargs)
            finally:
                self._holding = False

    return in_turn


def check_state_name(name: str) -> str:
    """``name`` if it is 1 to 64 of ``[A-Za-z0-9._-]`` (not ``.`` or ``..``), else :class:`BadRequest`."""
    if not isinstance(name, str) or not STATE_NAME.match(name) or name in (".", ".."):
        raise BadRequest(f"name: expected 1 to 64 characters of [A-Za-z0-9._-], got {name!r}")
    return name


@dataclass(frozen=True)
class AdamParams:
    """AdamW hyper-parameters of one optimizer step (``torch.optim.AdamW``'s, plus the clip)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: Clip the global L2 norm of the gradient to this; 0 = no clipping.
    max_grad_norm: float = 1.0

    def check(self) -> None:
        """Raises :class:`BadRequest` naming ``adam.<field>`` and what was expected."""
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise BadRequest(f"adam.learning_rate: expected a finite number > 0, got {self.learning_rate}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not (0.0 <= v < 1.0):
                raise BadRequest(f"adam.{name}: expected a number in [0, 1), got {v}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise BadRequest(f"adam.eps: expected a finite number > 0, got {self.eps}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise BadRequest(f"adam.weight_decay: expected a finite number >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            raise BadRequest(
                f"adam.max_grad_norm: expected a finite number >= 0 (0 = no clipping), got {self.max_grad_norm}"
            )


@dataclass
class ForwardBackwardResult:
    """Per datum, in order: ``logprobs`` (``N`` floats) and ``losses``; ``loss`` their sum."""

    logprobs: list[list[float]]
    losses: list[float]
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    accumulated_calls: int = 0


@dataclass
class SampleResult:
    prompt_tokens: list[int]
    samples: list[Sampled]
    step: int
    prompt_logprobs: list[float] = field(default_factory=list)
    topk_prompt_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class SavedState:
    name: str
    step: int
    folder: Path
    artifact_key: str = ""


class TrainingSession:
    """The state of one session: ``model`` (a PEFT model whose trainable parameters are the
    adapter), its AdamW optimizer, the accumulated gradient and the counters.

    Args:
        model, tokenizer: the PEFT model and its tokenizer (``_lm.load_for_training``).
        model_name: the base model as the task names it (written into saved adapters).
        lora: ``{"lora_rank", "lora_alpha", "target_modules"}`` of the adapter; None: the model is
            a plain one whose every weight trains (full weights; states are ``hf_full`` folders:
            ``config.json`` + ``model*.safetensors``, the tokenizer, ``trainer_state.pt``).
        limits: bounds per call (:class:`~.datums.Limits`).
        micro_batch_tokens: padded tokens per forward pass.
        checkpoint_dir: where states are written (``state_<name>``, ``sampler_<name>``).
        publish: ``(step, folder, kind) -> artifact key`` puts a written state into the artifact
            store (the workload's; None: folders only).
        params: the adapter's parameters, for the optimizer and the gradient (default: every
            parameter of ``model`` that requires a gradient; a model host's tenant passes its own,
            :meth:`opentinker_trainer.host.Tenant.parameters`).
        adapter_name: the PEFT name of the session's adapter in ``model`` (``default`` alone).
        turn: a context manager factory each call that uses the model runs in (a model host's
            :meth:`~opentinker_trainer.host.Tenant.turn`; default: none).
        report: ``(step, values)`` called after each optimizer step with that step's metrics
            (the workload's ``ctx.emit_metric``: the task's curve and its usage accounting):
            ``loss`` (summed over the step's ``forward_backward`` calls), ``train/tokens`` (tokens
            of their datums), ``tokens_generated`` (completion tokens sampled since the step
            before), ``grad_norm`` (before clipping), ``learning_rate``, ``forward_backward_calls``.
        snapshot_bytes: memory for copies of sampler saves' weights (:meth:`sample_snapshot`);
            a save beyond it is read back from its folder when sampled.
        fetch_state: ``(artifact key, manifest SHA-256, bytes) -> folder`` of another task's state
            in the artifact store, for :meth:`load_state` with ``artifact``; it raises
            :class:`StateNotFound` for one the task's owner may not read or the store lost. None:
            no store, and only the session's own states load.

    Raises:
        ValueError: ``model`` has no trainable (adapter) parameters.

    Not thread-safe: one call at a time (the servicer's :class:`~.sequencing.Sequencer` sees to it).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        model_name: str,
        lora: dict[str, Any] | None,
        limits: Limits = Limits(),
        micro_batch_tokens: int = 8192,
        checkpoint_dir: Path | None = None,
        publish: Callable[[int, Path, str], str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        params: Sequence[torch.nn.Parameter] | None = None,
        adapter_name: str = "default",
        turn: Callable[[], contextlib.AbstractContextManager] | None = None,
        report: Callable[[int, dict[str, float]], None] | None = None,
        snapshot_bytes: int = 256 << 20,
        fetch_state: Callable[[str, str, int], Path] | None = None,
    ) -> None:
        self.model = model
        self.adapter_name = adapter_name
        self._turn = turn or contextlib.nullcontext
        self._holding = False
        self.report = report
        #: What the next optimizer step's metrics sum: loss, tokens trained, tokens sampled.
        self._since_step = {"loss": 0.0, "train/tokens": 0.0, "tokens_generated": 0.0}
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.full = lora is None
        self.lora = dict(lora) if lora is not None else {}
        self.limits = limits
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.publish = publish
        self.fetch_state = fetch_state
        self.params = list(params) if params is not None else [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model: expected trainable (adapter) parameters, found none")
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.0)
        self.device = self.params[0].device
        self.step = 0
        self.accumulated_calls = 0
        self.states: dict[str, SavedState] = {}
        #: Sampler saves of this attempt, by name, and in-memory copies of their weights (the
        #: newest within ``snapshot_bytes``), for :meth:`sample_snapshot`.
        self.samplers: dict[str, SavedState] = {}
        self.snapshot_bytes = int(snapshot_bytes)
        self._frozen: collections.OrderedDict[str, list[torch.Tensor]] = collections.OrderedDict()
        #: Samples recorded for stable_reinforce, by sequence id.
        self.records = SequenceRecords()
        #: Folders (``state_<name>``, ``sampler_<name>``) this attempt published: stored artifacts are
        #: immutable, so a name is saved once per attempt.
        self._published: set[str] = set()
        self.resumed_from = ""
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        emb = model.get_input_embeddings().num_embeddings
        out = getattr(model.get_output_embeddings(), "out_features", emb)
        self.vocab_size = int(min(emb, out))
        self.context = int(getattr(model.config, "max_position_embeddings", 1 << 20) or (1 << 20))
        self.stop_token_ids = (
            list(stop_token_ids) if stop_token_ids is not None else _lm.stop_token_ids(tokenizer, model)
        )

    # --- forward passes -------------------------------------------------------------------------
    def _micro_batches(self, datums: Sequence[Datum]) -> list[list[int]]:
        """Consecutive datum indices whose padded size stays within ``micro_batch_tokens``."""
        groups: list[list[int]] = []
        width = 0
        for i, d in enumerate(datums):
            n = len(d)
            if groups and (len(groups[-1]) + 1) * max(width, n) <= self.micro_batch_tokens:
                groups[-1].append(i)
                width = max(width, n)
            else:
                groups.append([i])
                width = n
        return groups

    def _logprobs(self, datums: Sequence[Datum], rows: list[int]) -> list[torch.Tensor]:
        """Log-prob of each target token of ``datums[rows]``: one ``[N_i]`` float32 tensor each."""
        width = max(len(datums[i]) for i in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        targets = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            n = len(datums[i])
            ids[r, :n] = torch.as_tensor(list(datums[i].input_tokens), dtype=torch.long)
            targets[r, :n] = torch.as_tensor(list(datums[i].target_tokens), dtype=torch.long)
            mask[r, :n] = 1
        ids, targets, mask = ids.to(self.device), targets.to(self.device), mask.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logp = token_logprobs(logits, targets)
        return [logp[r, : len(datums[i])] for r, i in enumerate(rows)]

    def _scored_from(self, d: Datum, loss_fn: str) -> int:
        """First position whose loss coefficient (weight, or advantage) is not 0 (``len(d)`` if none).
        dro's penalty has a gradient at every token, so with dro it is 0."""
        coeff = d.weights if loss_fn == "cross_entropy" else d.advantages
        if loss_fn == "dro" or (loss_fn == "cross_entropy" and not len(coeff)):
            return 0
        if loss_fn == "stable_reinforce":  # its penalty has a gradient at every sampled token
            return first_sampled(d)
        for t, c in enumerate(coeff):
            if c != 0:
                return t
        return len(d)

    def _shared_logprobs(self, datums: Sequence[Datum], rows: list[int], loss_fn: str) -> dict[int, torch.Tensor]:
        """Log-probs (with grad where they count) of the next-token datums of ``rows`` whose
        unscored prefix (the tokens before the first non-zero weight or advantage) they share with
        others: each such prefix runs once, its key/value cache serves its group
        (:func:`opentinker_trainer.rl.rollout.prefix_logprobs`, exact up to float rounding), and the
        prefix positions' log-probs come from that pass's hidden states, without gradient (from a
        no-grad pass over the distinct prefixes for a model whose output projection does not give
        its logits). Returns
        ``{datum index: [N] log-probs}`` for the datums done so (the rest run flat)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i in rows:
            d = datums[i]
            start = self._scored_from(d, loss_fn)
            if start < 1 or start >= len(d) or list(d.target_tokens[:-1]) != list(d.input_tokens[1:]):
                continue
            groups.setdefault(tuple(d.input_tokens[:start]), []).append(i)
        groups = {k: v for k, v in groups.items() if len(v) > 1}
        if not groups:
            return {}
        prefixes = list(groups)
        members = [(g, i) for g, key in enumerate(prefixes) for i in groups[key]]
        prefix_ids, prefix_mask = left_pad(prefixes, self.pad_id, self.device)
        completions = [list(datums[i].target_tokens[len(prefixes[g]) - 1 :]) for g, i in members]
        comp_ids, comp_mask = right_pad(completions, self.pad_id, self.device)
        index = torch.tensor([g for g, _ in members], dtype=torch.long, device=self.device)
        shared = prefix_logprobs(self.model, prefix_ids, prefix_mask, index, comp_ids, comp_mask, prefix_scores=True)
        if shared is None:
            return {}
        scored, scores = shared
        if scores is not None:  # the prefix positions (coefficient 0): values only, from the prefix pass
            width = prefix_ids.shape[1]
            head = [scores[g, width - len(k) :] for g, k in enumerate(prefixes)]
        else:
            with torch.no_grad():
                flat = [Datum(list(k[:-1]) or [k[0]], list(k[1:]) or [k[0]]) for k in prefixes]
                head = self._logprobs(flat, list(range(len(flat))))
        out = {}
        for r, (g, i) in enumerate(members):
            n_prefix = len(prefixes[g]) - 1
            out[i] = torch.cat([head[g][:n_prefix].detach(), scored[r, : len(completions[r])]])
        return out

    @_in_turn
    def forward(self, datums: Sequence[Datum]) -> list[list[float]]:
        """Log-prob of each target token of each datum under the current weights; no state change.

        Raises:
            BadRequest, OverLimit: see :func:`~.datums.check_batch`.
        """
        check_batch(datums, "forward", vocab_size=self.vocab_size, limits=self.limits, context=self.context)
        out: list[list[float]] = [[] for _ in datums]
        self.model.eval()
        with torch.no_grad():
            for rows in self._micro_batches(datums):
                for i, lp in zip(rows, self._logprobs(datums, rows)):
                    out[i] = lp.tolist()
        return out

    @_in_turn
    def forward_backward(
        self, datums: Sequence[Datum], loss_fn: str, *, loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardResult:
        """Add the gradient of ``loss_fn`` summed over ``datums`` to the accumulated gradient.

        Args:
            loss_fn: a loss of :mod:`.losses`, by Tinker's name.
            loss_fn_config: the loss's hyper-parameters by Tinker's ``loss_fn_config`` keys
                (:func:`~.losses.loss_config`); missing ones take their defaults.

        Returns:
            Per-datum log-probs and losses, and ``metrics`` keyed ``name:reduction``:
            ``loss:sum``, ``tokens:sum``, ``importance_ratio:mean`` (policy losses) and
            ``clip_fraction:mean`` (ppo, cispo, gspo).

        Raises:
            BadRequest: a bad batch (:func:`~.datums.check_batch`), a bad ``loss_fn_config``, a
                stable_reinforce datum whose provenance the records refute
                (:meth:`~.provenance.SequenceRecords.resolve`), or a loss that is not finite
                (naming the datum); nothing accumulated.
            OverLimit: over the bounds per call.
        """
        config = loss_config(loss_fn, loss_fn_config or {})
        check_batch(datums, loss_fn, vocab_size=self.vocab_size, limits=self.limits, context=self.context)
        # stable_reinforce reads the sampler's recorded log-probs, not the datum's.
        provenance = (
            [self.records.resolve(d, f"datums[{i}]") for i, d in enumerate(datums)]
            if loss_fn == "stable_reinforce"
            else None
        )
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        logprobs: list[list[float]] = [[] for _ in datums]
        losses = [0.0] * len(datums)
        ratio_sum = clipped = 0.0
        try:
            # Dropout off, as in sample and forward: the loss scores the policy that sampled, so
            # the first step's importance ratio is 1 (grpo_update makes the same choice).
            self.model.eval()
            for rows in self._micro_batches(datums):
                parts = []
                shared = self._shared_logprobs(datums, rows, loss_fn)
                flat = [i for i in rows if i not in shared]
                computed = {**shared, **dict(zip(flat, self._logprobs(datums, flat) if flat else []))}
                for i in rows:
                    lp = computed[i]
                    d = datums[i]
                    sampling_logprobs, sampled = d.sampling_logprobs, ()
                    if provenance is not None:
                        sampling_logprobs, sampled = provenance[i].sampling_logprobs, provenance[i].sampled
                    loss, diag = datum_loss(
                        loss_fn,
                        lp,
                        weights=_tensor(d.weights, lp),
                        advantages=_tensor(d.advantages, lp),
                        sampling_logp=_tensor(sampling_logprobs, lp),
                        sequence_ratio_mask=_tensor(d.sequence_ratio_mask, lp),
                        sampled=_tensor(sampled, lp),
                        config=config,
                    )
                    value = float(loss.detach())
                    if not math.isfinite(value):
                        raise BadRequest(
                            f"datums[{i}]: the {loss_fn} loss is not finite ({value}); check its sampling_logprobs "
                            "(an importance ratio exp(logp - sampling_logprobs) overflowed?) and advantages"
                        )
                    losses[i] = value
                    logprobs[i] = lp.detach().tolist()
                    ratio_sum += float(diag.get("ratio_sum", 0.0))
                    clipped += float(diag.get("clipped", 0.0))
                    parts.append(loss)
                torch.stack(parts).sum().backward()
        except BaseException:
            for p, g in zip(self.params, saved):
                p.grad = g
            raise
        for p, g in zip(self.params, saved):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self.accumulated_calls += 1
        tokens = sum(len(d) for d in datums)
        self._since_step["loss"] += float(sum(losses))
        self._since_step["train/tokens"] += float(tokens)
        metrics = {"loss:sum": float(sum(losses)), "tokens:sum": float(tokens)}
        if loss_fn != "cross_entropy":
            metrics["importance_ratio:mean"] = ratio_sum / tokens
        if loss_fn in ("ppo", "cispo", "gspo"):
            metrics["clip_fraction:mean"] = clipped / tokens
        return ForwardBackwardResult(logprobs, losses, float(sum(losses)), metrics, self.accumulated_calls)

    @_in_turn
    def optim_step(self, adam: AdamParams) -> tuple[int, float]:
        """Apply the accumulated gradient with AdamW; returns ``(step, grad_norm before clipping)``.

        Raises:
            BadRequest: a bad hyper-parameter (``adam.<field>``).
            NotReady: nothing accumulated since the last step; or the gradient norm is not finite
                (the gradient is then discarded and the weights unchanged).
        """
        adam.check()
        if self.accumulated_calls == 0:
            raise NotReady(
                "optim_step: no gradient accumulated since the last optimizer step; call forward_backward first"
            )
        limit = adam.max_grad_norm if adam.max_grad_norm > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, limit))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.accumulated_calls = 0
            raise NotReady(f"optim_step: the gradient norm is {norm}; the gradient was discarded, weights unchanged")
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        calls, self.accumulated_calls = self.accumulated_calls, 0
        self.step += 1
        values, self._since_step = self._since_step, dict.fromkeys(self._since_step, 0.0)
        if self.report is not None:
            values.update(grad_norm=norm, learning_rate=adam.learning_rate, forward_backward_calls=float(calls))
            self.report(self.step, values)
        return self.step, norm

    # --- sampling -------------------------------------------------------------------------------
    def prompt_tokens(self, tokens: Sequence[int] | None, messages: Sequence[tuple[str, str]] | None) -> list[int]:
        """The prompt as token ids: ``tokens``, or ``messages`` through the chat template."""
        if messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise NotReady("messages: this model's tokenizer has no chat template; send prompt tokens")
            if not messages:
                raise BadRequest("messages: expected at least one message")
            try:
                ids = self.tokenizer.apply_chat_template(
                    [{"role": r, "content": c} for r, c in messages], add_generation_prompt=True, tokenize=True
                )
            except Exception as exc:  # the template's own checks, e.g. roles that must alternate
                raise BadRequest(f"messages: the model's chat template refused them: {exc}") from exc
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if not tokens:
            raise BadRequest("prompt: expected prompt tokens or chat messages, got none")
        for t, tok in enumerate(tokens):
            if not 0 <= tok < self.vocab_size:
                raise BadRequest(f"prompt.tokens[{t}]: expected a token id in [0, {self.vocab_size}), got {tok}")
        return list(tokens)

    def _jobs(
        self, jobs: Sequence[tuple[list[int], int, int | None]], params: SampleParams, where: str, n_field: str
    ) -> None:
        """Refuse a call's prompts and parameters (:class:`BadRequest` naming the field; the
        token budget :class:`OverLimit`)."""
        params.check(self.vocab_size, where)
        budget = 0
        for j, (prompt, n, _) in enumerate(jobs):
            field_n = n_field.format(j=j)
            if not 1 <= n <= 64:
                raise BadRequest(f"{field_n}: expected 1 to 64 completions, got {n}")
            if len(prompt) + params.max_tokens > self.context:
                raise BadRequest(
                    f"{where}max_tokens: the prompt's {len(prompt)} tokens plus max_tokens {params.max_tokens} "
                    f"exceed the model's context of {self.context}"
                )
            budget += n * (len(prompt) + params.max_tokens)
        if budget > self.limits.max_tokens_per_call:
            raise OverLimit(
                f"sample: the sum of samples * (prompt + max_tokens) is {budget} tokens, more than "
                f"max_tokens_per_call {self.limits.max_tokens_per_call}"
            )

    def _sample(
        self,
        jobs: Sequence[tuple[list[int], int, int | None]],
        params: SampleParams,
        more: Callable[[], Sequence[tuple[list[int], int, int | None]]] | None = None,
    ) -> list[PromptSamples]:
        out = sample_prompts(
            self.model,
            self.tokenizer,
            jobs,
            params,
            self.stop_token_ids,
            device=self.device,
            pad_id=self.pad_id,
            micro_batch_tokens=self.micro_batch_tokens,
            more=more,
        )
        self._since_step["tokens_generated"] += sum(len(s.tokens) for r in out for s in r.samples)
        return out

    def check_sample(self, prompt: Sequence[int], n: int, params: SampleParams) -> None:
        """Refuse a :meth:`sample` call before it runs.

        Raises:
            BadRequest: ``n`` outside 1..64, a parameter out of range (:meth:`SampleParams.check`),
                prompt plus max_tokens past the context.
            OverLimit: ``n * (prompt + max_tokens)`` over ``max_tokens_per_call``.
        """
        self._jobs([(list(prompt), n, None)], params, "", "n")

    def sample(self, prompt: list[int], *, n: int = 1, seed: int | None = None, params: SampleParams) -> SampleResult:
        """``n`` completions of ``prompt`` from the current weights.

        Raises:
            BadRequest, OverLimit: see :meth:`check_sample`.
        """
        self.check_sample(prompt, n, params)
        (result,) = self.sample_together([(list(prompt), n, seed)], params)
        return result

    @_in_turn
    def sample_together(
        self,
        jobs: Sequence[tuple[list[int], int, int | None]],
        params: SampleParams,
        more: Callable[[], Sequence[tuple[list[int], int, int | None]]] | None = None,
    ) -> list[SampleResult]:
        """:meth:`sample` of each ``(prompt, n, seed)`` of ``jobs`` and of the jobs ``more`` gives
        while they decode, in one continuous batch (:func:`~.sampling.sample_prompts`); the
        answers in the order the jobs came. Each job must have passed :meth:`check_sample`. With a
        seed a job samples what it samples alone: each job has its own random stream."""
        return [
            SampleResult(
                prompt_tokens=r.prompt_tokens,
                samples=r.samples,
                step=self.step,
                prompt_logprobs=r.prompt_logprobs,
                topk_prompt_logprobs=r.topk_prompt_logprobs,
            )
            for r in self._sample(jobs, params, more)
        ]

    @_in_turn
    def sample_snapshot(
        self,
        jobs: Sequence[tuple[list[int], int, int | None]],
        params: SampleParams,
        *,
        sampler: str | None,
        record: Sequence[Sequence[str]] = (),
    ) -> tuple[list[PromptSamples], int]:
        """Samples each ``(prompt, n, seed)`` of ``jobs`` from sampler save ``sampler`` of this
        session (None: the base model, the adapter off), all in one batch; the session's weights
        are as before afterwards. Returns the answers in order and the step of the weights.
        ``record[j]``, when given and not empty, names job ``j``'s samples: each is recorded
        under its id for ``stable_reinforce`` (:mod:`.provenance`).

        Raises:
            BadRequest: no prompts, more than ``max_datums_per_call``, a bad parameter or name,
                record ids that are not one new distinct id per sample.
            OverLimit: more prompts than ``max_datums_per_call``; the token budget.
            StateNotFound: no sampler save ``sampler`` in this attempt.
            NotReady: the base model of a session that trains every weight.
        """
        if not jobs:
            raise BadRequest("prompts: expected at least one prompt, got none")
        if len(jobs) > self.limits.max_datums_per_call:
            raise OverLimit(
                f"prompts: {len(jobs)} prompts, more than max_datums_per_call {self.limits.max_datums_per_call}"
            )
        self._jobs(jobs, params, "params.", "prompts[{j}].num_samples")
        seen: set[str] = set()
        for j, ids in enumerate(record):
            if ids:
                self.records.check_new(list(ids), jobs[j][1], f"prompts[{j}].record_sequence_ids")
                if seen & set(ids):
                    raise BadRequest(f"prompts[{j}].record_sequence_ids: an id of another prompt of this call")
                seen.update(ids)
        if any(record):
            params = dataclasses.replace(params, return_logprobs=True)
        results, step = self._sample_weights(jobs, params, sampler)
        for j, ids in enumerate(record):
            for sequence_id, sample in zip(ids, results[j].samples):
                self.records.record(
                    sequence_id, Recorded(tuple(jobs[j][0]), tuple(sample.tokens), tuple(sample.sampling_logprobs))
                )
        return results, step

    def _sample_weights(
        self, jobs: Sequence[tuple[list[int], int, int | None]], params: SampleParams, sampler: str | None
    ) -> tuple[list[PromptSamples], int]:
        if sampler is None:
            if self.full:
                raise NotReady("base_model: this session trains every weight; there is no base model to sample")
            with self.model.disable_adapter():
                return self._sample(jobs, params), 0
        check_state_name(sampler)
        saved = self.samplers.get(sampler)
        if saved is None:
            known = ", ".join(sorted(self.samplers)) or "none yet"
            raise StateNotFound(f"sampler {sampler!r}: no sampler save of that name in this session (saved: {known})")
        current = [p.detach().clone() for p in self.params]
        try:
            with torch.no_grad():
                frozen = self._frozen.get(sampler)
                if frozen is not None:
                    for p, v in zip(self.params, frozen):
                        p.copy_(v)
                elif self.full:
                    self._load_full_weights(sampler, saved.folder)
                else:
                    self._load_adapter(sampler, saved.folder)
            return self._sample(jobs, params), saved.step
        finally:
            with torch.no_grad():
                for p, v in zip(self.params, current):
                    p.copy_(v)

    def _freeze(self, name: str) -> None:
        """Keep a copy of the weights as sampler save ``name`` in memory, the newest first, within
        ``snapshot_bytes`` (older copies go; a save that does not fit is read from its folder)."""
        self._frozen.pop(name, None)
        size = sum(p.numel() * p.element_size() for p in self.params)
        if size > self.snapshot_bytes:
            return
        while self._frozen and size + self._frozen_bytes() > self.snapshot_bytes:
            self._frozen.popitem(last=False)
        self._frozen[name] = [p.detach().clone() for p in self.params]

    def _frozen_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for copy in self._frozen.values() for v in copy)

    # --- states ---------------------------------------------------------------------------------
    def _folder(self, prefix: str, name: str) -> Path:
        if self.checkpoint_dir is None:
            raise NotReady("this session has no checkpoint folder; it cannot save states")
        return self.checkpoint_dir / f"{prefix}_{name}"

    @_in_turn
    def save_state(self, name: str, *, next_sequence: int, kind: str = KIND_STATE) -> SavedState:
        """Write state ``name`` (``kind`` :data:`KIND_SAMPLER`: the adapter only, no optimizer) and
        publish it; returns what was saved. ``next_sequence``: the sequence number a session
        resumed from this state expects first."""
        check_state_name(name)
        folder = self._folder("state" if kind == KIND_STATE else "sampler", name)
        if self.publish is not None and folder.name in self._published:
            raise BadRequest(
                f"name: {name!r} was saved already in this attempt, and saved states are immutable; "
                "save under a new name"
            )
        state: dict[str, Any] = {
            "kind": kind,
            "name": name,
            "step": self.step,
            "next_sequence": int(next_sequence),
            "model": self.model_name,
            "lora": self.lora or None,
        }
        if kind == KIND_STATE:
            state["optimizer"] = self.optimizer.state_dict()
        tokenizer = self.tokenizer if self.full else None  # an hf_full folder loads on its own
        _lm.save_checkpoint(folder, self.model, state, tokenizer=tokenizer, base_model=self.model_name or None)
        key = self.publish(self.step, folder, kind) if self.publish is not None else ""
        if key:
            self._published.add(folder.name)
        saved = SavedState(name, self.step, folder, key or "")
        if kind == KIND_STATE:
            self.states[name] = saved
        else:
            self.samplers[name] = saved
            self._freeze(name)
        return saved

    @_in_turn
    def adopt(self, folder: Path) -> int:
        """Take the state in ``folder`` (a resumed attempt's ``resume_from``, whose adapter the
        model was loaded with) as this session's: its optimizer and step; returns its
        ``next_sequence``."""
        state = _lm.load_trainer_state(folder)
        name = str(state.get("name") or folder.name)
        self.states[name] = SavedState(name, int(state["step"]), Path(folder))
        self.resumed_from = name
        # Full weights were loaded from the folder itself (``_lm.load_for_training``): not again.
        self._load(name, with_optimizer=True, weights=not self.full)
        return int(state.get("next_sequence", 0))

    @_in_turn
    def start_from(self, folder: Path, *, with_optimizer: bool) -> None:
        """Take another task's state in ``folder`` (``init_from`` with ``init_state``, whose
        adapter the model was loaded with) as this session's start: with ``with_optimizer`` its
        AdamW state and step too. It is no state of this session: ``load_state`` does not know it."""
        name = str(_lm.load_trainer_state(folder).get("name") or folder.name)
        self._load_folder(name, Path(folder), with_optimizer=with_optimizer, weights=False)

    def load_state(self, name: str, *, with_optimizer: bool, artifact: tuple[str, str, int] | None = None) -> int:
        """Load state ``name``'s weights (the adapter, or all weights of a full-weight session),
        and its optimizer and step with ``with_optimizer``; clear the accumulated gradient.
        Returns the step. With ``artifact`` (key, manifest SHA-256, bytes) the state is another
        task's, fetched from the artifact store before the session's turn, as a session started
        from it (:meth:`start_from`) loads it.

        Raises:
            BadRequest: a bad name. StateNotFound: no state of that name; an artifact the owner
                may not read or the store no longer holds.
            NotReady: it was saved with another LoRA shape (rank, alpha, target modules), or it
                holds full weights and this session trains an adapter (or the other way round);
                an artifact and no store.
        """
        check_state_name(name)
        if artifact is None:
            return self._load_in_turn(name, None, with_optimizer=with_optimizer)
        if self.fetch_state is None:
            raise NotReady(f"state {name!r}: this session has no artifact store; it loads its own states only")
        return self._load_in_turn(name, self.fetch_state(*artifact), with_optimizer=with_optimizer)

    @_in_turn
    def _load_in_turn(self, name: str, folder: Path | None, *, with_optimizer: bool) -> int:
        if folder is None:
            return self._load(name, with_optimizer=with_optimizer, weights=True)
        return self._load_folder(name, folder, with_optimizer=with_optimizer, weights=True)

    def _load(self, name: str, *, with_optimizer: bool, weights: bool) -> int:
        check_state_name(name)
        saved = self.states.get(name)
        if saved is None:
            known = ", ".join(sorted(self.states)) or "none yet"
            raise StateNotFound(f"state {name!r}: no such state of this session (saved: {known})")
        return self._load_folder(name, saved.folder, with_optimizer=with_optimizer, weights=weights)

    def _load_folder(self, name: str, folder: Path, *, with_optimizer: bool, weights: bool) -> int:
        lora_state = (folder / "adapter_config.json").exists()
        if lora_state == self.full:
            theirs, mine = ("a LoRA adapter", "all weights") if lora_state else ("full weights", "a LoRA adapter")
            raise NotReady(f"state {name!r} holds {theirs} and this session trains {mine}; it cannot be loaded here")
        trainer = _lm.load_trainer_state(folder)
        self._since_step["loss"] = 0.0  # the accumulated gradient goes; what was trained still counts
        if weights and self.full:
            self._load_full_weights(name, folder)
        elif weights:
            self._load_adapter(name, folder)
        self.optimizer.zero_grad(set_to_none=True)
        self.accumulated_calls = 0
        if with_optimizer and "optimizer" in trainer:
            self.optimizer.load_state_dict(trainer["optimizer"])
            self.step = int(trainer["step"])
        else:
            self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.0)
        return self.step

    def _load_adapter(self, name: str, folder: Path) -> None:
        config = json.loads((folder / "adapter_config.json").read_text())
        mine = (int(self.lora["lora_rank"]), float(self.lora["lora_alpha"]), sorted(self.lora["target_modules"]))
        theirs = (
            int(config.get("r", -1)),
            float(config.get("lora_alpha", -1)),
            sorted(config.get("target_modules") or []),
        )
        if mine != theirs:
            raise NotReady(
                f"state {name!r} has LoRA rank/alpha/targets {theirs}, this session {mine}; it cannot be loaded here"
            )
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        weights = load_file(str(folder / "adapter_model.safetensors"), device=str(self.device))
        with torch.no_grad():
            result = set_peft_model_state_dict(self.model, weights, adapter_name=self.adapter_name)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise NotReady(f"state {name!r}: keys that match no adapter weight: {unexpected[:5]}")

    def _load_full_weights(self, name: str, folder: Path) -> None:
        """Every weight of the model from the ``model*.safetensors`` files of ``folder``
        (``save_pretrained``'s, one file or shards); weights tied to another (a tied output
        embedding) may be absent, any other missing or unknown key refuses the state, the model
        unchanged."""
        from safetensors.torch import load_file

        files = sorted(folder.glob("model*.safetensors"))
        if not files:
            raise NotReady(f"state {name!r}: no model*.safetensors in {folder.name}; not a full-weight state")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f), device=str(self.device)))
        own = dict(self.model.state_dict())
        sharing = collections.Counter(v.data_ptr() for v in own.values())
        tied = {k for k, v in own.items() if sharing[v.data_ptr()] > 1}  # weights that share storage
        missing = sorted(set(own) - set(weights) - tied)
        unexpected = sorted(set(weights) - set(own))
        wrong = sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape)
        if missing or unexpected or wrong:
            raise NotReady(
                f"state {name!r} does not fit this model: missing {missing[:5]}, unknown {unexpected[:5]}, "
                f"other shapes {wrong[:5]}"
            )
        with torch.no_grad():
            for k, v in weights.items():
                own[k].copy_(v)

    def info(self) -> dict[str, Any]:
        """What GetInfo shows (less the sequence and attempt, which the servicer adds)."""
        config = getattr(self.model, "config", None)
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        config = getattr(base, "config", config)
        return {
            "model": self.model_name,
            "tokenizer": str(getattr(self.tokenizer, "name_or_path", "")),
            "chat_template": str(getattr(self.tokenizer, "chat_template", "") or ""),
            "model_config_json": config.to_json_string() if config is not None else "{}",
            "lora": self.lora,
            "full": self.full,
            "step": self.step,
            "accumulated_calls": self.accumulated_calls,
            "states": sorted(self.states),
            "resumed_from": self.resumed_from,
            "stop_token_ids": list(self.stop_token_ids),
        }


def _tensor(values: Sequence[float], like: torch.Tensor) -> torch.Tensor | None:
    if not len(values):
        return None
    return torch.as_tensor(list(values), dtype=torch.float32, device=like.device)
