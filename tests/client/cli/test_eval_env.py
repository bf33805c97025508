"""`opentinker eval` of a policy rebuilds the task's environment from its spec, whose numbers
arrive as floats (a protobuf Struct): whole ones go back to ints for gymnasium."""

from opentinker_client.cli.commands import _ints


def test_whole_floats_become_ints_nested_and_the_rest_stays() -> None:
    env = {"env_id": "FrozenLake-v1", "max_episode_steps": 500.0, "env_kwargs": {"p": 0.5, "sizes": [2.0, 1.5]}}
    assert _ints(env) == {
        "env_id": "FrozenLake-v1",
        "max_episode_steps": 500,
        "env_kwargs": {"p": 0.5, "sizes": [2, 1.5]},
    }
    assert isinstance(_ints(env)["max_episode_steps"], int)
