"""oneDNN-packed weights for the served model's ``Linear`` layers on CPU (float32).

On CPU, ``torch.nn.functional.linear`` runs MKL's ``sgemm`` on the weight as it is stored
(``[out, in]``, used transposed). For the few rows of a decode step that is far from the memory
bound: measured on this project's 2-core AMD EPYC (AVX-512), one thread, SmolLM2-135M, all 211
``Linear`` layers in a row: 1 row 58 ms, 4 rows 91 ms, 16 rows 116 ms, 46 rows (a prefill) 217 ms.
The same products through oneDNN on weights reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile``'s CPU backend does when it
freezes weights; run by ``torch.ops.mkldnn._linear_pointwise``): 54 / 36 / 74 / 146 ms. A decode
step of a few rows then costs about what one row costs, which is what continuous batching needs.

:class:`PackedLinears` turns every plain float32 ``torch.nn.Linear`` of the model on CPU (not the
LoRA ``A`` / ``B`` matrices, which are small and grouped elsewhere) into a
:class:`PackedLinear`: the same module, weights and state dict, whose ``forward`` uses the
packed copy only inside :meth:`PackedLinears.use` on the calling thread and in inference mode;
anywhere else (training on a model host's shared model, ``model.generate`` in a benchmark,
another thread) it is ``nn.Linear``'s own ``forward``. The packed copy is rebuilt when the
weight changes (new storage or an in-place update: its version counter), e.g. after an
optimizer step of a full-weight tenant.

Costs: a second copy of the packed layers' weights (the model's size again, in float32); the
numbers differ from MKL's by float rounding (another summation order), the same for a row
alone and in a batch. Nothing changes on other devices, other dtypes, or where the
``mkldnn`` operators are missing.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch import nn

__all__ = ["PackedLinear", "PackedLinears", "available"]

# The batch-size hint of the reorder: oneDNN picks its blocking for it; measured, 16 is as fast
# as the exact size for 1 to 46 rows.
_HINT = 16

_active = threading.local()  # .store: the PackedLinears in use on this thread, else absent


def available(device: torch.device) -> bool:
    """Whether packing applies: a CPU model and torch built with the oneDNN operators."""
    return (
        torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Linear):
    """``nn.Linear`` that runs on its oneDNN-packed weight inside :meth:`PackedLinears.use`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        store = getattr(_active, "store", None)
        if store is not None and torch.is_inference_mode_enabled() and x.dtype == torch.float32:
            packed = store.packed(self)
            if packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return super().forward(x)


class PackedLinears:
    """The packed weights of ``model``'s plain float32 CPU ``Linear`` layers (see the module
    docstring). Construction swaps their class to :class:`PackedLinear` (nothing else changes);
    :meth:`close` swaps it back and drops the copies."""

    def __init__(self, model: nn.Module) -> None:
        self._store: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, int], torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )
        self.modules: list[nn.Module] = []
        for name, module in model.named_modules():
            if type(module) is not nn.Linear or "lora_" in name:
                continue
            w = module.weight
            if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
                continue
            module.__class__ = PackedLinear
            self.modules.append(module)

    def close(self) -> None:
        for module in self.modules:
            if type(module) is PackedLinear:
                module.__class__ = nn.Linear
        self.modules = []
        self._store = weakref.WeakKeyDictionary()

    @contextlib.contextmanager
    def use(self):
        """Packed weights for this thread's inference-mode passes inside the block (nests)."""
        before = getattr(_active, "store", None)
        _active.store = self
        try:
            yield
        finally:
            _active.store = before

    def pack_all(self) -> None:
        """Pack every layer now (else each on its first use)."""
        with torch.inference_mode(False), torch.no_grad():
            for module in self.modules:
                self.packed(module)

    def packed(self, module: nn.Module) -> torch.Tensor | None:
        """``module``'s packed weight, rebuilt when the weight changed; None when not packed."""
        w = module.weight
        if w.dtype != torch.float32 or w.device.type != "cpu":
            return None
        try:
            key = (w.data_ptr(), w._version)
        except RuntimeError:  # an inference tensor has no version counter (and cannot change in place)
            key = (w.data_ptr(), -1)
        entry = self._store.get(module)
        if entry is not None and entry[0] == key:
            return entry[1]
        if module not in self.modules:
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _HINT)
        self._store[module] = (key, packed)
        return packed
