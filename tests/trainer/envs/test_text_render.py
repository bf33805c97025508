"""Observations rendered as text for an LM, and replies parsed to actions."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

from opentinker_trainer.envs.text_render import DiscreteRenderer, FrozenLakeRenderer, parse_action, renderer_for

NAMES = ("left", "down", "right", "up")


@pytest.mark.parametrize(
    "reply, action",
    [
        ("right", 2),
        ("Right.", 2),
        (" UP", 3),
        ("I go down now", 1),
        ("left, then right", 0),
        ("Move: right!", 2),
        ("upright", None),
        ("", None),
        (None, None),
        ("go north", None),
        ("downward", None),
    ],
)
def test_parse_action_takes_the_first_whole_word_action(reply, action):
    assert parse_action(reply, NAMES) == action


def test_parse_action_with_numbers_and_longest_match():
    assert parse_action("action 2", ("0", "1", "2", "3")) == 2
    assert parse_action("12", ("0", "1", "2")) is None  # 12 is not an action, nor are its digits
    assert parse_action("up-left", ("up", "up-left")) == 1


def test_frozen_lake_render_shows_the_map_with_the_agent():
    env = gymnasium.make("FrozenLake-v1", is_slippery=False)
    r = renderer_for(env)
    assert isinstance(r, FrozenLakeRenderer) and r.action_names == NAMES
    text = r.render(5 + 1)  # row 2, column 3
    lines = text.splitlines()
    assert lines[:4] == ["S F F F", "F H P H", "F F F H", "H F F G"]
    assert "row 2, column 3" in lines[4] and "row 4, column 4" in lines[4]
    assert r.render(0).splitlines()[0] == "P F F F"
    assert "left, down, right or up" in r.system_prompt()


def test_frozen_lake_potential_is_minus_scaled_distance_to_goal():
    r = FrozenLakeRenderer(gymnasium.make("FrozenLake-v1").unwrapped.desc)
    assert r.potential(0) == -1.0 and r.potential(15) == 0.0 and r.potential(14) == pytest.approx(-1 / 6)
    assert r.potential(12) == -1.0  # a hole takes all progress back (12 is 3 from the goal)
    assert r.potential(5) == -1.0 and r.potential(6) == pytest.approx(-3 / 6)


def test_generic_renderer_for_other_discrete_envs():
    env = gymnasium.make("CliffWalking-v1")
    r = renderer_for(env)
    assert type(r) is DiscreteRenderer and r.action_names == ("0", "1", "2", "3")
    assert r.render(np.int64(36)) == "Observation: 36\nActions: 0, 1, 2, 3\nYour action:"
    assert r.render(np.array([0.5, -1.25])).startswith("Observation: [0.5, -1.25]")
    assert renderer_for(env, ("n", "e", "s", "w")).action_names == ("n", "e", "s", "w")
    with pytest.raises(ValueError, match="grid"):
        r.potential(3)
    with pytest.raises(ValueError, match="Discrete"):
        renderer_for(gymnasium.make("MountainCarContinuous-v0"))
    with pytest.raises(ValueError):
        DiscreteRenderer(3, ("a", "b"))
