"""Task specs as typed, validated values — the contract shared by client, scheduler and trainer.

Torch-free on purpose: the scheduler validates a spec at submit and the client can validate it
before sending, with the same code. Every refusal is a :class:`SpecError` that names the field
path (``spec.hyperparameters.learning_rate``) and what was expected; the scheduler maps it to
gRPC ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = [
    "spec_from_proto",
    "SpecError",
    "WORKLOAD_TYPES",
    "ArithmeticEnvConfig",
    "EnvConfig",
    "GRPOConfig",
    "TaskSpecModel",
    "parse_dataclass",
    "validate_env_config",
    "validate_hyperparameters",
]

#: Workload types the trainer knows how to run. A scheduler may configure a subset.
WORKLOAD_TYPES: tuple[str, ...] = ("lora_finetune", "full_rl", "sft", "inference")

#: Workload types with a trainer implementation in this release.
IMPLEMENTED_WORKLOADS: tuple[str, ...] = ("lora_finetune",)

#: Built-in text environments for language models.
TEXT_ENVIRONMENTS: tuple[str, ...] = ("arithmetic",)


class SpecError(ValueError):
    """A spec field is missing, of the wrong type or out of range.

    Attributes:
        field: dotted path of the offending field, e.g. ``spec.hyperparameters.steps``.
        expected: what a valid value looks like, for a person to read.
    """

    def __init__(self, field: str, expected: str, got: Any = dataclasses.MISSING) -> None:
        self.field = field
        self.expected = expected
        detail = f"{field}: expected {expected}"
        if got is not dataclasses.MISSING:
            detail += f", got {got!r}"
        super().__init__(detail)


# ---------------------------------------------------------------------------------------------
# Generic, strict dict -> frozen dataclass conversion.


def _bounds(f: dataclasses.Field) -> tuple[float | None, float | None, bool]:
    meta = f.metadata
    return meta.get("min"), meta.get("max"), meta.get("min_exclusive", False)


def _check_number(value: Any, f: dataclasses.Field, path: str, kind: type) -> int | float:
    lo, hi, lo_excl = _bounds(f)
    desc = "an integer" if kind is int else "a number"
    if lo is not None and hi is not None:
        desc += f" in {'(' if lo_excl else '['}{lo}, {hi}]"
    elif lo is not None:
        desc += f" {'>' if lo_excl else '>='} {lo}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(path, desc, value)
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(path, desc, value)
    if kind is int:
        if isinstance(value, float):
            if not value.is_integer():
                raise SpecError(path, desc, value)
            value = int(value)  # protobuf Struct carries every number as a double
    else:
        value = float(value)
    if lo is not None and (value < lo or (lo_excl and value == lo)):
        raise SpecError(path, desc, value)
    if hi is not None and value > hi:
        raise SpecError(path, desc, value)
    return value


def _convert(value: Any, tp: Any, f: dataclasses.Field, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], f, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, "true or false", value)
        return value
    if tp is int or tp is float:
        return _check_number(value, f, path, tp)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, "a string", value)
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise SpecError(path, f"one of {', '.join(choices)}", value)
        max_len = f.metadata.get("max_len", 4096)
        if len(value) > max_len:
            raise SpecError(path, f"a string of at most {max_len} characters", f"{value[:20]}...")
        return value
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise SpecError(path, "a list", value)
        if len(value) > 256:
            raise SpecError(path, "a list of at most 256 items", f"{len(value)} items")
        return tuple(_convert(v, item_tp, f, f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return parse_dataclass(tp, value, path)
    raise TypeError(f"unsupported field type {tp!r} at {path}")  # a bug in this module


@functools.cache
def _dataclass_fields(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """Type hints and init fields of ``cls``, resolved once (``get_type_hints`` compiles every
    string annotation on each call, which made validating a spec cost ~0.4 ms)."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls) if f.init}


def parse_dataclass(cls: type, data: Any, path: str):
    """Build frozen dataclass ``cls`` from a mapping, refusing unknown keys and wrong types.

    Raises:
        SpecError: naming ``path.<key>`` and what was expected.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise SpecError(path, "a mapping of keys to values", data)
    hints, fields = _dataclass_fields(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SpecError(f"{path}.{unknown[0]}", f"one of the known keys ({', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f, f"{path}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SpecError(f"{path}.{name}", "a value (this key is required)")
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        check(path)
    return obj


def _num(default, lo=None, hi=None, min_exclusive=False, doc=""):
    return field(default=default, metadata={"min": lo, "max": hi, "min_exclusive": min_exclusive, "doc": doc})


# ---------------------------------------------------------------------------------------------
# Environments.


@dataclass(frozen=True)
class ArithmeticEnvConfig:
    """The built-in ``arithmetic`` text task: "What is a + b?"; reward 1.0 when the last integer
    in the reply equals the sum, else 0.0. Operands have between ``min_digits`` and ``max_digits``
    decimal digits (1 digit means 0..9)."""

    env_id: str = "arithmetic"
    min_digits: int = _num(1, 1, 9)
    max_digits: int = _num(1, 1, 9)
    # The seed's Environment(action_space=..., observation_space=...) declares sizes; a text
    # environment takes free text in and out, so they are recorded but not used.
    action_space: int | None = _num(None, 1, 1_000_000)
    observation_space: int | None = _num(None, 1, 1_000_000)
    seed: int | None = _num(None, 0, 2**31 - 1)
    system_prompt: str | None = None

    def check(self, path: str) -> None:
        if self.min_digits > self.max_digits:
            raise SpecError(f"{path}.max_digits", f"an integer >= min_digits ({self.min_digits})", self.max_digits)


EnvConfig = ArithmeticEnvConfig

_ENV_CONFIGS: dict[str, type] = {"arithmetic": ArithmeticEnvConfig}


def validate_env_config(data: Any, path: str = "spec.env_config") -> EnvConfig:
    """Parse an ``env_config`` mapping (``Environment.to_dict()``) into its typed config.

    A missing ``env_id`` means the built-in ``arithmetic`` task.

    Raises:
        SpecError: unknown ``env_id`` (naming the known ones), unknown key or bad value.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise SpecError(path, "a mapping with at least env_id", data)
    env_id = data.get("env_id") or "arithmetic"
    if not isinstance(env_id, str) or env_id not in _ENV_CONFIGS:
        raise SpecError(f"{path}.env_id", f"one of {', '.join(sorted(_ENV_CONFIGS))}", env_id)
    return parse_dataclass(_ENV_CONFIGS[env_id], {**data, "env_id": env_id}, path)


# ---------------------------------------------------------------------------------------------
# Hyper-parameters.


@dataclass(frozen=True)
class GRPOConfig:
    """Hyper-parameters of ``lora_finetune``: GRPO with a PEFT LoRA adapter.

    Each step samples ``prompts_per_step`` prompts, ``group_size`` completions each, scores them,
    and takes ``ppo_epochs`` clipped policy-gradient updates on group-relative advantages
    (Shao et al. 2024, DeepSeekMath, https://arxiv.org/abs/2402.03300).
    """

    steps: int = _num(15, 1, 100_000, doc="optimizer steps (one batch of rollouts each)")
    prompts_per_step: int = _num(4, 1, 4096)
    group_size: int = _num(8, 2, 1024, doc="completions per prompt; advantages are relative within a group")
    max_new_tokens: int = _num(10, 1, 8192)
    temperature: float = _num(0.7, 0.0, 10.0, min_exclusive=True)
    top_p: float = _num(1.0, 0.0, 1.0, min_exclusive=True)
    learning_rate: float = _num(
        5e-4, 0.0, 1.0, min_exclusive=True, doc="AdamW learning rate of the adapter (5e-4: measured with scripts/measure_grpo.py)"
    )
    weight_decay: float = _num(0.0, 0.0, 1.0)
    max_grad_norm: float = _num(1.0, 0.0, 1e6, min_exclusive=True)
    ppo_epochs: int = _num(1, 1, 64, doc="gradient updates per batch of rollouts")
    micro_batch_size: int = _num(
        0, 0, 65536, doc="sequences per forward/backward pass, rounded down to whole groups (at least one); 0 = the whole batch"
    )
    clip_eps: float = _num(0.2, 0.0, 10.0, min_exclusive=True, doc="PPO ratio clip range")
    kl_coef: float = _num(0.0, 0.0, 100.0, doc="weight of the k3 KL penalty to the reference model; 0 skips it")
    scale_rewards: bool = True
    lora_rank: int = _num(16, 1, 1024)
    lora_alpha: float = _num(32.0, 0.0, 1e6, min_exclusive=True)
    lora_dropout: float = _num(0.0, 0.0, 1.0)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    checkpoint_every: int = _num(0, 0, 1_000_000, doc="steps between checkpoints; 0 writes only the final one")
    seed: int = _num(0, 0, 2**31 - 1)
    dtype: str = field(default="auto", metadata={"choices": ("auto", "float32", "bfloat16", "float16")})

    def check(self, path: str) -> None:
        if not self.target_modules:
            raise SpecError(f"{path}.target_modules", "at least one module name")


_HYPERPARAMETERS: dict[str, type] = {"lora_finetune": GRPOConfig}


def validate_hyperparameters(workload_type: str, data: Any, path: str = "spec.hyperparameters"):
    """Parse ``hyperparameters`` for ``workload_type`` into its typed config (defaults filled in).

    Raises:
        SpecError: unknown key (naming the known ones), wrong type or value out of range.
    """
    cls = _HYPERPARAMETERS.get(workload_type)
    if cls is None:
        raise SpecError("spec.workload_type", f"one of the implemented workloads ({', '.join(IMPLEMENTED_WORKLOADS)})", workload_type)
    return parse_dataclass(cls, data, path)


# ---------------------------------------------------------------------------------------------
# The whole task.


@dataclass(frozen=True)
class TaskSpecModel:
    """A validated task spec. ``gpu_count: 0`` is a CPU task that runs on any node."""

    workload_type: str
    model: str
    env: EnvConfig
    hyperparameters: GRPOConfig
    gpu_count: int = 0
    max_runtime_s: float | None = None
    max_attempts: int = 3
    priority: int | None = None
    name: str = ""

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
    ) -> "TaskSpecModel":
        """Validate every part; raises :class:`SpecError` on the first bad field."""
        if not isinstance(workload_type, str) or workload_type not in allowed_workloads:
            raise SpecError("spec.workload_type", f"one of {', '.join(allowed_workloads)}", workload_type)
        if workload_type not in IMPLEMENTED_WORKLOADS:
            raise SpecError(
                "spec.workload_type",
                f"a workload this release runs ({', '.join(IMPLEMENTED_WORKLOADS)}); {workload_type} is not implemented yet",
                workload_type,
            )
        if not isinstance(model, str) or not model.strip():
            raise SpecError("spec.model", "a model folder or hub id such as Qwen/Qwen2.5-0.5B-Instruct", model)
        if len(model) > 1024:
            raise SpecError("spec.model", "at most 1024 characters")
        if isinstance(gpu_count, bool) or not isinstance(gpu_count, int) or not 0 <= gpu_count <= 1024:
            raise SpecError("spec.resources.gpu_count", "an integer in [0, 1024] (0 = CPU task)", gpu_count)
        if max_runtime_s is not None and (not isinstance(max_runtime_s, (int, float)) or not 0 < max_runtime_s <= 30 * 86400):
            raise SpecError("spec.limits.max_runtime", "a duration in (0 s, 30 days]", max_runtime_s)
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or not 0 <= max_attempts <= 100:
            raise SpecError("spec.limits.max_attempts", "an integer in [1, 100] (0 = default 3)", max_attempts)
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000):
            raise SpecError("spec.priority", "an integer in [-1000, 1000]", priority)
        if not isinstance(name, str) or len(name) > 256:
            raise SpecError("spec.name", "a string of at most 256 characters", name)
        env = validate_env_config(env_config)
        if workload_type == "lora_finetune" and env.env_id not in TEXT_ENVIRONMENTS:
            raise SpecError("spec.env_config.env_id", f"a text environment for a language model ({', '.join(TEXT_ENVIRONMENTS)})", env.env_id)
        hp = validate_hyperparameters(workload_type, hyperparameters)
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
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists)."""
        return _jsonable(dataclasses.asdict(self))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def spec_from_proto(spec, *, allowed_workloads: tuple[str, ...] = WORKLOAD_TYPES) -> TaskSpecModel:
    """Validate an ``opentinker.common.v1.TaskSpec`` message into a :class:`TaskSpecModel`.

    Raises:
        SpecError: naming the field path (``spec.hyperparameters.steps`` ...).
    """
    from google.protobuf import json_format

    env = json_format.MessageToDict(spec.env_config) if spec.HasField("env_config") else {}
    hp = json_format.MessageToDict(spec.hyperparameters) if spec.HasField("hyperparameters") else {}
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
    )
