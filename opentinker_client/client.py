"""``RLClient``: submit tasks to the OpenTinker scheduler and follow them.

The seed's loop works as written::

    from opentinker_client import RLClient, Environment

    env = Environment(action_space=4, observation_space=100)
    client = RLClient(scheduler_url="http://scheduler-host:8888")
    task_id = client.submit_task(env_config=env.to_dict(), workload_type="lora_finetune", gpu_count=1)
    while not client.is_task_complete(task_id):
        metrics = client.get_metrics(task_id)
        print(f"Loss: {metrics['loss']:.4f}, Reward: {metrics['reward']:.2f}")

Around it: :meth:`RLClient.submit_config` (YAML task configs), :meth:`RLClient.watch` (an iterator of
events that survives scheduler restarts), :meth:`RLClient.wait`, :meth:`RLClient.cancel`.
Every error is an :class:`~opentinker_client.errors.OpenTinkerError` subclass carrying the gRPC
status code.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import random
import threading
import time
import uuid
from typing import Any, Iterable, Iterator, Mapping

import grpc

from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker_client.config import TaskConfig, load_task_config
from opentinker_client.convert import (
    NodeInfo,
    TaskEvent,
    TaskInfo,
    event_from_proto,
    metric_points,
    node_from_proto,
    state_enum,
    task_from_proto,
)
from opentinker_client.environment import Environment
from opentinker_client.errors import (
    SCHEDULER_PLAINTEXT_HINT,
    DeadlineExceededError,
    InvalidArgumentError,
    OpenTinkerError,
    TaskFailedError,
    UnavailableError,
    from_rpc_error,
)
from opentinker_client.client_data import DataMixin
from opentinker_client.client_serving import ServingMixin
from opentinker_common.net.url import parse_scheduler_address
from opentinker_common.net.grpc_options import client_keepalive, message_limits

__all__ = ["RLClient", "DEFAULT_SCHEDULER_URL"]

log = logging.getLogger("opentinker_client")

#: Used when neither ``scheduler_url`` nor the ``SCHEDULER_URL`` environment variable is set.
DEFAULT_SCHEDULER_URL = "localhost:8888"

_SERVICE = "opentinker.scheduler.v1.SchedulerService"

# Unary RPCs are retried by gRPC itself on UNAVAILABLE (scheduler restarting, connection refused).
# All of them are idempotent; SubmitTask is made so by the request_id the client always sends.
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [
                    {"service": _SERVICE, "method": m}
                    for m in (
                        "SubmitTask",
                        "GetTask",
                        "ListTasks",
                        "CancelTask",
                        "GetMetrics",
                        "ListNodes",
                        "ListCheckpoints",
                    )
                ],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.2s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def _channel_options() -> list[tuple[str, Any]]:
    from importlib import metadata

    try:
        version = metadata.version("opentinker")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        version = "dev"
    return [
        # Keepalive only while a call is open (a watch stream); the scheduler permits pings every 10 s.
        *client_keepalive(),
        # Keep pinging on a quiet watch stream (the default stops after 2 pings without data).
        ("grpc.http2.max_pings_without_data", 0),
        *message_limits(),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", _SERVICE_CONFIG),
        ("grpc.primary_user_agent", f"opentinker-client/{version}"),
    ]


class _Backoff:
    """Exponential backoff with +-20 % jitter."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial, self.maximum = initial, maximum
        self.current = initial

    def reset(self) -> None:
        self.current = self.initial

    def next(self) -> float:
        delay = self.current * random.uniform(0.8, 1.2)
        self.current = min(self.current * 2, self.maximum)
        return delay


class RLClient(ServingMixin, DataMixin):
    """A connection to the OpenTinker scheduler.

    Args:
        scheduler_url: ``http://host:port`` (the seed's form), ``grpc://host:port``, ``host:port``
            or ``[::1]:port``. ``None`` reads the ``SCHEDULER_URL`` environment variable, else
            ``localhost:8888``. ``https://host:port`` (or ``grpcs://``) means TLS: with
            ``root_certificates`` when given, else the system's trusted roots.
        timeout: deadline of each unary call, in seconds (it includes gRPC's own retries on
            ``UNAVAILABLE``). Streams (:meth:`watch`) have no deadline.
        api_key: sent as ``authorization: Bearer <key>`` on every call. ``None`` reads
            ``OPENTINKER_API_KEY``; an empty string sends none. Surrounding whitespace (the
            newline of a key read from a file) is stripped.
        min_poll_interval: seconds that :meth:`is_task_complete` keeps between two calls for the
            same task, sleeping if it is called sooner, so that the seed's tight
            ``while not client.is_task_complete(...)`` loop polls about once a second instead
            of flooding the scheduler. 0 turns this off.
        root_certificates: PEM file of the CA that signed the scheduler's TLS certificate; turns
            TLS on. ``None`` reads ``OPENTINKER_TLS_CA``; unset = plaintext (or, with an
            ``https://`` URL, TLS checked against the system roots).
        client_cert, client_key: PEM files for mTLS (schedulers with ``tls.client_auth: all``);
            ``None`` reads ``OPENTINKER_TLS_CERT`` / ``OPENTINKER_TLS_KEY``.

    Raises:
        ValueError: ``scheduler_url`` is not a valid address (see
            :func:`~opentinker_common.net.url.parse_scheduler_address`), a TLS file cannot be read
            or is not PEM, or ``api_key`` holds inner whitespace or control characters (the
            message names ``api_key``, never the key).

    The connection is made lazily; an unreachable scheduler shows up as
    :class:`~opentinker_client.errors.UnavailableError` on the first call. Use as a context
    manager, or call :meth:`close`. Safe to share between threads.
    """

    #: Reconnect backoff of :meth:`watch` (first delay, largest delay), in seconds.
    reconnect_backoff: tuple[float, float] = (0.5, 10.0)

    def __init__(
        self,
        scheduler_url: str | None = None,
        *,
        timeout: float = 30.0,
        api_key: str | None = None,
        min_poll_interval: float = 1.0,
        root_certificates: str | os.PathLike | None = None,
        client_cert: str | os.PathLike | None = None,
        client_key: str | os.PathLike | None = None,
    ) -> None:
        if scheduler_url is None:
            scheduler_url = os.environ.get("SCHEDULER_URL") or DEFAULT_SCHEDULER_URL
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.scheduler_url = scheduler_url
        address = parse_scheduler_address(scheduler_url)  # https:// / grpcs://: TLS even without a CA (system roots)
        self.target = address.target
        self.timeout = float(timeout)
        self.min_poll_interval = float(min_poll_interval)
        from opentinker_common.net.tls import channel_credentials
        from opentinker_common.net.bearer import clean_api_key

        if api_key is None:
            api_key = os.environ.get("OPENTINKER_API_KEY") or ""
        api_key = clean_api_key(api_key)  # a key read from a file ends in "\n": gRPC would refuse the metadata
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        creds = channel_credentials(root_certificates, client_cert, client_key, tls=address.tls)
        # Plaintext: an UNAVAILABLE "Socket closed" gets a hint that the scheduler may serve TLS.
        self._plaintext_hint = SCHEDULER_PLAINTEXT_HINT if creds is None else ""
        self._root_certificates = root_certificates  # serve() hands it to the InferenceClient
        if creds is None:
            self._channel = grpc.insecure_channel(self.target, options=_channel_options())
        else:
            self._channel = grpc.secure_channel(self.target, creds, options=_channel_options())
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)
        self._closed = False
        self._last_poll: dict[str, float] = {}
        self._poll_lock = threading.Lock()
        self._env_servers: list[Any] = []  # EnvironmentServer objects this client started

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel and stop the environments this client serves (their tasks then fail
        after their ``grace_s``). Open :meth:`watch` iterators end with an error. Idempotent."""
        for server in list(getattr(self, "_env_servers", ())):
            server.stop()
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> "RLClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def keys(self) -> Any:
        """API key management (:class:`~opentinker_client.keys.KeyAdmin`): ``client.keys.create(...)``,
        ``list()``, ``revoke(prefix)``, ``rotate(prefix)``."""
        from opentinker_client.keys import KeyAdmin

        if self._closed:
            raise OpenTinkerError("this RLClient is closed")
        return KeyAdmin(self._channel, metadata=self._metadata, timeout=self.timeout)

    def __repr__(self) -> str:
        return f"RLClient(scheduler_url={self.scheduler_url!r})"

    # -- plumbing -----------------------------------------------------------------------------

    def _unary(self, name: str, request: Any, *, timeout: float | None = None) -> Any:
        if self._closed:
            raise OpenTinkerError("this RLClient is closed")
        method = getattr(self._stub, name)
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err, plaintext_hint=self._plaintext_hint) from err

    @staticmethod
    def _check_task_id(task_id: Any) -> str:
        if not isinstance(task_id, str) or not task_id.strip():
            raise InvalidArgumentError(f"task_id: expected a non-empty task id, got {task_id!r}", field="task_id")
        return task_id

    # -- submit -------------------------------------------------------------------------------

    def submit_task(
        self,
        env_config: Mapping[str, Any] | Environment | None = None,
        *,
        workload_type: str,
        gpu_count: int = 0,
        model: str = "",
        hyperparameters: Mapping[str, Any] | None = None,
        name: str = "",
        priority: int | None = None,
        max_runtime: float | _dt.timedelta | None = None,
        max_attempts: int | None = None,
        request_id: str | None = None,
        dataset: str | os.PathLike[str] | None = None,
        init_from: str = "",
        env_token: str | None = None,
        env_tls_cert: str | os.PathLike[str] | None = None,
        env_tls_key: str | os.PathLike[str] | None = None,
        env_tls_ca: str | os.PathLike[str] | None = None,
    ) -> str:
        """Submit a task; it starts PENDING and runs when a node has room.

        Args:
            env_config: the environment, as ``Environment(...).to_dict()`` gives it (an
                :class:`Environment` is accepted too); ``None`` is the built-in ``arithmetic``.
                A client-hosted environment (an :class:`Environment` subclass defining
                ``reset``/``step``) is served from this process (see :meth:`serve_environment`)
                until the task ends or this client is closed.
            workload_type: ``lora_finetune`` (implemented), ``full_rl``, ``sft``, ``inference``.
            gpu_count: GPUs, all on one node; 0 is a CPU task that runs on any node.
            model: base model (local folder on the nodes, or a hub id); ``""`` uses the
                scheduler's default model.
            hyperparameters: the workload's hyper-parameters (for ``lora_finetune``: ``steps``,
                ``learning_rate``, ``group_size``, ... see ``spec.GRPOConfig``); omitted keys take
                their defaults, unknown keys are refused.
            name: a short name for people.
            priority: overrides the workload type's priority; larger numbers run first.
            max_runtime: wall-clock limit per attempt, in seconds (or a timedelta).
            max_attempts: attempts in all, counting requeues after node loss (default 3).
            request_id: idempotency key (at most 128 characters); a retry with the same id
                returns the first task instead of a second one. A random one is used when omitted.
            dataset: for ``sft``: a local JSONL file of chat examples, uploaded first
                (:meth:`upload_dataset`) and named in ``env_config`` as ``dataset_id``
                (``env_id`` defaults to ``chat_jsonl``).
            init_from: the id of a SUCCEEDED task (e.g. an ``sft`` one) whose final checkpoint
                this task starts from, on the same ``model`` (SFT warm start, then RL).
            env_token, env_tls_cert, env_tls_key, env_tls_ca: for a client-hosted environment
                only: ``token``, ``tls_cert``, ``tls_key``, ``tls_ca`` of
                :meth:`serve_environment` (the server always requires an access token; a random
                one unless ``env_token`` is given).

        Returns:
            The new task's id.

        Raises:
            InvalidArgumentError: a bad field, found locally or by the scheduler; ``err.field``
                is its path (``spec.hyperparameters.learning_rate``).
            FailedPreconditionError: no node could ever hold the task (e.g. too many GPUs).
            ResourceExhaustedError: a limit such as tasks per owner.
            UnavailableError: the scheduler cannot be reached.
        """
        hosted = None
        serve_options = {"token": env_token, "tls_cert": env_tls_cert, "tls_key": env_tls_key, "tls_ca": env_tls_ca}
        if isinstance(env_config, Environment) and env_config.is_client_hosted:
            # A client-hosted environment: serve it while the task runs (stopped when the task
            # ends or this client closes).
            hosted = self.serve_environment(env_config, **serve_options)
            env_config = hosted.env_config
        elif any(v is not None for v in serve_options.values()):
            name = "env_" + next(k for k, v in serve_options.items() if v is not None)
            raise InvalidArgumentError(
                f"{name}: only for a client-hosted environment (an Environment subclass defining reset/step, passed "
                "as env_config); for a server you started yourself, pass its env_config",
                field=name,
            )
        if isinstance(env_config, Environment):
            env_config = env_config.to_dict()
        if env_config is not None and not isinstance(env_config, Mapping):
            raise InvalidArgumentError(
                f"spec.env_config: expected a mapping such as Environment(...).to_dict(), got {type(env_config).__name__}",
                field="spec.env_config",
            )
        if hyperparameters is not None and not isinstance(hyperparameters, Mapping):
            raise InvalidArgumentError(
                f"spec.hyperparameters: expected a mapping, got {type(hyperparameters).__name__}",
                field="spec.hyperparameters",
            )
        if isinstance(max_runtime, _dt.timedelta):
            max_runtime = max_runtime.total_seconds()
        config = TaskConfig(
            workload_type=workload_type,
            name=name,
            model=model,
            gpu_count=gpu_count,
            priority=priority,
            max_runtime=max_runtime,
            max_attempts=max_attempts,
            env=dict(env_config or {}),
            hyperparameters=dict(hyperparameters or {}),
            init_from=init_from,
            dataset=os.fspath(dataset) if dataset is not None else "",
        )
        if hosted is None:
            return self.submit_config(config, request_id=request_id)
        try:
            task_id = self.submit_config(config, request_id=request_id)
        except BaseException:
            hosted.stop()
            raise
        hosted.stop_when_done(lambda: self._get_task(task_id).done)
        return task_id

    def submit_config(
        self, config_or_path: TaskConfig | str | os.PathLike[str], *, request_id: str | None = None
    ) -> str:
        """Submit a task from a :class:`TaskConfig` or a YAML file (see
        :mod:`opentinker_client.config` for the format). A ``dataset`` file is uploaded first
        (:meth:`upload_dataset`) and named in ``env`` as ``dataset_id``.

        Returns:
            The new task's id.

        Raises:
            OSError: the file cannot be read.
            ConfigError: the file is not a valid task config (names file, line and key).
            InvalidArgumentError, FailedPreconditionError, ResourceExhaustedError,
            UnavailableError: as for :meth:`submit_task`.
        """
        if isinstance(config_or_path, TaskConfig):
            config = config_or_path
        else:
            config = load_task_config(config_or_path)
        config.check()
        if config.dataset:  # sft: upload the local file first, then name it by its id
            info = self.upload_dataset(config.dataset)
            config = dataclasses.replace(
                config, env={"env_id": "chat_jsonl", **config.env, "dataset_id": info.dataset_id}, dataset=""
            )
        request = scheduler_pb2.SubmitTaskRequest(spec=config.to_proto(), request_id=request_id or uuid.uuid4().hex)
        response = self._unary("SubmitTask", request)
        return response.task.task_id

    # -- read ---------------------------------------------------------------------------------

    def get_task(self, task_id: str) -> TaskInfo:
        """The task as the scheduler knows it now.

        Raises:
            NotFoundError: no such task (or not yours).
            InvalidArgumentError: empty ``task_id``.
            UnavailableError: the scheduler cannot be reached.
        """
        self._check_task_id(task_id)
        return self._get_task(task_id)

    def list_tasks(self, *, states: Iterable[str | int] | str | None = None, limit: int | None = 100) -> list[TaskInfo]:
        """Tasks, newest first.

        Args:
            states: only tasks in these states (``"pending"``, ``"running"``, ... or enum values);
                ``None`` means all.
            limit: at most this many (pages are fetched as needed); ``None`` for all.

        Raises:
            InvalidArgumentError: an unknown state name or a limit < 1.
            UnavailableError: the scheduler cannot be reached.
        """
        if isinstance(states, (str, int)):
            states = [states]
        try:
            state_values = [state_enum(s) for s in (states or ())]
        except ValueError as err:
            raise InvalidArgumentError(f"states: {err}", field="states") from None
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise InvalidArgumentError(f"limit: expected an integer >= 1 or None, got {limit!r}", field="limit")
        out: list[TaskInfo] = []
        token = ""
        while True:
            page_size = 1000 if limit is None else min(1000, limit - len(out))
            response = self._unary(
                "ListTasks", scheduler_pb2.ListTasksRequest(states=state_values, page_size=page_size, page_token=token)
            )
            out.extend(task_from_proto(t) for t in response.tasks)
            token = response.next_page_token
            if not token or not response.tasks or (limit is not None and len(out) >= limit):
                break
        return out if limit is None else out[:limit]

    def is_task_complete(self, task_id: str) -> bool:
        """True when the task has ended: SUCCEEDED, FAILED or CANCELLED.

        Paced: a second call for the same task within ``min_poll_interval`` seconds (see the
        class) sleeps for the rest of that interval first.

        Raises:
            NotFoundError, InvalidArgumentError, UnavailableError: as for :meth:`get_task`.
        """
        self._check_task_id(task_id)
        if self.min_poll_interval > 0:
            with self._poll_lock:
                last = self._last_poll.get(task_id)
            if last is not None:
                wait = last + self.min_poll_interval - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            with self._poll_lock:
                if len(self._last_poll) > 10_000:
                    self._last_poll.clear()
                self._last_poll[task_id] = time.monotonic()
        return self.get_task(task_id).done

    def get_metrics(self, task_id: str) -> dict[str, float]:
        """The newest training step's metrics.

        Returns:
            A new dict that always has ``"loss"`` and ``"reward"`` (``float('nan')`` before the
            first step is reported) and ``"step"`` (an int; 0 before the first step), plus every
            other key the trainer reports (``loss/policy``, ``reward/mean``,
            ``perf/tokens_per_s`` ...). ``reward`` is the mean sample reward of that step.

        Raises:
            NotFoundError, InvalidArgumentError, UnavailableError: as for :meth:`get_task`.
        """
        self._check_task_id(task_id)
        response = self._unary("GetMetrics", scheduler_pb2.GetMetricsRequest(task_id=task_id, include_history=False))
        metrics: dict[str, Any] = {"loss": math.nan, "reward": math.nan}
        metrics.update(response.latest)
        metrics["step"] = int(response.latest_step)
        return metrics

    def get_metric_history(self, task_id: str, *, after_step: int = 0) -> list[tuple[int, dict[str, float]]]:
        """Every reported step after ``after_step``, oldest first, as ``(step, values)``; a step
        reported again by a resumed attempt appears once, with the newest values.

        Fetches more than once if the scheduler returns the history in pieces.

        Raises:
            NotFoundError, InvalidArgumentError, UnavailableError: as for :meth:`get_task`.
        """
        self._check_task_id(task_id)
        out: list[tuple[int, dict[str, float]]] = []
        step = int(after_step)
        while True:
            response = self._unary(
                "GetMetrics", scheduler_pb2.GetMetricsRequest(task_id=task_id, after_step=step, include_history=True)
            )
            points = [(s, v) for s, v in metric_points(response.points) if s > step]
            if not points:
                break
            out.extend(points)
            step = max(s for s, _ in points)
            if step >= response.latest_step:
                break
        # After a resume from a checkpoint the new attempt reports again the steps the old one
        # ran past that checkpoint: the newest report of each step wins.
        latest: dict[int, dict[str, float]] = {}
        for s, v in out:
            latest[s] = v
        return sorted(latest.items())

    def list_nodes(self) -> list[NodeInfo]:
        """Trainer nodes with their devices, free GPUs, running tasks and latest telemetry.

        Raises:
            UnavailableError: the scheduler cannot be reached.
        """
        response = self._unary("ListNodes", scheduler_pb2.ListNodesRequest())
        return [node_from_proto(n) for n in response.nodes]

    # -- follow -------------------------------------------------------------------------------

    def watch(
        self, task_id: str, *, after_sequence: int = 0, follow: bool = True, reconnect_timeout: float | None = 300.0
    ) -> Iterator[TaskEvent]:
        """Iterate over a task's events: state changes, metric points, checkpoints.

        Starts with the history after ``after_sequence`` (0: all of it), then live events, and
        ends after the event that moves the task to SUCCEEDED, FAILED or CANCELLED (or at once
        if the task had already ended). If the connection drops (``UNAVAILABLE``: scheduler
        restart, network) it reconnects with backoff and resumes after the last sequence seen,
        so no event is yielded twice or skipped. Closing the iterator (``break``) cancels the
        stream.

        Args:
            after_sequence: resume after this event sequence number.
            follow: False ends after the events recorded so far (no live ones).
            reconnect_timeout: seconds to keep trying while the scheduler is unreachable;
                ``None`` tries for ever.

        Raises:
            NotFoundError: no such task.
            UnavailableError: unreachable for longer than ``reconnect_timeout``.
            OpenTinkerError: any other error from the stream.
        """
        self._check_task_id(task_id)
        last = int(after_sequence)
        backoff = _Backoff(*self.reconnect_backoff)
        down_since: float | None = None
        while True:
            if self._closed:
                raise OpenTinkerError("this RLClient is closed")
            call = self._stub.WatchTask(
                scheduler_pb2.WatchTaskRequest(task_id=task_id, after_sequence=last, history_only=not follow),
                metadata=self._metadata,
            )
            unavailable: OpenTinkerError | None = None
            try:
                for response in call:
                    if response.event.sequence <= last:
                        continue  # already yielded before a reconnect
                    last = response.event.sequence
                    down_since = None
                    backoff.reset()
                    event = event_from_proto(response.event)
                    yield event
                    if event.is_terminal:
                        return
            except grpc.RpcError as err:
                mapped = from_rpc_error(err, plaintext_hint=self._plaintext_hint)
                if not isinstance(mapped, UnavailableError) or self._closed:
                    raise mapped from err
                unavailable = mapped
            finally:
                call.cancel()

            if unavailable is None and not follow:
                return  # the history so far was sent whole
            if unavailable is None:
                # The scheduler ends the stream when the task has ended; make sure it did.
                try:
                    if self.get_task(task_id).done:
                        return
                    down_since = None
                except UnavailableError as err:
                    unavailable = err
            if unavailable is not None:
                now = time.monotonic()
                down_since = down_since if down_since is not None else now
                if reconnect_timeout is not None and now - down_since > reconnect_timeout:
                    raise UnavailableError(
                        f"lost the watch stream of task {task_id} and could not reconnect for "
                        f"{reconnect_timeout:g} s: {unavailable.details}"
                    ) from unavailable
            delay = backoff.next()
            log.warning(
                "watch of task %s interrupted (%s); resuming after sequence %d in %.1f s",
                task_id,
                unavailable.details if unavailable is not None else "stream ended early",
                last,
                delay,
            )
            time.sleep(delay)

    def wait(self, task_id: str, *, timeout: float | None = None, poll_interval: float = 1.0) -> TaskInfo:
        """Block until the task ends, polling every ``poll_interval`` seconds.

        Rides out short scheduler outages (``UNAVAILABLE`` for up to 300 s in a row).

        Args:
            timeout: give up after this many seconds; ``None`` waits for ever.
            poll_interval: seconds between polls.

        Returns:
            The final :class:`TaskInfo` of a SUCCEEDED task.

        Raises:
            TaskFailedError: the task ended FAILED or CANCELLED (``err.task.error`` says why).
            DeadlineExceededError: ``timeout`` passed first (also a :class:`TimeoutError`).
            NotFoundError: no such task.
            UnavailableError: unreachable for more than 300 s in a row.
        """
        self._check_task_id(task_id)
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        down_since: float | None = None
        state = "unknown"
        while True:
            call_timeout = (
                self.timeout if deadline is None else max(0.1, min(self.timeout, deadline - time.monotonic()))
            )
            try:
                info = self._get_task(task_id, timeout=call_timeout)
            except (UnavailableError, DeadlineExceededError) as err:
                now = time.monotonic()
                down_since = down_since if down_since is not None else now
                if now - down_since > 300.0 and isinstance(err, UnavailableError):
                    raise
                info = None
            else:
                down_since = None
                state = info.state
                if info.done:
                    if info.state != "succeeded":
                        raise TaskFailedError(info)
                    return info
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise DeadlineExceededError(f"task {task_id} did not end within {timeout:g} s (last state: {state})")
            time.sleep(poll_interval if deadline is None else max(0.0, min(poll_interval, deadline - now)))

    def _get_task(self, task_id: str, *, timeout: float | None = None) -> TaskInfo:
        response = self._unary("GetTask", scheduler_pb2.GetTaskRequest(task_id=task_id), timeout=timeout)
        return task_from_proto(response.task)

    # -- change -------------------------------------------------------------------------------

    def cancel(self, task_id: str, *, reason: str = "") -> TaskInfo:
        """Cancel a pending or running task (a running worker process is killed).

        Idempotent: cancelling a task that has already ended returns it unchanged.

        Args:
            reason: why, for people; recorded on the task.

        Returns:
            The task after the cancel (normally ``state == "cancelled"``).

        Raises:
            NotFoundError: no such task. PermissionDeniedError: not yours.
            UnavailableError: the scheduler cannot be reached.
        """
        self._check_task_id(task_id)
        response = self._unary("CancelTask", scheduler_pb2.CancelTaskRequest(task_id=task_id, reason=reason))
        return task_from_proto(response.task)

    # -- serve and fetch trained adapters (logic in opentinker_client.inference) -----------------
