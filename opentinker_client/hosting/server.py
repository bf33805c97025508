"""Serve a user's :class:`~opentinker_client.Environment` subclass to trainers (client-hosted env).

The user's environment stays in the user's process. :class:`EnvironmentServer` hosts it over
``opentinker.environment.v1.EnvironmentService`` (a threaded gRPC server with
``grpc.health.v1.Health`` and server reflection when ``grpcio-health-checking`` /
``grpcio-reflection`` are installed), and the task's ``env_config`` names its endpoint and the
access token the trainer must send::

    {"env_id": "client", "endpoint": "127.0.0.1:50123", "action_space": 4,
     "observation_space": 16, "timeout_s": 30.0, "grace_s": 30.0, "token": "<43 characters>"}

Normally :meth:`RLClient.submit_task <opentinker_client.RLClient.submit_task>` does all of this
when given the environment object, or :meth:`RLClient.serve_environment` when the lifetime should
be explicit.

Access: every EnvironmentService call must carry ``authorization: Bearer <token>``
(:mod:`opentinker_client.hosting.auth`); otherwise it is answered ``UNAUTHENTICATED``. Health and
reflection stay open. With ``tls_cert``/``tls_key`` the port speaks TLS only.

Instances: each ``(session_id, env_index)`` gets its own instance, made on its first Reset by the
``factory`` (default: ``copy.deepcopy`` of the environment object that was served, so
constructor arguments carry over). A session is one trainer attempt's environments; calls on one
session run one at a time (:mod:`opentinker_client.hosting.service`).

Errors the trainer sees (see environment.proto): no or another token -> ``UNAUTHENTICATED``; the
user's ``reset``/``step`` raising -> ``UNKNOWN`` whose message is
``"<ClassName>.step raised ValueError: <text>"``; an observation outside the declared space or a
malformed step result -> ``INTERNAL`` saying what was returned; an action outside the action
space -> ``INVALID_ARGUMENT``; Step before Reset or after the episode ended ->
``FAILED_PRECONDITION``.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import threading
from concurrent import futures
from typing import Any, Callable

import grpc

from opentinker.environment.v1 import environment_pb2_grpc as pb_grpc
from opentinker_client.errors import InvalidArgumentError
from opentinker_client.hosting.auth import TokenInterceptor, checked_token, server_credentials
from opentinker_client.hosting.service import (  # re-exported: the public import path
    MAX_ENVS_PER_SESSION,
    MAX_SESSIONS,
    SERVICE_NAME,
    EnvError,
    EnvironmentServicer,
    Spaces,
    info_struct,
)
from opentinker_common.net.grpc_options import message_limits

__all__ = [
    "EnvironmentServer",
    "EnvError",
    "DEFAULT_HOST_ENV",
    "SERVICE_NAME",
    # defined in opentinker_client.hosting.service; importable from here too
    "EnvironmentServicer",
    "Spaces",
    "info_struct",
    "MAX_SESSIONS",
    "MAX_ENVS_PER_SESSION",
]

log = logging.getLogger("opentinker_client.hosting.server")


#: Environment variable naming the interface to bind (default 127.0.0.1, this machine only).
DEFAULT_HOST_ENV = "OPENTINKER_ENV_HOST"
#: Environment variable naming the host trainers should dial when it differs from the bind host.
ADVERTISE_HOST_ENV = "OPENTINKER_ENV_ADVERTISE_HOST"


def _default_host() -> str:
    return os.environ.get(DEFAULT_HOST_ENV) or "127.0.0.1"


class EnvironmentServer:
    """Host ``env`` (an :class:`~opentinker_client.Environment` subclass instance, or any object
    with gymnasium's ``reset(seed=None)`` / ``step(action)``) for trainers.

    Args:
        env: the environment; its ``action_space`` (int) and ``observation_space`` (int) are the
            declared sizes, its ``options`` (``observation_type``, ``action_names``, ``timeout_s``,
            ``grace_s``, ``seed``, ``max_episode_steps``) go into the env_config.
        factory: makes one instance per ``(session, env_index)``; default ``copy.deepcopy(env)``.
        host: interface to bind; default ``$OPENTINKER_ENV_HOST`` or ``127.0.0.1`` (this machine
            only). On a cluster bind ``0.0.0.0`` (or the interface trainers reach).
        port: 0 picks a free port.
        advertise_host: the host trainers dial (the endpoint in env_config); default
            ``$OPENTINKER_ENV_ADVERTISE_HOST``, else ``host``, else this machine's FQDN when
            ``host`` is a wildcard (``0.0.0.0``, ``::``).
        max_workers: threads serving calls (calls of one session still run one at a time).
        token: the access token trainers must send (``authorization: Bearer <token>``); default
            a random ``secrets.token_urlsafe(32)``. Given: 16..256 url-safe characters. It goes
            into :attr:`env_config` (so into the task spec) and is never logged.
        require_token: ``False`` serves without any token check — for local experiments only,
            on a port nobody else can reach (anyone who can connect could then drive your
            environment).
        tls_cert, tls_key: PEM paths of the server certificate (chain) and its private key, both
            or neither; with them the port speaks TLS only (``add_secure_port``). The
            certificate must name the host trainers dial (``advertise_host``).
        tls_ca: PEM path of the CA certificate that signed ``tls_cert``; its text goes to the
            trainers as ``env_config.tls_root_certificates`` (at most 64 KiB). ``None`` = they
            trust their system's roots (a publicly signed certificate).

    Raises:
        InvalidArgumentError: the declared spaces or options, the token or a TLS file are not
            valid (``err.field`` names it: ``spec.env_config.action_space``, ``token``,
            ``tls_key`` ...).
        OSError: the port cannot be bound.
    """

    def __init__(
        self,
        env: Any,
        *,
        factory: Callable[[], Any] | None = None,
        host: str | None = None,
        port: int = 0,
        advertise_host: str | None = None,
        max_workers: int = 8,
        token: str | None = None,
        require_token: bool = True,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        from opentinker_client.environment import client_env_config

        self.env = env
        self.host = host or _default_host()
        advertise = _advertised(advertise_host, self.host)
        self._advertise = advertise
        # Validate everything (declared config with a placeholder endpoint, token, TLS files)
        # before binding anything.
        cfg = client_env_config(env, endpoint=f"{_bracket(advertise)}:1")
        self._token, credentials, roots = _access(token, require_token, tls_cert, tls_key, tls_ca)
        self.tls = credentials is not None
        self._security = {"token": self._token, "tls": self.tls, "tls_root_certificates": roots}
        self.spaces = Spaces(cfg.action_space, cfg.observation_space, cfg.observation_type, cfg.action_names)
        self.factory = factory or (lambda: copy.deepcopy(env))
        self.name = type(env).__name__
        self.servicer = EnvironmentServicer(self.factory, self.spaces, self.name)
        self.auth = TokenInterceptor(self._token, self.name) if require_token else None
        if not require_token:
            log.warning(
                "serving %s WITHOUT an access token (require_token=False): anyone who can reach the port can drive it",
                self.name,
            )
        self._server, self._health, bound = _bound_server(
            self.servicer, self.auth, self.host, port, credentials, max_workers, "opentinker-env", "environment server"
        )
        self.port = bound
        self.endpoint = f"{_bracket(advertise)}:{bound}"
        self._config = self._validated(client_env_config(env, endpoint=self.endpoint))
        self._started = False
        self._stopped = threading.Event()

    def _validated(self, cfg: Any) -> Any:
        """``cfg`` with the token and TLS fields, validated as the scheduler will."""
        from opentinker_client.errors import from_spec_error
        from opentinker_common.spec import SpecError, jsonable, validate_env_config

        data = {k: v for k, v in jsonable(cfg.__dict__).items() if v is not None}
        data.update(self._security)
        try:
            return validate_env_config(data)
        except SpecError as err:
            raise from_spec_error(err) from None

    @property
    def token(self) -> str:
        """The access token (``""`` with ``require_token=False``). Keep it secret."""
        return self._token

    @property
    def env_config(self) -> dict[str, Any]:
        """The ``env_config`` to submit: ``{"env_id": "client", "endpoint": ..., "token": ..., ...}``
        (``tls``/``tls_root_certificates`` only when serving TLS; ``token`` only when required)."""
        from opentinker_common.spec import jsonable

        defaults = {"token": "", "tls": False, "tls_root_certificates": ""}
        return {
            k: v
            for k, v in jsonable(self._config.__dict__).items()
            if v is not None and v != [] and not (k in defaults and v == defaults[k])
        }

    def start(self) -> "EnvironmentServer":
        """Start serving (idempotent). Returns self."""
        if not self._started:
            self._started = True
            self._server.start()
            if self._health is not None:
                self._health.set(SERVICE_NAME, _serving())
                self._health.set("", _serving())
            log.info(
                "serving %s at %s (%s, %s)",
                self.name,
                self.endpoint,
                "TLS" if self.tls else "plaintext",
                "access token required" if self.auth is not None else "NO access token",
            )
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving; calls in flight get ``grace`` seconds. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        log.info("stopped serving %s at %s", self.name, self.endpoint)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop_when_done(self, is_done: Callable[[], bool], *, poll_interval: float = 2.0) -> threading.Thread:
        """Stop once ``is_done()`` returns true (polled every ``poll_interval`` seconds in a daemon
        thread; exceptions from it count as "not yet"). Returns the thread."""

        def watch() -> None:
            while not self._stopped.wait(poll_interval):
                try:
                    if is_done():
                        break
                except Exception:  # noqa: BLE001 - scheduler briefly unreachable: keep serving
                    continue
            self.stop()

        t = threading.Thread(target=watch, name=f"opentinker-env-watch-{self.port}", daemon=True)
        t.start()
        return t

    def __enter__(self) -> "EnvironmentServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EnvironmentServer({self.name}, endpoint={self.endpoint!r}, tls={self.tls}, stopped={self.stopped})"


def _advertised(advertise_host: str | None, host: str) -> str:
    """The host trainers dial: ``advertise_host``, else ``$OPENTINKER_ENV_ADVERTISE_HOST``, else
    ``host``; a wildcard (``0.0.0.0``, ``::``) becomes this machine's FQDN."""
    advertise = advertise_host or os.environ.get(ADVERTISE_HOST_ENV) or host
    return socket.getfqdn() if advertise in ("0.0.0.0", "::", "[::]", "") else advertise


def _access(token, require_token: bool, tls_cert, tls_key, tls_ca) -> tuple[str, Any, str]:
    """``(token, server credentials or None, CA text for trainers)`` of a hosted server's options.

    Raises:
        InvalidArgumentError: a bad token, a token with ``require_token=False``, or bad TLS files.
    """
    if require_token:
        checked = checked_token(token)
    elif token is not None:
        raise InvalidArgumentError("token: not used with require_token=False; give one or the other", field="token")
    else:
        checked = ""
    credentials, roots = server_credentials(tls_cert, tls_key, tls_ca)
    return checked, credentials, roots


def _bound_server(servicer, auth, host: str, port: int, credentials, max_workers: int, threads: str, what: str):
    """A gRPC server of ``servicer`` (the EnvironmentService, with health and reflection) bound to
    ``host:port``: ``(server, health servicer, bound port)``.

    Raises:
        OSError: the port cannot be bound (naming ``what``).
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=threads),
        interceptors=[auth] if auth is not None else None,
        options=[("grpc.so_reuseport", 0), *message_limits()],
    )
    pb_grpc.add_EnvironmentServiceServicer_to_server(servicer, server)
    health = _add_health_and_reflection(server)
    address = f"{_bracket(host)}:{int(port)}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # newer grpcio raises instead of returning 0
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind the {what} to {host}:{port}")
    return server, health, bound


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _serving():
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckResponse.SERVING


def _add_health_and_reflection(server: grpc.Server):
    """Register Health and reflection when their packages are installed (they are with the
    scheduler/trainer extras); returns the health servicer or None."""
    try:
        from grpc_health.v1 import health, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection
    except ImportError:  # client-only install without grpcio-health-checking / grpcio-reflection
        return None
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return servicer
