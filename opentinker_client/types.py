"""The values the OpenTinker client returns: frozen dataclasses, never protobuf messages.

Tasks and their events (:class:`TaskInfo`, :class:`TaskEvent`), trainer nodes
(:class:`NodeInfo`, :class:`DeviceInfo`, :class:`DeviceTelemetry`), uploaded datasets and
recorded checkpoints (:class:`DatasetInfo`, :class:`CheckpointInfo`), and what an inference
server answers (:class:`Generation`, :class:`Sample`, :class:`StreamChunk`,
:class:`AdapterInfo`), plus the sampling settings :meth:`InferenceClient.generate` takes
(:class:`Sampling`).

Times are timezone-aware :class:`datetime.datetime` in UTC (``None`` when unset); lengths of time
are float seconds; sizes are bytes. The conversion from the wire lives in
``opentinker_client._convert``; this module imports no protobuf code.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, TypedDict

__all__ = [
    "TERMINAL_STATES",
    "TaskInfo",
    "TaskEvent",
    "NodeInfo",
    "DeviceInfo",
    "DeviceTelemetry",
    "HostTelemetry",
    "DatasetInfo",
    "CheckpointInfo",
    "ActResult",
    "Sample",
    "Generation",
    "StreamChunk",
    "AdapterInfo",
    "Sampling",
]

#: Lowercase names of the states a task never leaves.
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


# ---------------------------------------------------------------------------------------------
# Tasks.


@dataclass(frozen=True)
class TaskInfo:
    """A task as the scheduler reports it.

    Attributes:
        task_id: the scheduler's id for the task.
        state: ``"pending"``, ``"assigned"``, ``"running"``, ``"succeeded"``, ``"failed"`` or
            ``"cancelled"``.
        attempt: 1 for the first attempt, +1 each time the task is requeued.
        name, workload_type, model: from the spec (``model`` as the scheduler resolved it).
        priority: effective priority; larger numbers are scheduled first.
        gpu_count: GPUs asked for (0 = CPU task).
        owner: who submitted it.
        node_id: node it is assigned to or running on; ``""`` when pending or finished.
        device_indices: device indices on that node.
        pending_reason: why a pending task has not started (for a person to read).
        error: why it failed or was cancelled (for a person to read).
        latest_step: newest training step reported (0 before the first).
        latest_metrics: that step's values (``loss``, ``reward``, namespaced keys ...).
        checkpoint_path: folder of the newest checkpoint on its node, ``""`` when none.
        checkpoint_step: the step that checkpoint was written after (0 when none).
        endpoint: ``host:port`` (``https://host:port`` with TLS) a RUNNING inference task
            serves on, ``""`` otherwise.
        openai_endpoint: base URL ``http(s)://host:port/v1`` of the OpenAI-compatible API a
            RUNNING inference task serves (submitted with ``openai_port``), ``""`` otherwise.
        create_time, update_time, start_time, end_time: UTC datetimes or ``None``.
        env_config, hyperparameters: the spec's mappings as plain dicts.
        max_runtime: wall-clock limit of one attempt in seconds, ``None`` for none.
        max_attempts: attempts allowed (0 = scheduler default); a hand-back does not count.
        handed_back: attempts handed back (preemption, drain), not counted against
            ``max_attempts``: the task has used ``attempt - handed_back`` of them.
        init_from: id of the task whose final checkpoint this one started from, ``""`` for none.
        queue: the quota queue its owner's tasks count against (``""`` when not told).
        usage: what it used, all attempts (``get_task`` only; empty otherwise): ``gpu_seconds``,
            ``cpu_task_seconds``, ``tokens_generated``, ``tokens_trained``, ``env_steps``, ``cost``
            (in the scheduler's ``usage.currency``), ``attempts``.
        proto: the underlying ``common_pb2.Task`` (not compared, not shown).
    """

    task_id: str
    state: str
    attempt: int = 0
    name: str = ""
    workload_type: str = ""
    model: str = ""
    priority: int = 0
    gpu_count: int = 0
    owner: str = ""
    node_id: str = ""
    device_indices: tuple[int, ...] = ()
    pending_reason: str = ""
    error: str = ""
    latest_step: int = 0
    latest_metrics: Mapping[str, float] = field(default_factory=dict)
    checkpoint_path: str = ""
    checkpoint_step: int = 0
    endpoint: str = ""
    openai_endpoint: str = ""
    create_time: _dt.datetime | None = None
    update_time: _dt.datetime | None = None
    start_time: _dt.datetime | None = None
    end_time: _dt.datetime | None = None
    env_config: Mapping[str, Any] = field(default_factory=dict)
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    max_runtime: float | None = None
    max_attempts: int = 0
    handed_back: int = 0
    init_from: str = ""
    queue: str = ""
    usage: Mapping[str, float] = field(default_factory=dict)
    proto: Any = field(default=None, repr=False, compare=False)

    @property
    def done(self) -> bool:
        """True once the task is SUCCEEDED, FAILED or CANCELLED."""
        return self.state in TERMINAL_STATES

    @property
    def succeeded(self) -> bool:
        return self.state == "succeeded"

    @property
    def checkpoint_note(self) -> str:
        """Which checkpoint of the task ``serve``, ``eval``, ``download`` and ``init_from`` use, for a
        person: ``"final checkpoint, step 20"``, or ``"last complete checkpoint, step 12 (the task
        ended CANCELLED)"``, ``"... (the task ended FAILED by TIMEOUT, max_runtime)"`` (a checkpoint
        is recorded only once all of it is stored); ``""`` when the task has none."""
        if not self.checkpoint_path:
            return ""
        ck = self.proto.latest_checkpoint if self.proto is not None else None
        if self.state == "succeeded" and (ck is None or ck.final):
            return f"final checkpoint, step {self.checkpoint_step}"
        timeout = " by TIMEOUT, max_runtime" if self.state == "failed" and "max_runtime" in self.error else ""
        ended = (
            f" (the task ended {self.state.upper()}{timeout})" if self.done else f" (the task is {self.state.upper()})"
        )
        return f"last complete checkpoint, step {self.checkpoint_step}{ended}"

    def without_checkpoint(self, nothing: str, *, deleted: str = "") -> str:
        """Why the task gives nothing to use, for a person, ending in ``nothing`` (``"there is
        nothing to download"``): ``"task t-1 has no checkpoint: its artifacts were deleted at ...
        by alice ...; ..."`` when ``deleted`` (:meth:`RLClient.artifacts_deletion`) says so,
        ``"task t-1 ended CANCELLED without a checkpoint; ..."`` (an ended task never will have
        one), or ``"task t-1 is RUNNING and has no checkpoint yet; ..."``."""
        if deleted:
            return f"task {self.task_id} has no checkpoint: {deleted}; {nothing}"
        if self.done:
            timeout = " by TIMEOUT, max_runtime" if self.state == "failed" and "max_runtime" in self.error else ""
            return f"task {self.task_id} ended {self.state.upper()}{timeout} without a checkpoint; {nothing}"
        return f"task {self.task_id} is {self.state.upper()} and has no checkpoint yet; {nothing}"


@dataclass(frozen=True)
class TaskEvent:
    """One entry of a task's event log, as :meth:`RLClient.watch` yields it.

    ``kind`` says which fields are filled:

    - ``"state"``: ``from_state``, ``to_state`` (lowercase state names), ``attempt``, ``reason``
      (machine-readable: ``SUBMITTED``, ``STARTED``, ``NODE_LOST`` ...), ``message``, ``node_id``.
    - ``"metric"``: ``step``, ``metrics`` (``loss``, ``reward``, namespaced keys ...) and
      ``attempt`` (0 from a scheduler that did not record it). After a resume the log holds the
      steps the new attempt ran again a second time, each with its attempt.
    - ``"checkpoint"``: ``step``, ``attempt``, ``node_id``, ``checkpoint_path``,
      ``checkpoint_format`` (``peft_lora`` ...) and ``final``.
    - ``"phase"``: ``phase`` (``loading model``, ``model loaded``: what the attempt does before
      its first step), ``message`` (the model; how long it took once loaded) and ``attempt``.
    - ``"checkpoint_failed"``: a checkpoint that could not be stored in the artifact store after
      its retries: ``step``, ``attempt``, ``node_id``, ``message`` (why), ``fatal`` (the attempt
      ends FAILED because of it) and ``failures_in_a_row``. Training goes on unless ``fatal``.
    - ``"artifacts_deleted"``: the task's artifacts were deleted (``RLClient.delete_artifacts``,
      ``opentinker rm``: ``message`` says how many, their bytes and by whom; the checkpoints
      before it are gone), or retention deleted older checkpoints (``message`` names their keys).
    - ``"checkpoint_expiry"``: a checkpoint's expiry was set or cleared (``message`` names its
      key and when the scheduler deletes it).
    - ``"unknown"``: an event kind this client does not know (a newer scheduler).

    Attributes:
        task_id: the task.
        sequence: position in the task's log, from 1; resume a watch after it.
        time: when the scheduler recorded it (UTC), or ``None``.
    """

    task_id: str
    sequence: int
    time: _dt.datetime | None
    kind: str
    from_state: str = ""
    to_state: str = ""
    attempt: int = 0
    reason: str = ""
    message: str = ""
    node_id: str = ""
    step: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    checkpoint_path: str = ""
    checkpoint_format: str = ""
    final: bool = False
    phase: str = ""
    fatal: bool = False
    failures_in_a_row: int = 0

    @property
    def is_terminal(self) -> bool:
        """True for the state change that ends the task (to SUCCEEDED, FAILED or CANCELLED)."""
        return self.kind == "state" and self.to_state in TERMINAL_STATES


# ---------------------------------------------------------------------------------------------
# Nodes.


@dataclass(frozen=True)
class DeviceInfo:
    """A device of a node. ``memory_total_bytes`` in bytes; ``simulated`` for ``--simulate-gpus``."""

    index: int
    uuid: str = ""
    name: str = ""
    memory_total_bytes: int = 0
    simulated: bool = False


@dataclass(frozen=True)
class DeviceTelemetry:
    """Latest telemetry of one device. A value NVML could not give is ``None`` and
    ``unavailable[field]`` says why.

    Units: ``utilization_percent`` %, memory in bytes, ``temperature_c`` degrees Celsius,
    ``power_w`` watts, ``sm_clock_mhz`` MHz, ``ecc_errors`` a count.
    """

    index: int
    utilization_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    ecc_errors: int | None = None
    unavailable: Mapping[str, str] = field(default_factory=dict)
    simulated: bool = False


@dataclass(frozen=True)
class HostTelemetry:
    """CPU and memory of a node's host (psutil), from its latest heartbeat. A value it could not
    read is ``None`` and ``unavailable[field]`` says why.

    Units: ``cpu_utilization_percent`` % of all cores, memory in bytes (used = total - available).
    """

    cpu_utilization_percent: float | None = None
    cpu_count: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    unavailable: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelHostInfo:
    """A model host on a node: one process holding one frozen copy of a base model, whose tenants
    are LoRA tasks with an adapter each (a node started with ``--tenants-per-host``).

    Attributes:
        model: the base model; device_indices: its GPUs on the node (empty: the CPU).
        task_ids: its tenants; max_tenants: most it takes; pid: its process id on the node.
        dtype: torch dtype of the base weights (``auto``, ``float32``, ...).
        base_bytes_estimate, tenant_bytes_estimate: the scheduler's GPU memory estimate for it, in
            bytes per GPU: its base model once, and its tenants' adapters, gradients and AdamW
            moments together (0: the scheduler does not know the model's shape).
    """

    model: str
    device_indices: tuple[int, ...] = ()
    task_ids: tuple[str, ...] = ()
    pid: int = 0
    max_tenants: int = 0
    dtype: str = ""
    base_bytes_estimate: int = 0
    tenant_bytes_estimate: int = 0


@dataclass(frozen=True)
class GpuMemoryEstimate:
    """What placement books on one GPU for shared LoRA tasks: ``booked_bytes`` (each base model
    once plus each tenant) of the GPU's ``total_bytes``; ``index`` is the device on its node."""

    index: int
    booked_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class NodeInfo:
    """A trainer node as the scheduler sees it.

    Attributes:
        connected: its stream is open and its lease fresh.
        gpu_count: GPUs the scheduler places on; ``gpus_free`` of them are free now.
        max_tasks: tasks it may run at once; ``running_task_ids`` runs now.
        last_heartbeat_time: UTC datetime or ``None``.
        notes: things a person should see (simulated devices, config/NVML disagreement ...).
        host: CPU and memory of its host (:class:`HostTelemetry`), ``None`` before a heartbeat.
        model_hosts: its model hosts and their LoRA tenants (:class:`ModelHostInfo`).
        gpu_memory_estimates: per GPU holding shared LoRA tasks, the memory placement books
            there (:class:`GpuMemoryEstimate`).
    """

    node_id: str
    connected: bool = False
    gpu_count: int = 0
    gpus_free: int = 0
    max_tasks: int = 0
    running_task_ids: tuple[str, ...] = ()
    devices: tuple[DeviceInfo, ...] = ()
    telemetry: tuple[DeviceTelemetry, ...] = ()
    last_heartbeat_time: _dt.datetime | None = None
    version: str = ""
    notes: tuple[str, ...] = ()
    host: HostTelemetry | None = None
    model_hosts: tuple[ModelHostInfo, ...] = ()
    gpu_memory_estimates: tuple[GpuMemoryEstimate, ...] = ()
    proto: Any = field(default=None, repr=False, compare=False)


# ---------------------------------------------------------------------------------------------
# Datasets and checkpoints.


@dataclass(frozen=True)
class DatasetInfo:
    """An uploaded dataset (``RLClient.upload_dataset``).

    Attributes:
        dataset_id: ``sha256:<hex>``, what ``env_config.dataset_id`` names.
        name: the name given at upload (the file name by default).
        size_bytes: bytes.
        num_examples: examples (non-blank lines).
        format: how its lines were checked: ``chat`` (sft examples) or ``prompts`` (RL prompts).
    """

    dataset_id: str
    name: str = ""
    size_bytes: int = 0
    num_examples: int = 0
    format: str = ""


@dataclass(frozen=True)
class ActResult:
    """What a PPO policy does with a batch of observations (``InferenceClient.act``).

    Attributes:
        actions: per observation, what ``env.step`` takes: an ``int`` (Discrete action space: the
            most probable action) or nested lists of floats of the action shape (Box: the
            Gaussian's mean, clipped to the bounds).
        values: the critic's ``V(s)`` per observation.
        policy: the full_rl task whose policy acted; step: its checkpoint step.
    """

    actions: list[Any]
    values: list[float]
    policy: str
    step: int


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint a task recorded (``RLClient.list_checkpoints``).

    Attributes:
        task_id: the task that wrote it.
        step: the training step it was written after.
        path: its folder on the node that wrote it.
        format: how the folder is laid out: ``peft_lora`` (a PEFT adapter), ``hf_full`` (all weights,
            ``save_pretrained``), ``torch_ppo`` (a PPO policy).
        final: written when the attempt ended.
        attempt, node_id: the attempt and node that wrote it.
        create_time: UTC datetime or ``None``.
    """

    task_id: str
    step: int
    path: str
    format: str
    final: bool
    attempt: int
    node_id: str
    create_time: _dt.datetime | None


# ---------------------------------------------------------------------------------------------
# Inference.


class Sampling(TypedDict, total=False):
    """The sampling settings of :meth:`InferenceClient.generate` and
    :meth:`InferenceClient.generate_stream`, all optional keywords.

    Keys:
        temperature: 0 is greedy; ``None`` (the default) is the server's default, 1.0.
        top_p: nucleus sampling, in (0, 1]; ``None`` (the default) is off.
        top_k: the ``top_k`` most likely tokens only; 0 (the default) is off.
        max_tokens: most new tokens per sample (default 64).
        stop: a string, or strings, that end a sample (default none).
        seed: the same seed gives the same samples; ``None`` (the default) is random.
        n: samples per prompt (default 1).
        ignore_eos: keep generating past the end-of-sequence token (default False).
    """

    temperature: float | None
    top_p: float | None
    top_k: int
    max_tokens: int
    stop: str | Sequence[str]
    seed: int | None
    n: int
    ignore_eos: bool


@dataclass(frozen=True)
class Sample:
    """One completion.

    Attributes:
        index: its position among the ``n`` samples of the request, from 0.
        text: decoded text without special tokens, cut before a matched stop string.
        token_ids: generated tokens, the stop token included.
        logprobs: per token, natural-log probability under the model's raw distribution
            (log-softmax of the logits at temperature 1, before temperature/top-k/top-p).
        finish_reason: ``"stop"`` (stop token or stop string) or ``"length"`` (max_tokens).
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str


@dataclass(frozen=True)
class Generation:
    """The answer to one :meth:`InferenceClient.generate` call.

    Attributes:
        samples: the completions, by index.
        prompt_tokens, completion_tokens: token counts of the prompt and of all samples.
        model: the base model that answered.
        adapter: the adapter (a task id) that answered, ``None`` for the base model.
    """

    samples: tuple[Sample, ...]
    prompt_tokens: int
    completion_tokens: int
    model: str
    adapter: str | None

    @property
    def text(self) -> str:
        """The first sample's text."""
        return self.samples[0].text if self.samples else ""


@dataclass(frozen=True)
class StreamChunk:
    """New output of sample ``index`` from :meth:`InferenceClient.generate_stream`.

    ``finish_reason`` is set on a sample's last chunk; the stream's very last chunk has
    ``usage`` = ``(prompt_tokens, completion_tokens)`` and no text.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None = None
    usage: tuple[int, int] | None = None


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter loaded on the server (``path``: its checkpoint folder's name, e.g. ``step_20``;
    ``size_bytes``: its LoRA tensors)."""

    name: str
    path: str
    size_bytes: int
    load_time: _dt.datetime | None
    last_used_time: _dt.datetime | None
    in_use: int
