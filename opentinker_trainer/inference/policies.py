"""PPO policies served by ``InferenceService.Act``: observations in, greedy actions and values out.

A policy is named by the id of a finished single-agent ``full_rl`` task; ``resolve(name)`` gives
its checkpoint folder and step (:meth:`~.resolve.SchedulerResolver.policy`: the scheduler, then the
artifact store through the node-local cache). The folder's ``policy.torchscript.pt``
(:mod:`opentinker_trainer.rl.policy_export`) is loaded once and kept, at most ``max_resident`` of
them, the least recently used dropped first; ``policy.json`` gives the observation shape a
request must match. A policy is a small MLP: it runs on the CPU, next to whatever model the
server holds.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from opentinker_trainer.rl.policy_export import ACTING_FILE

__all__ = ["MAX_OBSERVATIONS", "BadObservations", "PolicyBusy", "PolicyNotFound", "PolicyRefused", "PolicyRegistry"]

#: Most observations one Act call may carry.
MAX_OBSERVATIONS = 4096


class PolicyNotFound(LookupError):
    """No task of that id the caller may use (NOT_FOUND)."""


class PolicyRefused(Exception):
    """The task is not a finished single-agent full_rl task with an exported policy (FAILED_PRECONDITION)."""


class BadObservations(ValueError):
    """The request's observations do not fit the policy (INVALID_ARGUMENT)."""


class PolicyBusy(Exception):
    """``max_concurrent`` Act calls are running (RESOURCE_EXHAUSTED)."""


@dataclass
class LoadedPolicy:
    name: str
    module: torch.jit.ScriptModule
    step: int
    #: Shape of one observation (``()`` for a Discrete space); None when the checkpoint does not say.
    obs_shape: tuple[int, ...] | None
    discrete_obs: bool
    last_used: float


def _load(name: str, folder: Path, step: int) -> LoadedPolicy:
    file = Path(folder) / ACTING_FILE
    if not file.is_file():
        raise PolicyRefused(
            f"policy {name!r}: its checkpoint (step {step}) has no exported policy ({ACTING_FILE}); only "
            "single-agent full_rl (PPO) tasks export one"
        )
    meta_file = Path(folder) / "policy.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    shape = meta.get("observation_shape")
    module = torch.jit.load(str(file), map_location="cpu").eval()
    return LoadedPolicy(
        name=name,
        module=module,
        step=step,
        obs_shape=tuple(int(d) for d in shape) if shape is not None else None,
        discrete_obs=str(meta.get("observation_space", "")).startswith("Discrete"),
        last_used=time.monotonic(),
    )


class PolicyRegistry:
    """Loaded policies by name, and the Act computation.

    Args:
        resolve: ``name -> (checkpoint folder, step)``; raises PolicyNotFound / PolicyRefused.
        max_resident: policies kept loaded (1..).
        max_concurrent: Act calls running at once; more are refused with PolicyBusy.
    """

    def __init__(
        self, resolve: Callable[[str], tuple[Path, int]], *, max_resident: int = 8, max_concurrent: int = 16
    ) -> None:
        self.resolve = resolve
        self.max_resident = max_resident
        self.max_concurrent = max_concurrent
        self._loaded: OrderedDict[str, LoadedPolicy] = OrderedDict()
        self._lock = threading.Lock()
        self._running = 0

    def get(self, name: str) -> LoadedPolicy:
        """The policy ``name``, loaded on first use (blocking: it may ask the scheduler)."""
        with self._lock:
            hit = self._loaded.get(name)
            if hit is not None:
                self._loaded.move_to_end(name)
                hit.last_used = time.monotonic()
                return hit
        folder, step = self.resolve(name)
        loaded = _load(name, folder, step)
        with self._lock:
            self._loaded[name] = loaded
            self._loaded.move_to_end(name)
            while len(self._loaded) > self.max_resident:
                self._loaded.popitem(last=False)
        return loaded

    def act(
        self, name: str, shape: Sequence[int], values: Sequence[float]
    ) -> tuple[list[int], list[float], list[float], int]:
        """``(action shape, actions row-major, values [B], checkpoint step)`` of policy ``name`` for
        observations ``values`` of ``shape`` ``[B, *obs_shape]`` (blocking; run it off the event loop).

        Raises:
            BadObservations, PolicyNotFound, PolicyRefused, PolicyBusy.
        """
        if not name:
            raise BadObservations("policy: expected the id of a finished full_rl task, got an empty string")
        shape = [int(d) for d in shape]
        if not shape or any(d < 0 for d in shape):
            raise BadObservations(f"observations.shape: expected [B, *observation shape], got {shape}")
        batch = shape[0]
        if not 1 <= batch <= MAX_OBSERVATIONS:
            raise BadObservations(f"observations.shape[0]: expected 1..{MAX_OBSERVATIONS} observations, got {batch}")
        if math.prod(shape) != len(values):
            raise BadObservations(
                f"observations.values: expected {math.prod(shape)} values for shape {shape}, got {len(values)}"
            )
        with self._lock:
            if self._running >= self.max_concurrent:
                raise PolicyBusy(f"{self.max_concurrent} Act calls are running (max_concurrent_requests); retry")
            self._running += 1
        try:
            policy = self.get(name)
            if policy.obs_shape is not None and tuple(shape[1:]) != policy.obs_shape:
                raise BadObservations(
                    f"observations.shape: expected [B, {', '.join(map(str, policy.obs_shape))}] "
                    f"(policy {name!r} observes {list(policy.obs_shape) or 'one integer'} per step), got {shape}"
                )
            if policy.discrete_obs:
                if any(v != int(v) for v in values):
                    raise BadObservations("observations.values: expected integers (a Discrete observation space)")
                obs = torch.tensor([int(v) for v in values], dtype=torch.int64).reshape(shape)
            else:
                obs = torch.tensor(values, dtype=torch.float32).reshape(shape)
            try:
                with torch.no_grad():
                    action, value = policy.module(obs)
            except RuntimeError as exc:  # a shape the checkpoint did not declare (older ones)
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise BadObservations(f"observations.shape {shape} does not fit policy {name!r}: {first}") from None
            return list(action.shape), action.reshape(-1).tolist(), value.reshape(-1).tolist(), policy.step
        finally:
            with self._lock:
                self._running -= 1
