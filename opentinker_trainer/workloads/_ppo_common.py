"""What the PPO trainers (single- and multi-agent) share: seeding, episode
bookkeeping, a rollout's GAE batch, the PPO optimisation of one batch, and ``torch_ppo`` checkpoints.

Checkpoint format ``torch_ppo``: a folder ``<checkpoint_dir>/step_<update>/`` holding

* ``policy.pt`` — the policy's ``state_dict`` (``torch.load(..., weights_only=True)`` reads it);
  multi-agent: the state dict of an ``nn.ModuleDict`` keyed by learner (``shared`` or agent name);
* ``policy.json`` — how to rebuild the network (env id, spaces, hidden sizes, activation);
* ``trainer_state.pt`` — update number, environment steps, optimizer state(s), torch / numpy /
  Python RNG states, the last reported reward, the hyper-parameters.

Written beside its final name and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from opentinker_trainer import distributed
from opentinker_trainer.rl import ppo as ppo_math
from opentinker_trainer.rl.gae import gae

CHECKPOINT_FORMAT = "torch_ppo"
POLICY_FILE = "policy.pt"
POLICY_META = "policy.json"
TRAINER_STATE = "trainer_state.pt"
TRAINER_STATE_VERSION = 1


# --- seeding and RNG state ------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy's global RNG and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def env_seed_at(seed: int, update: int) -> int:
    """Seed for (re)starting the environments at ``update``: ``seed`` itself at update 0 (a fresh
    run), else a hash of ``(seed, update)``. Used on resume, because a vector env's internal state
    (episodes in flight, each sub-env's RNG) cannot be pickled in general."""
    if update == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed), int(update)]).generate_state(1)[0] % (2**31 - 1))


# --- episodes -------------------------------------------------------------------------------


class EpisodeTracker:
    """Returns and lengths of episodes in ``n`` parallel streams.

    Call :meth:`step` once per environment step with that step's rewards, ``done`` flags and
    ``valid`` mask (false on autoreset steps, which are not part of any episode).
    """

    def __init__(self, n: int) -> None:
        self.ret = np.zeros(n, dtype=np.float64)
        self.len = np.zeros(n, dtype=np.int64)
        self.finished: list[tuple[int, float, int]] = []  # (stream, return, length)

    def step(self, rewards: np.ndarray, dones: np.ndarray, valid: np.ndarray) -> None:
        self.ret += np.where(valid, rewards, 0.0)
        self.len += valid.astype(np.int64)
        for i in np.flatnonzero(dones & valid):
            self.finished.append((int(i), float(self.ret[i]), int(self.len[i])))
            self.ret[i], self.len[i] = 0.0, 0

    def pop(self) -> list[tuple[int, float, int]]:
        """Episodes finished since the last call."""
        out, self.finished = self.finished, []
        return out


# --- one PPO optimisation -------------------------------------------------------------------


@dataclass
class Batch:
    """Flat samples of one learner, autoreset steps already removed. ``B`` samples.

    ``obs [B, *obs_shape]``, ``actions [B]`` or ``[B, act_dim]``, ``logprobs, advantages, returns,
    values [B]``; ``agent_ids [B]`` for a shared multi-agent policy; ``groups``: name -> ``[B]``
    bool mask of samples to report losses for separately (``loss/agent/<name>/...``).
    """

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor
    agent_ids: torch.Tensor | None = None
    groups: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.logprobs.shape[0])


def kept_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x [T, N, ...]`` as ``[T * N, ...]`` rows (step-major), only those where ``keep [T * N]``
    (bool) is true."""
    return x.reshape(-1, *x.shape[2:])[keep]


def gae_batch(rollout: Mapping[str, torch.Tensor], reset: torch.Tensor, cfg: Any, **extra: Any) -> Batch:
    """GAE advantages and returns of a rollout (:func:`~opentinker_trainer.rl.gae.gae` with
    ``cfg.gamma``, ``cfg.gae_lambda``), and its steps that are not ``reset`` as one flat :class:`Batch`.

    Args:
        rollout: ``[T, N, ...]`` tensors of ``T`` steps of ``N`` streams: ``obs [T, N, *obs_shape]``,
            ``actions [T, N]`` or ``[T, N, act_dim]``, ``logprobs``, ``values``, ``rewards [T, N]``
            float, ``terminated``, ``truncated [T, N]`` bool; ``next_value [N]``, the value after the
            last step.
        reset: ``[T, N]`` bool, steps that are part of no episode (autoreset steps, or agents not
            alive): advantage 0, cut the recursion, left out of the batch.
        extra: further :class:`Batch` fields (``agent_ids``, ``groups``), already over the kept rows
            (:func:`kept_rows` with ``~reset.reshape(-1)``).

    Returns:
        ``B = (~reset).sum()`` samples, in step-major order.
    """
    adv, ret = gae(
        rollout["rewards"],
        rollout["values"],
        rollout["next_value"],
        rollout["terminated"],
        rollout["truncated"],
        reset,
        gamma=cfg.gamma,
        gae_lambda=cfg.gae_lambda,
    )
    keep = ~reset.reshape(-1)
    return Batch(
        obs=kept_rows(rollout["obs"], keep),
        actions=kept_rows(rollout["actions"], keep),
        logprobs=kept_rows(rollout["logprobs"], keep),
        advantages=kept_rows(adv, keep),
        returns=kept_rows(ret, keep),
        values=kept_rows(rollout["values"], keep),
        **extra,
    )


def ppo_update(
    policy,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: Any,
    clip_coef: float | None = None,
    dp: Any = None,
) -> dict[str, float]:
    """Up to ``update_epochs`` passes over ``batch`` in ``num_minibatches`` shuffled minibatches,
    one Adam step each, on ``pg_loss - ent_coef * entropy + vf_coef * value_loss`` (CleanRL
    ``ppo.py``): advantages normalised per minibatch when ``norm_adv``; the value loss clipped
    around the rollout's values when ``clip_vloss``, else plain ``0.5 * (V - R)^2``; gradients
    clipped to ``max_grad_norm``.

    ``clip_coef``: this update's clip coefficient, for the ratio and (``clip_vloss``) the value
    (:func:`clip_coef_at`); None = ``cfg.clip_coef``.

    Early stop (``cfg.target_kl`` set): after each minibatch's step, when that minibatch's
    ``approx_kl`` (k3, measured in its forward pass, before its step) exceeds ``target_kl``, the
    update ends there: no further minibatch of that epoch, no further epoch (CleanRL computes
    ``approx_kl`` per minibatch; SB3 checks each minibatch against ``1.5 * target_kl`` and skips
    that minibatch's step). The first minibatch of an update has ``approx_kl`` 0 (the policy is
    still the rollout's), so at least two steps are taken when ``num_minibatches * update_epochs >= 2``.

    ``dp`` (None: one rank) is this rank's data-parallel collectives
    (:class:`opentinker_trainer.distributed.DataParallel`), ``batch`` this rank's samples: every
    rank splits its samples into ``num_minibatches`` minibatches; minibatch ``j`` of the task is
    the union of the ranks' ``j``-th, its advantages normalised with its global mean and std, each
    rank's loss weighted by its share of the minibatch's samples and the gradients summed over
    ranks (CleanRL's multi-GPU PPO all-reduces the gradients the same way), so with one minibatch
    a step of W ranks equals the step of one rank on the union. The early stop compares the
    minibatch's global ``approx_kl``, so every rank stops after the same minibatch. Metrics are
    of the global batch.

    Returns:
        Means over all minibatches taken: ``loss/total``, ``loss/policy``, ``loss/value``,
        ``loss/entropy`` (mean entropy, nats), ``ppo/approx_kl``, ``ppo/clipfrac``,
        ``optim/grad_norm`` (before clipping); ``ppo/epochs`` (begun), ``ppo/minibatches`` (Adam
        steps taken), ``ppo/early_stop`` (1 when ``target_kl`` ended the update), ``ppo/clip_coef``,
        ``ppo/explained_variance`` (of the rollout's values); and
        ``loss/agent/<name>/{policy,value,entropy}`` per ``batch.groups``.
    """
    clip = cfg.clip_coef if clip_coef is None else float(clip_coef)
    v_clip = clip if cfg.clip_vloss else None
    n = len(batch)
    keys = (
        "loss/total",
        "loss/policy",
        "loss/value",
        "loss/entropy",
        "ppo/approx_kl",
        "ppo/clipfrac",
        "optim/grad_norm",
    )
    sums = dict.fromkeys(keys, 0.0)
    group_sums = {g: {"policy": 0.0, "value": 0.0, "entropy": 0.0, "n": 0.0} for g in batch.groups}
    taken, epochs, stopped = 0, 0, False
    params = [p for p in policy.parameters() if p.requires_grad]
    splits = min(cfg.num_minibatches, n) if dp is None else cfg.num_minibatches  # the same count on every rank
    for _ in range(cfg.update_epochs):
        epochs += 1
        for mb in torch.randperm(n, device=batch.logprobs.device).tensor_split(splits):
            aid = batch.agent_ids[mb] if batch.agent_ids is not None else None
            _, newlogprob, entropy, newvalue = policy.get_action_and_value(
                batch.obs[mb], batch.actions[mb], agent_ids=aid
            )
            logratio, ratio = ppo_math.log_ratio(newlogprob, batch.logprobs[mb])
            adv = batch.advantages[mb]
            share = 1.0  # this rank's fraction of the minibatch's samples
            if dp is not None:
                share, adv = _global_minibatch(dp, adv, cfg.norm_adv)
            elif cfg.norm_adv:
                adv = ppo_math.normalize_advantages(adv)
            old_v = batch.values[mb] if cfg.clip_vloss else None
            pg = ppo_math.pg_loss(adv, ratio, clip)
            v = ppo_math.value_loss(newvalue, batch.returns[mb], old_v, v_clip)
            ent = ppo_math.entropy_bonus(entropy)
            loss = pg - cfg.ent_coef * ent + cfg.vf_coef * v
            optimizer.zero_grad(set_to_none=True)
            (loss * share if dp is not None else loss).backward()
            if dp is not None:
                dp.all_reduce_grads(params)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            kl = ppo_math.approx_kl(logratio.detach(), ratio.detach())
            for key, val in zip(keys, (loss, pg, v, ent, kl, ppo_math.clip_fraction(ratio.detach(), clip), grad_norm)):
                sums[key] += val.detach().item() * (share if key != "optim/grad_norm" else 1.0)
            taken += 1
            with torch.no_grad():
                for g, gmask in batch.groups.items():
                    m = gmask[mb]
                    k = int(m.sum())
                    if k == 0:
                        continue
                    gs = group_sums[g]
                    gs["policy"] += k * float(ppo_math.pg_loss(adv, ratio, clip, m))
                    gs["value"] += k * float(ppo_math.value_loss(newvalue, batch.returns[mb], old_v, v_clip, m))
                    gs["entropy"] += k * float(ppo_math.entropy_bonus(entropy, m))
                    gs["n"] += k
            if cfg.target_kl is not None:
                global_kl = kl if dp is None else dp.sum(kl.item() * share)[0]
                if ppo_math.kl_exceeded(global_kl, cfg.target_kl):
                    stopped = True
                    break
        if stopped:
            break
    if dp is not None:
        local = [k for k in keys if k != "optim/grad_norm"]  # the grad norm is of the summed gradient
        sums.update(zip(local, dp.sum(*(sums[k] for k in local))))
        for gs in group_sums.values():  # the same groups, in the same order, on every rank
            parts = ("policy", "value", "entropy", "n")
            gs.update(zip(parts, dp.sum(*(gs[p] for p in parts))))
    out = {k: s / max(taken, 1) for k, s in sums.items()}
    out["ppo/epochs"] = float(epochs)
    out["ppo/minibatches"] = float(taken)
    out["ppo/early_stop"] = float(stopped)
    out["ppo/clip_coef"] = clip
    out["ppo/explained_variance"] = (
        ppo_math.explained_variance(batch.values, batch.returns)
        if dp is None
        else _global_explained_variance(dp, batch.values, batch.returns)
    )
    for g, gs in group_sums.items():
        for part in ("policy", "value", "entropy"):
            out[f"loss/agent/{g}/{part}"] = gs[part] / gs["n"] if gs["n"] else math.nan
    return out


def _global_minibatch(dp: Any, adv: torch.Tensor, norm: bool) -> tuple[float, torch.Tensor]:
    """``(share, advantages)`` of this rank's part of a minibatch spread over ranks: its fraction of
    the minibatch's samples and, when ``norm``, its advantages normalised with the whole
    minibatch's mean and sample std (:func:`~opentinker_trainer.rl.ppo.normalize_advantages`)."""
    a = adv.detach().double()
    total, s, q = dp.sum(a.numel(), a.sum().item(), (a**2).sum().item())
    share = a.numel() / total if total else 0.0
    if not norm:
        return share, adv
    mean = s / max(total, 1.0)
    var = max(q - total * mean**2, 0.0) / (max(total, 2.0) - 1.0)
    return share, (adv - mean) / (math.sqrt(var) + 1e-8)


def _global_explained_variance(dp: Any, values: torch.Tensor, returns: torch.Tensor) -> float:
    """:func:`~opentinker_trainer.rl.ppo.explained_variance` of all ranks' samples (from sums)."""
    v, r = values.detach().double(), returns.detach().double()
    e = r - v
    n, sr, qr, se, qe = dp.sum(r.numel(), r.sum().item(), (r**2).sum().item(), e.sum().item(), (e**2).sum().item())
    if n < 2:
        return float("nan")
    var_r = qr / n - (sr / n) ** 2
    if var_r <= 0:
        return float("nan")
    return float(1.0 - (qe / n - (se / n) ** 2) / var_r)


def annealed_lr(cfg: Any, update: int) -> float:
    """Learning rate of update ``update`` (1-based): linear decay from ``learning_rate`` towards 0
    over the run when ``anneal_lr`` (CleanRL; :func:`~opentinker_trainer.rl.ppo.linear_decay`),
    else constant."""
    if not cfg.anneal_lr:
        return cfg.learning_rate
    return ppo_math.linear_decay(cfg.learning_rate, update, cfg.num_updates)


def clip_coef_at(cfg: Any, update: int) -> float:
    """Clip coefficient of update ``update`` (1-based): ``clip_coef`` when ``clip_schedule`` is
    ``constant``; ``linear``: decayed towards 0 over the run like the learning rate
    (:func:`~opentinker_trainer.rl.ppo.linear_decay`; SB3 / rl-zoo ``clip_range: lin_0.2``)."""
    if cfg.clip_schedule == "constant":
        return cfg.clip_coef
    if cfg.clip_schedule == "linear":
        return ppo_math.linear_decay(cfg.clip_coef, update, cfg.num_updates)
    raise ValueError(f"unknown clip_schedule {cfg.clip_schedule!r}")  # the spec refuses it first


def episode_metrics(finished: list[tuple[int, float, int]], last_reward: float) -> tuple[dict[str, float], float]:
    """``reward`` metrics of one update and the new last-known reward.

    ``reward`` = ``reward/episode_return_mean`` = mean return of the episodes that finished during
    this update; when none finished it is the last known value (NaN before any episode ended)
    and ``reward/stale`` is 1.
    """
    if finished:
        rets = np.array([r for _, r, _ in finished])
        lens = np.array([n for _, _, n in finished])
        mean = float(rets.mean())
        return {
            "reward": mean,
            "reward/episode_return_mean": mean,
            "reward/episode_return_std": float(rets.std()),
            "reward/episode_return_max": float(rets.max()),
            "reward/episode_return_min": float(rets.min()),
            "reward/episode_length_mean": float(lens.mean()),
            "reward/episodes": float(len(finished)),
            "reward/stale": 0.0,
        }, mean
    return {
        "reward": last_reward,
        "reward/episode_return_mean": last_reward,
        "reward/episodes": 0.0,
        "reward/stale": 1.0,
    }, last_reward


def update_metrics(
    out: Mapping[str, float],
    rewards: Mapping[str, float],
    *,
    lr: float,
    env_steps: int,
    started: float,
    batch_size: int,
    step_s: float,
    rollout_s: float,
    samples: int,
) -> dict[str, float]:
    """The metrics one PPO update reports: ``loss`` (= ``loss/total``), the ``reward`` metrics,
    the update's own ``loss/*`` values, ``optim/lr``, ``env_steps``, ``wall_time_s`` (since
    ``started``, a :func:`time.perf_counter` reading) and ``perf/*`` (seconds, env steps per second)."""
    return {
        "loss": out["loss/total"],
        **rewards,
        **out,
        "optim/lr": lr,
        "env_steps": float(env_steps),
        "wall_time_s": time.perf_counter() - started,
        "perf/env_steps_per_s": batch_size / step_s,
        "perf/step_s": step_s,
        "perf/rollout_s": rollout_s,
        "perf/train_s": step_s - rollout_s,
        "perf/samples": float(samples),
    }


def run_updates(trainer: Any, log: Any, close, *, optimizers: Any, counts: tuple[str, ...]) -> None:
    """Run ``trainer.train_step()`` for updates ``trainer.update + 1 .. cfg.num_updates`` through
    :func:`~opentinker_trainer.workloads._loop.run_trainer` (report, checkpoint with
    ``trainer.save``, stop when asked), logging each update; ``close()`` runs at the end.

    A stop abandons the update in progress and stores the last completed one
    (:mod:`~opentinker_trainer.workloads._keep`): its policy and ``optimizers`` (one, or several),
    RNG states and the trainer's attributes named in ``counts`` (``update`` among them). The
    environments go on from where the abandoned update left them; a checkpoint holds none of
    their state, so the stored update is exactly the completed one."""
    from opentinker_trainer.workloads import _keep
    from opentinker_trainer.workloads._loop import run_trainer

    def restore(values: tuple) -> None:
        for name, value in zip(counts, values, strict=True):
            setattr(trainer, name, value)

    try:
        run_trainer(
            trainer,
            log,
            total=trainer.cfg.num_updates,
            checkpoint_every=trainer.cfg.checkpoint_every,
            counter="update",
            event="update",
            keep=_keep.keeper(
                trainer.ctx,
                optimizers,
                state=lambda: tuple(getattr(trainer, name) for name in counts),
                restore=restore,
            ),
            fields=lambda m: {
                "env_steps": trainer.env_steps,
                "reward": round(m["reward"], 3),
                "loss": round(m["loss"], 4),
                "steps_per_s": round(m["perf/env_steps_per_s"]),
            },
        )
    finally:
        close()


# --- checkpoints ----------------------------------------------------------------------------


def save_update(trainer: Any, *, final: bool) -> Path:
    """Checkpoint a PPO trainer at its current update, once for all its ranks
    (:func:`opentinker_trainer.distributed.save_once`: rank 0 writes with ``trainer._write(final,
    extra)``, ``extra`` the ranks' RNG states); the folder written."""
    return distributed.save_once(
        trainer.ctx, lambda extra: trainer._write(final, extra), step=trainer.update, final=final, fmt=CHECKPOINT_FORMAT
    )


def save_checkpoint(
    path: Path,
    policy_state: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    trainer_state: Mapping[str, Any],
    *,
    extra: Callable[[Path], object] | None = None,
) -> Path:
    """Write ``policy.pt``, ``policy.json`` and ``trainer_state.pt`` to folder ``path`` atomically;
    ``extra(folder)`` writes further files into the folder before it is renamed into place (the
    TorchScript acting policy, :func:`opentinker_trainer.rl.policy_export.export_torchscript`)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if extra is not None:
        extra(tmp)
    torch.save(dict(policy_state), tmp / POLICY_FILE)
    (tmp / POLICY_META).write_text(json.dumps(meta, indent=1, sort_keys=True))
    torch.save({"version": TRAINER_STATE_VERSION, **trainer_state}, tmp / TRAINER_STATE)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(policy state dict, trainer state)`` of checkpoint folder ``path`` (tensors on CPU).

    Raises:
        FileNotFoundError: ``path`` lacks ``policy.pt`` or ``trainer_state.pt``.
    """
    path = Path(path)
    for name in (POLICY_FILE, TRAINER_STATE):
        if not (path / name).exists():
            raise FileNotFoundError(f"checkpoint {path} has no {name}; cannot resume from it")
    policy = torch.load(path / POLICY_FILE, map_location="cpu", weights_only=True)
    state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
    return policy, state


@contextlib.contextmanager
def one_intra_op_thread():
    """Run the block with one torch intra-op thread, then restore the count. Small MLPs on small
    batches: one thread is ~10x faster than two that contend with the environments and other
    processes for the cores (measured, 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
