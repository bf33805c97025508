"""Log-probabilities of many completions whose prompts repeat, running each distinct prompt once.

In a multi-turn game the same observation (hence the same prompt) comes back many times in one
step: every episode of a group starts in the same state, and FrozenLake has only 16 squares. The
prompt is most of each sequence, so running each distinct prompt once and selecting its
key/value cache for every completion that follows it (``DynamicCache.batch_select_indices``)
cuts the forward and backward work several times. The forward is
:func:`~opentinker_trainer.rl.rollout.prefix_logprobs`, as for a group's shared prompt.
Gradients flow through the shared cache, so the values and gradients equal
:func:`~opentinker_trainer.rl.rollout.sequence_logprobs`' on the same rows (up to float rounding).
"""

from __future__ import annotations

from typing import Sequence

import torch

from opentinker_trainer.rl.rollout import left_pad, prefix_logprobs, sequence_logprobs

__all__ = ["dedupe", "shared_prompt_logprobs"]


def dedupe(prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """``(distinct prompts in first-seen order, index of each prompt among them)``."""
    seen: dict[tuple[int, ...], int] = {}
    unique: list[list[int]] = []
    index: list[int] = []
    for p in prompts:
        key = tuple(p)
        if key not in seen:
            seen[key] = len(unique)
            unique.append(list(p))
        index.append(seen[key])
    return unique, index


def shared_prompt_logprobs(
    model,
    prompts: Sequence[Sequence[int]],
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    pad_token_id: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-prob of each completion token, ``[B, T]`` float32, under ``softmax(logits / temperature)``.

    Args:
        prompts: ``B`` prompt token lists (repeats allowed, and cheap).
        completion_ids, completion_mask: ``[B, T]`` right-padded completions; row ``i`` follows
            ``prompts[i]``.

    Each distinct prompt is run once (left-padded among the distinct ones, positions counted
    from its first real token), its cache selected per row, then the completions run on top.
    Values at masked completion positions are meaningless; mask them. Grad flows when enabled.
    """
    device = completion_ids.device
    unique, index = dedupe(prompts)
    uniq_ids, uniq_mask = left_pad(unique, pad_token_id, device)
    idx = torch.as_tensor(index, dtype=torch.long, device=device)
    logp = prefix_logprobs(model, uniq_ids, uniq_mask, idx, completion_ids, completion_mask, temperature)
    if logp is None:  # a cache that cannot select rows: run every (prompt, completion) row flat
        ids, mask = left_pad(prompts, pad_token_id, device)
        logp = sequence_logprobs(model, ids, mask, completion_ids, completion_mask, temperature=temperature)
    return logp
