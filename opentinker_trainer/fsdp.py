"""Full-weight training sharded across a task's ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Used by full-weight SFT and full-weight GRPO on several ranks (:mod:`opentinker_trainer.workloads.sft`,
:mod:`opentinker_trainer.workloads.grpo_text`): each decoder
layer and then the whole model are wrapped with ``fully_shard`` (ZeRO-3 style: parameters,
gradients and optimizer state sharded over ranks, parameters all-gathered per layer for each
forward and backward, gradients reduce-scattered). FSDP2 averages gradients over ranks, so a
loss normalised by the *global* count is multiplied by the world size before ``backward``
(:func:`loss_scale`) to get the sum the one-rank step takes; gloo has no pre-multiplied sum,
so ``set_gradient_divide_factor`` is not used.

Every rank must run the same number of forward and backward passes (each is a collective):
:func:`equal_chunks` pads a rank's micro-batches with dummy ones (counted zero).

Checkpoints stay in the one-rank format (``hf_full``: ``save_pretrained`` with the full
weights, and the optimizer state with the parameters' names as keys): :class:`FullState`
gathers both on every rank (``torch.distributed.checkpoint.state_dict`` with
``full_state_dict=True, cpu_offload=True``) before rank 0 writes them; a resume loads the full
weights on every rank before sharding and the optimizer state with ``set_optimizer_state_dict``.

GRPO (:func:`opentinker_trainer.rl.grpo.grpo_update` with ``sharded=True``) samples with
``synced_gpus`` (every rank takes as many decoding steps: FSDP all-gathers per forward), pads
completions to the widest rank's and runs dummy micro-batches likewise
(:func:`opentinker_trainer.rl.rollout.generate`'s ``synced``, ``pad_completions``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

__all__ = ["FullState", "equal_chunks", "grad_norm", "loss_scale", "shard_model"]


def _layers(model) -> Sequence[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (``model.model.layers``), else none."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def shard_model(model) -> None:
    """``fully_shard`` each decoder layer of ``model``, then ``model`` itself, over the default
    process group (an initialised torch.distributed group)."""
    from torch.distributed.fsdp import fully_shard

    for layer in _layers(model):
        fully_shard(layer)
    fully_shard(model)


def loss_scale(dp) -> float:
    """The factor on a loss normalised by the global count, so that FSDP's average of the ranks'
    gradients is their sum: the world size."""
    return float(dp.world_size)


def grad_norm(total) -> float:
    """``clip_grad_norm_``'s result (a DTensor under FSDP) as a float."""
    return float(total.full_tensor() if hasattr(total, "full_tensor") else total)


def equal_chunks(mine: list, size: int, counts: Sequence[int], filler: list) -> list[tuple[list, bool]]:
    """This rank's items ``mine`` in micro-batches of ``size``, padded with dummy micro-batches
    (``filler``, flagged ``False``) up to the most micro-batches any rank has (``counts``:
    every rank's item count), so every rank runs as many passes."""
    most = max(math.ceil(c / size) for c in counts) if counts else 0
    real = [(mine[i : i + size], True) for i in range(0, len(mine), size)]
    return real + [(filler, False)] * (most - len(real))


class FullState:
    """The full (unsharded) weights and optimizer state of an FSDP model, gathered on every rank
    (a collective) and kept for rank 0's checkpoint writer; stands in for the model and the
    optimizer there (``save_pretrained``, ``state_dict``)."""

    def __init__(self, model, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        self.model = model
        self.weights = get_model_state_dict(model, options=options)
        self.optimizer = get_optimizer_state_dict(model, optimizer, options=options)

    def save_pretrained(self, path: str, **kw: Any) -> None:
        """The one-rank ``save_pretrained`` folder: tied weights (``lm_head`` = the embeddings)
        stored once, as transformers stores them."""
        weights = dict(self.weights)
        if getattr(getattr(self.model, "config", None), "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)
        self.model.save_pretrained(path, state_dict=weights, **kw)

    def state_dict(self) -> dict:
        return self.optimizer


class ShardedOptimizerState:
    """An optimizer of an FSDP model as :func:`opentinker_trainer.workloads._lm.resume_step` sees
    it: ``load_state_dict`` of a full state (as :class:`FullState` saved it) shards it in."""

    def __init__(self, model, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            self.model, self.optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True)
        )
