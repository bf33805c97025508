"""GRPO / PPO building blocks: small pure functions on tensors, and :func:`grpo_update`, the
GRPO optimisation of one step that the text and game trainers share.

In the style of CleanRL and tinker-cookbook: each estimator is a few lines with its shapes and a
reference beside it, so it can be checked against the paper. Shapes use

* ``G`` — number of groups (prompts), ``K`` — group size (completions per prompt),
* ``B`` — batch of sequences (``G * K`` when a batch is a set of groups), ``T`` — completion tokens.

Every mask is a bool (or 0/1) tensor where true marks a real, counted element. Masked-out
positions may hold anything, NaN and inf included: they are removed with ``torch.where``, never
multiplied by zero (``nan * 0`` is ``nan``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from opentinker_common.spec.lm_fields import LOSS_AGGREGATIONS
from opentinker_trainer.context import abandon_point

__all__ = [
    "ADAPTER_OFF",
    "GRPOBatch",
    "LOSS_AGGREGATIONS",
    "aggregate",
    "approx_kl_k3",
    "clip_fraction",
    "group_advantages",
    "grpo_update",
    "headline_metrics",
    "kl_k3",
    "loss_normalizer",
    "masked_mean",
    "masked_sum",
    "pg_loss",
    "rewards_tensor",
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


def loss_normalizer(
    mask: torch.Tensor, aggregation: str = "token_mean", max_completion_length: int | None = None
) -> torch.Tensor:
    """The denominator ``N`` of :func:`aggregate` for a whole batch, as a float32 scalar (at least 1).

    * ``token_mean`` — the number of counted tokens, ``sum_{i,t} m_it``;
    * ``seq_mean`` — the number of rows with at least one counted token (a row whose tokens are
      all masked out, e.g. one without a reward, is no sequence of the mean);
    * ``dr_grpo`` — ``B * L``, ``B = mask.shape[0]`` rows (all of them, as TRL's
      ``per_token_loss.size(0)``) and ``L = max_completion_length`` (default ``T``): a constant
      for a fixed batch size and generation budget, independent of the completions' lengths.

    Args:
        mask: ``[B, T]`` true on counted tokens.
        aggregation: one of :data:`LOSS_AGGREGATIONS`.
        max_completion_length: ``L`` of ``dr_grpo`` (the sampler's ``max_new_tokens``); ignored
            by the others.

    Raises:
        ValueError: an unknown ``aggregation``.
    """
    mask = mask.bool()
    if aggregation == "token_mean":
        n = mask.sum()
    elif aggregation == "seq_mean":
        n = mask.any(dim=1).sum()
    elif aggregation == "dr_grpo":
        length = mask.shape[1] if max_completion_length is None else int(max_completion_length)
        n = torch.tensor(mask.shape[0] * length, device=mask.device)
    else:
        raise ValueError(f"aggregation must be one of {', '.join(LOSS_AGGREGATIONS)}, got {aggregation!r}")
    return n.clamp(min=1).float()


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str = "token_mean",
    normalizer: torch.Tensor | float | None = None,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """Reduce per-token losses ``x [B, T]`` to a scalar, by name (TRL ``GRPOTrainer`` ``loss_type``).

    With ``m`` the mask, ``|o_i| = sum_t m_it`` and ``N`` = ``normalizer`` or, when None,
    :func:`loss_normalizer` of this ``mask``:

    * ``token_mean`` — ``sum_{i,t} m_it x_it / N``, ``N = sum_{i,t} m_it``: every counted token
      weighs the same (DAPO, https://arxiv.org/abs/2503.14476, sec. 3.3; TRL ``"bnpo"``);
    * ``seq_mean`` — ``sum_i (sum_t m_it x_it / |o_i|) / N``, ``N`` = rows with ``|o_i| > 0``:
      GRPO's mean of per-sequence means (Shao et al. 2024, DeepSeekMath, eq. 3,
      https://arxiv.org/abs/2402.03300; TRL ``"grpo"``), which down-weights long completions;
    * ``dr_grpo`` — ``sum_{i,t} m_it x_it / (B * L)`` with the constant ``L`` =
      ``max_completion_length`` (Liu et al. 2025, "Understanding R1-Zero-Like Training: A
      Critical Perspective", https://arxiv.org/abs/2503.20783; TRL ``"dr_grpo"``), which removes
      the length bias of both means.

    Pass ``normalizer`` (the whole batch's :func:`loss_normalizer`) when ``per_token`` is one
    micro-batch of a batch: the micro-batches' results then add up to the batch's. Masked-out
    positions may hold NaN (see :func:`masked_sum`); a row with no counted token adds 0.

    Returns:
        ``[]``, in ``per_token``'s dtype.
    """
    if normalizer is None:
        normalizer = loss_normalizer(mask, aggregation, max_completion_length).to(per_token.dtype)
    if aggregation == "seq_mean":
        lengths = mask.bool().sum(dim=1).clamp(min=1).to(per_token.dtype)
        return (masked_sum(per_token, mask, dim=1) / lengths).sum() / normalizer
    if aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(LOSS_AGGREGATIONS)}, got {aggregation!r}")
    return masked_sum(per_token, mask) / normalizer


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
    aggregation: str = "token_mean",
    max_completion_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss, reduced over tokens by ``aggregation`` (default a token mean).

    ``ratio = exp(logp - old_logp)``;
    ``loss_t = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))`` — Schulman et al. 2017, PPO,
    eq. 7, https://arxiv.org/abs/1707.06347; per token with a sequence-level ``A`` as in GRPO
    (https://arxiv.org/abs/2402.03300, eq. 3).

    Aggregation (:func:`aggregate`): by default a *token* mean over the whole batch (every
    unmasked token weighs the same, as DAPO, https://arxiv.org/abs/2503.14476, sec. 3.3), not
    GRPO's mean of per-sequence means (``seq_mean``), which down-weights long completions'
    tokens; ``dr_grpo`` divides the sum by the constant ``B * max_completion_length``.

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy (with grad).
        old_logp: ``[B, T]`` log-probs under the policy that sampled (no grad). For a single
            on-policy epoch pass ``logp.detach()``: the ratio is then 1 and the gradient is the
            plain policy gradient ``-A * grad logp``.
        advantages: ``[B]`` per-sequence (or ``[B, T]`` per-token) advantages.
        mask: ``[B, T]`` true on completion tokens that count.
        clip_eps: the clip range ``eps``.
        normalizer: the ``N`` of :func:`aggregate` instead of this batch's
            :func:`loss_normalizer` — set it to the whole batch's when ``logp`` is one
            micro-batch of it, so that the micro-batch losses add up to the batch's loss.
        aggregation: ``token_mean``, ``seq_mean`` or ``dr_grpo`` (:func:`aggregate`).
        max_completion_length: ``L`` of ``dr_grpo`` when ``normalizer`` is None (default ``T``).

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
    loss = aggregate(per_token, mask, aggregation, normalizer, max_completion_length)
    with torch.no_grad():
        metrics = {
            "clipfrac": clip_fraction(ratio, advantages, mask, clip_eps),
            "approx_kl": approx_kl_k3(logp, old_logp, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# One GRPO update: the optimisation of one step's samples, shared by the text and game trainers.

#: ``reference`` of :func:`grpo_update` for a PEFT model: the same weights with the adapter
#: switched off (``model.disable_adapter()``), i.e. the base model the adapter was added to.
ADAPTER_OFF = "adapter_off"


def rewards_tensor(values, num_groups: int, group_size: int) -> torch.Tensor:
    """``[num_groups, group_size]`` float32 rewards from a flat sequence of ``num_groups * group_size``
    values in group order; ``None`` (no reward: the scorer failed or gave none) becomes NaN, the
    missing-reward mark of :func:`group_advantages` and :func:`grpo_update`."""
    flat = [float("nan") if v is None else float(v) for v in values]
    return torch.tensor(flat, dtype=torch.float32).view(num_groups, group_size)


@dataclass
class GRPOBatch:
    """One step's samples for :func:`grpo_update`. ``G`` groups of ``K`` samples; ``B`` rows.

    A *sample* is what gets one reward (a completion of a text prompt, an episode of a game); a
    *row* is one (prompt, completion) sequence trained on. A text sample is one row; an episode
    has a row per turn, each with the episode's advantage.

    Attributes:
        rewards: ``[G, K]`` float rewards, NaN where missing (see :func:`rewards_tensor`).
        mask: ``[B, T]`` bool, true on the completion tokens of each row.
        chunks: micro-batches, row slices covering ``0 .. B``; one forward/backward each.
        sample_of_row: ``[B]`` long, the index into ``rewards.flatten()`` of each row's sample;
            None when row ``i`` is sample ``i`` (``B == G * K``).
    """

    rewards: torch.Tensor
    mask: torch.Tensor
    chunks: list[slice]
    sample_of_row: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.mask.shape[0])


@torch.no_grad()
def _no_grad_logprobs(
    logprobs: Callable, model, batch: GRPOBatch, reference: Any = None, dummies: int = 0
) -> torch.Tensor:
    """``[B, T]`` log-probs of every row, chunk by chunk, in eval mode, under ``model`` or, when
    given, under ``reference`` (a module, or :data:`ADAPTER_OFF`); then ``dummies`` more passes of
    the first chunk, discarded (a sharded model's ranks run as many forwards)."""
    model.eval()
    parts = []
    for sl in list(batch.chunks) + [batch.chunks[0]] * dummies:
        if reference is None:
            parts.append(logprobs(model, sl))
        elif isinstance(reference, str):
            if reference != ADAPTER_OFF:
                raise ValueError(f"reference must be a module, {ADAPTER_OFF!r} or None, got {reference!r}")
            with model.disable_adapter():
                parts.append(logprobs(model, sl))
        else:
            parts.append(logprobs(reference, sl))
    return torch.cat(parts[: len(parts) - dummies])


def grpo_update(
    model,
    optimizer: torch.optim.Optimizer,
    batch: GRPOBatch,
    logprobs: Callable[[Any, slice], torch.Tensor],
    cfg: Any,
    *,
    reference: Any = None,
    dp: Any = None,
    sharded: bool = False,
    chunk_pass: Callable[[slice, Callable[[torch.Tensor], torch.Tensor]], torch.Tensor] | None = None,
) -> dict[str, float]:
    """``ppo_epochs`` optimizer steps of GRPO on one step's samples; returns the metrics.

    Advantages: ``A = group_advantages(rewards, scale=cfg.scale_rewards)`` (eq. 3 of Shao et al.
    2024, DeepSeekMath, https://arxiv.org/abs/2402.03300), every token of a row getting its
    sample's ``A``. Each epoch is one optimizer step (AdamW or any ``optimizer``; gradients
    summed over ``batch.chunks``, then clipped to ``cfg.max_grad_norm``) on

        ``loss = pg_loss(logp, old_logp, A, mask, cfg.clip_eps) + cfg.kl_coef * KL``,
        ``KL = aggregate(kl_k3(logp, ref_logp))`` (the k3 penalty of DeepSeekMath eq. 4),

    both reduced by :func:`aggregate` with ``cfg.loss_aggregation`` over the whole batch: by
    default token means (every counted token weighs the same, DAPO sec. 3.3); ``seq_mean`` (GRPO's
    mean of per-sequence means) and ``dr_grpo`` (sum / ``(B * cfg.max_new_tokens)``, Dr. GRPO,
    https://arxiv.org/abs/2503.20783; ``B`` the batch's rows, for a game the step's turns) too.
    ``old_logp`` are the sampling policy's log-probs: a no-grad pass before the first epoch when
    ``ppo_epochs > 1``; with one epoch, the epoch's own forward, detached (ratio 1).

    **Dropout is off in every forward**, the loss's included: the model runs in ``eval()`` mode
    throughout and is put in ``train()`` mode on return. The rollout sampled with dropout off, so
    that is the behaviour policy ``pi_old`` of the ratio ``pi / pi_old``; a loss forward in
    ``train()`` mode draws a dropout mask (``lora_dropout > 0``), so the first epoch's ratio is not
    1 (approx_kl > 0, tokens clipped) before any step is taken. Dropout on in both passes would not
    help: the two masks differ. TRL's ``PPOTrainer`` makes the same choice (it removes dropout from
    the policy and the reference, ``disable_dropout_in_model``). With dropout 0 (the default)
    ``eval()`` and ``train()`` give the same numbers.

    Rules, the same for every trainer that calls this:

    * **Missing rewards** — a NaN reward (:func:`rewards_tensor` turns ``None`` into NaN) is left
      out of its group's mean and std, its rows' tokens are left out of the loss, of the
      normaliser of the loss (:func:`loss_normalizer`) and of the KL term and the reported KL; ``reward/mean`` and
      ``reward/std`` are over the finite rewards only (NaN when there are none).
    * **Groups without signal** — groups whose rewards are all equal get advantage 0
      (``grpo/zero_std_frac``). A batch where *every* group is so still takes its ``ppo_epochs``
      optimizer steps: with AdamW a zero policy gradient is no no-op (the moments from earlier
      steps still move the weights, and the KL term has a gradient of its own), and skipping it
      would change the runs of the text trainer, whose reward curves are pinned (the game
      trainer skipped such batches before the two shared this update). The metrics say which
      batches had no signal (``grpo/no_signal`` 1.0).
    * **Reference and reported KL** — ``reference`` is the KL anchor ``pi_ref``: a frozen module
      (a copy of the starting weights, for full-weight training), :data:`ADAPTER_OFF` (the base
      model under a LoRA adapter), or None (no reference: the KL term is 0 and ``cfg.kl_coef`` must
      be 0). ``kl`` (= ``grpo/kl_ref``) is the token mean of ``kl_k3(sampling logp, ref_logp)``,
      the k3 estimate of ``KL(pi_sampling || pi_ref)`` on this step's samples, before the update;
      NaN (so not reported) when there is no reference. ``loss/kl`` is the KL penalty term as
      optimised (mean over epochs, before ``kl_coef``), 0 without a reference.

    Args:
        model: the policy; every forward in ``eval()`` mode (no dropout, see above), left in
            ``train()`` mode.
        optimizer: steps the trainable parameters of ``model``.
        batch: the rows, their masks, micro-batches and rewards (:class:`GRPOBatch`).
        logprobs: ``logprobs(module, rows) -> [len(rows), T]`` float32 token log-probs of the
            completions of ``rows`` (a slice) under ``module`` (with grad when grad is enabled).
        cfg: ``ppo_epochs``, ``clip_eps``, ``kl_coef``, ``max_grad_norm``, ``scale_rewards``,
            ``loss_aggregation``, ``max_new_tokens`` (read for ``dr_grpo`` only).
        reference: see the rules above.
        dp: None (one rank), or this rank's data-parallel collectives
            (:class:`opentinker_trainer.distributed.DataParallel`: ``sum``, ``sum_tensor``,
            ``all_reduce_grads``). Then ``batch`` is this rank's share of the step's groups (whole
            groups: advantages stay per group); the loss normaliser and the token count are the
            sums over ranks, the gradients are summed over ranks before clipping, and every
            metric is of the global batch. So each rank takes the step one rank would take on
            the union of the ranks' batches (up to float summation order).
        sharded: with ``dp``, ``model`` (and a module ``reference``) is sharded with FSDP2
            (:mod:`opentinker_trainer.fsdp`): every forward and backward is a collective, so a rank
            with fewer micro-batches than another runs dummy ones (its first chunk again, weighted
            0) up to the most any rank has; FSDP averages the ranks' gradients itself (reduce-
            scatter), so each loss is multiplied by the world size before ``backward`` (the sum
            the one-rank step takes) and no ``all_reduce_grads`` follows. ``logprobs`` must run
            the same forwards on every rank for the same chunk count (same completion width).
        chunk_pass: ``chunk_pass(rows, loss_of) -> logp`` runs one micro-batch's loss pass in
            place of ``logprobs`` and ``backward``: it computes the rows' log-probs with grad,
            adds the gradient of ``loss_of(logp)`` to the parameters' ``.grad`` and returns
            ``logp`` detached. A model host batches its tenants' passes so
            (:mod:`opentinker_trainer.rl.update_batch`). One rank only (no ``dp``).

    Returns:
        Means over epochs of ``loss/policy``, ``loss/kl``, ``grpo/clipfrac``, ``grpo/approx_kl``
        (k3 of ``KL(old || new)``, how far the updates moved); ``loss/total`` (``loss/policy +
        kl_coef * loss/kl``), ``optim/grad_norm`` (the last epoch's, before clipping),
        ``kl`` and ``grpo/kl_ref``, ``grpo/zero_std_frac``, ``grpo/no_signal``,
        ``grpo/missing_rewards`` (how many rewards were NaN), ``grpo/tokens`` (tokens counted),
        ``train/tokens`` (the same count: the completion tokens the loss trained on, which the
        scheduler's usage accounts as ``tokens_trained``),
        ``reward/mean``, ``reward/std`` (population std).

    Raises:
        ValueError: ``cfg.kl_coef > 0`` with no reference, or a reference of another kind.
    """
    if cfg.kl_coef > 0 and reference is None:
        raise ValueError("kl_coef > 0 needs a reference model")
    if chunk_pass is not None and dp is not None:
        raise ValueError("chunk_pass runs on one rank: no dp")
    mask_device = batch.mask.device
    rewards = batch.rewards.float()
    adv_sample, zero_std = group_advantages(rewards, scale=cfg.scale_rewards)
    valid_sample = ~torch.isnan(rewards.flatten())
    adv, valid = adv_sample.flatten(), valid_sample
    if batch.sample_of_row is not None:
        rows = batch.sample_of_row.to(adv.device)
        adv, valid = adv[rows], valid[rows]
    adv, valid = adv.to(mask_device), valid.to(mask_device)
    mask = batch.mask & valid.unsqueeze(1)
    n_tokens = mask.sum().clamp(min=1).float()
    aggregation = cfg.loss_aggregation
    max_len = cfg.max_new_tokens if aggregation == "dr_grpo" else None
    normalizer = loss_normalizer(mask, aggregation, max_len)
    if dp is not None:  # every normaliser is a sum over rows or tokens: the global one is the ranks' sum
        normalizer, n_tokens = dp.sum_tensor(normalizer), dp.sum_tensor(n_tokens)
    sharded = sharded and dp is not None
    # Sharded: every rank runs the most chunks any rank has (dummies repeat chunk 0, weighted 0).
    dummies = int(dp.max(len(batch.chunks))[0]) - len(batch.chunks) if sharded else 0
    scale = float(dp.world_size) if sharded else 1.0
    ref_logp = _no_grad_logprobs(logprobs, model, batch, reference, dummies) if reference is not None else None
    old_logp = _no_grad_logprobs(logprobs, model, batch, None, dummies) if cfg.ppo_epochs > 1 else None

    model.eval()  # the loss's forwards too: the same dropout-free policy as old_logp and the sampler
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sums = {"loss/policy": 0.0, "loss/kl": 0.0, "grpo/clipfrac": 0.0, "grpo/approx_kl": 0.0}
    grad_norm = 0.0
    sampling_logp = old_logp
    for _epoch in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        epoch_logp = []
        for sl in batch.chunks:
            abandon_point()  # a stopped model-host tenant leaves its step here
            terms: dict[str, torch.Tensor] = {}

            def loss_of(logp: torch.Tensor, sl: slice = sl, terms: dict = terms) -> torch.Tensor:
                old = old_logp[sl] if old_logp is not None else logp.detach()
                m = mask[sl]
                policy_loss, stats = pg_loss(logp, old, adv[sl], m, cfg.clip_eps, normalizer, aggregation)
                if ref_logp is not None:
                    kl_loss = aggregate(kl_k3(logp, ref_logp[sl]), m, aggregation, normalizer)
                else:
                    kl_loss = torch.zeros(())
                terms.update(stats, policy=policy_loss.detach(), kl=kl_loss.detach())
                loss = policy_loss + cfg.kl_coef * kl_loss if cfg.kl_coef > 0 else policy_loss
                return loss * scale

            if chunk_pass is not None:
                epoch_logp.append(chunk_pass(sl, loss_of))
            else:
                logp = logprobs(model, sl)
                loss_of(logp).backward()
                epoch_logp.append(logp.detach())
            weight = (mask[sl].sum() / n_tokens).item()
            sums["loss/policy"] += terms["policy"].item()
            sums["loss/kl"] += terms["kl"].item()
            sums["grpo/clipfrac"] += terms["clipfrac"].item() * weight
            sums["grpo/approx_kl"] += terms["approx_kl"].item() * weight
        for _ in range(dummies):  # the same backward collectives as the ranks with more chunks
            (logprobs(model, batch.chunks[0]).sum() * 0.0).backward()
        if sampling_logp is None:
            sampling_logp = torch.cat(epoch_logp)
        if dp is not None and not sharded:
            dp.all_reduce_grads(params)
        total_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        grad_norm = float(total_norm.full_tensor() if hasattr(total_norm, "full_tensor") else total_norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.train()

    if dp is not None:
        return _global_metrics(dp, cfg, sums, grad_norm, rewards, valid_sample, zero_std, mask, sampling_logp, ref_logp)
    out = {k: v / cfg.ppo_epochs for k, v in sums.items()}
    out["loss/total"] = out["loss/policy"] + cfg.kl_coef * out["loss/kl"]
    kl_ref = masked_mean(kl_k3(sampling_logp, ref_logp), mask).item() if ref_logp is not None else math.nan
    finite = rewards.flatten()[valid_sample]
    out.update(
        {
            "kl": kl_ref,
            "grpo/kl_ref": kl_ref,
            "grpo/zero_std_frac": zero_std.float().mean().item(),
            "grpo/no_signal": float(bool(zero_std.all())),
            "grpo/missing_rewards": float((~valid_sample).sum()),
            "grpo/tokens": float(mask.sum()),
            "train/tokens": float(mask.sum()),  # the tokens the loss trained on (usage's tokens_trained)
            "optim/grad_norm": grad_norm,
            "reward/mean": finite.mean().item() if finite.numel() else math.nan,
            "reward/std": finite.std(unbiased=False).item() if finite.numel() else math.nan,
        }
    )
    return out


def _global_metrics(dp, cfg, sums, grad_norm, rewards, valid_sample, zero_std, mask, sampling_logp, ref_logp):
    """:func:`grpo_update`'s metrics over all ranks' batches, with one ``all_reduce``: the loss
    sums are already shares of global means (global normaliser), the rest are sums of counts,
    values and squares."""
    finite = rewards.flatten()[valid_sample].double()
    if ref_logp is not None:
        kl_sum, kl_n = masked_sum(kl_k3(sampling_logp, ref_logp), mask).item(), float(mask.sum())
    else:
        kl_sum, kl_n = 0.0, 0.0
    keys = list(sums)
    totals = dp.sum(
        *(sums[k] for k in keys),
        kl_sum,
        kl_n,
        float(zero_std.sum()),
        float(zero_std.numel()),
        float((~valid_sample).sum()),
        float(mask.sum()),
        float(finite.sum()),
        float((finite**2).sum()),
        float(finite.numel()),
    )
    out = {k: v / cfg.ppo_epochs for k, v in zip(keys, totals)}
    kl_sum, kl_n, zero, groups, missing, tokens, r_sum, r_sq, r_n = totals[len(keys) :]
    out["loss/total"] = out["loss/policy"] + cfg.kl_coef * out["loss/kl"]
    kl_ref = kl_sum / max(kl_n, 1.0) if ref_logp is not None else math.nan
    mean = r_sum / r_n if r_n else math.nan
    out.update(
        {
            "kl": kl_ref,
            "grpo/kl_ref": kl_ref,
            "grpo/zero_std_frac": zero / max(groups, 1.0),
            "grpo/no_signal": float(zero == groups),
            "grpo/missing_rewards": missing,
            "grpo/tokens": tokens,
            "train/tokens": tokens,
            "optim/grad_norm": grad_norm,
            "reward/mean": mean,
            "reward/std": math.sqrt(max(r_sq / r_n - mean**2, 0.0)) if r_n else math.nan,
        }
    )
    return out


def headline_metrics(out: Mapping[str, float]) -> dict[str, float]:
    """The short names every GRPO trainer reports for :func:`grpo_update`'s metrics ``out``:
    ``loss`` (= ``loss/total``), ``reward`` (= ``reward/mean``), ``reward_std`` (= ``reward/std``)
    and ``zero_std_frac`` (= ``grpo/zero_std_frac``), in that order.

    Raises:
        KeyError: ``out`` lacks one of those keys.
    """
    return {
        "loss": out["loss/total"],
        "reward": out["reward/mean"],
        "reward_std": out["reward/std"],
        "zero_std_frac": out["grpo/zero_std_frac"],
    }
