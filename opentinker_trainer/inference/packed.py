"""oneDNN-packed weights for the served model's ``Linear`` layers on CPU (float32).

On CPU, ``torch.nn.functional.linear`` runs MKL's ``sgemm`` on the weight as it is stored
(``[out, in]``, used transposed). For the few rows of a decode step that is far from the memory
bound: each extra row adds much of a row's cost. The same products through oneDNN on weights
reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what
``torch.compile``'s CPU backend does when it freezes weights; run by
``torch.ops.mkldnn._linear_pointwise``) cost little more for a few rows than for one, so a decode
step of a few rows costs about what one row costs, which is what continuous batching needs. The
figures are in docs/inference.md, "Packed weights on CPU".

On a model the server owns, :func:`pack_linears` reorders the weight of every plain float32
``nn.Linear`` on CPU into that layout and the packed weight replaces the plain one: the layer
becomes a :class:`PackedLinear` whose ``weight`` is empty, so the model holds its weights once.
Not the LoRA ``A`` / ``B`` matrices, which are small and grouped elsewhere. A layer whose weight
another module shares, such as an ``lm_head`` tied to the embeddings, keeps its plain weight, so
the embeddings still read it, and becomes a :class:`SharedLinear`: oneDNN runs on the plain
layout, still faster than MKL for a few rows, with no second copy.
A model host's shared model is never packed: its training tenants need the plain weights and
their gradients.

Costs: the numbers differ from MKL's by float rounding, another summation order, the same for a
row alone and in a batch. A packed or shared layer has no gradient. Nothing changes on other devices,
other dtypes, or where the ``mkldnn`` operators are missing.
"""

from __future__ import annotations

import collections

import torch
from torch import nn

__all__ = ["PackedLinear", "SharedLinear", "available", "pack_linears"]

# The batch-size hint of the reorder: oneDNN picks its blocking for it; measured, 16 is as fast
# as the exact size for 1 to 46 rows.
_HINT = 16


def available(device: torch.device) -> bool:
    """Whether packing applies: a CPU model and torch built with the oneDNN operators."""
    return (
        torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Linear):
    """``nn.Linear`` whose weight lives only in oneDNN's blocked layout (``packed``)."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class SharedLinear(nn.Linear):
    """``nn.Linear`` whose plain weight another module shares, run by oneDNN on that weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> list[PackedLinear]:
    """Pack the weight of every plain float32 CPU ``Linear`` of ``model`` in place of the plain
    one, and turn one whose weight is shared into a :class:`SharedLinear`, as the module docstring
    says. Returns the packed layers."""
    uses = collections.Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    out: list[PackedLinear] = []
    with torch.inference_mode(False), torch.no_grad():
        for name, module in model.named_modules():
            if type(module) is not nn.Linear or "lora_" in name:
                continue
            w = module.weight
            if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
                continue
            if uses[w.data_ptr()] > 1:
                module.__class__ = SharedLinear
                continue
            module.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _HINT)
            module.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
            module.__class__ = PackedLinear
            out.append(module)
        # A loaded model's tensors may all live in the checkpoint file mapped in memory, which
        # stays mapped while any of them does: every tensor left plain gets memory of its own,
        # so the file's pages, the plain weights included, are released.
        for t in [*model.parameters(), *model.buffers()]:
            if t.numel():
                t.data = t.data.clone()
    return out
