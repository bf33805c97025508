"""The update passes of several LoRA adapters in one forward and backward: a model host's tenants.

Each :class:`UpdateRequest` is one micro-batch of one tenant's GRPO update
(:func:`opentinker_trainer.rl.grpo.grpo_update`'s ``chunk_pass``): the rows of its rollout, its
adapter's parameters and ``loss_of``, which turns the rows' token log-probs into the tenant's
loss, normalized as in its update alone. :func:`run_batched` runs every request's rows in one
forward with grad, each row on its own tenant's adapter, then one backward of the sum of the
losses, and returns each request its token log-probs (detached) and the gradient of its own loss
on its own parameters. The caller adds those to ``.grad`` and takes its own clip and optimizer
step.

Layout: the distinct prompts of every request (a group's rows share theirs, as in
:func:`~opentinker_trainer.rl.rollout.sequence_logprobs`) run in one left-padded prefix pass, and
every completion, right-padded to the widest, runs on top of its prompt's key/value cache
(:func:`~opentinker_trainer.rl.rollout.prefix_logprobs`; each row's temperature its own). Both
passes run the frozen base once for all rows with PEFT's adapter layers off; a forward hook on
every LoRA ``Linear`` (:class:`GradRows`) then adds each row's low-rank update from its own
adapter's parameters, grouped by adapter as in
:class:`~opentinker_trainer.inference.lora_rows.RowLoRA` but with autograd: two batched products
over the adapters' stacked ``A`` and ``B``, whose gradients flow back to each adapter's own
weights.

Why a tenant's numbers are those of its update alone: padding-aware masks and positions make each
row's log-probs independent of the other rows, so a row's values and gradients differ from its
solo pass only by float rounding of the shared products. A tenant's parameters act on its own
rows only and its loss reads its own rows only, so the gradient of the sum on its parameters is
the gradient of its own loss. The model runs in eval mode (no dropout), as the update does.

A request alone runs the tenant's solo pass itself (PEFT's forward with its adapter active): a
worker's numbers exactly. Failures stay with their request: a batched pass that fails is retried
request by request alone, so each gets its own outcome; a request's error never reaches another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from opentinker_trainer.inference.lora_rows import plan_rows, supports
from opentinker_trainer.rl.rollout import Rollout, _shared_prompts, prefix_logprobs, sequence_logprobs

__all__ = ["PASS_TOKENS", "UpdateRequest", "UpdateOutcome", "GradRows", "run_batched", "run_alone", "add_grads"]

#: Token positions (prompts run once, plus completion rows) one batched pass takes at most: its
#: activations, kept for the backward, grow with them (about 1 MiB per position on SmolLM2-135M).
#: Requests beyond it run in further passes; a request larger than it runs alone.
PASS_TOKENS = 256


@dataclass(eq=False)
class UpdateRequest:
    """One micro-batch of one tenant's update.

    Attributes:
        adapter: the PEFT adapter name its rows use.
        params: that adapter's parameters, in the order the gradients come back.
        rollout: the rows (prompts and completions) the loss is computed on.
        loss_of: ``loss_of(logp [B, T]) -> []`` the tenant's loss of its rows' token log-probs;
            called once per pass, with grad.
        temperature: the log-probs are under ``softmax(logits / temperature)``.
        group_size: rows come in groups of this many identical prompts (each prompt run once).
    """

    adapter: str
    params: Sequence[torch.Tensor]
    rollout: Rollout
    loss_of: Callable[[torch.Tensor], torch.Tensor]
    temperature: float = 1.0
    group_size: int = 1


@dataclass
class UpdateOutcome:
    """What one request got: its rows' token log-probs ``logp [B, T]`` (detached) and ``grads``
    (one per parameter, None where its loss does not reach it), or the ``error`` that ended it."""

    logp: torch.Tensor | None = None
    grads: list[torch.Tensor | None] | None = None
    error: BaseException | None = None


def add_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Accumulate ``grads`` into ``params``' ``.grad``, as ``backward`` does."""
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


def run_alone(peft_model, request: UpdateRequest) -> UpdateOutcome:
    """``request`` by the solo pass: its adapter active, PEFT's own forward, one backward. The
    active adapter is restored after; errors are returned, not raised."""
    active = getattr(peft_model, "active_adapter", None)
    try:
        if request.adapter != active:
            peft_model.set_adapter(request.adapter)
        ro = request.rollout
        with torch.enable_grad():
            logp = sequence_logprobs(
                peft_model,
                ro.prompt_ids,
                ro.prompt_mask,
                ro.completion_ids,
                ro.completion_mask,
                temperature=request.temperature,
                group_size=request.group_size,
            )
            loss = request.loss_of(logp)
            grads = torch.autograd.grad(loss, list(request.params), allow_unused=True)
        return UpdateOutcome(logp=logp.detach(), grads=list(grads))
    except Exception as exc:  # noqa: BLE001 - one request's failure is its own outcome
        return UpdateOutcome(error=exc)
    finally:
        if active != getattr(peft_model, "active_adapter", None) and active in getattr(peft_model, "peft_config", {}):
            peft_model.set_adapter(active)


def run_batched(peft_model, requests: Sequence[UpdateRequest]) -> list[UpdateOutcome]:
    """Every request's forward and backward in one pass (see the module docstring).

    Args:
        peft_model: the ``PeftModel`` holding every request's adapter; it runs in eval mode, and
            its mode, active adapter, adapter layers and ``requires_grad`` flags are as before on
            return.
        requests: run in passes of at most :data:`PASS_TOKENS` token positions; a pass of one
            runs :func:`run_alone`, and so does every request when an adapter cannot run
            grouped (:func:`~opentinker_trainer.inference.lora_rows.supports`).

    Returns:
        One outcome per request, in order. Never raises for a request's failure.
    """
    was_training = peft_model.training
    peft_model.eval()
    try:
        grouped = supports(peft_model)
        out: list[UpdateOutcome] = []
        for part in _passes(requests, PASS_TOKENS):
            if len(part) > 1 and grouped:
                try:
                    out += _together(peft_model, part)
                    continue
                except Exception:  # noqa: BLE001 - the shared pass failed: each request again, alone
                    pass
            out += [run_alone(peft_model, r) for r in part]
        return out
    finally:
        peft_model.train(was_training)


def _tokens(request: UpdateRequest) -> int:
    """Token positions of ``request``'s pass: its prompts once per group, its completion rows."""
    ro = request.rollout
    rows, width = ro.completion_ids.shape
    groups = rows // request.group_size if request.group_size > 1 and rows % request.group_size == 0 else rows
    return groups * ro.prompt_ids.shape[1] + rows * width


def _passes(requests: Sequence[UpdateRequest], budget: int) -> list[list[UpdateRequest]]:
    """``requests`` in order, cut into passes of at most ``budget`` token positions each (a
    request over it alone)."""
    passes: list[list[UpdateRequest]] = []
    used = budget
    for r in requests:
        n = _tokens(r)
        if used + n > budget:
            passes.append([])
            used = 0
        passes[-1].append(r)
        used += n
    return passes


def _left(t: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)


def _right(t: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def _together(peft_model, requests: Sequence[UpdateRequest]) -> list[UpdateOutcome]:
    prompts, prompt_masks, prefix_of, prefix_adapters, row_adapters, temps = [], [], [], [], [], []
    for r in requests:
        ro, b = r.rollout, len(r.rollout)
        shared = _shared_prompts(ro.prompt_ids, ro.prompt_mask, r.group_size)
        ids, mask = shared if shared is not None else (ro.prompt_ids, ro.prompt_mask)
        first = sum(len(p) for p in prompts)
        per = r.group_size if shared is not None else 1
        prefix_of.append(first + torch.arange(b, device=ids.device) // per)
        prompts.append(ids)
        prompt_masks.append(mask)
        prefix_adapters += [r.adapter] * len(ids)
        row_adapters += [r.adapter] * b
        temps.append(torch.full((b, 1, 1), float(r.temperature), device=ids.device))
    width = max(p.shape[1] for p in prompts)
    t_max = max(r.rollout.completion_ids.shape[1] for r in requests)
    pad = 0  # padding is masked: any token id
    prefix_ids = torch.cat([_left(p, width, pad) for p in prompts])
    prefix_mask = torch.cat([_left(m, width, False) for m in prompt_masks])
    completion_ids = torch.cat([_right(r.rollout.completion_ids, t_max, pad) for r in requests])
    completion_mask = torch.cat([_right(r.rollout.completion_mask, t_max, False) for r in requests])
    params = [p for r in requests for p in r.params]
    base = peft_model.get_base_model()
    peft_model.base_model.disable_adapter_layers()
    hooks = GradRows(peft_model, {len(prefix_ids): prefix_adapters, len(completion_ids): row_adapters})
    try:
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            logp = prefix_logprobs(
                base,
                prefix_ids,
                prefix_mask,
                torch.cat(prefix_of),
                completion_ids,
                completion_mask,
                temperature=torch.cat(temps),
            )
            if logp is None:
                raise RuntimeError("the model's cache cannot be expanded along the batch")
            parts, losses, start = [], [], 0
            for r in requests:
                b, t = len(r.rollout), r.rollout.completion_ids.shape[1]
                part = logp[start : start + b, :t]
                losses.append(r.loss_of(part))
                parts.append(part.detach())
                start += b
            grads = torch.autograd.grad(sum(losses), params, allow_unused=True)
    finally:
        hooks.close()
        peft_model.base_model.enable_adapter_layers()  # requires_grad back to the active adapter's only
    out, start = [], 0
    for r, part in zip(requests, parts):
        n = len(r.params)
        out.append(UpdateOutcome(logp=part, grads=list(grads[start : start + n])))
        start += n
    return out


class GradRows:
    """Forward hooks on every LoRA ``Linear`` that add each row's own adapter's update, with
    autograd, while PEFT's adapter layers are off (each returns its base output).

    Args:
        peft_model: the ``PeftModel``.
        rows: for each pass's batch size, the adapter of each of its rows: the prefix pass and
            the completion pass of :func:`~opentinker_trainer.rl.rollout.prefix_logprobs` have
            different rows, told apart by their count (equal counts mean one row per prompt,
            the same adapters in the same order).

    Per module, the adapters present in it are stacked once (``A [G, r, in]``, ``B [G, out, r]``,
    ranks zero-padded to the largest: exact) from their parameters, so the stack's gradient
    reaches each adapter's own weights; rows are gathered by adapter as
    :func:`~opentinker_trainer.inference.lora_rows.plan_rows` lays them out (no gather when the
    rows of each adapter are consecutive and as many).
    """

    def __init__(self, peft_model, rows: Mapping[int, Sequence[str]]) -> None:
        from peft.tuners.lora import Linear

        self._rows = {n: list(names) for n, names in rows.items()}
        self._plans: dict[tuple, dict] = {}
        self._stacks: dict[int, tuple] = {}
        self._handles = []
        wanted = {a for names in self._rows.values() for a in names}
        for module in peft_model.modules():
            if isinstance(module, Linear) and any(a in module.lora_A for a in wanted):
                self._handles.append(module.register_forward_hook(self._hook))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stacks = {}

    def _plan(self, present: tuple[str, ...], rows: int, device):
        """The row plan of a pass of ``rows`` rows over adapters ``present`` (stack order), and
        whether it is the identity (no gather: consecutive, equal groups in stack order)."""
        key = (present, rows)
        if key not in self._plans:
            index = {a: i for i, a in enumerate(present)}
            plan = plan_rows([index.get(a) for a in self._rows[rows]], device)
            identity = (
                plan is not None
                and not plan.padded
                and len(plan.src) == rows
                and torch.equal(plan.src, torch.arange(rows, device=plan.src.device))
            )
            self._plans[key] = (plan, identity)
        return self._plans[key]

    def _stack(self, module) -> tuple:
        entry = self._stacks.get(id(module))
        if entry is None:
            present = []
            for a in self._rows_order():
                if a in module.lora_A and a not in present:
                    present.append(a)
            rank = max(module.lora_A[a].weight.shape[0] for a in present)
            a_stack = torch.stack([_pad_rows(module.lora_A[a].weight, rank) for a in present])
            b_stack = torch.stack([_pad_cols(module.lora_B[a].weight, rank) for a in present])
            scale = torch.tensor([float(module.scaling[a]) for a in present], device=a_stack.device)
            entry = (tuple(present), a_stack.transpose(1, 2), b_stack.transpose(1, 2), scale.to(b_stack.dtype))
            self._stacks[id(module)] = entry
        return entry

    def _rows_order(self) -> list[str]:
        seen: dict[str, None] = {}
        for names in self._rows.values():
            seen.update(dict.fromkeys(names))
        return list(seen)

    def _hook(self, module, args, output):
        x = args[0]
        rows, fan_in = x.shape[0], x.shape[-1]
        if rows not in self._rows:
            return None
        present, a_t, b_t, scale = self._stack(module)
        plan, identity = self._plan(present, rows, x.device)
        if plan is None:
            return None
        per_row = x.reshape(rows, -1, fan_in)
        t = per_row.shape[1]
        groups, size = int(plan.adapters.shape[0]), plan.size
        if groups != len(present):  # some adapter has no rows in this pass: its stack slice unused
            a_t, b_t, scale = a_t[plan.adapters], b_t[plan.adapters], scale[plan.adapters]
        xs = per_row if identity else per_row.index_select(0, plan.src)
        xs = xs.reshape(groups, size * t, fan_in).to(a_t.dtype)
        delta = torch.bmm(torch.bmm(xs, a_t), b_t) * scale[:, None, None]  # [G, m * T, out]
        if plan.padded:  # padding slots (a repeated row) add nothing
            delta = delta.reshape(groups, size, t, -1) * plan.keep.to(delta.dtype)[:, :, None, None]
        delta = delta.reshape(groups * size, t, -1).to(output.dtype)
        out = output.reshape(rows, t, -1)
        out = out + delta if identity else out.index_add(0, plan.src, delta)
        return out.reshape(output.shape)


def _pad_rows(weight: torch.Tensor, rank: int) -> torch.Tensor:
    return weight if weight.shape[0] == rank else torch.nn.functional.pad(weight, (0, 0, 0, rank - weight.shape[0]))


def _pad_cols(weight: torch.Tensor, rank: int) -> torch.Tensor:
    return weight if weight.shape[1] == rank else torch.nn.functional.pad(weight, (0, rank - weight.shape[1]))
