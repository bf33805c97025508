"""Gymnasium environments for trainers: one environment, or a vector of them, from a
:class:`~opentinker_common.spec.GymEnvConfig`.

* :func:`make_env` — ``gymnasium.make(env_id, **env_kwargs)`` (with ``max_episode_steps`` when
  the config sets it), seeded. ``env_id == "client"`` is a client-hosted environment
  (:mod:`opentinker_trainer.envs.remote`), imported lazily and delegated to.
* :func:`make_vector_env` — ``num_envs`` copies in a ``SyncVectorEnv`` (default) or an
  ``AsyncVectorEnv`` whose workers start with ``spawn`` or ``forkserver``, never ``fork``: a
  trainer process may already hold a gRPC channel (or its threads), and a forked child of such
  a process can deadlock or corrupt the channel
  (https://github.com/grpc/grpc/blob/master/doc/fork_support.md).

Observations are returned as gymnasium gives them; in particular a ``Discrete(n)`` observation
stays an integer (an LM playing the environment wants the raw value). The PPO policy one-hot
encodes it itself (:class:`opentinker_trainer.rl.policy.ObsEncoder`).

Vector environments use gymnasium 1.x's default ``AutoresetMode.NEXT_STEP``: the step after an
episode ends resets that sub-environment and ignores its action (see
:mod:`opentinker_trainer.rl.gae` for how training masks it out).
"""

from __future__ import annotations

import functools
from typing import Any

import gymnasium

__all__ = ["VECTOR_MODES", "ASYNC_CONTEXTS", "make_env", "make_vector_env"]

#: ``mode`` values of :func:`make_vector_env`.
VECTOR_MODES: tuple[str, ...] = ("sync", "async")
#: Start methods allowed for ``AsyncVectorEnv`` workers (``fork`` is refused, see module doc).
ASYNC_CONTEXTS: tuple[str, ...] = ("spawn", "forkserver")


def make_env(config: Any, *, seed: int | None) -> gymnasium.Env:
    """One environment made from ``config`` (a ``GymEnvConfig``).

    Args:
        config: parsed env config: ``env_id``, ``env_kwargs``, ``max_episode_steps``.
        seed: when not None, the environment's RNG is seeded by a first ``reset(seed=seed)`` and
            its action and observation spaces by ``space.seed(seed)``, so a later ``reset()``
            without a seed and ``action_space.sample()`` are reproducible. None leaves them
            unseeded.

    Returns:
        A ``gymnasium.Env`` (already reset once when ``seed`` was given).

    Raises:
        gymnasium.error.Error, TypeError, ValueError: gymnasium cannot make ``env_id`` with these
            ``env_kwargs`` (unknown id, missing extra, bad keyword). Trainers turn this into a
            non-retryable :class:`~opentinker_trainer.context.UserError`.
    """
    if config.env_id == "client":
        from opentinker_trainer.envs.remote import make_client_env

        return make_client_env(config, seed=seed)
    kwargs = dict(getattr(config, "env_kwargs", None) or {})
    max_steps = getattr(config, "max_episode_steps", None)
    if max_steps is not None:
        kwargs["max_episode_steps"] = int(max_steps)
    env = gymnasium.make(config.env_id, **kwargs)
    if seed is not None:
        env.reset(seed=int(seed))
        env.action_space.seed(int(seed))
        env.observation_space.seed(int(seed))
    return env


def _make_unseeded(config: Any) -> gymnasium.Env:
    # Module level (not a lambda) so that spawn/forkserver workers can unpickle it.
    return make_env(config, seed=None)


def make_vector_env(
    config: Any, *, num_envs: int, seed: int | None, mode: str = "sync", context: str = "spawn"
) -> gymnasium.vector.VectorEnv:
    """``num_envs`` copies of ``make_env(config)`` stepped as one batch.

    Args:
        config: parsed env config (see :func:`make_env`).
        num_envs: number of sub-environments (>= 1).
        seed: when not None, sub-environment ``i`` is reset with seed ``seed + i`` and the batched
            action space is seeded with ``seed``; the returned env is already reset, and the
            caller's next ``reset()`` (no seed) continues these RNGs deterministically.
        mode: ``"sync"`` (``SyncVectorEnv``: one process, no fork at all; the default) or
            ``"async"`` (``AsyncVectorEnv``: one worker process per sub-environment).
        context: start method of async workers, ``"spawn"`` or ``"forkserver"``.

    Returns:
        A ``gymnasium.vector.VectorEnv`` in ``AutoresetMode.NEXT_STEP``.

    Raises:
        ValueError: ``num_envs < 1``, unknown ``mode`` or a ``context`` that would fork.
    """
    if num_envs < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    if mode not in VECTOR_MODES:
        raise ValueError(f"mode must be one of {', '.join(VECTOR_MODES)}, got {mode!r}")
    fns = [functools.partial(_make_unseeded, config) for _ in range(num_envs)]
    autoreset = gymnasium.vector.AutoresetMode.NEXT_STEP
    if mode == "sync":
        vec = gymnasium.vector.SyncVectorEnv(fns, autoreset_mode=autoreset)
    else:
        if context not in ASYNC_CONTEXTS:
            raise ValueError(f"context must be one of {', '.join(ASYNC_CONTEXTS)} (never fork), got {context!r}")
        vec = gymnasium.vector.AsyncVectorEnv(fns, context=context, autoreset_mode=autoreset)
    if seed is not None:
        vec.reset(seed=int(seed))
        vec.action_space.seed(int(seed))
        vec.observation_space.seed(int(seed))
    return vec
