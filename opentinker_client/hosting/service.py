"""The ``EnvironmentService`` servicer of a client-hosted environment: request validation, the
user's ``reset``/``step`` called per ``(session_id, env_index)`` instance, results checked against
the declared spaces. The server around it (ports, TLS, access token, lifetime) is
:mod:`opentinker_client.hosting.server`; the status codes are listed there and in environment.proto.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from google.protobuf import json_format, struct_pb2

from opentinker.environment.v1 import environment_pb2 as pb
from opentinker.environment.v1 import environment_pb2_grpc as pb_grpc

__all__ = [
    "EnvError",
    "EnvironmentServicer",
    "Spaces",
    "info_struct",
    "SERVICE_NAME",
    "MAX_SESSIONS",
    "MAX_ENVS_PER_SESSION",
]

log = logging.getLogger("opentinker_client.hosting.server")

SERVICE_NAME = "opentinker.environment.v1.EnvironmentService"
MAX_SESSIONS = 64
MAX_ENVS_PER_SESSION = 1024


class EnvError(Exception):
    """A request the service refuses; carries the gRPC status code to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _bad_return(where: str, what: str) -> EnvError:
    """INTERNAL: the user's ``where`` (``Corridor.step`` ...) returned ``what`` (what it returned
    and what was expected, for a person to read)."""
    return EnvError(grpc.StatusCode.INTERNAL, f"{where} returned {what}")


# --- conversions ------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """``info`` as JSON-able data: numpy scalars/arrays become numbers/lists, the rest ``str``."""

    def default(o: Any) -> Any:
        if hasattr(o, "tolist"):
            return o.tolist()
        if hasattr(o, "item"):
            return o.item()
        return str(o)

    return json.loads(json.dumps(value, default=default, allow_nan=True))


def info_struct(info: Any) -> struct_pb2.Struct:
    """A ``google.protobuf.Struct`` of the ``info`` dict (non-dicts give an empty Struct)."""
    s = struct_pb2.Struct()
    if isinstance(info, dict) and info:
        data = _jsonable({str(k): v for k, v in info.items()})
        # Struct cannot carry NaN/inf as numbers; send them as strings.
        json_format.ParseDict(_finite(data), s)
    return s


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _flatten(value: Any) -> list[float]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        out: list[float] = []
        for v in value:
            out.extend(_flatten(v))
        return out
    return [float(value)]


@dataclass(frozen=True)
class Spaces:
    """Declared spaces: ``Discrete(action_n)`` actions; ``Discrete(obs_n)`` or a flat ``Box`` of
    ``obs_n`` floats as observations."""

    action_n: int
    obs_n: int
    obs_type: str = "discrete"
    action_names: tuple[str, ...] = ()

    def observation(self, value: Any, where: str) -> pb.Observation:
        """Check ``value`` against the observation space and wrap it.

        Raises:
            EnvError: INTERNAL, naming ``where`` and what was returned.
        """
        if self.obs_type == "discrete":
            try:
                if isinstance(value, bool):
                    raise TypeError
                if hasattr(value, "item") and getattr(value, "size", 1) == 1:
                    value = value.item()
                v = operator.index(value)
            except TypeError:
                raise _bad_return(
                    where, f"observation {value!r}: expected an integer in [0, {self.obs_n}) (Discrete({self.obs_n}))"
                ) from None
            if not 0 <= v < self.obs_n:
                raise _bad_return(
                    where, f"observation {v}: outside the declared observation_space Discrete({self.obs_n})"
                )
            return pb.Observation(discrete=v)
        try:
            flat = _flatten(value)
        except (TypeError, ValueError):
            raise _bad_return(where, f"observation {value!r}: expected {self.obs_n} numbers (Box)") from None
        if len(flat) != self.obs_n:
            raise _bad_return(
                where, f"an observation of {len(flat)} numbers: the declared observation_space has {self.obs_n}"
            )
        return pb.Observation(box=pb.BoxValue(shape=[self.obs_n], values=flat))

    def action(self, action: pb.Action) -> int:
        """The discrete action of ``action``.

        Raises:
            EnvError: INVALID_ARGUMENT when it is not an integer in ``[0, action_n)``.
        """
        if action.WhichOneof("value") != "discrete":
            raise EnvError(
                grpc.StatusCode.INVALID_ARGUMENT, f"action: expected a discrete action in [0, {self.action_n})"
            )
        if not 0 <= action.discrete < self.action_n:
            raise EnvError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"action: expected an integer in [0, {self.action_n}) (Discrete({self.action_n})), got "
                f"{action.discrete}",
            )
        return int(action.discrete)

    def describe(self, name: str) -> pb.DescribeResponse:
        obs = (
            pb.Space(discrete=pb.DiscreteSpace(n=self.obs_n))
            if self.obs_type == "discrete"
            else pb.Space(box=pb.BoxSpace(shape=[self.obs_n]))
        )
        return pb.DescribeResponse(
            action_space=pb.Space(discrete=pb.DiscreteSpace(n=self.action_n)),
            observation_space=obs,
            action_names=list(self.action_names),
            name=name,
        )


# --- the service ------------------------------------------------------------------------------


@dataclass
class _Session:
    lock: threading.Lock = field(default_factory=threading.Lock)
    envs: dict[int, Any] = field(default_factory=dict)
    running: dict[int, bool] = field(default_factory=dict)


class EnvironmentServicer(pb_grpc.EnvironmentServiceServicer):
    """``EnvironmentService`` over instances made by ``factory``; see the module docstring."""

    def __init__(self, factory: Callable[[], Any], spaces: Spaces, name: str) -> None:
        self.factory = factory
        self.spaces = spaces
        self.name = name
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    # plumbing
    def _session(self, session_id: str, *, create: bool) -> _Session:
        if not session_id:
            raise EnvError(grpc.StatusCode.INVALID_ARGUMENT, "session_id: expected a non-empty string")
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None and create:
                if len(self._sessions) >= MAX_SESSIONS:
                    raise EnvError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {MAX_SESSIONS} sessions at once; Close old ones"
                    )
                s = self._sessions[session_id] = _Session()
            return s  # type: ignore[return-value]

    @staticmethod
    def _indexes(items: Any) -> list[int]:
        if not items:
            raise EnvError(grpc.StatusCode.INVALID_ARGUMENT, "items: expected at least one env_index")
        idx = [int(i.env_index) for i in items]
        if len(set(idx)) != len(idx):
            raise EnvError(grpc.StatusCode.INVALID_ARGUMENT, "items: each env_index at most once per request")
        if max(idx) >= MAX_ENVS_PER_SESSION:
            raise EnvError(
                grpc.StatusCode.INVALID_ARGUMENT, f"env_index: expected < {MAX_ENVS_PER_SESSION}, got {max(idx)}"
            )
        return idx

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except EnvError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's code: report it to the trainer
            log.warning("%s raised %s: %s", what, type(exc).__name__, exc)
            raise EnvError(grpc.StatusCode.UNKNOWN, f"{what} raised {type(exc).__name__}: {exc}") from exc

    def _handle(self, context: grpc.ServicerContext, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except EnvError as err:
            context.abort(err.code, err.message)

    # RPCs
    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DescribeResponse:
        return self.spaces.describe(self.name)

    def Reset(self, request: pb.ResetRequest, context: grpc.ServicerContext) -> pb.ResetResponse:
        def run() -> pb.ResetResponse:
            idx = self._indexes(request.items)
            session = self._session(request.session_id, create=True)
            out = pb.ResetResponse()
            with session.lock:
                for item, i in zip(request.items, idx):
                    env = session.envs.get(i)
                    if env is None:
                        env = session.envs[i] = self._call(f"creating {self.name}", self.factory)
                    seed = item.seed if item.HasField("seed") else None
                    result = self._call(f"{self.name}.reset", lambda: env.reset(seed=seed))
                    obs, info = (
                        result
                        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)
                        else (result, {})
                    )
                    session.running[i] = True
                    out.results.append(
                        pb.ResetResult(
                            env_index=i,
                            observation=self.spaces.observation(obs, f"{self.name}.reset"),
                            info=info_struct(info),
                        )
                    )
            return out

        return self._handle(context, run)

    def Step(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        def run() -> pb.StepResponse:
            idx = self._indexes(request.items)
            session = self._session(request.session_id, create=False)
            if session is None:
                raise EnvError(grpc.StatusCode.FAILED_PRECONDITION, f"session {request.session_id!r}: Reset first")
            actions = [self.spaces.action(item.action) for item in request.items]
            out = pb.StepResponse()
            with session.lock:
                for i in idx:
                    if not session.running.get(i):
                        raise EnvError(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"env_index {i}: no episode running (Reset it first; an episode ends when "
                            "terminated or truncated)",
                        )
                for i, action in zip(idx, actions):
                    env = session.envs[i]
                    where = f"{self.name}.step"
                    result = self._call(where, lambda: env.step(action))
                    if not (isinstance(result, tuple) and len(result) == 5):
                        raise _bad_return(
                            where,
                            f"{type(result).__name__} {result!r:.200}: expected a tuple "
                            "(observation, reward, terminated, truncated, info)",
                        )
                    obs, reward, terminated, truncated, info = result
                    try:
                        reward = float(reward)
                    except (TypeError, ValueError):
                        raise _bad_return(where, f"reward {reward!r}: expected a number") from None
                    if not math.isfinite(reward):
                        raise _bad_return(where, f"reward {reward!r}: expected a finite number")
                    terminated, truncated = bool(terminated), bool(truncated)
                    if terminated or truncated:
                        session.running[i] = False
                    out.results.append(
                        pb.StepResult(
                            env_index=i,
                            observation=self.spaces.observation(obs, where),
                            reward=reward,
                            terminated=terminated,
                            truncated=truncated,
                            info=info_struct(info),
                        )
                    )
            return out

        return self._handle(context, run)

    def Close(self, request: pb.CloseRequest, context: grpc.ServicerContext) -> pb.CloseResponse:
        with self._lock:
            session = self._sessions.pop(request.session_id, None)
        if session is not None:
            with session.lock:
                for env in session.envs.values():
                    close = getattr(env, "close", None)
                    if callable(close):
                        try:
                            close()
                        except Exception as exc:  # noqa: BLE001 - closing is best effort
                            log.warning("%s.close raised %s: %s", self.name, type(exc).__name__, exc)
        return pb.CloseResponse()

    def session_count(self) -> int:
        with self._lock:
            return len(self._sessions)
