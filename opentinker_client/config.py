"""Task configs in YAML: what ``opentinker submit task.yaml`` and ``RLClient.submit_config`` read.

Format (every key but ``workload_type`` is optional)::

    name: arithmetic-demo                         # a short name for people (at most 256 characters)
    workload_type: lora_finetune                  # lora_finetune | full_rl | sft | inference | lora_session
    model: .cache/models/SmolLM2-135M-Instruct    # local folder or hub id; omitted: scheduler default
    gpu_count: 0                                  # GPUs, all from one node; 0 = CPU task (default 0)
    nodes: 1                                      # nodes of a gang task, gpu_count GPUs on each (default 1)
    priority: 5                                   # overrides the workload type's; larger runs first
    max_runtime: 600                              # seconds per attempt; omitted: no limit
    max_attempts: 3                               # attempts in all, counting requeues (default 3)
    env: {env_id: arithmetic, min_digits: 1, max_digits: 1}
    hyperparameters: {steps: 15, learning_rate: 2e-4}
    init_from: task-0192f3c4d5e6f7a8b9c            # start from this SUCCEEDED task's final checkpoint
    dataset: train.jsonl                          # sft (or env_id: prompts): a local JSONL file, uploaded at submit

``env`` is the ``env_config`` (what ``Environment(...).to_dict()`` gives: ``env_id`` plus that
environment's options; omitted: the built-in ``arithmetic`` task). ``hyperparameters`` are the
workload's (for ``lora_finetune`` see :class:`opentinker_common.spec.GRPOConfig`: ``steps``,
``learning_rate``, ``group_size``, ``lora_rank`` ...); omitted keys take their defaults.

The file is checked strictly, with the same code the scheduler uses: an unknown key (at the top,
in ``env`` or in ``hyperparameters``), a duplicate key, a wrong type or a value out of range is
refused with :class:`~opentinker_client.errors.ConfigError` naming the file, the line and column
(1-based, of the key) and the key, e.g.::

    INVALID_ARGUMENT: task.yaml:9:5: hyperparameters.lr: unknown key, expected one of the known keys (...)

An unknown key close to a known one ends with a suggestion (``difflib.get_close_matches``, in
:func:`opentinker_common.spec.did_you_mean`): ``...; did you mean 'learning_rate'?``, the same
from the scheduler for a spec sent without a file.

The file is read as YAML 1.2 (:class:`opentinker_common.yaml12.Yaml12Loader`): only ``true`` and
``false`` are booleans, so ``model: no`` is the string ``"no"``, and a key that wants a boolean
refuses ``no``/``off``/``yes``/``on`` with a hint (``expected true or false; 'no' is a string in
YAML 1.2 — write false``). Typographic quotes (``“ ”``), bullets (``•``) and other look-alike
characters outside comments and ASCII-quoted strings are refused with their line and column and
what to type instead. The file is read within :mod:`opentinker_common.documents`' bounds (1 MiB,
64 levels of nesting, 100,000 values with aliases expanded): a YAML bomb is refused with its
line and column and the limit it passed. At most 1 MiB and a byte is read of any kind of file, so
a pipe, a FIFO or ``/dev/zero`` is refused past the limit as a large file is.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import yaml

from opentinker.common.v1 import common_pb2
from opentinker_client._convert import dict_to_struct, seconds_to_duration
from opentinker_client.errors import ConfigError, InvalidArgumentError, from_spec_error
from opentinker_common.spec import WORKLOAD_TYPES, SpecError, TaskSpecModel, did_you_mean, short_repr
from opentinker_common.spec.task import EXPECTED
from opentinker_common.spec.registry import env_kinds_for
from opentinker_common.documents import DEFAULT_LIMITS, DocumentError, compose_yaml, construct_yaml, load_yaml
from opentinker_common.yaml12 import every_typography, find_typography, yaml11_bool_hint

__all__ = [
    "TaskConfig",
    "apply_overrides",
    "load_task_config",
    "load_with_overrides",
    "parse_task_config",
    "read_task_file",
]


# Stand-in for an empty model while validating locally: the scheduler fills in its default.
_DEFAULT_MODEL_PLACEHOLDER = "<scheduler default model>"
# Stand-in for the id of a `dataset` file not uploaded yet, while validating locally.
_DATASET_ID_PLACEHOLDER = "sha256:" + "0" * 64

_KEYS: dict[str, str] = {
    "name": "a string",
    "workload_type": f"one of {', '.join(WORKLOAD_TYPES)}",
    "model": "a model folder or hub id (a string)",
    "gpu_count": EXPECTED["gpu_count"],
    "nodes": EXPECTED["nodes"],
    "priority": EXPECTED["priority"],
    "max_runtime": f"a number of seconds, {EXPECTED['max_runtime']}",
    "max_attempts": EXPECTED["max_attempts"],
    "env": "a mapping (env_id and options)",
    "hyperparameters": "a mapping of hyper-parameter names to values",
    "init_from": "the id of a finished task to start from (a string)",
    "tracking": "a mapping of loggers (tensorboard, mlflow, wandb) the worker writes metrics to",
    "dataset": "a local JSONL file to upload: chat examples for sft, prompts for lora_finetune and full_rl (a path, "
    "relative to this file)",
}

#: Words people write for a top-level key (the API's field names, long forms): an unknown key
#: close to one of them suggests the key.
_ALIASES = {
    "environment": "env",
    "env_config": "env",
    "hyper_parameters": "hyperparameters",
    "hparams": "hyperparameters",
    "gpus": "gpu_count",
    "num_gpus": "gpu_count",
    "workload": "workload_type",
    "model_name": "model",
}


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """A task to submit, as read from YAML or built in code.

    Attributes:
        workload_type: ``lora_finetune``, ``full_rl``, ``sft`` or ``inference``.
        name: a short human-readable name.
        model: base model (local folder or hub id); ``""`` lets the scheduler use its default.
        gpu_count: GPUs, gang-placed on one node; 0 is a CPU task. With ``nodes`` > 1: GPUs per node.
        nodes: nodes the task spans (a gang: all placed at once, ``nodes * gpu_count`` ranks).
        priority: overrides the workload type's priority when set; larger runs first.
        max_runtime: wall-clock limit of one attempt, in seconds; ``None`` for no limit.
        max_attempts: attempts in all (node loss and preemption count); ``None`` for the default (3).
        env: the ``env_config`` mapping (``env_id`` + options); empty means ``arithmetic``.
        hyperparameters: the workload's hyper-parameters; omitted ones take their defaults.
        init_from: id of a SUCCEEDED task whose final checkpoint this one starts from; ``""`` = none.
        dataset: a local JSONL file: chat examples (``sft``) or prompts (``lora_finetune``,
            ``full_rl``); ``RLClient.submit_config`` uploads it and names it in ``env`` as
            ``dataset_id`` (``env_id`` defaults to ``chat_jsonl`` for sft, else ``prompts``:
            :data:`DATASET_ENV_IDS`).
        tracking: live experiment tracking (``spec.tracking``): ``tensorboard: /abs/folder``,
            ``mlflow: {uri, experiment}``, ``wandb: {project, mode}``.
        source: file it was read from, if any (not compared).
    """

    workload_type: str
    name: str = ""
    model: str = ""
    gpu_count: int = 0
    nodes: int = 1
    priority: int | None = None
    max_runtime: float | None = None
    max_attempts: int | None = None
    env: Mapping[str, Any] = field(default_factory=dict)
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    init_from: str = ""
    dataset: str = ""
    tracking: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = field(default=None, compare=False)

    def check(self) -> TaskSpecModel:
        """Validate locally, as the scheduler will (an empty ``model`` is allowed).

        Returns:
            The typed spec with defaults filled in.

        Raises:
            InvalidArgumentError: the first bad field, with ``err.field`` its spec path
                (``spec.hyperparameters.learning_rate``).
        """
        try:
            return _check_parts(self)
        except SpecError as err:
            raise from_spec_error(err) from None

    def to_proto(self) -> common_pb2.TaskSpec:
        """The ``common_pb2.TaskSpec`` to send: ``env`` and ``hyperparameters`` as
        ``google.protobuf.Struct``, ``max_runtime`` as a ``Duration``. Does not validate
        (see :meth:`check`).

        Raises:
            InvalidArgumentError: a value a Struct cannot carry (not JSON-like, or an integer
                beyond 2**53).
        """
        try:
            env = dict_to_struct(self.env)
        except ValueError as err:
            raise InvalidArgumentError(f"spec.env_config: {err}", field="spec.env_config") from None
        try:
            hp = dict_to_struct(self.hyperparameters)
        except ValueError as err:
            raise InvalidArgumentError(f"spec.hyperparameters: {err}", field="spec.hyperparameters") from None
        try:
            tracking = dict_to_struct(self.tracking) if self.tracking else None
        except ValueError as err:
            raise InvalidArgumentError(f"spec.tracking: {err}", field="spec.tracking") from None
        spec = common_pb2.TaskSpec(
            workload_type=self.workload_type,
            model=self.model or "",
            name=self.name or "",
            env_config=env,
            hyperparameters=hp,
            resources=common_pb2.Resources(gpu_count=self.gpu_count, nodes=self.nodes if self.nodes > 1 else 0),
            limits=common_pb2.Limits(max_attempts=self.max_attempts or 0),
            init_from=self.init_from or "",
            tracking=tracking,
        )
        if self.max_runtime is not None:
            spec.limits.max_runtime.CopyFrom(seconds_to_duration(self.max_runtime))
        if self.priority is not None:
            spec.priority = self.priority
        return spec


#: The environment a task's ``dataset`` file feeds, by workload type, when ``env`` names none:
#: sft's chat examples, the RL workloads' prompts (scored by ``env.reward``, numeric by default).
DATASET_ENV_IDS: dict[str, str] = {"sft": "chat_jsonl", "lora_finetune": "prompts", "full_rl": "prompts"}


def dataset_env(workload_type: str, env: Mapping[str, Any]) -> dict[str, Any]:
    """``env`` with the ``env_id`` a ``dataset`` file of ``workload_type`` feeds filled in when
    it has none (:data:`DATASET_ENV_IDS`).

    Raises:
        SpecError: field ``spec.dataset``: the workload takes no dataset file, or ``env.env_id``
            names an environment that reads none (only ``chat_jsonl`` and ``prompts`` do).
    """
    default = DATASET_ENV_IDS.get(workload_type)
    takes = " or ".join(f"{w} ({e})" for w, e in DATASET_ENV_IDS.items())
    if default is None:
        raise SpecError(
            "spec.dataset", f"no dataset file for {workload_type} (one is read by {takes} only); leave it out"
        )
    env_id = env.get("env_id") or default
    if env_id not in set(DATASET_ENV_IDS.values()):
        raise SpecError(
            "spec.dataset",
            f"env.env_id {'prompts' if default == 'prompts' else default} with a dataset file "
            f"(env_id {env_id!r} reads none: a dataset is prompts for lora_finetune and full_rl, chat examples "
            "for sft); set env.env_id: prompts (scored by env.reward) or leave the dataset out",
        )
    return {**env, "env_id": env_id}


def _check_parts(cfg: TaskConfig) -> TaskSpecModel:
    max_runtime = cfg.max_runtime
    if isinstance(max_runtime, _dt.timedelta):
        max_runtime = max_runtime.total_seconds()
    env = dict(cfg.env or {})
    if not env and not cfg.dataset and env_kinds_for(cfg.workload_type) == ("dataset",):
        raise SpecError(  # sft with no data at all: not "env_id: expected chat_jsonl, got 'arithmetic'"
            "spec.dataset",
            f"a dataset: {cfg.workload_type} trains on chat examples from a JSONL file (one "
            '{"messages": [...]} per line); pass dataset="train.jsonl" (uploaded at submit), or '
            'env_config={"env_id": "chat_jsonl", "path": "/data/train.jsonl"} for a file on the trainer nodes',
        )
    if cfg.dataset:  # uploaded at submit; checked here with a stand-in id
        if "dataset_id" in env or "path" in env:
            raise SpecError(
                "spec.env_config.dataset_id",
                "nothing here when `dataset` names a file to upload (it fills in dataset_id)",
                env.get("dataset_id", env.get("path")),
            )
        env = {**dataset_env(cfg.workload_type, env), "dataset_id": _DATASET_ID_PLACEHOLDER}
    return TaskSpecModel.from_parts(
        workload_type=cfg.workload_type,
        model=cfg.model or _DEFAULT_MODEL_PLACEHOLDER,
        env_config=env,
        hyperparameters=dict(cfg.hyperparameters or {}),
        gpu_count=cfg.gpu_count,
        nodes=cfg.nodes,
        max_runtime_s=max_runtime,
        max_attempts=cfg.max_attempts or 0,
        priority=cfg.priority,
        name=cfg.name or "",
        init_from=cfg.init_from or "",
        tracking=dict(cfg.tracking or {}) or None,
    )


# ---------------------------------------------------------------------------------------------
# YAML with line and column numbers.

Path = tuple  # of str keys and int list indices
Pos = tuple  # (line, column), both 1-based

#: Where an error with no better place points: the start of the file.
_START: Pos = (1, 1)


def _pos(mark: yaml.Mark) -> Pos:
    return (mark.line + 1, mark.column + 1)


def _at(pos: Pos | None) -> dict[str, int | None]:
    """``ConfigError`` keyword arguments for ``pos``."""
    return {"line": pos[0], "column": pos[1]} if pos else {"line": None, "column": None}


def _index_lines(node: yaml.Node, path: Path, lines: dict[Path, Pos], source: str) -> None:
    """Record the (line, column) of every mapping key and list item; refuse non-scalar and
    duplicate keys."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            where = _pos(key_node.start_mark)
            if not isinstance(key_node, yaml.ScalarNode):
                raise ConfigError(
                    "mapping keys must be plain names", source=source, **_at(where), key=_dotted(path) or None
                )
            key = key_node.value
            if key in seen:
                raise ConfigError(
                    f"duplicate key (first on line {seen[key]})",
                    source=source,
                    **_at(where),
                    key=_dotted(path + (key,)),
                )
            seen[key] = where[0]
            lines[path + (key,)] = where
            _index_lines(value_node, path + (key,), lines, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = _pos(item.start_mark)
            _index_lines(item, path + (i,), lines, source)


def _dotted(path: Path) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


_SPEC_PREFIXES: tuple[tuple[str, Path], ...] = (
    ("spec.env_config", ("env",)),
    ("spec.hyperparameters", ("hyperparameters",)),
    ("spec.resources.gpu_count", ("gpu_count",)),
    ("spec.resources.nodes", ("nodes",)),
    ("spec.limits.max_runtime", ("max_runtime",)),
    ("spec.limits.max_attempts", ("max_attempts",)),
    ("spec.init_from", ("init_from",)),
    ("spec.tracking", ("tracking",)),
    ("spec", ()),
)
_PATH_PART = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")


def _spec_field_to_path(spec_field: str) -> Path | None:
    """``spec.hyperparameters.target_modules[1]`` -> ``("hyperparameters", "target_modules", 1)``."""
    for prefix, base in _SPEC_PREFIXES:
        if spec_field == prefix or spec_field.startswith(prefix + ".") or spec_field.startswith(prefix + "["):
            rest = spec_field[len(prefix) :]
            parts: list[Any] = list(base)
            for m in _PATH_PART.finditer(rest):
                parts.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
            return tuple(parts)
    return None


def _line_for(path: Path, lines: dict[Path, Pos]) -> Pos | None:
    """(line, column) of ``path``, or of its nearest parent that is in the file."""
    for n in range(len(path), 0, -1):
        line = lines.get(path[:n])
        if line is not None:
            return line
    return None


def _value_at(data: Any, path: Path) -> Any:
    """The loaded value at ``path`` in ``data``, or ``None`` when there is none."""
    for part in path:
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            return None
    return data


def _type_ok(key: str, value: Any) -> bool:
    if value is None:
        return key != "workload_type"
    if key in ("name", "workload_type", "model", "init_from", "dataset"):
        return isinstance(value, str)
    if key in ("gpu_count", "nodes", "priority", "max_attempts"):
        return isinstance(value, int) and not isinstance(value, bool)
    if key == "max_runtime":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if key in ("env", "hyperparameters", "tracking"):
        return isinstance(value, Mapping)
    return False  # pragma: no cover


def parse_task_config(text: str, *, source: str = "<string>", check: bool = True) -> TaskConfig:
    """Parse and validate a task config from YAML text (see the module docs for the format).

    Args:
        text: the YAML document.
        source: name used in error messages (the file name).
        check: False leaves out the spec check (values and their combination), keeping the YAML,
            key and type checks: for a file that overrides complete (:func:`load_with_overrides`).

    Raises:
        ConfigError: not YAML, not a mapping, an unknown or duplicate key, a wrong type or a bad
            value (a YAML 1.1 boolean word such as ``no`` where a boolean is wanted is refused
            with a hint); ``err.line``, ``err.column`` (1-based) and ``err.key`` say where.
    """
    typos = every_typography(text)  # “quotes” and • bullets pasted from a document: named, before YAML misreads them
    if typos:
        raise ConfigError.combine([ConfigError(t.message, source=source, line=t.line, column=t.column) for t in typos])
    try:
        root = compose_yaml(text)
    except DocumentError as err:
        raise ConfigError(err.problem, source=source, line=err.line, column=err.column) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"not valid YAML: {problem}", source=source, **_at(_pos(mark) if mark else None)) from None
    if root is None:
        raise ConfigError(
            "the file is empty; expected a mapping with at least workload_type", source=source, **_at(_START)
        )
    root_pos = _pos(root.start_mark)
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError("expected a mapping of keys to values at the top level", source=source, **_at(root_pos))
    lines: dict[Path, Pos] = {}
    _index_lines(root, (), lines, source)
    try:
        data = construct_yaml(root)
    except yaml.YAMLError as err:  # e.g. a bad !!tag that composes but does not construct
        mark = getattr(err, "problem_mark", None)
        raise ConfigError(
            f"not valid YAML: {getattr(err, 'problem', err)}", source=source, **_at(_pos(mark) if mark else None)
        ) from None

    problems: list[ConfigError] = []  # every top-level problem, then raised together
    for key in data:
        if key not in _KEYS:
            problems.append(
                ConfigError(
                    f"unknown key, expected one of the known keys ({', '.join(_KEYS)})"
                    + (f"; {hint}" if (hint := did_you_mean(key, _KEYS, _ALIASES)) else ""),
                    source=source,
                    **_at(lines.get((str(key),))),
                    key=str(key),
                )
            )
    if "workload_type" not in data:
        problems.append(
            ConfigError(f"missing workload_type ({_KEYS['workload_type']})", source=source, **_at(root_pos))
        )
    for key, value in data.items():
        if key in _KEYS and not _type_ok(key, value):
            problems.append(
                ConfigError(
                    f"expected {_KEYS[key]}, got {short_repr(value)}", source=source, **_at(lines.get((key,))), key=key
                )
            )
    if problems:
        # The other keys are still checked (a compiler's whole list, not one error a run): the
        # spec check runs on the keys that are well typed, and what it says of a key that is
        # already named (or of what depends on it) is left out. A missing workload_type, or one
        # that is not a string, is checked as an unknown one: the fields that do not depend on it.
        named = {p.key for p in problems if p.key}
        if check:
            usable = {k: v for k, v in data.items() if k in _KEYS and _type_ok(k, v)}
            if not isinstance(usable.get("workload_type"), str):
                named.add("workload_type")
                usable["workload_type"] = ""
            if named & {"env", "dataset"} and env_kinds_for(usable["workload_type"]) == ("dataset",):
                # its data is named above: judge the rest as if a dataset file were given
                usable = {**{k: v for k, v in usable.items() if k != "env"}, "dataset": "train.jsonl"}
            for p in _spec_problems(_task_config(usable, source), usable, lines, source, root_pos):
                if not _depends_on_named(p.key, named):
                    problems.append(p)
        raise ConfigError.combine(problems)
    cfg = _task_config(data, source)
    if not check:
        return cfg
    problems = _spec_problems(cfg, data, lines, source, root_pos)
    if problems:
        raise ConfigError.combine(problems)
    # Values a Struct cannot carry (dates, huge integers) are refused here, with their line.
    for part in ("env", "hyperparameters"):
        try:
            dict_to_struct(getattr(cfg, part))
        except ValueError as err:
            msg = str(err)
            sub = msg.split(":", 1)[0]
            path = (part,) + tuple(
                m.group(1) if m.group(1) is not None else int(m.group(2)) for m in _PATH_PART.finditer("." + sub)
            )
            raise ConfigError(
                msg.split(": ", 1)[-1], source=source, **_at(_line_for(path, lines)), key=f"{part}.{sub}"
            ) from None
    return cfg


def _task_config(data: Mapping[str, Any], source: str) -> TaskConfig:
    """The :class:`TaskConfig` of a document whose top-level keys are known and well typed."""

    def opt(key: str, default: Any) -> Any:
        value = data.get(key)
        return default if value is None else value

    return TaskConfig(
        workload_type=data["workload_type"],
        name=opt("name", ""),
        model=opt("model", ""),
        gpu_count=opt("gpu_count", 0),
        nodes=opt("nodes", 1),
        priority=data.get("priority"),
        max_runtime=float(data["max_runtime"]) if data.get("max_runtime") is not None else None,
        max_attempts=data.get("max_attempts"),
        env=dict(opt("env", {})),
        hyperparameters=dict(opt("hyperparameters", {})),
        init_from=opt("init_from", ""),
        tracking=dict(opt("tracking", {})),
        dataset=_beside(source, opt("dataset", "")),
        source=source,
    )


def _depends_on_named(key: str | None, named: set[str]) -> bool:
    """Whether a spec problem of file key ``key`` is about a top-level key in ``named`` (already
    reported), or depends on one: a dataset problem on ``env`` and ``dataset`` both (either may
    carry the data)."""
    if not key:
        return False
    top = re.split(r"[.\[]", key, maxsplit=1)[0]
    return top in named or (top == "dataset" and bool(named & {"env", "dataset"}))


def _spec_problems(
    cfg: TaskConfig, data: Mapping[str, Any], lines: dict, source: str, root_pos: Pos
) -> list[ConfigError]:
    """What the spec check says of ``cfg``, each problem at its line in the file; [] when valid.

    The hyperparameters a workload takes depend on its type, so with an unknown
    ``workload_type`` they cannot be checked: a problem at ``hyperparameters`` says so, beside
    the problems of the fields checked without the type (env, gpu_count, ...)."""
    unchecked = []
    if cfg.workload_type not in WORKLOAD_TYPES and cfg.hyperparameters:
        unchecked.append(
            ConfigError(
                "not checked: the keys and values a workload takes depend on workload_type, which is not one of "
                "the known ones; fix workload_type to have them checked",
                source=source,
                **_at(lines.get(("hyperparameters",))),
                key="hyperparameters",
            )
        )
    return _spec_check_problems(cfg, data, lines, source, root_pos) + unchecked


def _spec_check_problems(
    cfg: TaskConfig, data: Mapping[str, Any], lines: dict, source: str, root_pos: Pos
) -> list[ConfigError]:
    """:func:`_spec_problems` of the spec check alone."""
    try:
        _check_parts(cfg)
    except SpecError as err:
        if err.field == "spec.dataset" and not cfg.dataset:
            # sft with neither `dataset:` nor `env:`: the env_id is the default, not anything in the file
            return [
                ConfigError(
                    f"{data['workload_type']} needs a dataset: add `dataset: train.jsonl` (a local JSONL file of "
                    'chat examples, one {"messages": [...]} per line, uploaded at submit), or `env: {env_id: '
                    "chat_jsonl, path: /data/train.jsonl}` for a file on the trainer nodes",
                    source=source,
                    **_at(lines.get(("workload_type",))),
                    key="dataset",
                )
            ]
        return [_file_problem(p, data, lines, source, root_pos) for p in err.problems]
    return []


def _file_problem(err: SpecError, data: Mapping[str, Any], lines: dict, source: str, root_pos: Pos) -> ConfigError:
    """One spec refusal as the file's error: the key as the file spells it, at its line."""
    path = _spec_field_to_path(err.field)
    key = _dotted(path) if path else err.field
    detail = _detail(err)
    hint = yaml11_bool_hint(_value_at(data, path)) if path and err.expected == "true or false" else None
    if hint:
        detail = f"expected {err.expected}; {hint}"
    return ConfigError(detail, source=source, **_at(_line_for(path, lines) if path else root_pos), key=key or None)


def _detail(err: SpecError) -> str:
    """A spec refusal's words without its field path (the caller names the key as the file does)."""
    detail = err.detail.removeprefix(err.field + ": ")
    return "unknown key, " + detail if err.expected.startswith("one of the known keys") else detail


def _beside(source: str, file: str) -> str:
    """``file`` relative to the folder of the config file ``source`` (when it is a file)."""
    if not file or os.path.isabs(file) or not os.path.isfile(source):
        return file
    return os.path.join(os.path.dirname(source), file)


def load_task_config(path: str | os.PathLike[str]) -> TaskConfig:
    """Read and validate a task config file (see the module docs for the format).

    Raises:
        OSError: the file cannot be read (e.g. :class:`FileNotFoundError`).
        ConfigError: the content is not a valid task config; the message names the file, the
            line and column, and the key.
    """
    path = os.fspath(path)
    return parse_task_config(read_task_file(path), source=path)


def read_task_file(path: str | os.PathLike[str]) -> str:
    """The text of the task file at ``path``, read once and at most ``max_bytes`` (1 MiB) plus
    one byte of it from any kind of file: a regular file, a pipe, a FIFO, ``/dev/zero``.

    Raises:
        OSError: the file cannot be read.
        ConfigError: the file is longer than ``max_bytes``.
        UnicodeDecodeError: the file is not UTF-8.
    """
    path = os.fspath(path)
    limit = DEFAULT_LIMITS.max_bytes
    with open(path, "rb") as fh:
        data = fh.read(limit + 1)
        if len(data) > limit:
            size = os.fstat(fh.fileno()).st_size if os.path.isfile(path) else 0
            got = str(size) if size > limit else "more"
            raise ConfigError(f"expected a document of at most {limit} bytes (max_bytes), got {got}", source=path)
    return data.decode("utf-8")


def load_with_overrides(path: str | os.PathLike[str], overrides: Iterable[str]) -> TaskConfig:
    """The task file at ``path`` with ``KEY=VALUE`` ``overrides`` applied (``opentinker submit
    --set``): :func:`load_task_config`, then :func:`apply_overrides`. A file that is valid only
    with its overrides (a template whose ``dataset`` or ``env.env_id`` comes from ``--set``) is
    taken too: when the file alone is refused, it is read without the spec check and checked
    once the overrides are in.

    Raises:
        OSError: the file cannot be read.
        ConfigError: an override's own error (naming the override) when the file alone is valid;
            when it is not, the file's error (file:line:col) unless the overrides complete it.
    """
    overrides = list(overrides)
    path = os.fspath(path)
    text = read_task_file(path)  # once: a pipe or FIFO cannot be read again
    try:
        cfg = parse_task_config(text, source=path)
    except ConfigError as file_error:
        if not overrides:
            raise
        try:
            return apply_overrides(parse_task_config(text, source=path, check=False), overrides)
        except ConfigError:
            raise file_error from None
    return apply_overrides(cfg, overrides)


#: Keys of the file that hold a mapping: ``--set`` names a value inside one, dotted (``env.max_digits``).
_MAPPING_KEYS = ("env", "hyperparameters", "tracking")
#: Keys of the file ``--set`` sets whole (each a TaskConfig field of the same name).
_SCALAR_KEYS = tuple(k for k in _KEYS if k not in _MAPPING_KEYS)
#: What an empty ``--set KEY=`` sets each scalar key back to (the TaskConfig default).
_UNSET = {"gpu_count": 0, "nodes": 1, "priority": None, "max_runtime": None, "max_attempts": None}


def apply_overrides(cfg: TaskConfig, overrides: Iterable[str]) -> TaskConfig:
    """``cfg`` with ``KEY=VALUE`` overrides applied, in order, then checked (``opentinker submit
    --set``): ``KEY`` is a key of the file, dotted into ``env``, ``hyperparameters`` and ``tracking``
    (``hyperparameters.steps=20``, ``env.max_digits=2``, ``tracking.tensorboard=/runs``,
    ``gpu_count=1``, ``nodes=2``, ``model=Qwen/...``); ``VALUE`` is read as YAML 1.2 (``20`` an int,
    ``2e-4`` a float, ``true`` a bool, ``x`` a string; ``null`` (or ``~``) removes a key of a mapping
    and sets a top-level key back to its default; an empty value is refused, as is a mapping key
    without a key inside it, ``hyperparameters=3``). A bad value is refused in the same words as
    in the file.

    Raises:
        ConfigError: a malformed override, an unknown key, or a value the spec refuses; the
            message names the override (``--set hyperparameters.stesp=20: unknown key ...``).
    """
    given: list[tuple[str, str]] = []  # (key, "--set KEY=VALUE")
    for item in overrides:
        source = f"--set {item}"
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError("expected KEY=VALUE (e.g. hyperparameters.steps=20)", source=source)
        typo = find_typography(text)
        if typo is not None:
            raise ConfigError(typo.message, source=source)
        parts = key.split(".")
        top = parts[0]
        if top in _MAPPING_KEYS and len(parts) == 1:  # `--set hyperparameters=3`: the mapping itself
            example = {"env": "env.max_digits=2", "tracking": "tracking.tensorboard=/runs"}.get(top, f"{top}.steps=20")
            raise ConfigError(
                f"expected a key inside it, dotted: {top}.KEY=VALUE (e.g. {example}); {top} is a mapping",
                source=source,
                key=top,
            )
        if not text.strip():  # `--set KEY=` (an unset shell variable, say): never silently a default
            raise ConfigError(
                f"no value after '='; expected {key}=VALUE, or {key}=null to "
                + ("remove it and use its default" if len(parts) > 1 else "set it back to its default"),
                source=source,
                key=key,
            )
        try:
            value = load_yaml(text)
        except DocumentError as err:
            raise ConfigError(f"the value is not valid: {err.problem}", source=source) from None
        except yaml.YAMLError as err:
            raise ConfigError(f"the value is not valid YAML: {getattr(err, 'problem', err)}", source=source) from None
        if top in _MAPPING_KEYS and len(parts) > 1:
            tree = _deep_copy(getattr(cfg, top))
            node = tree
            for part in parts[1:-1]:
                child = node.get(part)
                if child is None:
                    child = node[part] = {}
                elif not isinstance(child, dict):
                    raise ConfigError(f"{'.'.join(parts[:-1])} is {child!r}, not a mapping", source=source)
                node = child
            if value is None:
                node.pop(parts[-1], None)
            else:
                node[parts[-1]] = value
            cfg = dataclasses.replace(cfg, **{top: tree})
        elif len(parts) == 1 and top in _SCALAR_KEYS:
            if value is not None and not _type_ok(top, value):
                raise ConfigError(f"expected {_KEYS[top]}, got {value!r}", source=source, key=top)
            new = _UNSET.get(top, "") if value is None else value
            if top == "max_runtime" and new is not None:
                new = float(new)
            if top == "dataset" and new:  # a path on the command line: from the current folder
                new = os.path.abspath(new)
            cfg = dataclasses.replace(cfg, **{top: new})
        else:
            known = ", ".join([*_SCALAR_KEYS, *(f"{k}.KEY" for k in _MAPPING_KEYS)])
            hint = did_you_mean(top, list(_KEYS))
            raise ConfigError(
                f"unknown key {key!r}; expected one of {known}" + (f"; {hint}" if hint else ""), source=source
            )
        given.append((key, source))
    try:  # once all are applied: two overrides may only make sense together
        _check_parts(cfg)
    except SpecError as err:
        problems = []
        for problem in err.problems:
            path = _spec_field_to_path(problem.field)
            dotted = _dotted(path) if path else ""
            named = [
                src for key, src in given if dotted == key or dotted.startswith(key + ".") or key.startswith(dotted)
            ]
            source = named[-1] if named and dotted else "; ".join(src for _, src in given) or cfg.source or "<config>"
            problems.append(  # in the words of the file's errors
                ConfigError(_detail(problem) if dotted else problem.detail, source=source, key=dotted or None)
            )
        raise ConfigError.combine(problems) from None
    return cfg


def _deep_copy(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in mapping.items()}
