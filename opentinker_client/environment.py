"""Environments, as the seed describes them: ``Environment(action_space=4, observation_space=100)``.

An :class:`Environment` names a built-in environment (``env_id``, default ``"arithmetic"``, the
text task for language models) and its options; :meth:`Environment.to_dict` gives the
``env_config`` that :meth:`RLClient.submit_task` sends. Options are validated with the same code the
scheduler uses (:func:`opentinker_client.spec.validate_env_config`).

Options of the built-in ``arithmetic`` task ("What is a + b?"; reward 1.0 for the right sum):

- ``min_digits``, ``max_digits``: operand length in decimal digits, 1..9 (default 1 and 1).
- ``seed``: sampling seed, 0..2**31-1.
- ``system_prompt``: text put before every question.
- ``action_space``, ``observation_space``: the seed's sizes; a text task reads and writes free
  text, so they are recorded but not used.
"""

from __future__ import annotations

from typing import Any

from opentinker_client.errors import from_spec_error
from opentinker_client.spec import SpecError, validate_env_config

__all__ = ["Environment"]


class Environment:
    """A built-in environment and its options.

    Args:
        env_id: which environment; ``"arithmetic"`` (the default) is the built-in text task.
        action_space: size of the action space (the seed's argument; optional).
        observation_space: size of the observation space (the seed's argument; optional).
        **options: environment-specific options, e.g. ``min_digits=1, max_digits=2`` for
            ``arithmetic``. Options set to ``None`` are left out.

    Nothing is checked when the object is made; :meth:`to_dict` (and so ``submit_task``) refuses
    an unknown ``env_id``, an unknown option or a bad value with
    :class:`~opentinker_client.errors.InvalidArgumentError` naming the field
    (``spec.env_config.max_digits``).

    Example::

        env = Environment(action_space=4, observation_space=100)
        env = Environment(env_id="arithmetic", min_digits=1, max_digits=2)
    """

    def __init__(
        self,
        *,
        env_id: str = "arithmetic",
        action_space: int | None = None,
        observation_space: int | None = None,
        **options: Any,
    ) -> None:
        self.env_id = env_id
        self.action_space = action_space
        self.observation_space = observation_space
        self.options: dict[str, Any] = {k: v for k, v in options.items() if v is not None}

    def to_dict(self) -> dict[str, Any]:
        """The ``env_config`` mapping to submit: ``env_id`` plus every option that is set.

        Returns:
            A new plain dict of JSON-able values, e.g.
            ``{"env_id": "arithmetic", "action_space": 4, "observation_space": 100}``.

        Raises:
            InvalidArgumentError: unknown ``env_id`` or option, or a value of the wrong type or
                out of range; ``err.field`` is its path, e.g. ``spec.env_config.max_digits``.
        """
        data: dict[str, Any] = {"env_id": self.env_id}
        if self.action_space is not None:
            data["action_space"] = self.action_space
        if self.observation_space is not None:
            data["observation_space"] = self.observation_space
        data.update(self.options)
        try:
            validate_env_config(data)
        except SpecError as err:
            raise from_spec_error(err) from None
        return data

    def __repr__(self) -> str:
        parts = [f"env_id={self.env_id!r}"]
        if self.action_space is not None:
            parts.append(f"action_space={self.action_space!r}")
        if self.observation_space is not None:
            parts.append(f"observation_space={self.observation_space!r}")
        parts += [f"{k}={v!r}" for k, v in self.options.items()]
        return f"{type(self).__name__}({', '.join(parts)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Environment):
            return NotImplemented
        return (
            type(self) is type(other)
            and self.env_id == other.env_id
            and self.action_space == other.action_space
            and self.observation_space == other.observation_space
            and self.options == other.options
        )

    __hash__ = None  # type: ignore[assignment]  # mutable
