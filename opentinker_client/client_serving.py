"""The serving part of :class:`~opentinker_client.RLClient`: the client-side environment servers it
runs for trainers (``RLClient.serve_environment``) and serving a trained adapter
(``RLClient.serve``), over the :class:`~opentinker_client.connection.SchedulerConnection` and
:class:`~opentinker_client.client_tasks.TaskCalls` it is given."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, NoReturn

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_common.artifacts.checkpoint_lists import at_step, sampler_saves, steps_text
from opentinker_common.artifacts.deleted import deleted_words
from opentinker_common.artifacts.full_weights import FULL_FORMAT, weights_problem
from opentinker_common.spec.registry import env_entry
from opentinker_common.spec.task import DEFAULT_ENV_ID

from opentinker_client.client_tasks import TaskCalls
from opentinker_client.config import TaskConfig
from opentinker_client.connection import SchedulerConnection
from opentinker_client.endpoint_tokens import EndpointToken, EndpointTokens, issue_endpoint_token
from opentinker_client.errors import FailedPreconditionError, NotFoundError, UnavailableError
from opentinker_client.inference import ADAPTER_WORKLOADS, InferenceClient

from opentinker_client.training import TrainingSession

if TYPE_CHECKING:  # pragma: no cover
    from opentinker_client.hosting.server import EnvironmentServer

__all__ = ["ServingCalls"]

#: The prompt of the one-token generation that makes a server load the adapter a client is bound to.
_LOAD_PROMPT = "Hello"


class ServingCalls:
    """Servers started for, and clients of servers on, the cluster (see the ``RLClient`` method
    of each name for arguments, results and errors).

    Attributes:
        env_servers: every environment server started here, in order (:meth:`close` stops them).
    """

    def __init__(self, connection: SchedulerConnection, tasks: TaskCalls) -> None:
        self.connection = connection
        self.tasks = tasks
        self.env_servers: list[EnvironmentServer] = []

    def host(self, server: EnvironmentServer) -> EnvironmentServer:
        """Start ``server`` and keep it until :meth:`close`; returns it."""
        self.env_servers.append(server.start())
        return server

    def close(self) -> None:
        """Stop every environment server started here (their tasks then fail after ``grace_s``)."""
        for server in list(self.env_servers):
            server.stop()

    def serve(
        self,
        task_id: str,
        *,
        step: int = 0,
        gpu_count: int,
        ttl: float,
        max_resident_adapters: int,
        timeout: float,
        root_certificates: str | os.PathLike | None,
    ) -> InferenceClient:
        """A client bound to the adapter of task ``task_id`` (finished, or a ``lora_finetune`` or
        ``sft`` task still training once it has a checkpoint: each request gets its newest one,
        or its live adapter on its own model host, docs/inference.md): reuses a running (or
        pending) ``inference`` task on the same base model, else submits one (``ttl`` seconds,
        ``gpu_count`` GPUs, ``max_resident_adapters``); waits up to ``timeout`` seconds until it
        serves. The client sends the connection's API key and trusts ``root_certificates``
        (``None``: the connection's CA, else ``$OPENTINKER_TLS_CA``, else the system's roots);
        it has made one call already (:meth:`_client`), so a server it cannot reach or that
        refuses its key fails here (``RLClient.serve``). A task whose newest checkpoint (or whose
        checkpoint at ``step`` > 0) is full weights is served as the base model of its own server.
        A running ``lora_session`` serves its sampler saves (:meth:`_serve_running_session`)."""
        task = self.tasks.get(task_id)
        if task.workload_type == "lora_session" and not task.done:
            return self._serve_running_session(
                task,
                step,
                gpu_count=gpu_count,
                ttl=ttl,
                max_resident_adapters=max_resident_adapters,
                timeout=timeout,
                root_certificates=root_certificates,
            )
        # full_rl on a text environment trains all weights of its model: full weights to serve,
        # also once its checkpoints are gone (no latest checkpoint to tell it by)
        full_text = task.workload_type == "full_rl" and _env_kind(task.env_config) == "text"
        if step or task.proto.latest_checkpoint.format == FULL_FORMAT or full_text:
            return self._serve_full_weights(
                task, step, gpu_count=gpu_count, ttl=ttl, timeout=timeout, root_certificates=root_certificates
            )
        policy = task.workload_type == "full_rl"  # PPO (gym, multiagent): served for Act by a policies_only server
        if task.workload_type not in ADAPTER_WORKLOADS and not policy:
            raise FailedPreconditionError(
                f"task {task_id} is a {task.workload_type} task; "
                f"only {', '.join(ADAPTER_WORKLOADS[:-1])} and {ADAPTER_WORKLOADS[-1]} tasks give adapters to serve, "
                "and full_rl tasks policies"
            )
        if not task.done and policy:
            raise FailedPreconditionError(
                f"task {task_id} is {task.state}; wait for it to finish (RLClient.wait) before serving its policy"
            )
        what = "policy" if policy else "adapter"
        if task.workload_type == "sft" and (task.hyperparameters or {}).get("lora") is False:
            what = "weights"  # a full-weight SFT
        if not task.done and not task.checkpoint_path:
            # A training task is served from its newest checkpoint while it trains (or its live
            # adapter on its own model host); before the first one there is nothing to serve.
            every = (task.hyperparameters or {}).get("checkpoint_every")
            when = f" (it writes one every {every} steps, checkpoint_every)" if every else ""
            verb = "are" if what == "weights" else "is"
            raise FailedPreconditionError(
                task.without_checkpoint(f"there {verb} no {what} to serve until its first checkpoint{when}")
            )
        if not task.checkpoint_path:
            self._refuse_without_checkpoint(task, what, self._checkpoints(task_id))
        server_id = self._inference_task(
            task.model, gpu_count=gpu_count, ttl=ttl, adapters=max_resident_adapters, policies_only=policy
        )
        return self._client(
            server_id,
            timeout=timeout,
            root_certificates=root_certificates,
            adapter=None if policy else task_id,
            policy=task_id if policy else None,
            model="" if policy else task.model,
        )

    def _serve_running_session(
        self,
        task,
        step: int,
        *,
        gpu_count: int,
        ttl: float,
        max_resident_adapters: int,
        timeout: float,
        root_certificates,
    ) -> InferenceClient:
        """:meth:`serve` for a running training session: a client bound to adapter
        ``<task id>@<step>``, the session's sampler save (``SaveWeightsForSampler``) at ``step``
        (waited for up to ``timeout`` seconds until the scheduler records it: the node reports it
        just after the save returns), or with ``step`` 0 its newest one the scheduler has recorded.
        Each call binds the version it found; an older client keeps serving its own.

        Raises:
            FailedPreconditionError: no sampler save yet (call SaveWeightsForSampler first).
            NotFoundError: none at ``step`` within ``timeout`` (the message lists those there are).
        """
        task_id = task.task_id
        deadline = time.monotonic() + timeout
        while True:
            listed = self._checkpoints(task_id)
            saves = sampler_saves(listed.checkpoints)
            chosen = at_step(saves, step) if step else (saves[-1] if saves else None)
            if chosen is not None:
                break
            if not step:
                raise FailedPreconditionError(
                    f"task {task_id} is a running training session with no sampler save yet; "
                    "call SaveWeightsForSampler (TrainingSession.save_weights_for_sampler) first"
                )
            if time.monotonic() >= deadline:
                raise NotFoundError(
                    f"task {task_id}: no sampler save at step {step}; steps with one: {steps_text(saves)}"
                )
            time.sleep(0.2)
        server_id = self._inference_task(task.model, gpu_count=gpu_count, ttl=ttl, adapters=max_resident_adapters)
        return self._client(
            server_id,
            timeout=max(1.0, deadline - time.monotonic()),
            root_certificates=root_certificates,
            adapter=f"{task_id}@{chosen.step}",
            model=task.model,
        )

    def _serve_full_weights(
        self, task, step: int, *, gpu_count: int, ttl: float, timeout: float, root_certificates
    ) -> InferenceClient:
        """:meth:`serve` for a full-weight (``hf_full``) checkpoint of ``task`` at ``step`` (0: its
        newest): an ``inference`` task serving that checkpoint as its base model
        (``checkpoint_task_id``, ``checkpoint_step``), reused when one serves the same checkpoint;
        the client names the model by the task's id.

        Raises:
            FailedPreconditionError: not finished, no checkpoint (deleted artifacts named), the
                chosen one is not full weights or lacks its weights file.
            NotFoundError: no checkpoint at ``step``, or its files are gone from the artifact store.
        """
        task_id = task.task_id
        if not task.done:
            raise FailedPreconditionError(
                f"task {task_id} is {task.state}; wait for it to finish (RLClient.wait) before serving its weights"
            )
        listed = self._checkpoints(task_id)
        checkpoints = list(listed.checkpoints)
        if not checkpoints:
            self._refuse_without_checkpoint(task, "weights", listed)
        if step:
            ckpt = at_step(checkpoints, step)
            if ckpt is None:
                raise NotFoundError(
                    f"task {task_id} has no checkpoint at step {step}; steps with one: {steps_text(checkpoints)}"
                )
        else:  # the task's newest, as the task records it
            latest = task.proto.latest_checkpoint.path
            ckpt = next((c for c in reversed(checkpoints) if c.path == latest), checkpoints[-1])
        if ckpt.format != FULL_FORMAT:
            raise FailedPreconditionError(
                f"task {task_id} step {ckpt.step}: its checkpoint is {ckpt.format or 'of no format'!r}, "
                f"not full weights ({FULL_FORMAT}); serve(task_id) without step serves a task's newest adapter"
            )
        self._check_weights(task_id, int(ckpt.step))
        server_id = self._full_weights_task(task, int(ckpt.step), gpu_count=gpu_count, ttl=ttl)
        return self._client(server_id, timeout=timeout, root_certificates=root_certificates, model=task_id)

    def _checkpoints(self, task_id: str):
        """``ListCheckpointsResponse`` of ``task_id``: its checkpoints, oldest first, and the
        deletion of its artifacts if there was one."""
        return self.connection.unary("ListCheckpoints", scheduler_pb2.ListCheckpointsRequest(task_id=task_id))

    @staticmethod
    def _refuse_without_checkpoint(task, what: str, listed) -> NoReturn:
        """Raises FailedPreconditionError: ``task`` has no checkpoint, so no ``what`` ("adapter",
        "policy", "weights") to serve; its artifacts' deletion is named when ``listed`` records one."""
        nothing = f"there {'are' if what == 'weights' else 'is'} no {what} to serve"
        deleted = deleted_words(listed.artifacts_deleted) if listed.HasField("artifacts_deleted") else ""
        raise FailedPreconditionError(task.without_checkpoint(nothing, deleted=deleted))

    def _check_weights(self, task_id: str, step: int) -> None:
        """Read the manifest (the first message of ``DownloadCheckpoint``) of ``task_id``'s
        checkpoint at ``step`` and refuse one without ``config.json`` and a weights file."""
        request = scheduler_pb2.DownloadCheckpointRequest(task_id=task_id, step=step)
        try:
            with self.connection.stream("DownloadCheckpoint", request, plaintext_hint=False) as msgs:
                manifest = next(iter(msgs)).manifest
        except NotFoundError as err:
            raise NotFoundError(f"task {task_id} step {step}: its checkpoint is not in the artifact store: {err}")
        problem = weights_problem(task_id, step, (f.path for f in manifest.files))
        if problem is not None:
            raise FailedPreconditionError(problem)

    def _full_weights_task(self, task, step: int, *, gpu_count: int, ttl: float) -> str:
        """The id of a running, assigned or pending ``inference`` task serving ``task``'s
        checkpoint at ``step`` with ``gpu_count`` GPUs, else of a new one."""
        for t in self.tasks.list(states=["running", "assigned", "pending"], limit=1000):
            hp = t.hyperparameters or {}
            if (
                t.workload_type == "inference"
                and hp.get("checkpoint_task_id") == task.task_id
                and int(hp.get("checkpoint_step") or 0) == step
                and t.gpu_count == gpu_count
            ):
                return t.task_id
        config = TaskConfig(
            workload_type="inference",
            model=task.model,
            gpu_count=gpu_count,
            hyperparameters={"ttl_s": float(ttl), "checkpoint_task_id": task.task_id, "checkpoint_step": step},
            name=f"serve {task.task_id} step {step}",
            max_attempts=3,
        )
        config.check()
        return self.tasks.submit(config.to_proto())

    def endpoint_token(self, task_id: str, *, ttl: float) -> EndpointToken:
        """A new endpoint token for task ``task_id`` (``RLClient.endpoint_token``)."""
        return issue_endpoint_token(self.connection, task_id, ttl=ttl)

    def _client(self, server_id: str, *, timeout: float, root_certificates, **binding) -> InferenceClient:
        """An :class:`InferenceClient` of inference task ``server_id`` once it serves, bound as
        ``binding`` says (``adapter``, ``policy``, ``model``), checked with one call. Bound to an
        adapter, that call generates one token with it: the server loads it, so an adapter that
        cannot load fails here and the OpenAI endpoint lists it (``/v1/models``) from now on."""
        serving = self.tasks.wait_serving(server_id, timeout=timeout)
        if root_certificates is None:
            root_certificates = self.connection.root_certificates
        tokens = EndpointTokens(self.connection, server_id)
        llm = InferenceClient(serving.endpoint, tokens=tokens, root_certificates=root_certificates, **binding)
        llm.task_id = server_id
        llm.openai_endpoint = serving.openai_endpoint
        try:  # one real call: a wrong CA, a plaintext/TLS mix-up or a refused key fails here, not on first use
            if binding.get("adapter"):
                llm.generate(_LOAD_PROMPT, temperature=0, max_tokens=1)
            else:
                llm.list_adapters()
        except BaseException:
            llm.close()
            raise
        return llm

    def _inference_task(
        self, model: str, *, gpu_count: int, ttl: float, adapters: int, policies_only: bool = False
    ) -> str:
        """The id of a running, assigned or pending ``inference`` task on ``model`` with
        ``gpu_count`` GPUs (``policies_only``: one that serves policies only), else of a new one."""
        for t in self.tasks.list(states=["running", "assigned", "pending"], limit=1000):
            if (
                t.workload_type == "inference"
                and t.model == model
                and not (t.hyperparameters or {}).get("checkpoint_task_id")  # serves a task's weights
                and t.gpu_count == gpu_count
                and bool((t.hyperparameters or {}).get("policies_only", False)) == policies_only
            ):
                return t.task_id
        hyperparameters: dict = {"ttl_s": float(ttl), "max_resident_adapters": int(adapters)}
        if policies_only:
            hyperparameters["policies_only"] = True
        config = TaskConfig(
            workload_type="inference",
            model=model,
            gpu_count=gpu_count,
            hyperparameters=hyperparameters,
            name=f"serve {'policies' if policies_only else model}",
            max_attempts=3,
        )
        config.check()
        return self.tasks.submit(config.to_proto())

    # --- training sessions ------------------------------------------------------------------------
    def create_training_session(
        self, config: TaskConfig, *, timeout: float, root_certificates: str | os.PathLike | None
    ) -> TrainingSession:
        """Submit the ``lora_session`` task ``config``, wait up to ``timeout`` seconds until it
        serves, and connect to it (``RLClient.create_training_session``)."""
        config.check()
        task_id = self.tasks.submit(config.to_proto())
        return self._connect(task_id, timeout=timeout, root_certificates=root_certificates)

    def resume_training_session(
        self, task_id: str, *, timeout: float, root_certificates: str | os.PathLike | None
    ) -> TrainingSession:
        """Connect to session task ``task_id`` again: after a node loss its next attempt resumes
        from the task's newest SaveState; the connection continues from the sequence number that
        state was saved at (``RLClient.resume_training_session``)."""
        task = self.tasks.get(task_id)
        if task.workload_type != "lora_session":
            raise FailedPreconditionError(f"task {task_id} is a {task.workload_type} task, not a lora_session")
        if task.done:
            raise FailedPreconditionError(
                f"session task {task_id} ended {task.state}; its states stay in its checkpoints "
                "(list_checkpoints), but a session that ended cannot be resumed: start a new one"
            )
        return self._connect(task_id, timeout=timeout, root_certificates=root_certificates)

    def _connect(self, task_id: str, *, timeout: float, root_certificates) -> TrainingSession:
        """A session on ``task_id``'s endpoint once it answers. An endpoint that does not answer
        (the attempt of a node just lost, still shown until the scheduler sees the loss) is asked
        again until ``timeout``."""
        if root_certificates is None:
            root_certificates = self.connection.root_certificates
        deadline = time.monotonic() + timeout
        while True:
            endpoint = self.tasks.wait_for_endpoint(task_id, timeout=max(0.1, deadline - time.monotonic()))
            try:
                return TrainingSession(
                    endpoint,
                    task_id=task_id,
                    tokens=EndpointTokens(self.connection, task_id),
                    root_certificates=root_certificates,
                )
            except UnavailableError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)


def _env_kind(env_config) -> str:
    """The registered kind (``text``, ``gym``, ``multiagent``) of a task's environment; "" when
    this client does not know its ``env_id``."""
    env_id = (env_config or {}).get("env_id") or DEFAULT_ENV_ID
    entry = env_entry(env_id) if isinstance(env_id, str) else None
    return entry.kind if entry is not None else ""
