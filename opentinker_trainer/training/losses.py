"""The losses of ``ForwardBackward``, on one datum's tokens: ``[N]`` tensors in, ``[]`` out.

Each is Tinker's built-in loss of the same name, as its docs define it
(https://tinker-docs.thinkingmachines.ai/tinker/losses), and a *sum* over the datum's tokens: a
mean is the caller's choice, made through the weights or advantages, so several calls before one
optimizer step add up to the loss of their union. ``logp`` is the current model's log-probability
of each target token (with grad); ``sampling_logp`` the sampler's (Tinker's ``logprobs`` input);
``A`` the advantages; ``r = exp(logp - sampling_logp)`` the importance ratio; ``sg`` stops the
gradient. ``lo`` and ``hi`` bound the ratio itself, as Tinker's ``clip_low_threshold`` and
``clip_high_threshold`` do, not its distance from 1.

* ``cross_entropy``: ``sum_t -w_t logp_t``. Supervised learning; any finite weight, so a
  negative one too (``forward_backward_custom`` sends ``dLoss/dlogp`` as weights).
* ``importance_sampling``: ``sum_t -r_t A_t``. The policy gradient of samples from another
  policy, reweighted by the importance ratio; on-policy (``r = 1``) its gradient is REINFORCE's,
  ``-A grad logp`` (Williams 1992).
* ``ppo``: ``sum_t -min(r_t A_t, clip(r_t, lo, hi) A_t)``. PPO's clipped surrogate (Schulman et
  al. 2017, eq. 7) with asymmetric bounds; Tinker's defaults ``lo = 0.8``, ``hi = 1.2``.
* ``cispo``: ``sum_t -sg(clip(r_t, lo, hi)) logp_t A_t``. The clipped ratio weighs the
  log-probability and never zeroes a token's gradient (MiniMax-M1, Chen et al. 2025); Tinker's
  defaults ``lo = 0``, ``hi = 4`` clip one side only.
* ``dro``: ``sum_t -(logp_t A_t - beta / 2 (logp_t - sampling_logp_t)^2)``. Direct Reward
  Optimization (Richemond et al. 2024): a quadratic penalty on the log-ratio in place of a clip.
* ``gspo``: GSPO-token (Zheng et al. 2025). The sequence ratio ``s = exp(mean_{t in M}
  sg(logp_t) - sampling_logp_t)`` over the tokens ``M`` that ``sequence_ratio_mask`` marks;
  each token's ratio ``s_t = s exp(logp_t - sg(logp_t))`` has the value of ``s`` and the gradient
  of its own log-probability; then PPO's clipped surrogate on ``s_t``.
* ``stable_reinforce``: ``sum_{t in S} -sg(min(r_t, 1)) A_t logp_t + kl_coeff (r_t - 1 - log r_t)``
  over the sampled target tokens ``S``. Our reading of Tinker's StableReinforce
  (https://tinker-docs.thinkingmachines.ai/tinker/losses/stable-reinforce/), which publishes no
  formula: "a REINFORCE variant that stays stable even when the sampling policy differs from the
  policy being trained", using "minimal additional information captured at sampling time", with a
  ``kl_coeff`` (tinker_public.proto, ``loss_fn_config_v2``). Here that information is the
  sampler's own log-probability of each sampled token under the distribution that drew it,
  recorded by the session when asked (``record_stability_info``): it is ``sampling_logp``, the
  datum's ``logprobs`` input is not read. The weight ``min(r_t, 1)`` is a truncated importance
  weight (IMPALA's V-trace, Espeholt et al. 2018, with bound 1): on-policy it is 1 and the
  gradient is REINFORCE's, ``-A grad logp``; a token the learner now favours more than the
  sampler did is not weighted up, so no ratio can blow up a step. ``r - 1 - log r`` is Schulman's
  k3 estimate of ``KL(sampler || learner)`` on the sampler's tokens, whose gradient ``(r_t - 1)
  grad logp_t`` pulls the learner back towards the sampler. ``kl_coeff`` defaults to 0: Tinker
  documents no default (its proto's example is 0.01).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from opentinker_trainer.training.errors import BadRequest

__all__ = [
    "LossConfig",
    "loss_config",
    "cispo",
    "cross_entropy",
    "datum_loss",
    "dro",
    "gspo",
    "importance_sampling",
    "ppo",
    "stable_reinforce",
]


@dataclass(frozen=True)
class LossConfig:
    """A loss's hyper-parameters, named as Tinker's ``loss_fn_config`` keys."""

    #: Lower and upper bounds of the importance ratio (ppo, cispo, gspo).
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2
    #: Weight of dro's quadratic penalty on the log-ratio.
    beta: float = 0.0
    #: Weight of stable_reinforce's penalty on the distance to the sampler.
    kl_coeff: float = 0.0


#: Each loss's ``loss_fn_config`` keys and their defaults (None: required); Tinker's defaults
#: where its docs give them, PPO's for gspo.
_CONFIG: dict[str, dict[str, float | None]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": None},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "stable_reinforce": {"kl_coeff": 0.0},
}


def loss_config(loss_fn: str, given: Mapping[str, float]) -> LossConfig:
    """The :class:`LossConfig` of ``loss_fn`` from the ``loss_fn_config`` values ``given``.

    Raises:
        BadRequest: a key the loss does not read, a required one missing, a value not finite,
            thresholds outside ``0 <= clip_low_threshold <= 1 <= clip_high_threshold``, ``beta < 0``
            or ``kl_coeff < 0``.
    """
    if loss_fn not in _CONFIG:
        raise BadRequest(f"loss_fn: expected one of {', '.join(_CONFIG)}, got {loss_fn!r}")
    keys = _CONFIG[loss_fn]
    values = dict(keys)
    for key, value in given.items():
        if key not in keys:
            reads = ", ".join(keys) or "no key"
            raise BadRequest(f"loss_fn_config.{key}: not read by {loss_fn} (it reads {reads})")
        if not math.isfinite(value):
            raise BadRequest(f"loss_fn_config.{key}: expected a finite number, got {value}")
        values[key] = float(value)
    for key, value in values.items():
        if value is None:
            raise BadRequest(f"loss_fn_config.{key}: {loss_fn} needs it (a number >= 0); Tinker has no default")
    lo, hi = values.get("clip_low_threshold", 0.8), values.get("clip_high_threshold", 1.2)
    if not 0.0 <= lo <= 1.0:
        raise BadRequest(f"loss_fn_config.clip_low_threshold: expected a ratio in [0, 1], got {lo}")
    if hi < 1.0:
        raise BadRequest(f"loss_fn_config.clip_high_threshold: expected a ratio >= 1, got {hi}")
    beta = values.get("beta", 0.0)
    if beta < 0:
        raise BadRequest(f"loss_fn_config.beta: expected a number >= 0, got {beta}")
    kl_coeff = values.get("kl_coeff", 0.0)
    if kl_coeff < 0:
        raise BadRequest(f"loss_fn_config.kl_coeff: expected a number >= 0, got {kl_coeff}")
    return LossConfig(clip_low_threshold=lo, clip_high_threshold=hi, beta=beta, kl_coeff=kl_coeff)


def cross_entropy(logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_t -w_t logp_t``."""
    return -(weights * logp).sum()


def importance_sampling(logp: torch.Tensor, sampling_logp: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """``sum_t -exp(logp_t - sampling_logp_t) A_t``."""
    return -(torch.exp(logp - sampling_logp) * advantages).sum()


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """``sum_t -min(ratio_t A_t, clip(ratio_t, lo, hi) A_t)``."""
    return -torch.min(ratio * advantages, torch.clamp(ratio, lo, hi) * advantages).sum()


def ppo(
    logp: torch.Tensor, sampling_logp: torch.Tensor, advantages: torch.Tensor, lo: float, hi: float
) -> torch.Tensor:
    """``sum_t -min(r_t A_t, clip(r_t, lo, hi) A_t)``, ``r_t = exp(logp_t - sampling_logp_t)``."""
    return _clipped_surrogate(torch.exp(logp - sampling_logp), advantages, lo, hi)


def cispo(
    logp: torch.Tensor, sampling_logp: torch.Tensor, advantages: torch.Tensor, lo: float, hi: float
) -> torch.Tensor:
    """``sum_t -sg(clip(r_t, lo, hi)) logp_t A_t``."""
    weight = torch.clamp(torch.exp(logp - sampling_logp), lo, hi).detach()
    return -(weight * logp * advantages).sum()


def dro(logp: torch.Tensor, sampling_logp: torch.Tensor, advantages: torch.Tensor, beta: float) -> torch.Tensor:
    """``sum_t -(logp_t A_t - beta / 2 (logp_t - sampling_logp_t)^2)``."""
    return -(logp * advantages - 0.5 * beta * (logp - sampling_logp) ** 2).sum()


def gspo_ratio(logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``s_t``: the sequence ratio's value over the tokens ``mask`` marks (non-zero), with the
    gradient of ``exp(logp_t)`` relative to itself. ``mask`` marks at least one token."""
    marked = mask != 0
    log_s = (logp.detach() - sampling_logp)[marked].mean()
    return torch.exp(log_s + logp - logp.detach())


def gspo(
    logp: torch.Tensor, sampling_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, lo: float, hi: float
) -> torch.Tensor:
    """PPO's clipped surrogate on GSPO-token's ratio :func:`gspo_ratio`."""
    return _clipped_surrogate(gspo_ratio(logp, sampling_logp, mask), advantages, lo, hi)


def stable_reinforce(
    logp: torch.Tensor, sampling_logp: torch.Tensor, advantages: torch.Tensor, sampled: torch.Tensor, kl_coeff: float
) -> torch.Tensor:
    """``sum_{t in S} -sg(min(r_t, 1)) A_t logp_t + kl_coeff (r_t - 1 - log r_t)``, ``S`` the
    positions ``sampled`` marks (non-zero); ``sampling_logp`` is read there only."""
    marked = sampled != 0
    log_ratio = torch.where(marked, logp - sampling_logp, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=1.0).detach()
    policy = -(weight * advantages * logp)
    penalty = kl_coeff * (ratio - 1.0 - log_ratio)
    return torch.where(marked, policy + penalty, torch.zeros_like(logp)).sum()


def datum_loss(
    loss_fn: str,
    logp: torch.Tensor,
    *,
    weights: torch.Tensor | None,
    advantages: torch.Tensor | None,
    sampling_logp: torch.Tensor | None,
    sequence_ratio_mask: torch.Tensor | None = None,
    sampled: torch.Tensor | None = None,
    config: LossConfig = LossConfig(),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss [], diagnostics)`` of one datum; ``weights`` None means all 1 (``cross_entropy``).
    ``sampled`` marks the sampled target tokens (stable_reinforce).

    Diagnostics, detached sums over the datum's tokens: ``ratio_sum`` (of ``r_t``, or ``s_t``
    for gspo, 1 on the tokens stable_reinforce does not train) for the policy losses;
    ``clipped``, the tokens whose ratio lies outside ``[lo, hi]``, for ppo, cispo and gspo.

    Raises:
        ValueError: an unknown ``loss_fn``.
    """
    if loss_fn == "cross_entropy":
        w = torch.ones_like(logp) if weights is None else weights
        return cross_entropy(logp, w), {}
    lo, hi = config.clip_low_threshold, config.clip_high_threshold
    with torch.no_grad():
        if loss_fn == "gspo":
            ratio = gspo_ratio(logp, sampling_logp, sequence_ratio_mask)
        elif loss_fn == "stable_reinforce":
            ratio = torch.exp(torch.where(sampled != 0, logp - sampling_logp, torch.zeros_like(logp)))
        else:
            ratio = torch.exp(logp - sampling_logp)
        diag = {"ratio_sum": ratio.sum()}
        if loss_fn in ("ppo", "cispo", "gspo"):
            diag["clipped"] = ((ratio < lo) | (ratio > hi)).sum().to(ratio.dtype)
    if loss_fn == "importance_sampling":
        return importance_sampling(logp, sampling_logp, advantages), diag
    if loss_fn == "ppo":
        return ppo(logp, sampling_logp, advantages, lo, hi), diag
    if loss_fn == "cispo":
        return cispo(logp, sampling_logp, advantages, lo, hi), diag
    if loss_fn == "dro":
        return dro(logp, sampling_logp, advantages, config.beta), diag
    if loss_fn == "gspo":
        return gspo(logp, sampling_logp, advantages, sequence_ratio_mask, lo, hi), diag
    if loss_fn == "stable_reinforce":
        return stable_reinforce(logp, sampling_logp, advantages, sampled, config.kl_coeff), diag
    raise ValueError(f"loss_fn: unknown {loss_fn!r}")
