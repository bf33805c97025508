"""Submits held in the scheduler's environment check, for tests of load and refusals.

:class:`BlockingBuilder` is a TEST DOUBLE of ``opentinker_common.spec.gym._real_spaces`` (the
lru-cached function that builds a gymnasium environment to read its spaces): it answers with
CartPole's spaces at once, or, for ``env_kwargs`` holding ``block: true``, after the test sets
:attr:`BlockingBuilder.release`, so nothing depends on how fast this machine is. The
``held_env_checks`` fixture (tests/conftest.py) installs one for a test.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from typing import Iterator

import grpc

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2 as S, scheduler_pb2_grpc

from tests.support.security import LoopbackScheduler


class BlockingBuilder:
    """TEST DOUBLE of ``gym._real_spaces``: CartPole's spaces, after waiting for :attr:`release`
    when ``env_kwargs`` hold ``block: true``. Wrapped in ``lru_cache`` like the real one."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)
        self.calls: list[tuple] = []
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()
        self.cached = functools.lru_cache(maxsize=64)(self._build)

    def _build(self, env_id: str, kwargs_items: str):  # the canonical JSON of env_kwargs (gym_spec.kwargs_key)
        with self._lock:
            self.calls.append(kwargs_items)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        self.entered.release()
        try:
            if json.loads(kwargs_items).get("block"):
                self.release.wait(60)
            return ("Discrete(2)", "Box(-inf, inf, (4,), float32)", 2, 4)
        finally:
            with self._lock:
                self.active -= 1

    def wait_entered(self, n: int = 1) -> None:
        for _ in range(n):
            assert self.entered.acquire(timeout=30), "the check never started"


def cartpole_request(request_id: str = "", **env_kwargs) -> S.SubmitTaskRequest:
    """A ``full_rl`` CartPole submit with ``env_kwargs`` (``block=True``: held in the check)."""
    spec = C.TaskSpec(workload_type="full_rl")
    spec.env_config.update({"env_id": "CartPole-v1", "env_kwargs": env_kwargs})
    return S.SubmitTaskRequest(spec=spec, request_id=request_id)


@contextlib.contextmanager
def serving(tmp_path, config_text: str = "") -> Iterator[tuple[LoopbackScheduler, grpc.Channel, object]]:
    """A loopback scheduler with ``config_text`` (YAML) and an insecure channel to it:
    ``(sched, channel, SchedulerService stub)``; both closed on exit, the channel first."""
    sched = LoopbackScheduler(tmp_path / "state", config_text)
    channel = grpc.insecure_channel(sched.target)
    try:
        yield sched, channel, scheduler_pb2_grpc.SchedulerServiceStub(channel)
    finally:
        channel.close()
        sched.close()
