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
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from opentinker_client.client_data import DataCalls, check_task_dataset, dataset_format
from opentinker_client.client_serving import ServingCalls
from opentinker_client.client_tasks import PollPacer, TaskCalls, check_task_id
from opentinker_client.config import TaskConfig, dataset_env, load_task_config
from opentinker_client.connection import SchedulerConnection
from opentinker_client.endpoint_tokens import DEFAULT_TTL_S as DEFAULT_ENDPOINT_TOKEN_TTL_S
from opentinker_client.endpoint_tokens import EndpointToken
from opentinker_client.environment import Environment
from opentinker_client.errors import InvalidArgumentError
from opentinker_client.hosting.reward import RewardFn, RewardServer
from opentinker_client.hosting.server import EnvironmentServer
from opentinker_client.inference import InferenceClient
from opentinker_client.training import TrainingSession
from opentinker_client.keys import KeyAdmin
from opentinker_client.queues import QueueAdmin
from opentinker_client.types import CheckpointInfo, DatasetInfo, NodeInfo, TaskEvent, TaskInfo

__all__ = ["RLClient", "DEFAULT_SCHEDULER_URL"]

#: Used when neither ``scheduler_url`` nor the ``SCHEDULER_URL`` environment variable is set.
DEFAULT_SCHEDULER_URL = "localhost:8888"
#: Seconds a task may stay PENDING before the client logs why (``pending_warning_after``).
DEFAULT_PENDING_WARNING_AFTER = 30.0


class RLClient:
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
        pending_warning_after: once a task this client reads (:meth:`is_task_complete`,
            :meth:`get_task`, :meth:`wait`) has been PENDING this many seconds, log a warning with
            its pending reason (logger ``opentinker_client``; without any logging set up Python
            prints warnings to stderr). ``None`` reads ``OPENTINKER_PENDING_WARNING_AFTER``, else
            30; 0 turns it off.

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
        pending_warning_after: float | None = None,
    ) -> None:
        if scheduler_url is None:
            scheduler_url = os.environ.get("SCHEDULER_URL") or DEFAULT_SCHEDULER_URL
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.scheduler_url = scheduler_url
        self.min_poll_interval = float(min_poll_interval)
        self._connection = SchedulerConnection(
            scheduler_url,
            timeout=timeout,
            api_key=api_key,
            root_certificates=root_certificates,
            client_cert=client_cert,
            client_key=client_key,
        )
        if pending_warning_after is None:
            text = os.environ.get("OPENTINKER_PENDING_WARNING_AFTER") or ""
            try:
                pending_warning_after = float(text) if text else DEFAULT_PENDING_WARNING_AFTER
            except ValueError:
                raise ValueError(
                    f"OPENTINKER_PENDING_WARNING_AFTER: expected a number of seconds, got {text!r}"
                ) from None
        if not (isinstance(pending_warning_after, (int, float)) and pending_warning_after >= 0):
            raise ValueError(f"pending_warning_after must be a number of seconds >= 0, got {pending_warning_after!r}")
        self._tasks = TaskCalls(self._connection, pending_warning_after=float(pending_warning_after))
        self._data = DataCalls(self._connection)
        self._serving = ServingCalls(self._connection, self._tasks)
        self._pacer = PollPacer()
        self._env_servers = self._serving.env_servers  # the EnvironmentServer objects this client started

    @property
    def target(self) -> str:
        """The ``host:port`` this client dials (from ``scheduler_url``)."""
        return self._connection.target

    @property
    def timeout(self) -> float:
        """Deadline of each unary call, in seconds; may be set."""
        return self._connection.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._connection.timeout = float(seconds)

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel and stop the environments this client serves (their tasks then fail
        after their ``grace_s``). Open :meth:`watch` iterators end with an error. Idempotent."""
        self._serving.close()
        self._connection.close()

    def __enter__(self) -> "RLClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def keys(self) -> KeyAdmin:
        """API key management (:class:`~opentinker_client.keys.KeyAdmin`): ``client.keys.create(...)``,
        ``list()``, ``revoke(prefix)``, ``rotate(prefix)``."""
        self._connection.check_open()
        return KeyAdmin(self._connection)

    @property
    def queues(self) -> QueueAdmin:
        """Quota queues and the scale signal (:class:`~opentinker_client.queues.QueueAdmin`):
        ``client.queues.list()``, ``set(name, gpu_quota=..., cpu_task_quota=...)``,
        ``desired_trainers()``."""
        self._connection.check_open()
        return QueueAdmin(self._connection)

    def __repr__(self) -> str:
        return f"RLClient(scheduler_url={self.scheduler_url!r})"

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
        nodes: int = 1,
        tracking: Mapping[str, Any] | None = None,
    ) -> str:
        """Submit a task; it starts PENDING and runs when a node has room.

        Args:
            env_config: the environment, as ``Environment(...).to_dict()`` gives it (an
                :class:`Environment` is accepted too); ``None`` is the built-in ``arithmetic``.
                A client-hosted environment (an :class:`Environment` subclass defining
                ``reset``/``step``) is served from this process (see :meth:`serve_environment`)
                until the task ends or this client is closed.
            workload_type: ``lora_finetune`` (implemented), ``full_rl``, ``sft``, ``inference``.
            gpu_count: GPUs, all on one node; 0 is a CPU task that runs on any node. A task of
                N > 1 GPUs runs N torch.distributed ranks (data-parallel).
            nodes: nodes the task spans, ``gpu_count`` GPUs on each (a gang: placed all at once
                or not at all, ``nodes * gpu_count`` ranks); 1 = one node.
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
            tracking: live experiment tracking the worker writes as steps happen, e.g.
                ``{"tensorboard": "/runs/tb"}``, ``{"mlflow": {"uri": "file:///runs/mlruns",
                "experiment": "grpo"}}``, ``{"wandb": {"project": "p", "mode": "offline"}}``
                (``spec.tracking``; the node needs the logger's extra installed).

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
                "spec.env_config: expected a mapping such as Environment(...).to_dict(), got "
                f"{type(env_config).__name__}",
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
            nodes=nodes,
            priority=priority,
            max_runtime=max_runtime,
            max_attempts=max_attempts,
            env=dict(env_config or {}),
            hyperparameters=dict(hyperparameters or {}),
            init_from=init_from,
            dataset=os.fspath(dataset) if dataset is not None else "",
            tracking=dict(tracking or {}),
        )
        if hosted is None:
            return self.submit_config(config, request_id=request_id)
        try:
            task_id = self.submit_config(config, request_id=request_id)
        except BaseException:
            hosted.stop()
            raise
        hosted.stop_when_done(lambda: self._tasks.get(task_id).done)
        return task_id

    def submit_config(
        self, config_or_path: TaskConfig | str | os.PathLike[str], *, request_id: str | None = None
    ) -> str:
        """Submit a task from a :class:`TaskConfig` or a YAML file (see
        :mod:`opentinker_client.config` for the format). A ``dataset`` file is checked here, then
        uploaded (:meth:`upload_dataset`) and named in ``env`` as ``dataset_id``.

        Returns:
            The new task's id.

        Raises:
            OSError: the file cannot be read.
            ConfigError: the file is not a valid task config (names file, line and key).
            InvalidArgumentError: also a ``dataset`` file that is not there (the message names the
                path tried and what it is relative to) or has a bad line.
            FailedPreconditionError, ResourceExhaustedError, UnavailableError: as for :meth:`submit_task`.
        """
        if isinstance(config_or_path, TaskConfig):
            config = config_or_path
        else:
            config = load_task_config(config_or_path)
        return self._tasks.submit(self._with_dataset(config, upload=True).to_proto(), request_id=request_id)

    def _with_dataset(self, config: TaskConfig, *, upload: bool) -> TaskConfig:
        """``config`` checked (:meth:`TaskConfig.check`), with its local ``dataset`` file checked
        (:func:`~opentinker_client.client_data.check_task_dataset`: there, every line, a prompts
        reward against its first lines) and named in ``env`` as ``dataset_id``: uploaded first
        with ``upload`` (a submit), else only its id (a dry run: nothing leaves this machine).
        Submit and :meth:`estimate` share it, so a dry run resolves and refuses what a submit does."""
        config.check()
        if not config.dataset:
            return config
        env = dataset_env(config.workload_type, config.env)  # env_id: chat_jsonl for sft, else prompts
        dataset_id = check_task_dataset(config.dataset, env, source=config.source)
        if upload:
            dataset_id = self._data.upload_dataset(config.dataset, format=dataset_format(env), checked=True).dataset_id
        return dataclasses.replace(config, env={**env, "dataset_id": dataset_id}, dataset="")

    def estimate(self, config_or_path: TaskConfig | str | os.PathLike[str]) -> tuple[TaskInfo, dict[str, float], str]:
        """Validate a task config on the scheduler and estimate what it would use, without
        submitting it (``opentinker submit --dry-run``).

        The config goes through the same checks as :meth:`submit_config`, here and on the
        scheduler (a ``dataset`` file is found and checked here and named by its id, but not
        uploaded; the scheduler checks the rest as for a submit: limits, paths, ``init_from``,
        the environment), so a config that passes is one a submit accepts.

        Returns:
            ``(task, usage, basis)``: the task as it would be stored (no id; ``pending_reason``
            says when its queue's quota would hold it back now), the expected usage of one
            attempt (``gpu_seconds``, ``cost``, ``attempts`` 1 ...: from the spec's steps and the
            recent step times of the same workload type and model; zeros when there are none)
            and how it was made.

        Raises:
            As :meth:`submit_config` (nothing is uploaded or created).
        """
        config = config_or_path if isinstance(config_or_path, TaskConfig) else load_task_config(config_or_path)
        local_dataset = bool(config.dataset)  # checked here and named by its id; uploaded only at submit
        return self._tasks.estimate(
            self._with_dataset(config, upload=False).to_proto(), dataset_uploaded_at_submit=local_dataset
        )

    def usage(self, *, owner: str = "", since: _dt.datetime | float | None = None) -> dict[str, Any]:
        """Accounted usage (GPU-seconds, CPU-task seconds, tokens, env steps, cost) of attempts
        assigned since ``since`` (a datetime or unix seconds; None: all), per owner and queue:
        ``{"currency": "USD", "owners": {owner: {"queue": ..., "gpu_seconds": ...}}, "queues":
        {queue: {...}}}``. A user key sees its own owner's only."""
        if isinstance(since, _dt.datetime):
            since = since.timestamp()
        return self._tasks.usage(owner=owner, since=since)

    # -- read ---------------------------------------------------------------------------------

    def get_task(self, task_id: str) -> TaskInfo:
        """The task as the scheduler knows it now.

        Raises:
            NotFoundError: no such task (or not yours).
            InvalidArgumentError: empty ``task_id``.
            UnavailableError: the scheduler cannot be reached.
        """
        return self._tasks.get(check_task_id(task_id))

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
        return self._tasks.list(states=states, limit=limit)

    def is_task_complete(self, task_id: str) -> bool:
        """True when the task has ended: SUCCEEDED, FAILED or CANCELLED.

        Paced: a second call for the same task within ``min_poll_interval`` seconds (see the
        class) sleeps for the rest of that interval first.

        Raises:
            NotFoundError, InvalidArgumentError, UnavailableError: as for :meth:`get_task`.
        """
        check_task_id(task_id)
        self._pacer.pace(task_id, self.min_poll_interval)
        return self.get_task(task_id).done

    def pending_reason(self, task_id: str) -> str:
        """Why the task has not started yet, as the scheduler says it ("no node has 1 free
        GPU(s) ..."); ``""`` once it is not PENDING.

        Raises:
            NotFoundError, InvalidArgumentError, UnavailableError: as for :meth:`get_task`.
        """
        info = self.get_task(task_id)
        return info.pending_reason if info.state == "pending" else ""

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
        return self._tasks.metrics(check_task_id(task_id))

    def get_metric_history(self, task_id: str, *, after_step: int = 0) -> list[tuple[int, dict[str, float]]]:
        """Every reported step after ``after_step``, oldest first, as ``(step, values)``; a step
        reported again by a resumed attempt appears once, with the newest values.

        Fetches more than once if the scheduler returns the history in pieces.

        Raises:
            NotFoundError, InvalidArgumentError, UnavailableError: as for :meth:`get_task`.
        """
        return self._tasks.metric_history(check_task_id(task_id), after_step=after_step)

    def get_timed_metric_history(
        self, task_id: str, *, after_step: int = 0
    ) -> list[tuple[int, float, dict[str, float]]]:
        """As :meth:`get_metric_history`, as ``(step, unix seconds, values)``: the time the step was
        reported, for curves against wall time (``opentinker plot --x time``)."""
        return self._tasks.timed_metric_history(check_task_id(task_id), after_step=after_step)

    def list_nodes(self) -> list[NodeInfo]:
        """Trainer nodes with their devices, free GPUs, running tasks and latest telemetry.

        Raises:
            UnavailableError: the scheduler cannot be reached.
        """
        return self._tasks.nodes()

    # -- follow -------------------------------------------------------------------------------

    def watch(
        self,
        task_id: str,
        *,
        after_sequence: int = 0,
        follow: bool = True,
        reconnect_timeout: float | None = 300.0,
        timeout: float | None = None,
    ) -> Iterator[TaskEvent]:
        """Iterate over a task's events: state changes, metric points, checkpoints.

        Starts with the history after ``after_sequence`` (0: all of it), then live events, and
        ends after the event that moves the task to SUCCEEDED, FAILED or CANCELLED (or at once
        if the task had already ended) and what the ended task still records: a task cancelled
        or timed out while running gets the step its worker finishes on the way out and the
        checkpoint it writes then (``metric`` and ``checkpoint`` events after the terminal one);
        the scheduler ends the stream once the node says the worker is gone. A break in the
        stream after the terminal event ends the watch (no reconnect). If the connection drops
        (``UNAVAILABLE``: scheduler restart, network) it reconnects with backoff and resumes after
        the last sequence seen, so no event is yielded twice or skipped. Closing the iterator
        (``break``) cancels the stream.

        Args:
            after_sequence: resume after this event sequence number.
            follow: False ends after the events recorded so far (no live ones).
            reconnect_timeout: seconds to keep trying while the scheduler is unreachable or does
                not answer (a frozen scheduler that accepts connections and sends nothing), from
                the moment the stream was opened or lost until it answers again; every try in
                that window (each reopen, each ``GetTask`` check, each backoff sleep) is bounded
                by what is left of it, and by the client's ``timeout``. ``None`` tries for ever.
            timeout: seconds for the whole watch, live events included; ``None`` (the default):
                no limit.

        Raises:
            NotFoundError: no such task.
            UnavailableError: unreachable or unanswering for ``reconnect_timeout`` seconds.
            DeadlineExceededError: the task had not ended within ``timeout`` seconds (also a
                :class:`TimeoutError`).
            OpenTinkerError: any other error from the stream.
        """
        check_task_id(task_id)
        return self._tasks.watch(
            task_id,
            after_sequence=after_sequence,
            follow=follow,
            reconnect_timeout=reconnect_timeout,
            backoff=self.reconnect_backoff,
            timeout=timeout,
        )

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
        return self._tasks.wait(check_task_id(task_id), timeout=timeout, poll_interval=poll_interval)

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
        return self._tasks.cancel(check_task_id(task_id), reason=reason)

    def delete_artifacts(self, task_id: str) -> tuple[TaskInfo, list[str], int]:
        """Delete every artifact of a finished task from the scheduler's artifact store: its
        checkpoints of all attempts, the final one included (``opentinker rm``). The task and its
        event log stay; it has no checkpoint afterwards (no ``init_from``, serving or download).

        Idempotent: a second call deletes nothing.

        Returns:
            The task after it, the keys deleted (sorted) and their bytes.

        Raises:
            NotFoundError: no such task, or another owner's (admins may delete any task's).
            FailedPreconditionError: the task has not ended (cancel it first), its worker is still
                stopping, or an unfinished task names it as ``init_from``.
            UnavailableError: the scheduler or its artifact store cannot be reached.
        """
        return self._tasks.delete_artifacts(check_task_id(task_id))

    # -- datasets and checkpoints -------------------------------------------------------------

    def upload_dataset(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        timeout: float | None = None,
        format: str = "chat",
    ) -> DatasetInfo:
        """Upload a JSONL file of chat examples for ``sft`` tasks (one
        ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line), or with
        ``format="prompts"`` of prompts for RL (one ``{"prompt": ..., "answer": ...}`` per line,
        docs/rlvr.md), streamed in 1 MiB chunks.

        The scheduler checks every line while it arrives and stores the file by content, so
        uploading the same bytes twice returns the same id and stores them once. Name it in a
        task with ``env_config={"env_id": "chat_jsonl", "dataset_id": info.dataset_id}``, or pass
        ``dataset=path`` to :meth:`submit_task`, which calls this first.

        Args:
            path: the local file.
            name: a name for people (default: the file name).
            timeout: seconds for the whole upload (default: none).
            format: ``chat`` (sft examples) or ``prompts`` (RL prompts,
                :func:`opentinker_common.spec.prompts.parse_prompt_line`); name a ``prompts``
                dataset with ``env_config={"env_id": "prompts", "dataset_id": ..., "reward": ...}``.

        Returns:
            :class:`~opentinker_client.types.DatasetInfo` (``dataset_id`` ``sha256:<hex>``,
            ``num_examples``, ``size_bytes``).

        Raises:
            OSError: the file cannot be read.
            InvalidArgumentError: a bad line (the message names its number and what was
                expected) or an empty file.
            ResourceExhaustedError: larger than the scheduler's limit (256 MiB by default).
            UnavailableError: the scheduler cannot be reached.
        """
        return self._data.upload_dataset(path, name=name, timeout=timeout, format=format)

    def upload_adapter(
        self,
        folder: str | os.PathLike[str],
        *,
        model: str | None = None,
        name: str | None = None,
        timeout: float | None = None,
    ) -> TaskInfo:
        """Upload a PEFT LoRA adapter folder trained elsewhere, so the cluster can use it: the
        returned task (``lora_finetune``, SUCCEEDED, its final checkpoint the folder, step 0)
        names it in ``init_from=``, :meth:`serve` and :meth:`download_checkpoint`.

        The scheduler stores the files in its artifact store (each one's size and SHA-256
        checked) and refuses a folder that is not a LoRA adapter as PEFT saves one
        (``adapter_config.json`` with ``peft_type`` LORA; ``adapter_model.safetensors`` with
        ``base_model.model.<module>.lora_A.weight``-style keys only). Whether its modules and
        shapes fit ``model`` is checked when a task loads it (the task fails naming the keys).

        Args:
            folder: the adapter folder (``PeftModel.save_pretrained``'s output).
            model: the base model it was trained on, as tasks name it (hub id or model name);
                default: the adapter's ``base_model_name_or_path``.
            name: a name for people (default: the folder's name).
            timeout: seconds for the whole upload (default: none).

        Raises:
            InvalidArgumentError: not an adapter folder (here or on the scheduler; the message
                names the file). ResourceExhaustedError: too many files or bytes.
            FailedPreconditionError: the scheduler keeps no artifact store.
        """
        return self._data.upload_adapter(folder, model=model, name=name, timeout=timeout)

    def list_checkpoints(self, task_id: str) -> list[CheckpointInfo]:
        """The checkpoints a task recorded, oldest first
        (:class:`~opentinker_client.types.CheckpointInfo`).

        Raises:
            NotFoundError: no such task. InvalidArgumentError: empty id.
        """
        return self._data.list_checkpoints(check_task_id(task_id))

    def artifacts_deletion(self, task_id: str) -> str:
        """How the task's artifacts were deleted, for a person: ``"its artifacts were deleted at
        2026-12-01 23:04:05 UTC by alice (DeleteTaskArtifacts, `opentinker rm`)"``, or ``""`` when
        they were not.

        Raises:
            NotFoundError: no such task. InvalidArgumentError: empty id.
        """
        return self._data.artifacts_deletion(check_task_id(task_id))

    def download_checkpoint(self, task_id: str, dest: str | os.PathLike[str], *, step: int | None = None) -> Path:
        """Download a checkpoint folder (the newest, or the one at ``step``) into ``dest``,
        verifying each file's size and SHA-256; returns ``dest`` as a Path.

        Raises:
            NotFoundError: no such task or step. FailedPreconditionError: the scheduler cannot
            read the folder. FileExistsError: ``dest`` is not an empty folder.
            OpenTinkerError: a file arrived damaged (nothing is left at ``dest``).
        """
        return self._data.download_checkpoint(check_task_id(task_id), dest, step=step)

    # -- serve --------------------------------------------------------------------------------

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
    ) -> EnvironmentServer:
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
        self._connection.check_open()
        server = EnvironmentServer(
            env,
            host=host,
            port=port,
            advertise_host=advertise_host,
            factory=factory,
            token=token,
            require_token=require_token,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_ca=tls_ca,
        )
        return self._serving.host(server)

    def serve_reward(
        self,
        fn: RewardFn,
        *,
        host: str | None = None,
        port: int = 0,
        advertise_host: str | None = None,
        token: str | None = None,
        require_token: bool = True,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        timeout_s: float = 30.0,
        grace_s: float = 30.0,
        max_consecutive_failures: int = 3,
    ) -> RewardServer:
        """Serve a reward function from this process to trainers (a client-hosted reward) and
        return the started :class:`~opentinker_client.hosting.reward.RewardServer`; a ``prompts``
        task names it with ``env_config["reward"] = server.reward_config``::

            def reward(prompts, completions, metadata):
                return [float(str(m["answer"]) in c) for c, m in zip(completions, metadata)]

            with client.serve_reward(reward) as server:
                task_id = client.submit_task(workload_type="lora_finetune", env_config={
                    "env_id": "prompts", "dataset_id": info.dataset_id, "reward": server.reward_config})
                client.wait(task_id)

        ``fn(prompts, completions, metadata)`` gets lists of equal length (the prompt as text, the
        model's reply, the dataset line's other fields) and returns one number per item; the
        missing-reward policy (NaN, a non-number, raising, timing out) is in
        :mod:`opentinker_client.hosting.reward`. The server stops on leaving the ``with`` block,
        on ``server.stop()`` or on :meth:`close`.

        Args:
            host, port, advertise_host, token, require_token, tls_cert, tls_key, tls_ca: as for
                :meth:`serve_environment`.
            timeout_s: seconds the trainer waits for one batch to be scored.
            grace_s: seconds the trainer retries while this server is unreachable.
            max_consecutive_failures: failed calls in a row after which the task ends FAILED.

        Raises:
            InvalidArgumentError: ``fn`` not callable, a bad token, TLS file or option.
            OSError: the port cannot be bound.
        """
        self._connection.check_open()
        server = RewardServer(
            fn,
            host=host,
            port=port,
            advertise_host=advertise_host,
            token=token,
            require_token=require_token,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_ca=tls_ca,
            timeout_s=timeout_s,
            grace_s=grace_s,
            max_consecutive_failures=max_consecutive_failures,
        )
        return self._serving.host(server)

    def create_training_session(
        self,
        model: str = "",
        *,
        lora: bool = True,
        lora_rank: int = 16,
        lora_alpha: float = 32.0,
        target_modules: Iterable[str] | None = None,
        seed: int = 0,
        idle_timeout: float = 1800.0,
        gpu_count: int = 0,
        priority: int | None = None,
        max_runtime: float | None = None,
        max_attempts: int | None = None,
        name: str = "",
        hyperparameters: Mapping[str, Any] | None = None,
        timeout: float = 600.0,
        root_certificates: str | os.PathLike | None = None,
    ) -> "TrainingSession":
        """Start a training session on ``model`` and connect to it: your own training loop with
        Tinker-style primitives (``forward_backward``, ``optim_step``, ``sample``,
        ``save_state`` ...; docs/primitives.md). ``model`` "" is the scheduler's
        ``default_model``.

        Submits a ``lora_session`` task (a LoRA adapter of ``lora_rank`` / ``lora_alpha`` on
        ``target_modules``, seeded by ``seed``; with ``lora=False`` every weight of the model
        trains instead, where the device's memory allows: about 16 bytes per parameter in
        float32 with AdamW; it ends after ``idle_timeout`` seconds without a
        call, or at ``max_runtime``), placed like any task (``gpu_count``, ``priority``), waits up
        to ``timeout`` seconds until it serves and returns a
        :class:`~opentinker_client.training.TrainingSession` that sends an endpoint token of the
        session (fetched and renewed with this client's API key, which stays with the scheduler).
        ``hyperparameters``: further ``lora_session`` settings (``max_datums_per_call``,
        ``max_tokens_per_call``, ``max_in_flight_calls``, ``micro_batch_tokens``, ``dtype``).

        Raises:
            InvalidArgumentError: a bad setting (its field path). TaskFailedError: the session
            task ended before serving. DeadlineExceededError: not serving within ``timeout``.
        """
        hp: dict[str, Any] = {
            "lora": bool(lora),
            "lora_rank": int(lora_rank),
            "lora_alpha": float(lora_alpha),
            "seed": int(seed),
            "idle_timeout_s": float(idle_timeout),
            **dict(hyperparameters or {}),
        }
        if target_modules is not None:
            hp["target_modules"] = list(target_modules)
        config = TaskConfig(
            workload_type="lora_session",
            model=model,
            name=name or f"session {model or 'on the default model'}",
            gpu_count=gpu_count,
            priority=priority,
            max_runtime=max_runtime,
            max_attempts=max_attempts,
            hyperparameters=hp,
        )
        return self._serving.create_training_session(config, timeout=timeout, root_certificates=root_certificates)

    def resume_training_session(
        self, task_id: str, *, timeout: float = 600.0, root_certificates: str | os.PathLike | None = None
    ) -> "TrainingSession":
        """Connect again to training session ``task_id``, e.g. after its node was lost: the
        scheduler requeued the task and its next attempt resumed from the newest ``save_state``
        (adapter, optimizer, step); the returned session continues from the sequence number that
        state was saved at (calls after it are lost; redo them). Waits up to ``timeout`` seconds.

        Raises:
            NotFoundError: no such task. FailedPreconditionError: not a ``lora_session`` task, or
            it ended. TaskFailedError, DeadlineExceededError: as :meth:`create_training_session`.
        """
        return self._serving.resume_training_session(
            check_task_id(task_id), timeout=timeout, root_certificates=root_certificates
        )

    def endpoint_token(self, task_id: str, *, ttl: float = DEFAULT_ENDPOINT_TOKEN_TTL_S) -> EndpointToken:
        """A new endpoint token for the endpoints of ``inference`` or ``lora_session`` task
        ``task_id``: the ``api_key`` their OpenAI-compatible API and gRPC services take, which
        refuse API keys. It works ``ttl`` seconds (1 s to 24 h), and stops when this client's
        API key is revoked. :meth:`serve` and training sessions get and renew tokens themselves.

        With the scheduler running without authentication the token is ``""`` and the endpoints
        take any ``api_key``. The ``openai`` package refuses an empty one: pass any other string,
        e.g. ``OpenAI(base_url=..., api_key=token.token or "no-auth")``.

        Raises:
            NotFoundError: no such task (or not yours). InvalidArgumentError: a bad ``ttl``.
            FailedPreconditionError: the task serves no endpoint.
        """
        return self._serving.endpoint_token(check_task_id(task_id), ttl=ttl)

    def serve(
        self,
        task_id: str,
        *,
        step: int = 0,
        gpu_count: int = 0,
        ttl: float = 3600.0,
        max_resident_adapters: int = 8,
        timeout: float = 600.0,
        root_certificates: str | os.PathLike | None = None,
    ) -> InferenceClient:
        """Serve the adapter of a ``lora_finetune`` or ``sft`` task, or of an ended
        ``lora_session`` (its newest ``save_weights_for_sampler`` or ``save_state``), in one call.

        A ``lora_finetune`` or ``sft`` task that is still training is served once it has a
        checkpoint: each request is pinned, when the server accepts it, to the task's newest
        checkpoint, or to its live adapter when the server is a tenant of the model host the task
        trains on (docs/inference.md, "Serving a task while it trains"); once it ends, its final one.

        Reuses a running (or queued) ``inference`` task for the same base model, else submits
        one (``ttl`` seconds, ``gpu_count`` GPUs), waits until it serves, and returns an
        :class:`~opentinker_client.inference.InferenceClient` bound to this task's adapter
        (``client.generate(...)``; ``adapter=None`` on a call asks the base model). The
        returned client sends an endpoint token of the inference task (this client's API key stays
        with the scheduler); for an ``https://`` endpoint it trusts
        ``root_certificates`` (the CA of the inference servers' certificate; default: this
        client's CA, else ``$OPENTINKER_TLS_CA``, else the system's roots).

        A task that trained all weights (``sft`` with ``lora: false``, ``full_rl`` GRPO on text:
        ``hf_full`` checkpoints) is served as the base model itself: its newest checkpoint, or
        the one at ``step`` (> 0), on an ``inference`` task of its own (reused only while it
        serves that same checkpoint), fetched there from the artifact store; the client's
        requests name the model by ``task_id``.

        A ``lora_session`` that is still running serves its sampler saves
        (``TrainingSession.save_weights_for_sampler``): its newest one the scheduler has
        recorded, or the one at ``step`` (waited for up to ``timeout`` seconds: the node reports a
        save just after it returns). The client is bound to adapter ``<task id>@<step>``, that
        version: a later save is a new version, served by calling ``serve`` again (the same
        inference task loads it next to the old one; docs/inference.md, "Serving a running
        training session").

        Before it returns, it makes one call on the server, so a wrong CA, a TLS/plaintext mix-up
        or a refused key fails here rather than on the first request: bound to an adapter, a
        one-token ``Generate`` that loads it (the OpenAI endpoint's ``/v1/models`` lists it from
        then on), else ``ListAdapters``. That ``Generate`` costs one generated token, counted in
        usage like any other; the adapter loads within that call's timeout (the returned
        client's ``timeout``, 120 seconds); it fails with ResourceExhaustedError when all of
        the server's adapter slots are in use.

        Raises:
            NotFoundError: no such task, no checkpoint at ``step`` (a running session: no sampler
            save at ``step`` within ``timeout``), or its files are gone from
            the artifact store. FailedPreconditionError: not an adapter or full-weight task, a
            policy or full-weight task not finished, no checkpoint (none yet while it trains, or
            its artifacts deleted), a running training session
            with no sampler save yet, or a full-weight checkpoint without its weights file.
            TaskFailedError: the inference task ended before serving.
            DeadlineExceededError: not serving within ``timeout`` seconds.
            UnavailableError, UnauthenticatedError, PermissionDeniedError: the check call failed
            (certificate, TLS mode, key).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"step: expected 0 (the newest) or a step >= 1, got {step!r}", field="step")
        return self._serving.serve(
            check_task_id(task_id),
            step=step,
            gpu_count=gpu_count,
            ttl=ttl,
            max_resident_adapters=max_resident_adapters,
            timeout=timeout,
            root_certificates=root_certificates,
        )
