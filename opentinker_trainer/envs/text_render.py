"""Observations as text for a language model, and its replies as actions.

A renderer turns one observation of a Discrete-action environment into the user message of a
chat turn, offers a default system prompt, and names the actions the model may answer with:

* :class:`FrozenLakeRenderer` — FrozenLake's map with the agent as ``P``, its row and column,
  actions ``left, down, right, up`` (FrozenLake's 0..3), and a potential for reward shaping
  (minus the grid distance to the goal, scaled to [-1, 0]).
* :class:`DiscreteRenderer` — any other environment: ``Observation: 5`` (a Box observation as
  rounded numbers) and the action names, by default ``0 .. n-1``.

:func:`parse_action` reads a reply: the FIRST whole word (case-insensitive) that is one of the
action names decides; a reply with none is an invalid action (None). So ``"Right."``, ``"I go
right"`` and ``"right, then down"`` are all ``right``.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

__all__ = ["DiscreteRenderer", "FrozenLakeRenderer", "parse_action", "renderer_for"]

FROZEN_LAKE_ACTIONS = ("left", "down", "right", "up")


def parse_action(reply: str | None, action_names: Sequence[str]) -> int | None:
    """Index of the first action name that occurs as a whole word in ``reply``, or None.

    Matching is case-insensitive; ``action_names[i]`` is action ``i``. A longer name wins over a
    shorter one starting at the same place (``"up"`` vs ``"upward"`` both listed).
    """
    if not reply:
        return None
    lookup = {name.strip().lower(): i for i, name in enumerate(action_names)}
    pattern = "|".join(re.escape(n) for n in sorted(lookup, key=len, reverse=True))
    m = re.search(rf"(?<![\w-])({pattern})(?![\w])", reply.lower())
    return None if m is None else lookup[m.group(1)]


class DiscreteRenderer:
    """Generic text for any environment with ``Discrete(n)`` actions.

    ``reply_prefix`` is put at the start of the model's reply (after the chat template's
    assistant header): the model continues it, so even a small model answers with an action
    word right away instead of restating the question. Its completion is what is parsed.
    """

    reply_prefix = "Action:"

    def __init__(self, n_actions: int, action_names: Sequence[str] = ()) -> None:
        self.action_names = tuple(action_names) or tuple(str(i) for i in range(n_actions))
        if len(self.action_names) != n_actions:
            raise ValueError(f"{len(self.action_names)} action names for {n_actions} actions")

    def system_prompt(self) -> str:
        names = ", ".join(self.action_names)
        return (
            "You are playing a game. Each turn you see an observation and choose one action. "
            f"Answer with one action only: {names}."
        )

    def render(self, observation: Any) -> str:
        if isinstance(observation, (int, np.integer)):
            text = str(int(observation))
        else:
            text = "[" + ", ".join(f"{float(v):.3g}" for v in np.asarray(observation).ravel()) + "]"
        return f"Observation: {text}\nActions: {', '.join(self.action_names)}\nYour action:"

    def potential(self, observation: Any) -> float:
        """No generic shaping potential exists."""
        raise ValueError("reward_shaping 'distance' needs an environment with a goal on a grid (FrozenLake)")


class FrozenLakeRenderer(DiscreteRenderer):
    """FrozenLake (``gymnasium.envs.toy_text.FrozenLakeEnv``): the map with ``P`` for the agent.

    Args:
        desc: the map as FrozenLake holds it (``env.unwrapped.desc``: rows of bytes ``S F H G``).
    """

    reply_prefix = "Move:"

    def __init__(self, desc: Any) -> None:
        super().__init__(4, FROZEN_LAKE_ACTIONS)
        self.rows = [[c.decode() if isinstance(c, bytes) else str(c) for c in row] for row in np.asarray(desc)]
        self.nrow, self.ncol = len(self.rows), len(self.rows[0])
        goals = [(r, c) for r in range(self.nrow) for c in range(self.ncol) if self.rows[r][c] == "G"]
        self.goal = goals[0] if goals else (self.nrow - 1, self.ncol - 1)

    def system_prompt(self) -> str:
        return (
            "You play FrozenLake. P is you, F is ice, H is a hole, G is the goal. "
            "Move one square at a time to reach G without stepping on H. "
            "Answer with one word: left, down, right or up."
        )

    def render(self, observation: Any) -> str:
        pos = int(observation)
        r, c = divmod(pos, self.ncol)
        lines = []
        for i, row in enumerate(self.rows):
            cells = ["P" if (i, j) == (r, c) else ch for j, ch in enumerate(row)]
            lines.append(" ".join(cells))
        gr, gc = self.goal
        return (
            "\n".join(lines)
            + f"\nYou are at row {r + 1}, column {c + 1}. The goal is at row {gr + 1}, column {gc + 1}. Your move:"
        )

    def potential(self, observation: Any) -> float:
        """``-(|row - goal row| + |col - goal col|) / (nrow + ncol - 2)``, in [-1, 0]; a hole is
        -1 (as far as it gets), so an episode that ends in a hole keeps none of its progress and
        walking into one is never worth as much as staying on the ice."""
        r, c = divmod(int(observation), self.ncol)
        if self.rows[r][c] == "H":
            return -1.0
        return -(abs(r - self.goal[0]) + abs(c - self.goal[1])) / max(1, self.nrow + self.ncol - 2)


def renderer_for(env: Any, action_names: Sequence[str] = ()) -> DiscreteRenderer:
    """The renderer for a ``gymnasium.Env`` with Discrete actions: FrozenLake's map when ``env``
    is FrozenLake, else :class:`DiscreteRenderer` (with ``action_names`` when given, else the
    env's own ``action_names`` attribute, e.g. a client-hosted environment's).

    Raises:
        ValueError: the action space is not ``Discrete``.
    """
    import gymnasium

    space = env.action_space
    if not isinstance(space, gymnasium.spaces.Discrete):
        raise ValueError(f"an LM can only choose among Discrete actions; this environment's action space is {space}")
    unwrapped = env.unwrapped
    if type(unwrapped).__name__ == "FrozenLakeEnv" and hasattr(unwrapped, "desc"):
        return FrozenLakeRenderer(unwrapped.desc)
    names = tuple(action_names) or tuple(getattr(unwrapped, "action_names", ()) or ())
    return DiscreteRenderer(int(space.n), names)
