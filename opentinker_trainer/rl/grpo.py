"""GRPO / PPO building blocks: small pure functions on tensors.

In the style of CleanRL and tinker-cookbook: each estimator is a few lines with its shapes and a
reference beside it, so it can be checked against the paper. Shapes use

* ``G`` — number of groups (prompts), ``K`` — group size (completions per prompt),
* ``B`` — batch of sequences (``G * K`` when a batch is a set of groups), ``T`` — completion tokens.

Every mask is a bool (or 0/1) tensor where true marks a real, counted element. Masked-out
positions may hold anything, NaN and inf included: they are removed with ``torch.where``, never
multiplied by zero (``nan * 0`` is ``nan``).
"""

from __future__ import annotations

import torch

__all__ = [
    "approx_kl_k3",
    "clip_fraction",
    "group_advantages",
    "kl_k3",
    "masked_mean",
    "masked_sum",
    "pg_loss",
    "token_logprobs",
]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is true; masked positions (even NaN) contribute 0."""
    mask = mask.bool()
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    picked = torch.where(mask, values, zeros)
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is true.

    ``dim=None`` averages over every unmasked element (a *token* mean when ``values`` is
    ``[B, T]``). A slice with no unmasked element has mean 0, not NaN.
    """
    mask = mask.bool()
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages of GRPO.

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` — Shao et al. 2024, DeepSeekMath,
    eq. 3 / sec. 4.1.2 (outcome supervision), https://arxiv.org/abs/2402.03300. With
    ``scale=False`` only the mean is subtracted (Dr. GRPO, Liu et al. 2025,
    https://arxiv.org/abs/2503.20783, argues the std division biases towards easy/hard groups).

    Args:
        rewards: ``[G, K]`` float rewards, one row per prompt. A NaN marks a missing or invalid
            reward: that sample is left out of its group's mean and std and gets advantage
            exactly 0. The caller should also drop it from the loss mask (``~rewards.isnan()``),
            so that it does not count in token means either.
        scale: divide by the group's std (GRPO) or not (Dr. GRPO).
        eps: added to the std.

    Returns:
        ``(advantages [G, K], zero_std [G] bool)``. ``zero_std`` marks groups whose valid rewards
        are all equal (fewer than two valid samples included): they carry no learning signal,
        and their advantages are exactly 0 without any division by zero. The std is the sample
        (``n - 1``) std, as ``torch.std`` and TRL use.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    valid = ~torch.isnan(rewards)
    n = valid.sum(dim=1, keepdim=True)  # [G, 1]
    mean = masked_sum(rewards, valid, dim=1).unsqueeze(1) / n.clamp(min=1)
    centered = torch.where(valid, rewards - mean, torch.zeros_like(rewards))
    var = (centered**2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
    std = var.sqrt()
    # Exact test, not std < tol: rewards like [1, 1, 1] give mean 1 and centered 0 exactly.
    big = torch.finfo(rewards.dtype).max
    lo = torch.where(valid, rewards, torch.full_like(rewards, big)).amin(dim=1)
    hi = torch.where(valid, rewards, torch.full_like(rewards, -big)).amax(dim=1)
    zero_std = (n.squeeze(1) < 2) | (hi <= lo)
    adv = centered / (std + eps) if scale else centered
    adv = torch.where(valid & ~zero_std.unsqueeze(1), adv, torch.zeros_like(adv))
    return adv, zero_std


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each chosen token under its logits.

    Args:
        logits: ``[B, T, V]``, where ``logits[:, t]`` is the distribution that produced
            ``tokens[:, t]`` (for a causal LM: the logits one position to the left, already shifted).
        tokens: ``[B, T]`` token ids.

    Returns:
        ``[B, T]`` float32 ``log softmax(logits)[tokens]``, computed in float32 so that bf16 logits
        lose nothing; ``logsumexp`` form, so no ``[B, T, V]`` log-softmax tensor is kept.
    """
    logits = logits.float()
    chosen = torch.gather(logits, -1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(pi || pi_ref)`` from samples of ``pi``.

    ``k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1`` (>= 0, unbiased) — J. Schulman,
    "Approximating KL divergence", http://joschu.net/blog/kl-approx.html; the KL penalty of
    GRPO, DeepSeekMath eq. 4, https://arxiv.org/abs/2402.03300. Shapes: any, elementwise.
    """
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


def approx_kl_k3(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scalar k3 estimate of ``KL(pi_old || pi)`` over masked tokens (sampled from ``pi_old``).

    ``r = pi / pi_old``; ``k3 = (r - 1) - log r`` — http://joschu.net/blog/kl-approx.html, as
    CleanRL's ``approx_kl`` (https://docs.cleanrl.dev/rl-algorithms/ppo/). A diagnostic: how far
    the updates moved the policy from the one that sampled. ``[B, T]`` inputs, ``[]`` output.
    """
    log_ratio = logp - old_logp
    return masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, mask)


def clip_fraction(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """Fraction of masked tokens whose surrogate was clipped (gradient zeroed by the clip).

    A token is clipped when ``ratio > 1 + eps`` with ``A > 0`` or ``ratio < 1 - eps`` with ``A < 0``
    (the cases where ``max(-A r, -A clip(r))`` takes the clipped branch). ``ratio, mask: [B, T]``,
    ``advantages: [B, 1]`` or ``[B, T]``.
    """
    advantages = advantages.expand_as(ratio)
    clipped = ((ratio > 1.0 + clip_eps) & (advantages > 0)) | ((ratio < 1.0 - clip_eps) & (advantages < 0))
    return masked_mean(clipped.float(), mask)


def pg_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss, averaged over tokens.

    ``ratio = exp(logp - old_logp)``;
    ``loss_t = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))`` — Schulman et al. 2017, PPO,
    eq. 7, https://arxiv.org/abs/1707.06347; per token with a sequence-level ``A`` as in GRPO
    (https://arxiv.org/abs/2402.03300, eq. 3).

    Aggregation is a *token* mean over the whole batch (every unmasked token weighs the same,
    as DAPO, https://arxiv.org/abs/2503.14476, sec. 3.3), not GRPO's mean of per-sequence means,
    which down-weights long completions' tokens.

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy (with grad).
        old_logp: ``[B, T]`` log-probs under the policy that sampled (no grad). For a single
            on-policy epoch pass ``logp.detach()``: the ratio is then 1 and the gradient is the
            plain policy gradient ``-A * grad logp``.
        advantages: ``[B]`` per-sequence (or ``[B, T]`` per-token) advantages.
        mask: ``[B, T]`` true on completion tokens that count.
        clip_eps: the clip range ``eps``.
        normalizer: divide the masked *sum* by this instead of by the number of masked tokens in
            this batch — set it to the token count of the whole batch when ``logp`` is one
            micro-batch of it, so that the micro-batch losses add up to the batch token mean.

    Returns:
        ``(loss [], metrics)`` with ``metrics`` holding detached scalars ``clipfrac``,
        ``approx_kl`` (k3 of ``KL(old || new)``) and ``ratio_mean``.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logp.dtype)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)
    if normalizer is None:
        loss = masked_mean(per_token, mask)
    else:
        loss = masked_sum(per_token, mask) / normalizer
    with torch.no_grad():
        metrics = {
            "clipfrac": clip_fraction(ratio, advantages, mask, clip_eps),
            "approx_kl": approx_kl_k3(logp, old_logp, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics
