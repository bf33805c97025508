"""Client-hosted environments, trainer side: a ``gymnasium.Env`` over an EnvironmentService.

:func:`make_client_env` gives a ``gymnasium.Env`` whose ``reset``/``step`` are calls to the
user's client at ``config.endpoint`` (``opentinker.environment.v1``). Spaces come from the
config (``Discrete(action_space)``; ``Discrete(observation_space)`` or a flat
``Box(-inf, inf, (observation_space,))``) and are checked against what the client declares
(``Describe``) on the first call, so a mismatch fails the task at once.

Failures are :class:`~opentinker_trainer.context.UserError` (the task ends FAILED, not
retried; a retry cannot fix the user's environment), with these messages:

* the environment raised -> ``client environment Corr at host:port failed in step: Corr.step raised ValueError: ...``;
* no answer within ``timeout_s`` -> ``... did not answer step within timeout_s=2 s``;
* no EnvironmentService answered for longer than ``grace_s`` (client gone, unreachable, a TLS
  handshake that fails, another protocol on the port) -> ``... unreachable for grace_s=30 s: no
  EnvironmentService answered (...)``, with a TLS hint that depends on ``env_config.tls`` only.
  The text is the same whatever the transport said, so a task cannot probe what listens on the
  trainer's network; the transport error goes to the trainer's log. Calls are retried with
  backoff meanwhile. A client whose server comes back within the grace period has lost its
  instances, so the next Step fails with FAILED_PRECONDITION (a UserError too) unless it was a
  Reset. Errors with a message of their own are shown only once an EnvironmentService has
  answered at the endpoint.
* the access token is refused (UNAUTHENTICATED; not retried) -> ``the access token
  (env_config.token) did not match the environment server at host:port ...``.

Access: every call carries ``authorization: Bearer <env_config.token>`` (when the token is not
empty); with ``env_config.tls`` the channel is ``grpc.secure_channel`` trusting
``env_config.tls_root_certificates`` (PEM; empty = the system's roots). The token is never put in
a log line or an error message.

All environments of one worker process share one gRPC channel per endpoint and one session id
(a random UUID); each :func:`make_client_env` call takes the next ``env_index``.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from typing import Any

import grpc
import gymnasium
import numpy as np
import structlog
from google.protobuf import json_format

from opentinker.environment.v1 import environment_pb2 as pb
from opentinker.environment.v1 import environment_pb2_grpc as pb_grpc
from opentinker_trainer.context import UserError, abandon_point
from opentinker_common.net.grpc_options import message_limits

log = structlog.get_logger("opentinker.trainer.env")

__all__ = ["AccessRefused", "ClientEnv", "RemoteSession", "close_all_sessions", "make_client_env"]


class AccessRefused(UserError):
    """The client's server refused the access token (UNAUTHENTICATED): no retry can fix it."""


# UNAVAILABLE: nobody listens (client gone, network). CANCELLED: the client's server shut down with
# this call in flight (the trainer never cancels its own calls). Both: retry until grace_s.
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def channel_for(endpoint: str, *, tls: bool = False, root_certificates: str = "") -> grpc.Channel:
    """A channel to ``endpoint``: plaintext, or TLS trusting ``root_certificates`` (PEM text;
    ``""`` = the system's roots). gRPC's own retries are off (:meth:`RemoteSession.call` retries)."""
    options = [("grpc.enable_retries", 0), *message_limits()]
    if not tls:
        return grpc.insecure_channel(endpoint, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=root_certificates.encode("ascii", "replace") or None)
    return grpc.secure_channel(endpoint, creds, options=options)


class RemoteSession:
    """One channel and session id per endpoint in this process; calls with timeouts, retries on
    UNAVAILABLE for ``grace_s`` and errors mapped to :class:`UserError`."""

    _lock = threading.Lock()
    _sessions: dict[tuple[str, str, bool, str], "RemoteSession"] = {}  # (endpoint, token, tls, roots)

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float,
        grace_s: float,
        token: str = "",
        tls: bool = False,
        root_certificates: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s)
        self.tls = bool(tls)
        self.session_id = uuid.uuid4().hex
        # The token is a secret: kept only in the call metadata, never in a message or a repr.
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.channel = channel_for(endpoint, tls=tls, root_certificates=root_certificates)
        self.stub = pb_grpc.EnvironmentServiceStub(self.channel)
        self._indexes = itertools.count()
        self.name = "client environment"
        self.described: pb.DescribeResponse | None = None
        self._answered = False  # an EnvironmentService has answered here (its errors may be shown)

    def __repr__(self) -> str:
        return f"RemoteSession({self.endpoint!r}, tls={self.tls}, token={'set' if self._metadata else 'none'})"

    @classmethod
    def shared(
        cls,
        endpoint: str,
        *,
        timeout_s: float,
        grace_s: float,
        token: str = "",
        tls: bool = False,
        root_certificates: str = "",
    ) -> "RemoteSession":
        """The session of this process for ``endpoint`` with these credentials (made on first use)."""
        key = (endpoint, token, bool(tls), root_certificates)
        with cls._lock:
            s = cls._sessions.get(key)
            if s is None:
                s = cls._sessions[key] = cls(
                    endpoint,
                    timeout_s=timeout_s,
                    grace_s=grace_s,
                    token=token,
                    tls=tls,
                    root_certificates=root_certificates,
                )
            return s

    def next_index(self) -> int:
        with self._lock:
            return next(self._indexes)

    def call(self, method: str, request: Any) -> Any:
        """``stub.<method>(request)`` with the timeout; see the module docstring for errors.

        Raises:
            UserError: the environment raised, answered too late, or stayed unreachable.
        """
        fn = getattr(self.stub, method)
        first_down: float | None = None
        delay = 0.1
        what = method.lower()
        while True:
            try:
                response = _answer(fn.future(request, timeout=self.timeout_s, metadata=self._metadata))
                self._answered = True
                return response
            except grpc.RpcError as err:
                code = err.code()
                where = f"{self.name} at {self.endpoint}"
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    # A retry cannot fix a wrong token: fail now, naming the cause (never the token).
                    if self._metadata:
                        message = (
                            "the access token (env_config.token) did not match the environment server at "
                            f"{self.endpoint} "
                            f"({code.name}); each EnvironmentServer makes its own token when it starts, "
                            "so submit the task with the env_config of the server that is running"
                        )
                    else:
                        message = (
                            f"the environment server at {self.endpoint} requires an access token but the task's "
                            f"env_config.token is empty ({code.name}: {err.details()})"
                        )
                    raise AccessRefused(message) from None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and not self._answered:
                    raise UserError(self._unreachable(where, code, err.details(), waited=False)) from None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise UserError(
                        f"{where} did not answer {what} within timeout_s={self.timeout_s:g} s "
                        "(raise env_config.timeout_s if the environment is slow)"
                    ) from None
                if code in _RETRY_CODES:
                    now = time.monotonic()
                    first_down = now if first_down is None else first_down
                    if now - first_down >= self.grace_s:
                        raise UserError(self._unreachable(where, code, err.details())) from None
                    time.sleep(min(delay, max(0.0, self.grace_s - (now - first_down))))
                    delay = min(delay * 2, 2.0)
                    continue
                if not self._answered:  # not known to be an EnvironmentService: say nothing about what is there
                    raise UserError(self._unreachable(where, code, err.details(), waited=False)) from None
                raise UserError(f"{where} failed in {what}: {err.details()} ({code.name})") from None

    def _unreachable(self, where: str, code: grpc.StatusCode, details: str | None, *, waited: bool = True) -> str:
        """The task's error when no EnvironmentService answered at the endpoint. One text whatever
        the transport said (refused, reset, a TLS handshake, another protocol), so a task cannot
        be used to probe what listens on the trainer's network; the transport error goes to the
        trainer node's log for its operator."""
        log.warning("client environment unreachable", endpoint=self.endpoint, code=code.name, details=details or "")
        hint = (
            "or its TLS handshake failed: env_config.tls_root_certificates must be the CA that signed the server's "
            "certificate, the certificate must name the endpoint's host, and the server must serve TLS"
            if self.tls
            else "or it serves TLS while env_config.tls is false"
        )
        when = f" for grace_s={self.grace_s:g} s" if waited else ""
        return (
            f"{where} unreachable{when}: no EnvironmentService answered (the client that hosts it has gone away or "
            f"cannot be reached from this node, {hint}; the trainer node's log has the transport error)"
        )

    def describe(self) -> pb.DescribeResponse:
        if self.described is None:
            self.described = self.call("Describe", pb.DescribeRequest())
            if self.described.name:
                self.name = f"client environment {self.described.name}"
        return self.described

    def close(self) -> None:
        try:
            self.stub.Close(
                pb.CloseRequest(session_id=self.session_id), timeout=min(self.timeout_s, 5.0), metadata=self._metadata
            )
        except grpc.RpcError:
            pass  # the client may be gone already; nothing to release then


#: Seconds between looks at a stop while a call is waited for (:func:`_answer`).
_ABANDON_POLL_S = 0.2


def _answer(future: Any) -> Any:
    """The response of a call in flight. A step that a stop abandons while it waits
    (:func:`~opentinker_trainer.context.abandon_point`: a model host's tenant, whose stop no
    signal brings) cancels the call and leaves.

    Raises:
        grpc.RpcError: the call failed. StepAbandoned: see above.
    """
    try:
        while True:
            try:
                return future.result(timeout=_ABANDON_POLL_S)
            except grpc.FutureTimeoutError:
                abandon_point()
    except grpc.RpcError:
        raise
    except BaseException:  # StepAbandoned, also from a worker's SIGTERM handler
        future.cancel()
        raise


def _obs(observation: pb.Observation) -> Any:
    if observation.WhichOneof("value") == "box":
        return np.asarray(observation.box.values, dtype=np.float32)
    return int(observation.discrete)


def _space_text(space: pb.Space) -> str:
    if space.WhichOneof("kind") == "box":
        return f"Box({int(np.prod(space.box.shape))},)"
    return f"Discrete({space.discrete.n})"


class ClientEnv(gymnasium.Env):
    """A ``gymnasium.Env`` played by a client-hosted environment (one ``env_index``).

    Observations: ``int`` for Discrete, ``float32 [n]`` for Box. ``info`` is the client's dict.
    """

    metadata = {"render_modes": []}

    def __init__(self, config: Any, session: RemoteSession) -> None:
        self.config = config
        self.session = session
        self.env_index = session.next_index()
        self.action_space = gymnasium.spaces.Discrete(config.action_space)
        if config.observation_type == "box":
            self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (config.observation_space,), np.float32)
        else:
            self.observation_space = gymnasium.spaces.Discrete(config.observation_space)
        self.action_names = tuple(config.action_names)
        self._checked = False

    def _check_spaces(self) -> None:
        """Refuse a client whose declared spaces differ from the task's env_config."""
        if self._checked:
            return
        d = self.session.describe()
        want_act = pb.Space(discrete=pb.DiscreteSpace(n=self.config.action_space))
        if self.config.observation_type == "box":
            want_obs = pb.Space(box=pb.BoxSpace(shape=[self.config.observation_space]))
        else:
            want_obs = pb.Space(discrete=pb.DiscreteSpace(n=self.config.observation_space))
        for name, want, got in (
            ("action_space", want_act, d.action_space),
            ("observation_space", want_obs, d.observation_space),
        ):
            if _space_text(want) != _space_text(got):
                raise UserError(
                    f"env_config.{name}: the task says {_space_text(want)} but {self.session.name} at "
                    f"{self.session.endpoint} declares {_space_text(got)}"
                )
        if not self.action_names and d.action_names:
            self.action_names = tuple(d.action_names)
        self._checked = True

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._check_spaces()
        item = pb.ResetItem(env_index=self.env_index)
        if seed is not None:
            item.seed = int(seed)
        res = self.session.call("Reset", pb.ResetRequest(session_id=self.session.session_id, items=[item])).results[0]
        return _obs(res.observation), json_format.MessageToDict(res.info)

    def step(self, action: Any):
        a = int(np.asarray(action).item())
        if not self.action_space.contains(a):
            raise ValueError(f"action {action!r} is outside {self.action_space}")
        req = pb.StepRequest(
            session_id=self.session.session_id,
            items=[pb.StepItem(env_index=self.env_index, action=pb.Action(discrete=a))],
        )
        res = self.session.call("Step", req).results[0]
        return (
            _obs(res.observation),
            float(res.reward),
            bool(res.terminated),
            bool(res.truncated),
            json_format.MessageToDict(res.info),
        )

    def close(self) -> None:
        pass  # the session (shared by this process's envs) is closed by close_all_sessions()


def close_all_sessions() -> None:
    """Close every session this process opened (drops the client's instances)."""
    with RemoteSession._lock:
        sessions = list(RemoteSession._sessions.values())
        RemoteSession._sessions.clear()
    for s in sessions:
        s.close()
        s.channel.close()


def make_client_env(config: Any, *, seed: int | None) -> gymnasium.Env:
    """A ``gymnasium.Env`` over the client-hosted environment of ``config``
    (a :class:`~opentinker_common.spec.ClientEnvConfig`).

    Args:
        seed: when not None, the environment is reset once with it (as
            :func:`opentinker_trainer.envs.gym.make_env` does for gymnasium ids) and its spaces
            are seeded.

    Raises:
        UserError: declared spaces differ from the config, or the client fails/times out/is
            unreachable (see the module docstring).
    """
    session = RemoteSession.shared(
        config.endpoint,
        timeout_s=config.timeout_s,
        grace_s=config.grace_s,
        token=getattr(config, "token", ""),
        tls=getattr(config, "tls", False),
        root_certificates=getattr(config, "tls_root_certificates", ""),
    )
    env: gymnasium.Env = ClientEnv(config, session)
    if config.max_episode_steps is not None:
        env = gymnasium.wrappers.TimeLimit(env, max_episode_steps=int(config.max_episode_steps))
    if seed is None and config.seed is not None:
        seed = config.seed
    if seed is not None:
        env.reset(seed=int(seed))
        env.action_space.seed(int(seed))
        env.observation_space.seed(int(seed))
    return env
