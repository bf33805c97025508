"""Where workloads and environments plug into spec validation.

Each environment config class is registered under its ``env_id`` (or, for families such as
"any gymnasium id", under a matcher) together with its *kind*; each workload registers the
hyper-parameter class it takes for each environment kind. Validation then is: find the env
config class from ``env_id``, parse it, find the hyper-parameter class from
``(workload_type, env kind)``, parse that.

Env kinds in use:

* ``text`` — a text task for a causal LM (prompt in, reply scored), e.g. ``arithmetic``;
* others are added by the modules that implement them (``gym``, ``multiagent``, ...).

Registration happens at import of :mod:`opentinker_common.spec`; modules register by calling
:func:`register_env` / :func:`register_env_family` / :func:`register_workload` at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = [
    "WORKLOAD_TYPES",
    "EnvEntry",
    "env_entry",
    "hyperparameters_class",
    "implemented_workloads",
    "known_env_ids",
    "register_env",
    "register_env_family",
    "register_workload",
    "uses_model",
    "workload_env_kinds",
]

#: Workload types of the system (docs/tasks.md). A scheduler may configure a subset.
WORKLOAD_TYPES: tuple[str, ...] = ("lora_finetune", "full_rl", "sft", "inference", "lora_session")


@dataclass(frozen=True)
class EnvEntry:
    """One registered environment config: ``cls`` parses it; ``kind`` picks hyper-parameters."""

    cls: type
    kind: str
    description: str = ""


_ENVS: dict[str, EnvEntry] = {}
_FAMILIES: list[tuple[str, Callable[[str], bool], EnvEntry]] = []
_WORKLOADS: dict[str, dict[str, type]] = {}


def register_env(env_id: str, cls: type, *, kind: str, description: str = "") -> None:
    """Register the config class of one ``env_id``."""
    _ENVS[env_id] = EnvEntry(cls, kind, description)


def register_env_family(
    name: str, matcher: Callable[[str], bool], cls: type, *, kind: str, description: str = ""
) -> None:
    """Register a config class for every ``env_id`` for which ``matcher(env_id)`` is true
    (checked after exact ids, in registration order). ``name`` is what errors list, e.g.
    ``"any gymnasium id (CartPole-v1, ...)"``."""
    _FAMILIES.append((name, matcher, EnvEntry(cls, kind, description)))


def env_entry(env_id: str) -> EnvEntry | None:
    """The entry for ``env_id``, or None when nothing registered knows it."""
    entry = _ENVS.get(env_id)
    if entry is not None:
        return entry
    for _, matcher, fam in _FAMILIES:
        if matcher(env_id):
            return fam
    return None


def exact_env_ids() -> list[str]:
    """The ids registered one by one (not the families'), sorted: the did-you-mean choices."""
    return sorted(_ENVS)


def known_env_ids() -> list[str]:
    """Exact ids plus the names of families, for error messages."""
    return sorted(_ENVS) + [name for name, _, _ in _FAMILIES]


def register_workload(workload_type: str, hyperparameters: type, *, env_kinds: tuple[str, ...]) -> None:
    """``workload_type`` on an environment of any of ``env_kinds`` takes ``hyperparameters``."""
    if workload_type not in WORKLOAD_TYPES:
        raise ValueError(f"unknown workload type {workload_type!r}")
    per_kind = _WORKLOADS.setdefault(workload_type, {})
    for kind in env_kinds:
        per_kind[kind] = hyperparameters


def hyperparameters_class(workload_type: str, env_kind: str) -> type | None:
    """The hyper-parameter class of ``workload_type`` on an ``env_kind`` environment, or None."""
    return _WORKLOADS.get(workload_type, {}).get(env_kind)


def env_kinds_for(workload_type: str) -> tuple[str, ...]:
    """Environment kinds ``workload_type`` runs on (empty when not implemented)."""
    return tuple(_WORKLOADS.get(workload_type, {}))


def workload_env_kinds() -> frozenset[tuple[str, str]]:
    """Every registered ``(workload_type, env kind)`` pair: what a trainer must implement
    (``opentinker_trainer.workloads.TRAINERS`` has exactly these keys)."""
    return frozenset((w, kind) for w, per_kind in _WORKLOADS.items() for kind in per_kind)


def uses_model(hyperparameters: type) -> bool:
    """Whether tasks with these hyper-parameters train or serve a causal LM named by ``spec.model``
    (class attribute ``USES_MODEL``, default True). PPO on a gymnasium id builds its own MLP."""
    return bool(getattr(hyperparameters, "USES_MODEL", True))


def implemented_workloads() -> tuple[str, ...]:
    """Workload types with a trainer implementation in this release."""
    return tuple(w for w in WORKLOAD_TYPES if _WORKLOADS.get(w))
