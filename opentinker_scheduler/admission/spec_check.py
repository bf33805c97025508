"""Checking a submitted spec's environment off the event loop, under a time budget.

Validating ``spec.env_config`` may build the environment (gymnasium ``make``, a PettingZoo
``parallel_env``) to compare its spaces with the seed's (:mod:`opentinker_common.spec.gym`,
:mod:`opentinker_common.spec.multiagent`). Done inside ``ClientApi.submit`` on the event loop,
one heavy spec (``mpe2/simple_spread_v3`` with ``N: 3200``: 24 s, +600 MB) blocked every RPC,
``/health`` and the node heartbeats. So ``SubmitTask`` first runs
:func:`~opentinker_common.spec.validate_env_config` here:

* in a worker thread (``asyncio.to_thread``), so the loop keeps serving;
* at most :data:`MAX_CONCURRENT` at once per scheduler (a slot is held until its thread really
  ends, also after a timeout: a thread cannot be stopped, and a caller must not be able to pile
  up runaway builds by retrying); a caller waits for a slot at most the time budget, then gets
  ``RESOURCE_EXHAUSTED``;
* within ``limits.spec_check_timeout`` seconds (default 10): past it, ``INVALID_ARGUMENT``
  ``spec.env_config: building the environment took longer than 10 s; use smaller env_kwargs``,
  nothing stored; the same ``env_config`` is then refused at once for as long as the scheduler
  runs (:data:`REMEMBER_TOO_SLOW` of them are kept).

The env-building checks are ``functools.lru_cache``-d on (env id, env_kwargs), so the
``spec_from_proto`` that ``ClientApi.submit`` runs next on the loop finds the result cached
and builds nothing. An ``env_config`` that passed once is not sent to a thread again (the last
:data:`REMEMBER_PASSED` are kept): the check is a pre-check of what ``ClientApi.submit``
validates anyway, and the hop to a thread and back was a fifth of a typical submit's CPU.

A refused ``env_config`` is refused with its own problems (every bad key of it, as field
violations), without the rest of the spec's: checking those too would build the environment a
second time on the loop.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from typing import Any, Callable

from opentinker.common.v1 import common_pb2
from opentinker_common.spec import SpecError, validate_env_config
from opentinker_common.spec.structs import struct_to_dict

from opentinker_scheduler.errors import InvalidArgument, ResourceExhausted

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_CONCURRENT", "SpecChecker", "check_submitted_spec", "checker_for"]

#: ``limits.spec_check_timeout`` when the config leaves it unset (seconds).
DEFAULT_TIMEOUT_S = 10.0
#: Environment checks running at once per scheduler.
MAX_CONCURRENT = 2
#: ``env_config`` s that ran past the budget, refused at once afterwards (oldest forgotten first).
REMEMBER_TOO_SLOW = 256
#: ``env_config`` s that passed, not checked in a thread again (least recently used forgotten first).
REMEMBER_PASSED = 4096


def _env_dict(spec: common_pb2.TaskSpec) -> dict[str, Any]:
    """``spec.env_config`` as ``spec_from_proto`` reads it."""
    return struct_to_dict(spec.env_config, "spec.env_config") if spec.HasField("env_config") else {}


def _too_slow_message(timeout_s: float) -> str:
    return f"spec.env_config: building the environment took longer than {timeout_s:g} s; use smaller env_kwargs"


def _consume(fut: asyncio.Future) -> None:
    """Retrieve a finished future's exception so nothing logs 'exception was never retrieved'."""
    if not fut.cancelled():
        fut.exception()


class SpecChecker:
    """Runs the environment part of spec validation in threads, bounded in number and time.

    Args:
        validate: ``env_config`` mapping -> parsed config; raises ``SpecError``. Default
            :func:`~opentinker_common.spec.validate_env_config` (what ``spec_from_proto`` runs).
        max_concurrent: checks running at once.
    """

    def __init__(
        self, *, validate: Callable[[Any], Any] = validate_env_config, max_concurrent: int = MAX_CONCURRENT
    ) -> None:
        self._validate = validate
        self.max_concurrent = max_concurrent
        self._slots = asyncio.Semaphore(max_concurrent)
        self._too_slow: OrderedDict[bytes, None] = OrderedDict()
        self._passed: OrderedDict[bytes, None] = OrderedDict()
        #: Checks whose thread is running now (timed-out ones included); for tests and metrics.
        self.running = 0

    async def check(self, spec: common_pb2.TaskSpec, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Validate ``spec.env_config`` in a thread within ``timeout_s`` seconds.

        Raises:
            InvalidArgument: a bad env_config (the ``SpecError`` message, naming the field path),
                or building the environment took longer than ``timeout_s`` (now or before).
            ResourceExhausted: no check slot came free within ``timeout_s``.
        """
        key = spec.env_config.SerializeToString(deterministic=True)
        if key in self._passed:
            self._passed.move_to_end(key)
            return
        if key in self._too_slow:
            raise InvalidArgument(_too_slow_message(timeout_s))
        try:
            env = _env_dict(spec)
        except SpecError as exc:
            raise InvalidArgument.from_spec(exc) from None
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout_s)
        except TimeoutError:
            raise ResourceExhausted(
                f"spec.env_config: {self.max_concurrent} environment checks are already running and none ended within "
                f"{timeout_s:g} s (limits.spec_check_timeout); retry later"
            ) from None
        self.running += 1
        fut = asyncio.ensure_future(asyncio.to_thread(self._validate, env))
        fut.add_done_callback(self._release)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            fut.add_done_callback(_consume)
            self._too_slow[key] = None
            while len(self._too_slow) > REMEMBER_TOO_SLOW:
                self._too_slow.popitem(last=False)
            raise InvalidArgument(_too_slow_message(timeout_s)) from None
        except SpecError as exc:
            raise InvalidArgument.from_spec(exc) from None
        self._passed[key] = None
        while len(self._passed) > REMEMBER_PASSED:
            self._passed.popitem(last=False)

    def _release(self, _fut: asyncio.Future) -> None:
        self.running -= 1
        self._slots.release()


_CHECKERS: "weakref.WeakKeyDictionary[Any, SpecChecker]" = weakref.WeakKeyDictionary()


def checker_for(owner: Any) -> SpecChecker:
    """The :class:`SpecChecker` of one scheduler (``owner``: its ``SchedulerCore``), made on first use."""
    checker = _CHECKERS.get(owner)
    if checker is None:
        checker = _CHECKERS[owner] = SpecChecker()
    return checker


async def check_submitted_spec(core: Any, spec: common_pb2.TaskSpec) -> None:
    """``SubmitTask``'s environment check for the scheduler of ``core`` (its
    ``limits.spec_check_timeout``, default :data:`DEFAULT_TIMEOUT_S`). See :meth:`SpecChecker.check`."""
    timeout_s = getattr(core.config.limits, "spec_check_timeout", None) or DEFAULT_TIMEOUT_S
    await checker_for(core).check(spec, timeout_s=timeout_s)
