"""Client-hosted rewards, trainer side: the user's reward function, called over ``Score``.

A ``prompts`` task with ``reward.verifier: client`` scores its replies by calling
``EnvironmentService.Score`` at ``reward.endpoint`` — the user's ``RewardServer``
(:mod:`opentinker_client.hosting.reward`), served from the user's process like a client-hosted
environment, through the same :class:`~opentinker_trainer.envs.remote.RemoteSession`: the bearer
token, TLS, ``timeout_s`` per call, ``grace_s`` of retries while the endpoint is unreachable.

The missing-reward policy (:class:`ClientReward`):

* an item the function scored NaN, an infinity, None or a non-number has no reward (``None``):
  GRPO leaves that sample out of its group's baseline and its loss
  (:func:`~opentinker_trainer.rl.grpo.grpo_update`, ``grpo/missing_rewards``);
* a call that fails (the function raised, the call timed out, the server stayed unreachable past
  ``grace_s``) gives every item of the batch no reward, and so does a call where no item got one;
  such a call is a *failure*;
* after ``reward.max_consecutive_failures`` failures in a row the task ends FAILED
  (:class:`~opentinker_trainer.context.UserError`) with the last failure's reason; one call
  with at least one reward resets the count;
* a refused access token ends the task at once (no retry can fix it).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import structlog
from google.protobuf import struct_pb2

from opentinker.environment.v1 import environment_pb2 as pb
from opentinker_trainer.context import UserError
from opentinker_trainer.envs.remote import AccessRefused, RemoteSession

log = structlog.get_logger("opentinker.trainer.reward")

__all__ = ["ClientReward", "MAX_ITEMS_PER_CALL"]

#: Items per Score call; a larger batch is sent as several calls.
MAX_ITEMS_PER_CALL = 1024


def _struct(metadata: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(_finite(metadata))
    return s


def _finite(value: Any) -> Any:
    """Struct has no NaN/inf numbers nor non-JSON values: those become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class ClientReward:
    """The batched scorer of a client-hosted reward (module docstring for the failure policy).

    Args:
        reward: the task's :class:`~opentinker_common.spec.prompts.RewardConfig` (``client``).

    Attributes (counts since the last :meth:`take_counts`): ``failures`` (failed calls),
    ``missing`` (items without a reward); ``consecutive``: failed calls in a row.
    """

    def __init__(self, reward: Any) -> None:
        self.max_failures = int(reward.max_consecutive_failures)
        self.session = RemoteSession(
            reward.endpoint,
            timeout_s=reward.timeout_s,
            grace_s=reward.grace_s,
            token=reward.token,
            tls=reward.tls,
            root_certificates=reward.tls_root_certificates,
        )
        # Describe first (retried while unreachable for grace_s): once a service has answered, its
        # errors (the function raised ...) can be shown to the task.
        described = self.session.describe()
        self.session.name = f"client reward {described.name}" if described.name else "client reward"
        self.consecutive = 0
        self.failures = 0
        self.missing = 0
        self.last_error = ""

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict]
    ) -> list[float | None]:
        """One reward per item (None = missing).

        Raises:
            UserError: the access token was refused, or this call was the
                ``max_consecutive_failures``-th failure in a row (naming the reason).
        """
        out: list[float | None] = []
        for start in range(0, len(prompts), MAX_ITEMS_PER_CALL):
            sl = slice(start, start + MAX_ITEMS_PER_CALL)
            out.extend(self._call(prompts[sl], completions[sl], metadata[sl]))
        return out

    def _call(self, prompts, completions, metadata) -> list[float | None]:
        n = len(prompts)
        req = pb.ScoreRequest(
            items=[
                pb.ScoreItem(prompt=p, completion=c, metadata=_struct(m))
                for p, c, m in zip(prompts, completions, metadata)
            ]
        )
        rewards: list[float | None] = [None] * n
        reason = ""
        try:
            res = self.session.call("Score", req)
            if len(res.results) != n:
                reason = f"{self.session.name} at {self.session.endpoint} answered {len(res.results)} results for {n}"
            else:
                errors = []
                for i, r in enumerate(res.results):
                    if r.HasField("reward") and math.isfinite(r.reward):
                        rewards[i] = float(r.reward)
                    else:
                        errors.append(r.error or f"reward {r.reward!r}")
                if errors:
                    reason = f"no reward for {len(errors)} of {n} items (first: {errors[0]})"
        except AccessRefused:
            raise
        except UserError as exc:
            reason = str(exc)
        got = sum(r is not None for r in rewards)
        self.missing += n - got
        if got == 0:
            self.failures += 1
            self.consecutive += 1
            self.last_error = reason or "no reward for any item"
            log.warning(
                "client reward failed", endpoint=self.session.endpoint, consecutive=self.consecutive, reason=reason
            )
            if self.consecutive >= self.max_failures:
                raise UserError(
                    f"the client reward failed {self.consecutive} times in a row "
                    f"(reward.max_consecutive_failures={self.max_failures}); last: {self.last_error}"
                )
        else:
            self.consecutive = 0
            if reason:
                log.info("client reward: some items have no reward", endpoint=self.session.endpoint, reason=reason)
        return rewards

    def take_counts(self) -> dict[str, float]:
        """``reward/client_failures`` and ``reward/client_missing`` since the last call; resets them."""
        out = {"reward/client_failures": float(self.failures), "reward/client_missing": float(self.missing)}
        self.failures = self.missing = 0
        return out

    def close(self) -> None:
        self.session.channel.close()
