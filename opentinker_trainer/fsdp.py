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
weights, and the optimizer state as one rank's ``state_dict()``, parameters by number), so a
checkpoint of any world size resumes at any other: :class:`FullState`
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
        """The optimizer state as one unsharded rank's ``optimizer.state_dict()`` has it
        (parameters numbered in ``model.parameters()`` order), so a resume at any world size,
        one rank included, reads it."""
        return by_number(self.optimizer, trained_names(self.model))


def trained_names(model) -> list[str]:
    """The names of ``model``'s trained parameters, in ``parameters()`` order (the optimizer's)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def by_number(state: dict, names: Sequence[str]) -> dict:
    """An optimizer state keyed by parameter name (``get_optimizer_state_dict``) keyed by number
    instead (``Optimizer.state_dict``): ``names[i]`` is parameter ``i``."""
    number = {n: i for i, n in enumerate(names)}
    return {
        "state": {number[k]: v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [number[k] for k in g["params"]]} for g in state["param_groups"]],
    }


def by_name(state: dict, names: Sequence[str]) -> dict:
    """The inverse of :func:`by_number` (a state keyed by name passes through)."""
    key = lambda k: names[k] if isinstance(k, int) else k  # noqa: E731
    return {
        "state": {key(k): v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [key(k) for k in g["params"]]} for g in state["param_groups"]],
    }


class ShardedOptimizerState:
    """An optimizer of an FSDP model as :func:`opentinker_trainer.workloads._lm.resume_step` sees
    it: ``load_state_dict`` of a full state (as :class:`FullState` or one unsharded rank saved it:
    parameters by number) shards it in."""

    def __init__(self, model, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            self.model,
            self.optimizer,
            optim_state_dict=by_name(state, trained_names(self.model)),
            options=StateDictOptions(full_state_dict=True),
        )
