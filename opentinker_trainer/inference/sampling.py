"""Next-token selection: pure functions on a ``[B, V]`` row of logits.

The warpers follow ``transformers``' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
``TopPLogitsWarper`` step for step and in the same order (temperature, top-k, top-p), and the
draw is ``torch.multinomial(softmax(scores), 1)``, so with the same random stream the service
samples exactly what ``model.generate(do_sample=True, ...)`` samples. Top-p is nucleus sampling
(Holtzman et al. 2020, https://arxiv.org/abs/1904.09751).

Two log-probabilities of a chosen token:

* :func:`raw_logprobs`: the log-softmax of the model's own logits at temperature 1, before any
  warper. This is the model's distribution, independent of the sampling settings (what vLLM and
  Tinker return by default), and what a training forward computes for the same tokens.
* :func:`sampling_logprobs`: the log-probability under the distribution the token was drawn
  from, after temperature, top-k and top-p; 0 for greedy choice. It is the denominator of an
  importance ratio when sampling settings differ from temperature 1.
"""

from __future__ import annotations

import torch

__all__ = ["warp", "select", "raw_logprobs", "sampling_logprobs"]


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


def sampling_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """``log softmax(warp(logits))[b, tokens[b]]``: the log-probability of each token under the
    distribution :func:`select` drew it from. ``[B, V]`` logits, ``[B]`` ids -> ``[B]`` float32.
    Greedy choice (``temperature == 0``) is certain: 0."""
    if temperature == 0.0:
        return torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    scores = warp(logits.float(), temperature=temperature, top_k=top_k, top_p=top_p)
    return torch.log_softmax(scores, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
