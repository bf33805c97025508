"""Environments, as the seed describes them: ``Environment(action_space=4, observation_space=100)``.

An :class:`Environment` names a built-in environment (``env_id``, default ``"arithmetic"``, the
text task for language models) and its options; :meth:`Environment.to_dict` gives the
``env_config`` that :meth:`RLClient.submit_task` sends. Options are validated with the same code the
scheduler uses (:func:`opentinker_common.spec.validate_env_config`).

Options of the built-in ``arithmetic`` task ("What is a + b?"; reward 1.0 for the right sum):

- ``min_digits``, ``max_digits``: operand length in decimal digits, 1..9 (default 1 and 1).
- ``seed``: sampling seed, 0..2**31-1.
- ``system_prompt``: text put before every question.
- ``action_space``, ``observation_space``: the seed's sizes; a text task reads and writes free
  text, so they are recorded but not used.

Client-hosted environments: a subclass that overrides :meth:`Environment.reset` and
:meth:`Environment.step` (gymnasium's signatures) runs in your own process; pass the object to
``RLClient.submit_task(env_config=env, ...)`` and the client serves it to the trainer over
``EnvironmentService`` while the task runs (see :mod:`opentinker_client.hosting.server`)::

    class Corridor(Environment):
        def __init__(self):
            super().__init__(action_space=2, observation_space=5, action_names=["left", "right"])
            self.pos = 0

        def reset(self, seed=None):
            self.pos = 0
            return self.pos

        def step(self, action):
            self.pos = max(0, min(4, self.pos + (1 if action == 1 else -1)))
            done = self.pos == 4
            return self.pos, float(done), done, False, {}

Options of a client-hosted environment: ``observation_type`` (``"discrete"`` or ``"box"``),
``action_names``, ``timeout_s`` (per call, default 30), ``grace_s`` (how long the trainer waits
for an unreachable client, default 30), ``seed``, ``max_episode_steps``.
"""

from __future__ import annotations

from typing import Any

from opentinker_client.errors import InvalidArgumentError, from_spec_error
from opentinker_common.spec import SpecError, validate_env_config

__all__ = ["Environment", "client_env_config"]


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
        if self.is_client_hosted:
            raise InvalidArgumentError(
                f"spec.env_config: {type(self).__name__} is a client-hosted environment (it defines "
                "reset/step): pass the "
                "object itself, submit_task(env_config=env, ...), or use RLClient.serve_environment(env).env_config",
                field="spec.env_config",
            )
        client_only = sorted(set(self.options) & set(CLIENT_ENV_OPTIONS) - {"seed", "max_episode_steps"})
        if client_only:
            raise InvalidArgumentError(
                f"spec.env_config.{client_only[0]}: only client-hosted environments take {', '.join(client_only)}: "
                f"subclass Environment and define reset() and step() (env_id {self.env_id!r} is built in)",
                field=f"spec.env_config.{client_only[0]}",
            )
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

    # --- client-hosted environments (gymnasium's API) -------------------------------------------
    # Override reset() and step() in a subclass and the environment runs in YOUR process: RLClient
    # serves it over EnvironmentService and the trainer calls it (see opentinker_client.hosting.server).

    def reset(self, seed: int | None = None) -> Any:
        """Start a new episode; return the first observation (or ``(observation, info)`` as
        gymnasium's ``reset`` does).

        Override in a client-hosted environment. The observation is an int in
        ``[0, observation_space)`` (``Discrete``), or ``observation_space`` numbers (a list or
        array of any shape) with the option ``observation_type="box"``. ``seed`` is given when the
        trainer wants a reproducible episode.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define reset(seed=None)")

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        """Take ``action`` (an int in ``[0, action_space)``); return gymnasium's
        ``(observation, reward, terminated, truncated, info)``.

        ``terminated``: the episode reached an end state (goal, hole); ``truncated``: it was cut
        short (a time limit). ``info`` is a dict of JSON-able values (sent along, may be empty).
        An exception raised here ends the task FAILED with its message.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define step(action)")

    def close(self) -> None:
        """Release resources of one instance when the trainer is done with it (optional)."""

    @property
    def is_client_hosted(self) -> bool:
        """True when this class overrides :meth:`step` or :meth:`reset` (runs in the client)."""
        cls = type(self)
        return cls.step is not Environment.step or cls.reset is not Environment.reset

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


#: Options of a client-hosted environment that go into its env_config (see spec.ClientEnvConfig).
CLIENT_ENV_OPTIONS = ("observation_type", "action_names", "timeout_s", "grace_s", "seed", "max_episode_steps")


def client_env_config(env: Any, *, endpoint: str):
    """The validated :class:`~opentinker_common.spec.ClientEnvConfig` of a client-hosted ``env``
    served at ``endpoint``: its declared ``action_space``/``observation_space`` and options.

    Raises:
        InvalidArgumentError: a missing or bad size or option; ``err.field`` names it
            (``spec.env_config.action_space``).
    """
    options = dict(getattr(env, "options", None) or {})
    unknown = sorted(set(options) - set(CLIENT_ENV_OPTIONS))
    if unknown:
        raise InvalidArgumentError(
            f"spec.env_config.{unknown[0]}: expected one of the options of a client-hosted environment "
            f"({', '.join(CLIENT_ENV_OPTIONS)})",
            field=f"spec.env_config.{unknown[0]}",
        )
    data: dict[str, Any] = {"env_id": "client", "endpoint": endpoint, **options}
    for name in ("action_space", "observation_space"):
        value = getattr(env, name, None)
        if value is None:
            raise InvalidArgumentError(
                f"spec.env_config.{name}: a client-hosted environment must declare its {name} "
                f"(e.g. super().__init__(action_space=4, observation_space=16))",
                field=f"spec.env_config.{name}",
            )
        data[name] = value
    cls = type(env)
    missing = [m for m in ("reset", "step") if getattr(cls, m, None) is getattr(Environment, m)]
    if missing:
        raise InvalidArgumentError(
            f"spec.env_config: a client-hosted environment defines both reset() and step(); "
            f"{cls.__name__} does not define {' or '.join(m + '()' for m in missing)}",
            field="spec.env_config",
        )
    if isinstance(data.get("action_names"), tuple):
        data["action_names"] = list(data["action_names"])
    try:
        return validate_env_config(data)
    except SpecError as err:
        raise from_spec_error(err) from None
