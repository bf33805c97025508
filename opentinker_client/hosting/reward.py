"""Serve a user's reward function to trainers (a client-hosted reward).

The function stays in the user's process, like a client-hosted environment
(:mod:`opentinker_client.hosting.server`): :class:`RewardServer` hosts it as
``EnvironmentService.Score`` with the same access token (``authorization: Bearer <token>``),
TLS files, health and reflection; a ``prompts`` task names it with
``env_config.reward = server.reward_config``::

    def reward(prompts, completions, metadata):          # batched: lists of equal length
        return [float(c.strip() == str(m["answer"])) for c, m in zip(completions, metadata)]

    with client.serve_reward(reward) as server:
        task = client.submit_task(workload_type="lora_finetune", env_config={
            "env_id": "prompts", "dataset_id": info.dataset_id, "reward": server.reward_config})
        client.wait(task)

The contract of ``fn(prompts, completions, metadata) -> list``: ``prompts[i]`` is the prompt as text
(a chat prompt's user messages joined by newlines), ``completions[i]`` the model's reply,
``metadata[i]`` the dataset line's other fields (a dict, as JSON gives it; integral numbers are
``int``); it returns one number per item. What
the trainer gets (environment.proto, ``Score``):

* a finite number -> that reward; ``NaN``, an infinity, ``None`` or a non-number (``"0.5"``, a
  list) -> no reward for that item, with the reason (the trainer counts it missing);
* ``fn`` raising -> ``UNKNOWN`` ``"<fn's name> raised ValueError: <text>"``: no reward for the batch;
* a result that is not a list of one value per item -> ``INTERNAL`` saying what came back;
* no token or another token -> ``UNAUTHENTICATED`` before ``fn`` runs.

A slow ``fn`` (past the task's ``reward.timeout_s``) is a failed call for the trainer. After
``reward.max_consecutive_failures`` failed calls in a row the task ends FAILED with the reason
(:mod:`opentinker_trainer.envs.client_reward`).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
from typing import Any, Callable, Sequence

import grpc
from google.protobuf import json_format

from opentinker.environment.v1 import environment_pb2 as pb
from opentinker.environment.v1 import environment_pb2_grpc as pb_grpc
from opentinker_client.errors import InvalidArgumentError
from opentinker_client.hosting.auth import TokenInterceptor
from opentinker_client.hosting.server import _access, _advertised, _bound_server, _bracket, _default_host
from opentinker_client.hosting.service import SERVICE_NAME

__all__ = ["MAX_ITEMS", "RewardFn", "RewardServer", "RewardServicer"]

log = logging.getLogger("opentinker_client.hosting.reward")

#: A batched reward: ``(prompts, completions, metadata) -> one number per item``.
RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[dict]], Sequence[Any]]

#: Most items one Score call may carry.
MAX_ITEMS = 4096


def _ints(value: Any) -> Any:
    """Integral numbers back to ``int`` (a protobuf ``Struct`` carries every number as a double),
    so ``{"answer": 7}`` in the dataset is ``7`` here, not ``7.0``."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


def _result(value: Any) -> pb.ScoreResult:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return pb.ScoreResult(error=f"the reward function returned {type(value).__name__} {value!r:.60}, not a number")
    value = float(value)
    if not math.isfinite(value):
        return pb.ScoreResult(error=f"the reward function returned {value!r}")
    return pb.ScoreResult(reward=value)


class RewardServicer(pb_grpc.EnvironmentServiceServicer):
    """``Score`` over ``fn`` (module docstring) and ``Describe`` (the function's name only, no
    spaces: what the trainer calls first to know a service answers here); Reset, Step and Close
    answer UNIMPLEMENTED.

    Attributes:
        calls: Score calls answered (for tests and operators).
    """

    def __init__(self, fn: RewardFn, name: str) -> None:
        self.fn = fn
        self.name = name
        self.calls = 0
        self._lock = threading.Lock()

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DescribeResponse:
        return pb.DescribeResponse(name=self.name)

    def Score(self, request: pb.ScoreRequest, context: grpc.ServicerContext) -> pb.ScoreResponse:
        n = len(request.items)
        if not 1 <= n <= MAX_ITEMS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"items: expected 1..{MAX_ITEMS} items, got {n}")
        prompts = [it.prompt for it in request.items]
        completions = [it.completion for it in request.items]
        metadata = [_ints(json_format.MessageToDict(it.metadata)) for it in request.items]
        with self._lock:
            self.calls += 1
        try:
            values = self.fn(prompts, completions, metadata)
        except Exception as exc:  # noqa: BLE001 - the user's function: its error goes to the trainer
            log.warning("reward %s raised %s: %s", self.name, type(exc).__name__, exc)
            context.abort(grpc.StatusCode.UNKNOWN, f"{self.name} raised {type(exc).__name__}: {exc}"[:2000])
        if hasattr(values, "tolist"):
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"{self.name} returned {got} for {n} items; expected a list of one number per item",
            )
        return pb.ScoreResponse(results=[_result(v) for v in values])


class RewardServer:
    """Host ``fn`` (a batched reward function, module docstring) for trainers.

    Args:
        fn: ``fn(prompts, completions, metadata) -> list of numbers``.
        host, port, advertise_host, max_workers, token, require_token, tls_cert, tls_key, tls_ca:
            as for :class:`~opentinker_client.hosting.server.EnvironmentServer`.
        timeout_s: seconds the trainer waits for one Score answer (``reward.timeout_s``).
        grace_s: seconds the trainer retries an unreachable server (``reward.grace_s``).
        max_consecutive_failures: failed calls in a row that end the task.

    Raises:
        InvalidArgumentError: ``fn`` is not callable, a bad token or TLS file, or options out of
            range (``err.field`` names it).
        OSError: the port cannot be bound.
    """

    def __init__(
        self,
        fn: RewardFn,
        *,
        host: str | None = None,
        port: int = 0,
        advertise_host: str | None = None,
        max_workers: int = 4,
        token: str | None = None,
        require_token: bool = True,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        timeout_s: float = 30.0,
        grace_s: float = 30.0,
        max_consecutive_failures: int = 3,
    ) -> None:
        if not callable(fn):
            raise InvalidArgumentError(f"reward: expected a callable, got {type(fn).__name__}", field="reward")
        self.fn = fn
        self.name = getattr(fn, "__qualname__", None) or type(fn).__name__
        self.host = host or _default_host()
        advertise = _advertised(advertise_host, self.host)
        self._token, credentials, roots = _access(token, require_token, tls_cert, tls_key, tls_ca)
        self.tls = credentials is not None
        self._options = {
            "timeout_s": float(timeout_s),
            "grace_s": float(grace_s),
            "max_consecutive_failures": int(max_consecutive_failures),
        }
        self._roots = roots
        self.servicer = RewardServicer(fn, self.name)
        self.auth = TokenInterceptor(self._token, self.name) if require_token else None
        self._server, self._health, bound = _bound_server(
            self.servicer, self.auth, self.host, port, credentials, max_workers, "opentinker-reward", "reward server"
        )
        self.port = bound
        self.endpoint = f"{_bracket(advertise)}:{bound}"
        self.reward_config  # validated now, as the scheduler will  # noqa: B018
        self._started = False
        self._stopped = threading.Event()

    @property
    def token(self) -> str:
        """The access token (``""`` with ``require_token=False``). Keep it secret."""
        return self._token

    @property
    def reward_config(self) -> dict[str, Any]:
        """The ``env_config.reward`` to submit: ``{"verifier": "client", "endpoint": ..., "token": ...}``.

        Raises:
            InvalidArgumentError: an option is out of range (as the scheduler would refuse it).
        """
        from opentinker_client.errors import from_spec_error
        from opentinker_common.spec import SpecError, parse_dataclass
        from opentinker_common.spec.prompts import RewardConfig

        cfg: dict[str, Any] = {"verifier": "client", "endpoint": self.endpoint, **self._options}
        if self._token:
            cfg["token"] = self._token
        if self.tls:
            cfg["tls"] = True
            if self._roots:
                cfg["tls_root_certificates"] = self._roots
        try:
            parse_dataclass(RewardConfig, cfg, "spec.env_config.reward")
        except SpecError as err:
            raise from_spec_error(err) from None
        return cfg

    def start(self) -> "RewardServer":
        """Start serving (idempotent). Returns self."""
        if not self._started:
            self._started = True
            self._server.start()
            if self._health is not None:
                from grpc_health.v1 import health_pb2

                self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
                self._health.set("", health_pb2.HealthCheckResponse.SERVING)
            log.info("serving reward %s at %s (%s)", self.name, self.endpoint, "TLS" if self.tls else "plaintext")
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving; calls in flight get ``grace`` seconds. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def __enter__(self) -> "RewardServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RewardServer({self.name}, endpoint={self.endpoint!r}, tls={self.tls}, stopped={self.stopped})"
