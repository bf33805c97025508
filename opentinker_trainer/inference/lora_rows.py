"""Rows of different LoRA adapters in one forward pass, grouped by adapter (Punica / S-LoRA).

The base model runs once for all rows (PEFT's LoRA layers disabled, so each LoRA ``Linear``
returns its base layer's output); a forward hook on every LoRA ``Linear`` then adds each row's
own low-rank update, computed over only the rows of that adapter:

* per pass (:func:`plan_rows`, once for all modules): the rows are grouped by adapter (base-model
  rows in no group); each group is padded to the largest group's size ``m`` by repeating its
  first row, giving a gather index ``src [G * m]`` and a weight ``keep [G, m]`` (1 for a real
  row, 0 for padding);
* per LoRA module: ``x[src]`` ``[G, m * T, in]`` goes through one ``bmm`` with the groups'
  stacked ``A`` ``[G, r, in]`` (transposed) and one with their ``B`` ``[G, out, r]`` (transposed,
  times each adapter's ``lora_alpha / r``; both laid out once per plan), is multiplied by
  ``keep`` where groups are padded, and added back to its rows (``index_add_``).

That is Punica's segmented gather matrix-vector product (SGMV; Chen et al. 2023, "Punica:
Multi-Tenant LoRA Serving") and S-LoRA's batched LoRA computation (Sheng et al. 2023) in plain
``torch``: four kernels per LoRA module whatever the number of adapters in the batch, where
PEFT's per-row ``adapter_names`` runs a Python loop over the adapters in every module (two
module calls, a list index and an indexed add per adapter). Adapters of different ranks are
zero-padded to the largest rank (exact: the padded products are zero).

Supported: PEFT LoRA ``Linear`` layers without variants (no DoRA), no LoRA bias, no
``modules_to_save``; :func:`supports` says whether every loaded adapter is such, else the caller
keeps PEFT's ``adapter_names``. Runs on the model thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["RowPlan", "plan_rows", "grouped_update", "supports", "RowLoRA"]


@dataclass(frozen=True)
class RowPlan:
    """Which rows of a pass each adapter group covers.

    Attributes:
        adapters: stack index of each group's adapter, ``[G]`` (long).
        src: batch row of each group slot, ``[G * m]`` (long; padding repeats the group's first row).
        keep: ``[G, m]`` float, 1.0 for a real row, 0.0 for padding.
        size: ``m``, the largest group's row count.
        padded: whether any slot is padding (groups of different sizes).
    """

    adapters: torch.Tensor
    src: torch.Tensor
    keep: torch.Tensor
    size: int
    padded: bool = False


def plan_rows(row_adapters: Sequence[int | None], device: torch.device | str = "cpu") -> RowPlan | None:
    """Group rows by adapter: ``row_adapters[b]`` is row ``b``'s adapter stack index, ``None`` for
    the base model. Returns ``None`` when no row uses an adapter. Groups are in stack order
    (when every adapter has rows, the stacks are used as they are, without a gather)."""
    groups: dict[int, list[int]] = {}
    for row, adapter in enumerate(row_adapters):
        if adapter is not None:
            groups.setdefault(int(adapter), []).append(row)
    if not groups:
        return None
    groups = dict(sorted(groups.items()))
    size = max(len(rows) for rows in groups.values())
    src, keep = [], []
    for rows in groups.values():
        pad = size - len(rows)
        src.extend(rows + [rows[0]] * pad)
        keep.append([1.0] * len(rows) + [0.0] * pad)
    return RowPlan(
        adapters=torch.tensor(list(groups), dtype=torch.long, device=device),
        src=torch.tensor(src, dtype=torch.long, device=device),
        keep=torch.tensor(keep, dtype=torch.float32, device=device),
        size=size,
        padded=size * len(groups) != sum(len(rows) for rows in groups.values()),
    )


def grouped_update(xs: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor, plan: RowPlan, t: int) -> torch.Tensor:
    """The low-rank update of a pass's rows, grouped by adapter.

    Args:
        xs: ``[G, m * T, in]``, the rows ``plan.src`` gathers, by group.
        a_t: the groups' ``A^T``, ``[G, in, r]``.
        b_t: the groups' ``B^T`` times each adapter's scale, ``[G, r, out]``.
        plan: the pass's :class:`RowPlan`.
        t: ``T``, positions per row.

    Returns:
        ``[G * m, T, out]``, to be added to rows ``plan.src``; zero on padding slots. Gradients
        flow to every input.
    """
    groups, size = int(plan.adapters.shape[0]), plan.size
    delta = torch.bmm(torch.bmm(xs, a_t), b_t)  # [G, m * T, r] then [G, m * T, out]
    if plan.padded:  # padding slots (a repeated row) add nothing
        delta = delta.reshape(groups, size, t, -1) * plan.keep.to(delta.dtype)[:, :, None, None]
    return delta.reshape(groups * size, t, -1)


def _lora_linear_type():
    from peft.tuners.lora import Linear

    return Linear


def supports(peft_model) -> bool:
    """True when every adapter of ``peft_model`` can run grouped: plain LoRA on ``Linear``
    layers (no DoRA or other variant, no LoRA bias, no ``modules_to_save``)."""
    linear = _lora_linear_type()
    for cfg in getattr(peft_model, "peft_config", {}).values():
        if getattr(cfg, "peft_type", None) is None or str(getattr(cfg.peft_type, "value", cfg.peft_type)) != "LORA":
            return False
        if getattr(cfg, "modules_to_save", None) or getattr(cfg, "bias", "none") != "none":
            return False
    for module in peft_model.modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "lora_B"):
            continue
        if not isinstance(module, linear):
            return False  # embeddings, convolutions: PEFT's path
        if getattr(module, "lora_variant", None) or any(getattr(module, "lora_bias", {}).values()):
            return False
    return True


class RowLoRA:
    """Stacked LoRA weights of ``adapters`` (in that order) on every LoRA ``Linear`` of
    ``peft_model``, and the forward hooks that apply them per row while a plan is set.

    Args:
        peft_model: the served ``PeftModel`` (its adapter layers are disabled by the caller
            while :attr:`plan` is set, so each LoRA layer returns its base output).
        adapters: adapter names; a row's stack index is its position here.
        alias: re-point the adapters' own weights into the stacks (below); ``False``: the stacks
            are copies, and the adapters' parameters are not touched (a model host's rollout
            stacks adapters that are being trained, whose parameters an optimizer holds: the
            copies are valid while the weights do not change, i.e. for the rollout's passes).

    Memory: each adapter's PEFT ``lora_A`` / ``lora_B`` weight is re-pointed to its slice of the
    stacks ``A [N, r, in]`` / ``B [N, out, r]`` (values unchanged, so PEFT's own paths keep
    working on them; nothing added beyond rank padding). With ``alias=False`` the stacks are a
    second copy of the adapters' LoRA weights. While a plan is set, the weights of its groups are
    kept once more, laid out for the two products (``A^T [G, in, r]`` and ``B^T`` times the
    adapter's scale, ``[G, r, out]``): consecutive decode steps of the same rows reuse them
    (:meth:`set_rows` keeps a plan for the same row adapters), so a step gathers nothing.
    """

    def __init__(self, peft_model, adapters: Sequence[str], *, alias: bool = True) -> None:
        self.alias = alias
        self.adapters = list(adapters)
        self.index = {name: i for i, name in enumerate(self.adapters)}
        self.plan: RowPlan | None = None
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._scales: list[torch.Tensor] = []  # distinct per-adapter scale vectors [N]
        self._handles = []
        self._names: list | None = None  # the row adapters the plan was made for
        # Per plan, id(module) -> (stack versions, A^T [G, in, r], scaled B^T [G, r, out]) of its groups.
        self._prepared: dict[int, tuple] = {}
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None  # (last input, its rows by group)
        # Built as ordinary tensors even when called inside inference mode (a forward pass):
        # PEFT's parameters become views of them, and later adapter loads touch those.
        with torch.inference_mode(False), torch.no_grad():
            self._stack(peft_model)

    def _stack(self, peft_model) -> None:
        linear = _lora_linear_type()
        n = len(self.adapters)
        for module in peft_model.modules():
            if not isinstance(module, linear):
                continue
            present = [a for a in self.adapters if a in module.lora_A]
            if not present:
                continue
            ref = module.lora_A[present[0]].weight
            fan_in = ref.shape[1]
            fan_out = module.lora_B[present[0]].weight.shape[0]
            rank = max(module.lora_A[a].weight.shape[0] for a in present)
            a_stack = torch.zeros((n, rank, fan_in), dtype=ref.dtype, device=ref.device)
            b_stack = torch.zeros((n, fan_out, rank), dtype=ref.dtype, device=ref.device)
            scale = torch.zeros(n, dtype=torch.float32, device=ref.device)
            for a in present:
                i, wa, wb = self.index[a], module.lora_A[a].weight, module.lora_B[a].weight
                r = wa.shape[0]
                a_stack[i, :r] = wa
                b_stack[i, :, :r] = wb
                if self.alias:  # PEFT's own tensors become views of the stack: no second copy
                    wa.data = a_stack[i, :r]
                    wb.data = b_stack[i, :, :r]
                scale[i] = float(module.scaling[a])
            for known in self._scales:  # most modules share their adapters' scales: one tensor
                if torch.equal(known, scale):
                    scale = known
                    break
            else:
                self._scales.append(scale)
            self._weights[id(module)] = (a_stack, b_stack, scale)
            self._handles.append(module.register_forward_hook(self._hook))

    def close(self) -> None:
        """Remove the hooks (before the adapters change)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.set_state_none()

    def set_rows(self, names: Sequence[str | None]) -> None:
        """Plan the next passes for rows of adapters ``names`` (``None``: the base model); the
        same ``names`` as the current plan's keep it and its prepared weights."""
        names = list(names)
        self._gathered = None
        if self.plan is not None and names == self._names:
            return
        device = next(iter(self._weights.values()))[0].device if self._weights else "cpu"
        self.plan = plan_rows([None if a is None else self.index[a] for a in names], device)
        self._names = names
        self._prepared = {}

    def state(self) -> tuple:
        """The current plan and its caches, for :meth:`restore`."""
        return self.plan, self._names, self._prepared, self._gathered

    def restore(self, state: tuple) -> None:
        self.plan, self._names, self._prepared, self._gathered = state

    def set_state_none(self) -> None:
        """No plan (the hooks do nothing)."""
        self.restore((None, None, {}, None))

    def _prepare(self, module, plan: RowPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """``module``'s ``A^T [G, in, r]`` and scaled ``B^T [G, r, out]`` for the plan's groups,
        made once per plan (again if a stack changed in place: its version counter)."""
        a_stack, b_stack, scale = self._weights[id(module)]
        versions = (a_stack._version, b_stack._version, scale._version)
        entry = self._prepared.get(id(module))
        if entry is not None and entry[0] == versions:
            return entry[1], entry[2]
        # Plain tensors even inside inference mode (a plan may serve a later pass outside it).
        with torch.inference_mode(False), torch.no_grad():
            a = a_stack.index_select(0, plan.adapters)
            b = b_stack.index_select(0, plan.adapters)
            s = scale.index_select(0, plan.adapters).to(b.dtype)
            a_t = a.transpose(1, 2).contiguous()
            b_t = (b * s[:, None, None]).transpose(1, 2).contiguous()
        self._prepared[id(module)] = (versions, a_t, b_t)
        return a_t, b_t

    def _hook(self, module, args, output):
        plan = self.plan
        if plan is None:
            return None
        a_t, b_t = self._prepare(module, plan)
        x = args[0]
        rows, fan_in = x.shape[0], x.shape[-1]
        per_row = x.reshape(rows, -1, fan_in)  # [B, T, in]
        t = per_row.shape[1]
        groups, size = int(plan.adapters.shape[0]), plan.size
        if self._gathered is not None and self._gathered[0] is x:
            xs = self._gathered[1]  # q, k and v projections share their input: gathered once
        else:
            xs = per_row.index_select(0, plan.src).reshape(groups, size * t, fan_in)
            if xs.dtype != a_t.dtype:
                xs = xs.to(a_t.dtype)
            self._gathered = (x, xs)
        delta = grouped_update(xs, a_t, b_t, plan, t)
        out = output.reshape(rows, t, -1)
        out.index_add_(0, plan.src, delta if delta.dtype == out.dtype else delta.to(out.dtype))
        return out.reshape(output.shape)
