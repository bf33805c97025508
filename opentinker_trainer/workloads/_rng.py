"""Capture and restore the global random number generators, for checkpoints that resume exactly.

One state dict holds Python's ``random``, numpy's global RNG, torch's CPU generator and, when
CUDA is available, every CUDA device's generator, in a form ``torch.load(weights_only=True)``
reads (numpy's key array as an int64 tensor). A trainer that has RNG state of its own (an
environment's) stores it beside these under a key of its choosing.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

import numpy as np
import torch

__all__ = ["rng_state", "restore_rng_state"]


def rng_state() -> dict[str, Any]:
    """``{"torch", "numpy", "python"[, "cuda"]}``: the current global RNG states."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`rng_state`. ``numpy`` and ``python`` may be absent (checkpoints written
    before they were captured): those generators are then left as they are. The CUDA states are
    restored only when this machine has as many CUDA devices as the one that saved them."""
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "python" in state:
        random.setstate(_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(value: Any) -> Any:
    """``random.setstate`` wants tuples; a state that went through ``torch.save`` may hold lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value
