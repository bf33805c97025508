"""Gymnasium environments by id (env kind ``gym``): ``CartPole-v1``, ``FrozenLake-v1``, ...

Any registered gymnasium id is accepted. Where gymnasium is importable (scheduler and trainer
installs), the id is checked against its registry at validation time and the seed's
``action_space`` / ``observation_space`` sizes are checked against the environment's real spaces
(``Discrete(n)`` has size ``n``; a ``Box`` has size ``prod(shape)``), so a mismatch is an
``INVALID_ARGUMENT`` at submit rather than a failed task. The client alone (no gymnasium) skips
these checks; the trainer repeats them.

Before anything is built, ``env_kwargs`` are bounded generically (any registered id may take any
keyword argument, so no per-id table is possible): numbers finite with ``|x| <= 1e6``, strings of
at most 256 characters, lists and mappings of at most 256 items nested at most 3 deep, and the whole
mapping at most 16 KiB as JSON (:func:`check_env_kwargs_bounds`). Together with the scheduler's
time budget for building the environment (``limits.spec_check_timeout``) this keeps one spec from
stalling validation.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from opentinker_common.spec._parse import SpecError, num
from opentinker_common.spec.registry import register_env_family

__all__ = ["GymEnvConfig", "check_env_kwargs_bounds", "is_gym_id", "kwargs_key", "space_size"]

# gymnasium ids: [namespace/]name-vN, e.g. "CartPole-v1", "ALE/Pong-v5". No "module:" prefix:
# gymnasium would import that module, which would let a task spec run code on the scheduler.
_GYM_ID = re.compile(r"^(?:[A-Za-z][\w.-]*/)?[A-Za-z][\w.-]*-v\d+$")


#: Generic bounds on ``env_kwargs`` values of ids without a per-id table.
MAX_KWARG_NUMBER = 1e6
MAX_KWARG_STRING = 256
MAX_KWARG_ITEMS = 256
MAX_KWARG_DEPTH = 3
MAX_KWARGS_JSON_BYTES = 16 * 1024


_PATH_KEY_SUFFIXES = ("file", "path", "dir", "filename")
_NO_PATHS = (
    "no file path: file paths are not accepted in env_kwargs (environments are built on the scheduler and the trainers)"
)


def _check_kwarg_value(value: Any, path: str, depth: int) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or abs(value) > MAX_KWARG_NUMBER:
            raise SpecError(path, "a finite number with |x| <= 1e6", value)
        return
    if isinstance(value, str):
        if len(value) > MAX_KWARG_STRING:
            raise SpecError(
                path, f"a string of at most {MAX_KWARG_STRING} characters", f"{value[:20]}... ({len(value)} characters)"
            )
        if "/" in value or "\\" in value or value.startswith("~"):
            raise SpecError(path, _NO_PATHS, value)
        return
    if isinstance(value, (list, tuple, dict)):
        if depth > MAX_KWARG_DEPTH:
            raise SpecError(path, f"lists and mappings nested at most {MAX_KWARG_DEPTH} deep", "a deeper value")
        if len(value) > MAX_KWARG_ITEMS:
            raise SpecError(path, f"at most {MAX_KWARG_ITEMS} items", f"{len(value)} items")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(value, dict):
                _check_kwarg_key(k, f"{path}.{k}")
            _check_kwarg_value(v, f"{path}.{k}" if isinstance(value, dict) else f"{path}[{k}]", depth + 1)
        return
    raise SpecError(path, "a number, a string, true/false, a list or a mapping", value)


def _check_kwarg_key(key: Any, path: str) -> None:
    if isinstance(key, str) and key.lower().endswith(_PATH_KEY_SUFFIXES):
        raise SpecError(path, _NO_PATHS)


def check_env_kwargs_bounds(env_kwargs: dict[str, Any], path: str) -> None:
    """Generic bounds on keyword arguments passed through to an environment constructor.

    Numbers finite with ``|x| <= 1e6``; strings of at most 256 characters; lists and mappings of
    at most 256 items, nested at most 3 deep (``env_kwargs`` itself is level 0); the whole mapping
    at most 16 KiB (16384 bytes) as JSON. ``path`` is the field path of ``env_kwargs``.

    No file paths (the environment is built on the scheduler and on the trainers, so a path would
    be opened there, e.g. MuJoCo's ``xml_file``): keys, at any depth, whose name ends in ``file``,
    ``path``, ``dir`` or ``filename`` (any case), and string values holding ``/`` or ``\\`` or
    starting with ``~`` are refused.

    Raises:
        SpecError: naming the offending key's path, e.g.
            ``spec.env_config.env_kwargs.size: expected a finite number with |x| <= 1e6, got 10000000``.
    """
    for key, value in env_kwargs.items():
        _check_kwarg_key(key, f"{path}.{key}")
        _check_kwarg_value(value, f"{path}.{key}", 1)
    size = len(json.dumps(env_kwargs, separators=(",", ":")).encode())
    if size > MAX_KWARGS_JSON_BYTES:
        raise SpecError(path, f"at most {MAX_KWARGS_JSON_BYTES} bytes as JSON", f"{size} bytes")


def is_gym_id(env_id: str) -> bool:
    """True when ``env_id`` has the shape of a versioned gymnasium id (``Name-vN``)."""
    return bool(_GYM_ID.match(env_id)) and len(env_id) <= 256


def space_size(space: Any) -> int | None:
    """Size of a gymnasium space as the seed counts it: ``n`` of ``Discrete(n)``, the number of
    elements of a ``Box``; None for other spaces (Dict, Tuple, ...)."""
    n = getattr(space, "n", None)
    if n is not None and not hasattr(space, "nvec"):
        return int(n)
    shape = getattr(space, "shape", None)
    if shape is not None and type(space).__name__ == "Box":
        return int(math.prod(shape))
    return None


def kwargs_key(env_kwargs: dict[str, Any]) -> str:
    """A canonical, hashable cache key for ``env_kwargs`` (values may be lists and mappings)."""
    return json.dumps(env_kwargs, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=64)
def _real_spaces(env_id: str, kwargs_json: str) -> tuple[str, str, int | None, int | None] | str:
    """(action space, observation space, their sizes) of ``env_id`` made with the keyword arguments
    ``kwargs_json`` (:func:`kwargs_key`), or an error string; ``""`` when gymnasium is not
    installed here."""
    try:
        import gymnasium
    except ImportError:
        return ""
    try:
        gymnasium.spec(env_id)
    except Exception as exc:  # noqa: BLE001 - gymnasium raises several error types for unknown ids
        return f"a registered gymnasium id ({type(exc).__name__}: {exc})"
    try:
        env = gymnasium.make(env_id, **json.loads(kwargs_json))
    except Exception as exc:  # noqa: BLE001 - bad kwargs or missing extra (box2d, ale ...)
        return f"an environment gymnasium can make with these env_kwargs ({type(exc).__name__}: {exc})"
    try:
        return (
            str(env.action_space),
            str(env.observation_space),
            space_size(env.action_space),
            space_size(env.observation_space),
        )
    finally:
        env.close()


@dataclass(frozen=True)
class GymEnvConfig:
    """A gymnasium environment by id, made with ``gymnasium.make(env_id, **env_kwargs)``.

    ``action_space`` and ``observation_space`` are the seed's declared sizes
    (``Environment(action_space=4, observation_space=16)``); when given they must match the
    environment's real spaces. ``max_episode_steps`` overrides the registered time limit.
    """

    env_id: str = "CartPole-v1"
    action_space: int | None = num(None, 1, 1_000_000_000)
    observation_space: int | None = num(None, 1, 1_000_000_000)
    seed: int | None = num(None, 0, 2**31 - 1)
    max_episode_steps: int | None = num(None, 1, 10_000_000)
    env_kwargs: dict[str, Any] = field(default_factory=dict, metadata={"nested_depth": 3})

    def check(self, path: str) -> None:
        if "render_mode" in self.env_kwargs:
            raise SpecError(
                f"{path}.env_kwargs.render_mode",
                "no render_mode (trainers run headless)",
                self.env_kwargs["render_mode"],
            )
        check_env_kwargs_bounds(self.env_kwargs, f"{path}.env_kwargs")
        real = _real_spaces(self.env_id, kwargs_key(self.env_kwargs))
        if real == "":
            return  # gymnasium not installed here (client-only install): the trainer checks
        if isinstance(real, str):
            raise SpecError(f"{path}.env_id", real, self.env_id)
        act, obs, act_n, obs_n = real
        if self.action_space is not None and self.action_space != act_n:
            raise SpecError(
                f"{path}.action_space",
                f"the size of {self.env_id}'s action space {act} ({act_n if act_n is not None else 'no fixed size'})",
                self.action_space,
            )
        if self.observation_space is not None and self.observation_space != obs_n:
            raise SpecError(
                f"{path}.observation_space",
                f"the size of {self.env_id}'s observation space {obs} "
                f"({obs_n if obs_n is not None else 'no fixed size'})",
                self.observation_space,
            )


register_env_family(
    "any gymnasium id (CartPole-v1, FrozenLake-v1, ...)",
    is_gym_id,
    GymEnvConfig,
    kind="gym",
    description="a gymnasium environment made by id",
)
