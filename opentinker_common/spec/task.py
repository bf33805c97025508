"""The whole task spec: :class:`TaskSpecModel`, built from parts or from the wire message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from opentinker_common.spec._parse import SpecError, check_text, did_you_mean, parse_dataclass, plain, raise_if_any
from opentinker_common.spec.structs import struct_to_dict
from opentinker_common.spec.tracking import TrackingConfig, parse_tracking
from opentinker_common.spec.registry import (
    WORKLOAD_TYPES,
    env_entry,
    env_kinds_for,
    hyperparameters_class,
    implemented_workloads,
    exact_env_ids,
    known_env_ids,
    uses_model,
)

__all__ = [
    "EXPECTED",
    "TaskSpecModel",
    "spec_from_proto",
    "validate_env_config",
    "validate_hyperparameters",
    "env_kind",
    "task_uses_model",
]

#: ``env_id`` when ``env_config`` names none: the built-in text task.
DEFAULT_ENV_ID = "arithmetic"


def validate_env_config(data: Any, path: str = "spec.env_config") -> Any:
    """Parse an ``env_config`` mapping (``Environment.to_dict()``) into its typed config.

    A missing ``env_id`` means the built-in ``arithmetic`` task; an empty one is refused.

    Raises:
        SpecError: unknown ``env_id`` (naming the known ones), unknown key or bad value.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise SpecError(path, "a mapping with at least env_id", data)
    env_id = data.get("env_id", DEFAULT_ENV_ID)
    if env_id is None:
        env_id = DEFAULT_ENV_ID
    if env_id == "":
        raise SpecError(
            f"{path}.env_id",
            f"an environment id, one of {', '.join(known_env_ids())} (leave env_id out for {DEFAULT_ENV_ID})",
            env_id,
        )
    entry = env_entry(env_id) if isinstance(env_id, str) else None
    if entry is None:
        hint = did_you_mean(env_id, exact_env_ids())
        raise SpecError(f"{path}.env_id", f"one of {', '.join(known_env_ids())}", env_id, hint=hint)
    return parse_dataclass(entry.cls, {**data, "env_id": env_id}, path)


def _named_env_kind(env_config: Any) -> str | None:
    """The kind of the environment an unvalidated ``env_config`` names (the default's when it
    names none), or None when it names no known one."""
    env_id = (env_config.get("env_id") if isinstance(env_config, Mapping) else None) or DEFAULT_ENV_ID
    entry = env_entry(env_id) if isinstance(env_id, str) else None
    return entry.kind if entry is not None else None


def task_uses_model(workload_type: str, env_config: Any) -> bool:
    """Whether a task of ``workload_type`` on ``env_config`` (an unvalidated mapping) needs
    ``spec.model`` (a causal LM). True when that cannot be told yet (validation then says why)."""
    env_id = (env_config.get("env_id") if isinstance(env_config, Mapping) else None) or DEFAULT_ENV_ID
    entry = env_entry(env_id) if isinstance(env_id, str) else None
    cls = hyperparameters_class(workload_type, entry.kind) if entry is not None else None
    return cls is None or uses_model(cls)


def env_kind(env: Any) -> str:
    """The registered kind (``text``, ...) of a parsed env config."""
    entry = env_entry(env.env_id)
    assert entry is not None, env.env_id  # parsed configs always come from a registered entry
    return entry.kind


def validate_hyperparameters(
    workload_type: str, data: Any, path: str = "spec.hyperparameters", *, env: Any = None, kind: str | None = None
):
    """Parse ``hyperparameters`` for ``workload_type`` on ``env`` (a parsed env config; None =
    the environment kind ``kind``, or the workload's only or first one) into its typed config,
    defaults filled in.

    Raises:
        SpecError: workload not implemented or not runnable on this kind of environment; unknown
            key (naming the known ones), wrong type or value out of range.
    """
    kinds = env_kinds_for(workload_type)
    if not kinds:
        raise SpecError(
            "spec.workload_type",
            f"a workload this release runs ({', '.join(implemented_workloads())}); {workload_type} is not "
            "implemented yet",
            workload_type,
        )
    kind = env_kind(env) if env is not None else kind or kinds[0]
    cls = hyperparameters_class(workload_type, kind)
    if cls is None:
        ok = [e for e in known_env_ids() if (en := env_entry(e)) is not None and en.kind in kinds]
        if kinds == ("dataset",):  # sft: no environment at all; say how to give the data
            raise SpecError(
                "spec.env_config.env_id",
                f"a dataset: {workload_type} trains on chat examples from a JSONL file (one "
                '{"messages": [...]} per line), not on an environment; give the file as `dataset: train.jsonl` in a '
                'task config or dataset="train.jsonl" to submit_task (uploaded at submit), or '
                'env_config {"env_id": "chat_jsonl", "path": "/data/train.jsonl"} for a file on the trainer nodes',
                env.env_id,
            )
        raise SpecError(
            "spec.env_config.env_id",
            f"an environment {workload_type} runs on ({', '.join(ok) or ', '.join(kinds)})",
            env.env_id,
        )
    return parse_dataclass(cls, data, path)


#: Most nodes of one gang task (``resources.nodes``).
MAX_GANG_NODES = 64

#: What the task-level fields take, in the words every refusal uses: the scheduler's and the
#: client's spec check, a task file and ``opentinker submit --set`` (one wording, from here).
EXPECTED: dict[str, str] = {
    "gpu_count": "an integer in [0, 1024] (0 = CPU task)",
    "nodes": f"an integer in [1, {MAX_GANG_NODES}] (nodes of a gang task)",
    "max_runtime": "a duration in (0 s, 30 days]",
    "max_attempts": "an integer in [1, 100] (0 = default 3)",
    "priority": "an integer in [-1000, 1000]",
}

#: ``(workload_type, env kind)`` of the trainers that run data-parallel across nodes (the
#: trainer's ``opentinker_trainer.distributed.DISTRIBUTED_TRAINERS``, checked equal by a test).
GANG_WORKLOADS: frozenset[tuple[str, str]] = frozenset(
    {
        ("lora_finetune", "text"),
        ("lora_finetune", "gym"),
        ("full_rl", "text"),
        ("sft", "dataset"),
        ("full_rl", "gym"),
        ("full_rl", "multiagent"),
    }
)


@dataclass(frozen=True)
class TaskSpecModel:
    """A validated task spec. ``gpu_count: 0`` is a CPU task that runs on any node."""

    workload_type: str
    model: str
    env: Any
    hyperparameters: Any
    gpu_count: int = 0
    max_runtime_s: float | None = None
    max_attempts: int = 3
    priority: int | None = None
    name: str = ""
    #: Task whose final checkpoint this one starts from (e.g. an ``sft`` task before RL); "" = none.
    init_from: str = ""
    #: Nodes the task spans (``resources.nodes``; a gang of ``nodes`` x ``gpu_count`` ranks); 1 = one node.
    nodes: int = 1
    #: Live experiment tracking (``spec.tracking``: TensorBoard, MLflow, W&B); none by default.
    tracking: TrackingConfig = TrackingConfig()

    @classmethod
    def from_parts(
        cls,
        *,
        workload_type: Any,
        model: Any,
        env_config: Any,
        hyperparameters: Any,
        gpu_count: Any = 0,
        max_runtime_s: Any = None,
        max_attempts: Any = 0,
        priority: Any = None,
        name: Any = "",
        allowed_workloads: tuple[str, ...] = WORKLOAD_TYPES,
        init_from: Any = "",
        nodes: Any = 1,
        tracking: Any = None,
    ) -> "TaskSpecModel":
        """Validate every part.

        The parts that do not depend on each other are all checked before anything is raised
        (the workload, the model, resources, limits, priority, name, ``env_config``,
        ``hyperparameters``, ``init_from``, ``tracking``), so one refusal names every bad field;
        a check that combines parts (a gang's GPUs, the workload on that environment) runs once
        those parts are valid. ``hyperparameters`` are checked against the class of the named
        ``env_id`` even when another key of ``env_config`` is bad.

        Raises:
            SpecError: the first bad field, the others as its ``also`` (:meth:`SpecError.combine`).
        """
        errors: list[SpecError] = []
        workload_ok = True
        if not isinstance(workload_type, str) or workload_type not in allowed_workloads:
            hint = did_you_mean(workload_type, allowed_workloads)
            errors.append(
                SpecError("spec.workload_type", f"one of {', '.join(allowed_workloads)}", workload_type, hint=hint)
            )
            workload_ok = False
        elif not env_kinds_for(workload_type):
            errors.append(
                SpecError(
                    "spec.workload_type",
                    f"a workload this release runs ({', '.join(implemented_workloads())}); {workload_type} is not "
                    "implemented yet",
                    workload_type,
                )
            )
            workload_ok = False
        try:
            if not isinstance(model, str) or (
                not model.strip() and workload_ok and task_uses_model(workload_type, env_config)
            ):
                raise SpecError("spec.model", "a model folder or hub id such as Qwen/Qwen2.5-0.5B-Instruct", model)
            if len(model) > 1024:
                raise SpecError("spec.model", "at most 1024 characters")
            check_text("spec.model", model)
        except SpecError as err:
            errors.append(err)
        gpu_ok = not isinstance(gpu_count, bool) and isinstance(gpu_count, int) and 0 <= gpu_count <= 1024
        if not gpu_ok:
            errors.append(SpecError("spec.resources.gpu_count", EXPECTED["gpu_count"], gpu_count))
        nodes = 1 if nodes in (0, None) else nodes
        nodes_ok = not isinstance(nodes, bool) and isinstance(nodes, int) and 1 <= nodes <= MAX_GANG_NODES
        if not nodes_ok:
            errors.append(SpecError("spec.resources.nodes", EXPECTED["nodes"], nodes))
        elif gpu_ok and nodes > 1 and gpu_count < 1:
            errors.append(
                SpecError(
                    "spec.resources.gpu_count",
                    "at least 1 with resources.nodes > 1 (a gang task runs gpu_count ranks on each node)",
                    gpu_count,
                )
            )
        if max_runtime_s is not None and (
            not isinstance(max_runtime_s, (int, float)) or not 0 < max_runtime_s <= 30 * 86400
        ):
            errors.append(SpecError("spec.limits.max_runtime", EXPECTED["max_runtime"], max_runtime_s))
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or not 0 <= max_attempts <= 100:
            errors.append(SpecError("spec.limits.max_attempts", EXPECTED["max_attempts"], max_attempts))
        if priority is not None and (
            isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000
        ):
            errors.append(SpecError("spec.priority", EXPECTED["priority"], priority))
        try:
            if not isinstance(name, str) or len(name) > 256:
                raise SpecError(
                    "spec.name",
                    "a string of at most 256 characters",
                    f"{name[:20]}... ({len(name)} characters)" if isinstance(name, str) else name,
                )
            check_text("spec.name", name)
        except SpecError as err:
            errors.append(err)
        env = hp = None
        kind = None  # the environment kind, for the hyperparameters' class
        try:
            env = validate_env_config(env_config)
            kind = env_kind(env)
        except SpecError as err:
            errors.append(err)
            kind = _named_env_kind(env_config)
        if env is not None and workload_ok and nodes_ok and nodes > 1 and (workload_type, kind) not in GANG_WORKLOADS:
            errors.append(
                SpecError(
                    "spec.resources.nodes",
                    "1 for this workload: only "
                    + ", ".join(f"{w} on {k} environments" for w, k in sorted(GANG_WORKLOADS))
                    + " run across nodes",
                    nodes,
                )
            )
        if workload_ok and (env is not None or hyperparameters_class(workload_type, kind) is not None):
            try:
                hp = validate_hyperparameters(workload_type, hyperparameters, env=env, kind=kind)
            except SpecError as err:
                errors.append(err)
        try:
            _check_init_from(init_from, env)
        except SpecError as err:
            errors.append(err)
        try:
            tracked = parse_tracking(tracking)
        except SpecError as err:
            errors.append(err)
        raise_if_any(errors)
        return cls(
            workload_type=workload_type,
            model=model,
            env=env,
            hyperparameters=hp,
            gpu_count=gpu_count,
            max_runtime_s=float(max_runtime_s) if max_runtime_s is not None else None,
            max_attempts=max_attempts or 3,
            priority=priority,
            name=name,
            init_from=init_from,
            nodes=nodes,
            tracking=tracked,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists)."""
        return plain(self)


def spec_from_proto(spec, *, allowed_workloads: tuple[str, ...] = WORKLOAD_TYPES) -> TaskSpecModel:
    """Validate an ``opentinker.common.v1.TaskSpec`` message into a :class:`TaskSpecModel`.

    Raises:
        SpecError: naming the field path (``spec.hyperparameters.steps`` ...).
    """
    env = struct_to_dict(spec.env_config, "spec.env_config") if spec.HasField("env_config") else {}
    hp = struct_to_dict(spec.hyperparameters, "spec.hyperparameters") if spec.HasField("hyperparameters") else {}
    tracking = struct_to_dict(spec.tracking, "spec.tracking") if spec.HasField("tracking") else None
    max_runtime_s = None
    if spec.HasField("limits") and spec.limits.HasField("max_runtime"):
        max_runtime_s = spec.limits.max_runtime.ToNanoseconds() / 1e9
    return TaskSpecModel.from_parts(
        workload_type=spec.workload_type,
        model=spec.model,
        env_config=env,
        hyperparameters=hp,
        gpu_count=spec.resources.gpu_count,
        max_runtime_s=max_runtime_s,
        max_attempts=spec.limits.max_attempts,
        priority=spec.priority if spec.HasField("priority") else None,
        name=spec.name,
        allowed_workloads=allowed_workloads,
        init_from=spec.init_from,
        nodes=spec.resources.nodes,
        tracking=tracking,
    )


#: Env kinds whose workloads can start from another task's checkpoint (a causal LM's weights).
INIT_FROM_ENV_KINDS: tuple[str, ...] = ("text", "dataset")


def _check_init_from(init_from: Any, env: Any) -> None:
    """``init_from`` is a task id (or empty), on a workload that can start from an LM checkpoint
    (that part is left out while ``env`` is None: the environment was refused)."""
    if (
        not isinstance(init_from, str)
        or len(init_from) > 128
        or (init_from and not init_from.replace("-", "").replace("_", "").isalnum())
    ):
        raise SpecError(
            "spec.init_from", "the id of a finished task (such as task-0192f3c4d5e6f7a8b9c) or empty", init_from
        )
    if init_from and env is not None and env_kind(env) not in INIT_FROM_ENV_KINDS:
        raise SpecError(
            "spec.init_from",
            "empty: starting from another task's checkpoint works for language-model workloads on "
            f"{' or '.join(INIT_FROM_ENV_KINDS)} environments, not {env.env_id}",
            init_from,
        )
