"""Next-token selection: pure functions on a ``[B, V]`` row of logits.

The warpers follow ``transformers``' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
``TopPLogitsWarper`` step for step and in the same order (temperature, top-k, top-p), and the
draw is ``torch.multinomial(softmax(scores), 1)``, so with the same random stream the service
samples exactly what ``model.generate(do_sample=True, ...)`` samples. Top-p is nucleus sampling
(Holtzman et al. 2020, https://arxiv.org/abs/1904.09751).

Log-probabilities reported to clients are :func:`raw_logprobs`: the log-softmax of the model's
own logits at temperature 1, before any warper — the model's distribution, independent of the
sampling settings (what vLLM returns by default). A warped distribution can be recomputed from
them; the reverse is not possible once top-k/top-p cut tokens to probability zero.
"""

from __future__ import annotations

import torch

__all__ = ["warp", "select", "raw_logprobs"]


def warp(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scores to sample from: ``[B, V]`` float32 logits -> ``[B, V]`` with cut tokens at ``-inf``.

    ``temperature`` divides (skipped at 1.0); ``top_k > 0`` keeps the ``k`` largest (ties at the
    k-th value are kept); ``top_p < 1`` keeps the smallest set of tokens whose probability sums
    to more than ``top_p`` (at least one).
    """
    scores = logits
    if temperature != 1.0:
        scores = scores / temperature
    if top_k > 0:
        k = min(top_k, scores.size(-1))
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, -float("inf"))
    return scores


def select(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Next token of each row: ``[B, V]`` logits -> ``[B]`` long.

    ``temperature == 0`` is greedy (argmax; no randomness used). Otherwise one
    ``torch.multinomial`` draw per row from ``softmax(warp(logits))`` using ``generator``.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = warp(logits, temperature=temperature, top_k=top_k, top_p=top_p).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[b, tokens[b]]``: ``[B, V]`` float logits, ``[B]`` ids -> ``[B]`` float32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
