"""The losses of ``ForwardBackward``, on one datum's tokens: ``[N]`` tensors in, ``[]`` out.

Each is a *sum* over the datum's tokens (Tinker's convention): a mean is the caller's choice,
made through the weights or advantages, so several calls before one optimizer step add up to
the loss of their union. ``logp`` is the current model's log-probability of each target token
(with grad); ``sampling_logp`` the sampler's.

* ``cross_entropy`` — ``sum_t -w_t logp_t``: supervised learning; with ``w_t = 1 / T`` on the
  ``T`` trained tokens of a batch it is the token-mean NLL of the built-in ``sft`` step.
* ``importance_sampling`` — ``sum_t -(exp(logp_t - sampling_logp_t)) A_t``: the policy gradient
  of samples from another policy, reweighted by the importance ratio (Tinker's
  ``importance_sampling``); at ratio 1 (on-policy) its gradient is REINFORCE's, ``-A grad logp``
  (Williams 1992).
* ``ppo`` — ``sum_t max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps))``: PPO's clipped surrogate
  (Schulman et al. 2017, eq. 7), computed by :func:`opentinker_trainer.rl.ppo.pg_loss` (its
  token mean times ``N``).
"""

from __future__ import annotations

import torch

from opentinker_trainer.rl.ppo import log_ratio, pg_loss

__all__ = ["cross_entropy", "datum_loss", "importance_sampling", "ppo"]


def cross_entropy(logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_t -weights_t * logp_t``. ``[N]`` inputs."""
    return -(weights * logp).sum()


def importance_sampling(logp: torch.Tensor, sampling_logp: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """``sum_t -exp(logp_t - sampling_logp_t) * A_t``. ``[N]`` inputs."""
    _, ratio = log_ratio(logp, sampling_logp)
    return -(ratio * advantages).sum()


def ppo(logp: torch.Tensor, sampling_logp: torch.Tensor, advantages: torch.Tensor, clip_epsilon: float) -> torch.Tensor:
    """PPO's clipped surrogate summed over the ``N`` tokens: ``N * pg_loss(A, r, eps)``. ``[N]`` inputs."""
    _, ratio = log_ratio(logp, sampling_logp)
    return pg_loss(advantages, ratio, clip_epsilon) * logp.shape[0]


def datum_loss(
    loss_fn: str,
    logp: torch.Tensor,
    *,
    weights: torch.Tensor | None,
    advantages: torch.Tensor | None,
    sampling_logp: torch.Tensor | None,
    clip_epsilon: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss [], diagnostics)`` of one datum; ``weights`` None means all 1 (``cross_entropy``).

    Diagnostics (detached sums over the datum's tokens): ``ratio_sum`` for the policy losses,
    ``clipped`` (tokens whose ratio is outside ``1 +- eps``) for ``ppo``.
    """
    if loss_fn == "cross_entropy":
        w = torch.ones_like(logp) if weights is None else weights
        return cross_entropy(logp, w), {}
    with torch.no_grad():
        ratio = torch.exp(logp - sampling_logp)
        diag = {"ratio_sum": ratio.sum()}
    if loss_fn == "importance_sampling":
        return importance_sampling(logp, sampling_logp, advantages), diag
    if loss_fn == "ppo":
        diag["clipped"] = ((ratio - 1.0).abs() > clip_epsilon).sum().to(ratio.dtype)
        return ppo(logp, sampling_logp, advantages, clip_epsilon), diag
    raise ValueError(f"loss_fn: unknown {loss_fn!r}")
