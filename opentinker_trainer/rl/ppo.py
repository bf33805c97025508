"""PPO losses and diagnostics: small pure functions on tensors.

PPO — Schulman et al. 2017, https://arxiv.org/abs/1707.06347 — with the implementation choices
of CleanRL's ``ppo.py`` (https://docs.cleanrl.dev/rl-algorithms/ppo/; Huang et al. 2022, "The 37
Implementation Details of PPO", https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/).

Shapes: ``B`` samples of a (mini)batch; every input is ``[B]``. ``mask`` (optional, ``[B]`` bool)
marks samples that count (autoreset steps and absent agents are masked out); masked samples may
hold anything, NaN included. Every loss is a mean over counted samples; the total loss of PPO is
``pg_loss - ent_coef * entropy + vf_coef * value_loss``.
"""

from __future__ import annotations

import torch

from opentinker_trainer.rl.grpo import masked_mean

__all__ = [
    "approx_kl",
    "clip_fraction",
    "entropy_bonus",
    "explained_variance",
    "kl_exceeded",
    "linear_decay",
    "log_ratio",
    "normalize_advantages",
    "pg_loss",
    "value_loss",
]


def _mask(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()


def log_ratio(new_logprob: torch.Tensor, old_logprob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log r, r)`` with ``r = pi(a|s) / pi_old(a|s) = exp(new_logprob - old_logprob)``. ``[B]`` each."""
    logratio = new_logprob - old_logprob
    return logratio, logratio.exp()


def normalize_advantages(advantages: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-8) -> torch.Tensor:
    """``(A - mean A) / (std A + eps)`` over counted samples (CleanRL normalises per minibatch).

    The std is the sample (``n - 1``) std, as ``torch.std``; one counted sample gives ``A - A = 0``.
    Masked samples come back as 0. ``[B] -> [B]``.
    """
    m = _mask(advantages, mask)
    mean = masked_mean(advantages, m)
    centered = torch.where(m, advantages - mean, torch.zeros_like(advantages))
    n = m.sum().clamp(min=2).to(advantages.dtype)
    std = ((centered**2).sum() / (n - 1)).sqrt()
    return centered / (std + eps)


def pg_loss(
    advantages: torch.Tensor, ratio: torch.Tensor, clip_coef: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Clipped surrogate policy loss ``mean(max(-A r, -A clip(r, 1 - eps, 1 + eps)))`` —
    PPO eq. 7 (negated, to minimise). ``[B]`` inputs, ``[]`` output."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef)
    return masked_mean(torch.maximum(unclipped, clipped), _mask(ratio, mask))


def value_loss(
    new_value: torch.Tensor,
    returns: torch.Tensor,
    old_value: torch.Tensor | None = None,
    clip_coef: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Value loss, ``[B]`` inputs, ``[]`` output.

    * plain (``old_value`` or ``clip_coef`` None; CleanRL ``--no-clip-vloss``, SB3's default
      ``clip_range_vf=None``): ``0.5 * mean((V - R)^2)``;
    * clipped (CleanRL ``--clip-vloss``, from OpenAI baselines' PPO2):
      ``0.5 * mean(max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2))`` with
      ``eps = clip_coef``: once ``V`` has moved more than ``eps`` from ``V_old`` towards ``R`` the
      clipped term is the larger and its gradient is 0, so a sample's value moves at most about
      ``eps`` per update (in return units: a tight limit when returns are large).

    SB3 computes ``F.mse_loss`` without the 0.5, so its ``vf_coef`` weighs the value loss twice
    as much as the same ``vf_coef`` here.
    """
    unclipped = (new_value - returns) ** 2
    if old_value is not None and clip_coef is not None:
        v_clipped = old_value + torch.clamp(new_value - old_value, -clip_coef, clip_coef)
        per_sample = torch.maximum(unclipped, (v_clipped - returns) ** 2)
    else:
        per_sample = unclipped
    return 0.5 * masked_mean(per_sample, _mask(new_value, mask))


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean policy entropy (nats) over counted samples; PPO eq. 9 adds ``ent_coef`` times it to the
    objective. ``[B] -> []``."""
    return masked_mean(entropy, _mask(entropy, mask))


@torch.no_grad()
def approx_kl(logratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """k3 estimate of ``KL(pi_old || pi)``: ``mean((r - 1) - log r)`` — http://joschu.net/blog/kl-approx.html,
    CleanRL's ``approx_kl``. ``[B] -> []``."""
    return masked_mean((ratio - 1.0) - logratio, _mask(ratio, mask))


@torch.no_grad()
def clip_fraction(ratio: torch.Tensor, clip_coef: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Fraction of counted samples with ``|r - 1| > clip_coef`` (CleanRL's ``clipfracs``). ``[B] -> []``."""
    return masked_mean(((ratio - 1.0).abs() > clip_coef).float(), _mask(ratio, mask))


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """``1 - Var(R - V) / Var(R)`` over counted samples: 1 is a perfect critic, 0 no better than a
    constant, negative worse; NaN when the returns have no variance. ``[B]`` inputs."""
    m = _mask(values, mask)
    v, r = values[m].double(), returns[m].double()
    if r.numel() < 2:
        return float("nan")
    var_r = r.var(unbiased=False)
    if var_r == 0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)


def linear_decay(start: float, update: int, num_updates: int) -> float:
    """``start * (1 - (update - 1) / num_updates)`` for update ``update`` (1-based) of
    ``num_updates``: ``start`` at the first update, ``start / num_updates`` at the last, linear in
    between (CleanRL's learning-rate annealing; SB3's ``lin_<start>`` schedule as rl-zoo writes
    it, which SB3 evaluates at ``1 - steps_done / total_steps``, i.e. one update later).
    """
    return start * (1.0 - (update - 1.0) / num_updates)


def kl_exceeded(kl: torch.Tensor | float, target_kl: float | None) -> bool:
    """Whether a minibatch's :func:`approx_kl` ends the update: ``target_kl`` set and ``kl > target_kl``
    (CleanRL ``ppo.py``'s test, applied after every minibatch; SB3 tests ``kl > 1.5 * target_kl``
    before the step)."""
    return target_kl is not None and float(kl) > target_kl
