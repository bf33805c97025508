"""The trainer's gymnasium.Env over a client-hosted environment served from this process."""

from __future__ import annotations

import time

import gymnasium
import numpy as np
import pytest

from opentinker_client import Environment
from opentinker_client.hosting.server import EnvironmentServer
from opentinker_common.spec import validate_env_config
from opentinker_trainer.context import UserError
from opentinker_trainer.envs.gym import make_env
from opentinker_trainer.envs.remote import RemoteSession, close_all_sessions, make_client_env


class Corridor(Environment):
    def __init__(self, **options):
        super().__init__(action_space=2, observation_space=5, action_names=["left", "right"], **options)
        self.pos = 0

    def reset(self, seed=None):
        self.pos = 0 if seed is None else seed % 3
        return self.pos

    def step(self, action):
        if action == 0 and self.pos == 0:
            raise ValueError("walked into the west wall")
        self.pos = min(4, self.pos + (1 if action == 1 else -1))
        return self.pos, float(self.pos == 4), self.pos == 4, False, {"pos": self.pos}


class Slow(Corridor):
    def step(self, action):
        time.sleep(1.5)
        return super().step(action)


@pytest.fixture(autouse=True)
def fresh_sessions():
    close_all_sessions()
    yield
    close_all_sessions()


def config(server: EnvironmentServer, **change):
    return validate_env_config({**server.env_config, **change})


def test_gymnasium_env_plays_the_client_environment():
    with EnvironmentServer(Corridor()) as server:
        env = make_env(config(server), seed=None)  # the generic factory delegates env_id "client"
        assert env.action_space == gymnasium.spaces.Discrete(2)
        assert env.observation_space == gymnasium.spaces.Discrete(5)
        obs, info = env.reset(seed=4)
        assert obs == 1 and info == {}
        obs, reward, terminated, truncated, info = env.step(np.int64(1))
        assert (obs, reward, terminated, truncated, info) == (2, 0.0, False, False, {"pos": 2.0})
        env.step(1)
        assert env.step(1)[1:3] == (1.0, True)
        second = make_client_env(config(server), seed=None)  # its own instance on the client
        assert second.unwrapped.env_index != env.unwrapped.env_index
        assert second.reset()[0] == 0
        assert env.unwrapped.action_names == ("left", "right")
        close_all_sessions()
        assert server.servicer.session_count() == 0


def test_time_limit_and_seed_from_config():
    with EnvironmentServer(Corridor()) as server:
        env = make_client_env(config(server, max_episode_steps=2, seed=5), seed=None)
        env.reset()
        env.step(1)
        assert env.step(1)[3] is True  # truncated by the time limit


def test_environment_error_becomes_a_user_error_with_its_message():
    with EnvironmentServer(Corridor()) as server:
        env = make_client_env(config(server), seed=None)
        env.reset()
        with pytest.raises(UserError) as err:
            env.step(0)
    msg = str(err.value)
    assert (
        "client environment Corridor at" in msg and "Corridor.step raised ValueError: walked into the west wall" in msg
    )


def test_slow_environment_fails_naming_the_timeout():
    with EnvironmentServer(Slow()) as server:
        env = make_client_env(config(server, timeout_s=0.3), seed=None)
        env.reset()
        with pytest.raises(UserError, match=r"did not answer step within timeout_s=0.3 s"):
            env.step(1)


def test_unreachable_client_fails_after_the_grace_period():
    server = EnvironmentServer(Corridor()).start()
    env = make_client_env(config(server, grace_s=1.0), seed=None)
    env.reset()
    server.stop(grace=0)
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"unreachable for grace_s=1 s"):
        env.step(1)
    assert time.monotonic() - t0 >= 1.0  # it kept trying for the grace period


def test_client_declaring_other_spaces_is_refused():
    with EnvironmentServer(Corridor()) as server:
        env = make_client_env(config(server, action_space=3, action_names=[]), seed=None)
        with pytest.raises(
            UserError, match=r"env_config.action_space: the task says Discrete\(3\) but .* declares Discrete\(2\)"
        ):
            env.reset()


def test_box_observations_are_float_vectors():
    class Sensors(Environment):
        def __init__(self):
            super().__init__(action_space=2, observation_space=3, observation_type="box")

        def reset(self, seed=None):
            return np.array([1.0, 2.0, 3.0])

        def step(self, action):
            return [0.5, 0.5, 0.5], 1.0, True, False, {}

    with EnvironmentServer(Sensors()) as server:
        env = make_client_env(config(server), seed=3)  # seed: reset once, as make_env does
        assert env.observation_space.shape == (3,)
        obs, _ = env.reset()
        assert obs.dtype == np.float32 and obs.tolist() == [1.0, 2.0, 3.0]
        assert env.step(0)[0].tolist() == [0.5, 0.5, 0.5]


def test_sessions_are_shared_per_endpoint():
    with EnvironmentServer(Corridor()) as server:
        cfg = config(server)
        a = RemoteSession.shared(cfg.endpoint, timeout_s=1, grace_s=1)
        assert RemoteSession.shared(cfg.endpoint, timeout_s=1, grace_s=1) is a


def test_observations_past_grpcs_default_4_mib_limit_arrive() -> None:
    """600,000 doubles (4.8 MB) per observation: over gRPC's default receive limit (4 MiB), under
    the 64 MiB both sides set."""
    n = 600_000

    class Camera(Environment):
        def __init__(self):
            super().__init__(action_space=2, observation_space=n, observation_type="box")

        def reset(self, seed=None):
            return np.full(n, 0.25)

        def step(self, action):
            return np.full(n, float(action)), 1.0, True, False, {}

    with EnvironmentServer(Camera()) as server:
        env = make_client_env(config(server), seed=None)
        obs, _ = env.reset()
        assert obs.shape == (n,) and float(obs[-1]) == 0.25
        assert float(env.step(1)[0][0]) == 1.0
