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
Such a fallback is logged, once per exception type, and reported to the caller's ``fallback``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import structlog
import torch

from opentinker_trainer.inference.lora_rows import grouped_update, plan_rows, supports
from opentinker_trainer.rl.rollout import Rollout, prefix_logprobs, sequence_logprobs, shared_prompts

__all__ = [
    "PASS_SHARE",
    "PASS_TOKENS",
    "UpdateRequest",
    "UpdateOutcome",
    "GradRows",
    "run_batched",
    "run_alone",
    "add_grads",
    "pass_tokens",
    "passes",
]

log = structlog.get_logger("opentinker.update_batch")

#: Token positions one batched pass takes at most, counted padded as the pass runs them: its
#: prompts, each once, times the widest prompt, plus its completion rows times the widest
#: completion. Its activations, kept for the backward, grow with them (1 to 2 MiB per position
#: on SmolLM2-135M), so the limit is about twice one default-shaped micro-batch (4 prompts of 8
#: completions of 10 tokens: about 500 positions with the arithmetic prompts): two such tenants
#: share a pass. A request larger than the limit raises it to its own size, since it takes that
#: memory alone anyway. Requests beyond it run in further passes.
PASS_TOKENS = 1024

#: A pass also takes at most this many times the token positions of the largest request of its
#: run, so a host holds at most about four times the activations a worker would whatever the
#: number of its tenants: eight small micro-batches run in two passes of four, not in one pass of
#: eight times a worker's. Each further pass costs a pass's fixed work (the weights read, the
#: layers' Python): with eight of the multitenant benchmark's micro-batches, two passes of four
#: cost about 7% more CPU per step than one of eight and cut the host's peak RSS by about 15%;
#: four passes of two cost about 20%.
PASS_SHARE = 4

_warned: set[type] = set()  # exception types of failed batched passes already logged


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
    """Accumulate ``grads`` into ``params``' ``.grad``, as ``backward`` does: a parameter's first
    gradient becomes a tensor of its own, never a view into a buffer shared with others."""
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g.clone(memory_format=torch.contiguous_format) if g._base is not None else g
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


def run_batched(
    peft_model,
    requests: Sequence[UpdateRequest],
    fallback: Callable[[BaseException], None] | None = None,
) -> list[UpdateOutcome]:
    """Every request's forward and backward in one pass (see the module docstring).

    Args:
        peft_model: the ``PeftModel`` holding every request's adapter; it runs in eval mode, and
            its mode, active adapter, adapter layers and ``requires_grad`` flags are as before on
            return.
        requests: run in passes (:func:`passes`); a pass of one runs :func:`run_alone`, and so
            does every request when an adapter cannot run grouped
            (:func:`~opentinker_trainer.inference.lora_rows.supports`).
        fallback: called with the exception of each batched pass that failed, before its
            requests run again one by one alone.

    Returns:
        One outcome per request, in order. Never raises for a request's failure.
    """
    was_training = peft_model.training
    peft_model.eval()
    try:
        grouped = supports(peft_model)
        out: list[UpdateOutcome] = []
        for part in passes(requests):
            if len(part) > 1 and grouped:
                try:
                    out += _together(peft_model, part)
                    continue
                except Exception as exc:  # noqa: BLE001 - the shared pass failed: each request again, alone
                    _fell_back(exc, len(part), fallback)
            out += [run_alone(peft_model, r) for r in part]
        return out
    finally:
        peft_model.train(was_training)


def _fell_back(exc: Exception, requests: int, fallback: Callable[[BaseException], None] | None) -> None:
    """Log a failed batched pass, once per exception type, and tell ``fallback``."""
    if type(exc) not in _warned:
        _warned.add(type(exc))
        log.warning("a batched update pass failed; its requests run alone", requests=requests, error=repr(exc))
    if fallback is not None:
        fallback(exc)


@dataclass(frozen=True)
class _Size:
    """A pass's layout: ``prompts`` rows of ``prompt_width`` (a group's prompt once) and ``rows``
    completion rows of ``completion_width``, each padded to the widest."""

    prompts: int = 0
    prompt_width: int = 0
    rows: int = 0
    completion_width: int = 0

    @staticmethod
    def of(request: UpdateRequest) -> "_Size":
        ro = request.rollout
        shared = shared_prompts(ro.prompt_ids, ro.prompt_mask, request.group_size)
        prompts = len(ro) if shared is None else len(shared[0])
        return _Size(prompts, ro.prompt_ids.shape[1], len(ro), ro.completion_ids.shape[1])

    def __add__(self, other: "_Size") -> "_Size":
        return _Size(
            self.prompts + other.prompts,
            max(self.prompt_width, other.prompt_width),
            self.rows + other.rows,
            max(self.completion_width, other.completion_width),
        )

    @property
    def tokens(self) -> int:
        return self.prompts * self.prompt_width + self.rows * self.completion_width


def pass_tokens(requests: Sequence[UpdateRequest]) -> int:
    """Token positions of one pass of ``requests``, padded as the pass lays them out: the
    distinct prompts (a group's once) times the widest prompt, plus every completion row times
    the widest completion."""
    return sum((_Size.of(r) for r in requests), _Size()).tokens


def passes(requests: Sequence[UpdateRequest]) -> list[list[UpdateRequest]]:
    """``requests`` in order, cut into passes of at most ``min(PASS_TOKENS, PASS_SHARE * largest
    request)`` token positions each (:func:`pass_tokens`), and at least the largest request's: a
    request over :data:`PASS_TOKENS` takes that memory alone anyway, so others may share its pass
    up to its size."""
    sizes = [_Size.of(r) for r in requests]
    largest = max((s.tokens for s in sizes), default=0)
    budget = max(largest, min(PASS_TOKENS, PASS_SHARE * largest))
    out: list[list[UpdateRequest]] = []
    used = _Size()
    for r, size in zip(requests, sizes):
        if out and (used + size).tokens <= budget:
            out[-1].append(r)
            used += size
        else:
            out.append([r])
            used = size
    return out


def _left(t: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)


def _right(t: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def _together(peft_model, requests: Sequence[UpdateRequest]) -> list[UpdateOutcome]:
    prompts, prompt_masks, prefix_of, prefix_adapters, row_adapters, temps = [], [], [], [], [], []
    for r in requests:
        ro, b = r.rollout, len(r.rollout)
        shared = shared_prompts(ro.prompt_ids, ro.prompt_mask, r.group_size)
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
    hooks = None
    try:
        peft_model.base_model.disable_adapter_layers()
        hooks = GradRows(peft_model, {len(prefix_ids): prefix_adapters, len(completion_ids): row_adapters})
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
        if hooks is not None:
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

    Per module, the adapters present in it are stacked once (``A [G, r, in]``, ``B [G, out, r]``
    times each adapter's scale, ranks zero-padded to the largest: exact) from their parameters,
    so the stack's gradient reaches each adapter's own weights; rows are gathered by adapter as
    :func:`~opentinker_trainer.inference.lora_rows.plan_rows` lays them out (no gather when the
    rows of each adapter are consecutive and as many) and go through
    :func:`~opentinker_trainer.inference.lora_rows.grouped_update`, as in ``RowLoRA``.

    Raises (from the forward): RuntimeError when a LoRA layer runs on a batch whose row count is
    none of ``rows``: its rows' adapters are unknown, so the pass fails and its requests run
    alone rather than without their LoRA.
    """

    def __init__(self, peft_model, rows: Mapping[int, Sequence[str]]) -> None:
        from peft.tuners.lora import Linear

        self._handles = []
        self._rows = {n: list(names) for n, names in rows.items()}
        self._plans: dict[tuple, dict] = {}
        self._stacks: dict[int, tuple] = {}
        wanted = {a for names in self._rows.values() for a in names}
        try:
            for module in peft_model.modules():
                if isinstance(module, Linear) and any(a in module.lora_A for a in wanted):
                    self._handles.append(module.register_forward_hook(self._hook))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove the hooks registered so far; safe to call again."""
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
            a_stack = torch.stack([_pad_rank(module.lora_A[a].weight, rank, 0) for a in present])
            b_stack = torch.stack([_pad_rank(module.lora_B[a].weight, rank, 1) for a in present])
            scale = torch.tensor([float(module.scaling[a]) for a in present], device=a_stack.device)
            b_stack = b_stack * scale.to(b_stack.dtype)[:, None, None]
            entry = (tuple(present), a_stack.transpose(1, 2), b_stack.transpose(1, 2))
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
        if rows not in self._rows:  # a batch the pass does not know: its rows' adapters unknown
            raise RuntimeError(f"a LoRA layer ran on {rows} rows; this pass's batches have {sorted(self._rows)} rows")
        present, a_t, b_t = self._stack(module)
        plan, identity = self._plan(present, rows, x.device)
        if plan is None:  # no row of this pass has an adapter this layer holds
            return None
        per_row = x.reshape(rows, -1, fan_in)
        t = per_row.shape[1]
        groups, size = int(plan.adapters.shape[0]), plan.size
        if groups != len(present):  # some adapter has no rows in this pass: its stack slice unused
            a_t, b_t = a_t[plan.adapters], b_t[plan.adapters]
        xs = per_row if identity else per_row.index_select(0, plan.src)
        xs = xs.reshape(groups, size * t, fan_in).to(a_t.dtype)
        delta = grouped_update(xs, a_t, b_t, plan, t).to(output.dtype)
        out = output.reshape(rows, t, -1)
        out = out + delta if identity else out.index_add(0, plan.src, delta)
        return out.reshape(output.shape)


def _pad_rank(weight: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
    """``weight`` zero-padded along ``dim`` (its rank: 0 for ``A``, 1 for ``B``) to ``rank``."""
    short = rank - weight.shape[dim]
    if short == 0:
        return weight
    return torch.nn.functional.pad(weight, (0, short) if dim == 1 else (0, 0, 0, short))
