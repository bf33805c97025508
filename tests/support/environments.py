"""Environments that live in the test process, for the tests that host them over gRPC."""

from __future__ import annotations

from opentinker_client import Environment


class Corridor(Environment):
    """Positions 0..4; action 1 moves right, 0 left; reaching 4 pays 1 and ends the episode."""

    def __init__(self, length: int = 5, **options):
        super().__init__(action_space=2, observation_space=length, action_names=["left", "right"], **options)
        self.length = length
        self.pos = 0
        self.seeds: list = []

    def reset(self, seed=None):
        self.seeds.append(seed)
        self.pos = 0
        return self.pos

    def step(self, action):
        self.pos = max(0, min(self.length - 1, self.pos + (1 if action == 1 else -1)))
        done = self.pos == self.length - 1
        return self.pos, float(done), done, False, {"pos": self.pos}


class WalkRight(Environment):
    """Positions 0..4; every action moves one right; reaching 4 pays 1 and ends the episode."""

    def __init__(self, **options):
        super().__init__(action_space=2, observation_space=5, **options)
        self.pos = 0

    def reset(self, seed=None):
        self.pos = 0
        return self.pos

    def step(self, action):
        self.pos = min(4, self.pos + 1)
        return self.pos, float(self.pos == 4), self.pos == 4, False, {}


class OneStep(Environment):
    """Starts at 0; any action ends the episode at 1 with no reward."""

    def __init__(self):
        super().__init__(action_space=2, observation_space=5)

    def reset(self, seed=None):
        return 0

    def step(self, action):
        return 1, 0.0, True, False, {}
