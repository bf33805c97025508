"""The serving half of :class:`~opentinker_client.client.RLClient`: hosting a client-side
environment for trainers (:meth:`ServingMixin.serve_environment`) and serving a trained adapter
(:meth:`ServingMixin.serve`). Mixed into ``RLClient``; it uses its channel, key and CA."""

from __future__ import annotations

import os
from typing import Any

from opentinker_client.environment import Environment
from opentinker_client.errors import OpenTinkerError

__all__ = ["ServingMixin"]


class ServingMixin:
    """``RLClient`` methods that start servers or clients of servers on trainer nodes."""

    def serve_environment(
        self,
        env: Environment,
        *,
        host: str | None = None,
        port: int = 0,
        advertise_host: str | None = None,
        factory: Any = None,
        token: str | None = None,
        require_token: bool = True,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> Any:
        """Serve a client-hosted environment (a subclass of :class:`Environment` that defines
        ``reset``/``step``) to trainers, and return the started
        :class:`~opentinker_client.hosting.server.EnvironmentServer`.

        Use as a context manager for an explicit lifetime; submit ``server.env_config``::

            with client.serve_environment(MyEnv()) as server:
                task_id = client.submit_task(env_config=server.env_config, workload_type="full_rl")
                client.wait(task_id)

        It stops on leaving the ``with`` block, on ``server.stop()`` or on :meth:`close`.

        Args:
            host: interface to bind; default ``$OPENTINKER_ENV_HOST`` or ``127.0.0.1``. Trainers
                on other machines need ``0.0.0.0`` (or the interface they reach) here.
            port: 0 picks a free port.
            advertise_host: the host trainers dial, when it differs from ``host``.
            factory: makes one instance per trainer env (default: a deep copy of ``env``).
            token: the access token trainers must send; default a random one
                (``secrets.token_urlsafe(32)``). It goes into ``server.env_config`` (the task
                spec) and is never logged.
            require_token: ``False`` serves without a token: local experiments only.
            tls_cert, tls_key: PEM paths of the server certificate and key (both or neither):
                serve TLS only. The certificate must name the host trainers dial.
            tls_ca: PEM path of the CA that signed ``tls_cert``; this client reads it and sends
                its text to trainers (``env_config.tls_root_certificates``). ``None``: trainers
                trust their system's roots.

        Raises:
            InvalidArgumentError: missing or bad declared spaces/options, a bad token or TLS
                file (``err.field`` names it).
            OSError: the port cannot be bound.
        """
        from opentinker_client.hosting.server import EnvironmentServer

        if self._closed:
            raise OpenTinkerError("this RLClient is closed")
        server = EnvironmentServer(
            env, host=host, port=port, advertise_host=advertise_host, factory=factory,
            token=token, require_token=require_token, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
        ).start()  # fmt: skip
        self._env_servers.append(server)
        return server

    def serve(
        self,
        task_id: str,
        *,
        gpu_count: int = 0,
        ttl: float = 3600.0,
        max_resident_adapters: int = 8,
        timeout: float = 600.0,
        root_certificates: str | os.PathLike | None = None,
    ):
        """Serve the adapter of a finished ``lora_finetune`` or ``sft`` task, in one call.

        Reuses a running (or queued) ``inference`` task for the same base model, else submits
        one (``ttl`` seconds, ``gpu_count`` GPUs), waits until it serves, and returns an
        :class:`~opentinker_client.inference.InferenceClient` bound to this task's adapter
        (``client.generate(...)``; ``adapter=None`` on a call asks the base model). The
        returned client sends this client's API key; for an ``https://`` endpoint it trusts
        ``root_certificates`` (the CA of the inference servers' certificate; default: this
        client's CA, else ``$OPENTINKER_TLS_CA``, else the system's roots).

        Before it returns, it makes one ``ListAdapters`` call on the server, so a wrong CA, a
        TLS/plaintext mix-up or a refused key fails here rather than on the first request.

        Raises:
            NotFoundError: no such task. FailedPreconditionError: not an adapter task, not
            finished, or no checkpoint. TaskFailedError: the inference task ended before
            serving. DeadlineExceededError: not serving within ``timeout`` seconds.
            UnavailableError, UnauthenticatedError, PermissionDeniedError: the check call failed
            (certificate, TLS mode, key).
        """
        from opentinker_client.inference import serve_task

        self._check_task_id(task_id)
        return serve_task(
            self,
            task_id,
            gpu_count=gpu_count,
            ttl=ttl,
            max_resident_adapters=max_resident_adapters,
            timeout=timeout,
            root_certificates=root_certificates,
        )
