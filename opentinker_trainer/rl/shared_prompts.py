"""Log-probabilities of many completions whose prompts repeat, running each distinct prompt once.

In a multi-turn game the same observation (hence the same prompt) comes back many times in one
step: every episode of a group starts in the same state, and FrozenLake has only 16 squares. The
prompt is most of each sequence, so running each distinct prompt once and selecting its
key/value cache for every completion that follows it (``DynamicCache.batch_select_indices``)
cuts the forward and backward work several times. Gradients flow through the shared cache, so
the values and gradients equal :func:`~opentinker_trainer.rl.rollout.sequence_logprobs`' on the
same rows (up to float rounding).
"""

from __future__ import annotations

from typing import Sequence

import torch

from opentinker_trainer.rl.grpo import token_logprobs
from opentinker_trainer.rl.rollout import _cache_kwarg, left_pad, position_ids_from_mask

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
    out = model(
        input_ids=uniq_ids,
        attention_mask=uniq_mask.long(),
        position_ids=position_ids_from_mask(uniq_mask),
        use_cache=True,
        logits_to_keep=1,
    )
    cache = out.get("cache", None) if "cache" in type(out).__dataclass_fields__ else out.past_key_values
    first = out.logits[:, -1:, :].index_select(0, idx)  # [B, 1, V]
    t = completion_ids.shape[1]
    if t > 1:
        cache.batch_select_indices(idx)
        full_mask = torch.cat([uniq_mask.index_select(0, idx), completion_mask], dim=1)
        positions = position_ids_from_mask(full_mask)
        p = uniq_ids.shape[1]
        rest = model(
            input_ids=completion_ids[:, :-1],
            attention_mask=full_mask[:, :-1].long(),
            position_ids=positions[:, p:-1],
            use_cache=True,
            **{_cache_kwarg(model): cache},
        )
        logits = torch.cat([first, rest.logits], dim=1)
    else:
        logits = first
    if temperature != 1.0:
        logits = logits.float() / temperature
    return token_logprobs(logits, completion_ids)
