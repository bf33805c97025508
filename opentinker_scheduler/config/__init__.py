"""Scheduler configuration (``scheduler_config.yaml``), in the seed's form.

.. code-block:: yaml

    resource_pool:            # nodes the scheduler expects
      - node_id: gpu-node-01
        gpu_count: 4          # GPUs placed on; the smaller of this and what NVML finds wins
        max_tasks: 8          # most tasks the node runs at once
    workload_types:
      - type: lora_finetune
        priority: 1
      - type: full_rl
        priority: 2
    # optional, with defaults:
    state_dir: ./state        # SQLite database (WAL) lives here
    allow_unknown_nodes: true # nodes not in resource_pool may join (dynamic scale-out)
    unknown_node_max_tasks: 4
    heartbeat_interval: 2     # seconds between node heartbeats
    lease: 10                 # seconds of silence after which a node is lost
    default_model: ""         # model used when a task names none
    default_max_attempts: 3
    max_node_losses: 3        # node losses (kill -9, lease ran out) a task goes through before it
                              # ends FAILED; they do not use up max_attempts
    restart_grace: 30         # seconds a restarted scheduler waits for nodes to re-announce work
    forget_disconnected_after: 600 # seconds after which a disconnected node that is not in
                              # resource_pool and holds no task is dropped from ListNodes
    max_tasks_per_gpu: 2      # LoRA tasks on the same base model may share a GPU, this many at
                              # most (always within max_tasks); 1 = every task has its GPUs alone
    preemption_timeout: 120   # seconds a preemption waits for its victims' node to confirm they
                              # stopped before the scheduler gives up on it and may choose again
    gang_rendezvous_ports: [29500, 29999] # TCP ports (inclusive) a multi-node task's first node may
                              # be told to host its torch.distributed rendezvous on
    auth: {enabled: false}    # API keys and roles; production turns this on (config/auth.py, security/auth.py)
    tls: {cert: ..., key: ...} # TLS, and mTLS for nodes with client_ca (config/tls.py)
    http_tls: {cert: ..., key: ...} # HTTPS on the HTTP port (/health, /metrics); config/tls.py
    http_metrics_token_file: scrape.token # /metrics only with "Authorization: Bearer <token>"
                              # (HTTP port and gRPC port's HTTP answers; /health, /ready stay open)
    http_on_grpc_port: true   # also answer HTTP/1.1 GET /health and /metrics on the gRPC port
                              # (the seed curls it); plaintext only: with tls: it is off
    limits: {...}             # message/spec sizes, pending tasks, submit rate, streams (security/limits.py)
    store: {kind: sqlite}     # or {kind: postgres, dsn: ..., password_env: ...}: several schedulers,
                              # one leader (config/store.py, state/pg_store.py, state/leadership.py)
    paths:                    # local paths a task spec may name on trainer nodes (admission/paths.py)
      model_dirs: [/models]   # spec.model may name a local folder only under these
      data_dirs: [/data]      # env_config.path (chat_jsonl) may name a file only under these
                              # unset: anything with auth off, no local path at all with auth on
    queues: [...]             # quota queues shared by teams, fair share, borrowing (config/queues.py)
    default_queue: ""         # the queue of owners no queue lists ("": each is a queue of its own)
    usage: {prices: {spot: 0.9}} # price per GPU-hour by node class, for usage accounting (config/usage.py)
    model_names:              # Tinker model names -> local model folders, for Tinker API gateways
      - {name: HuggingFaceTB/SmolLM2-135M-Instruct, folder: /models/SmolLM2-135M-Instruct} # (config/model_names.py)
    artifacts:                # checkpoints: backend local (default) or s3, retention (config/artifacts.py)
      backend: local
      keep_checkpoints: 3

**Priority**: a larger number is more important. Pending tasks are placed in order of
priority (largest first), then age (oldest first). A workload type missing from
``workload_types`` cannot be submitted. Priorities are integers in [-1000, 1000]. A config
without ``workload_types`` allows all five: lora_finetune 1, full_rl 2, sft 1, inference 3, lora_session 3.

Unknown keys and wrong types are refused at start with the file, line, column and key named
(:class:`ConfigError`, e.g. ``scheduler_config.yaml:2:12: auth.enabled: expected true or false; 'no' is
a string in YAML 1.2 — write false``). The file is read as YAML 1.2
(:class:`opentinker_common.yaml12.Yaml12Loader`): only ``true``/``false`` are booleans, so
``default_model: no`` is the string ``"no"``. Each section's frozen value and parser lives in this package
(:mod:`.auth`, :mod:`.tls`, :mod:`.limits`, :mod:`.paths`, :mod:`.artifacts`, :mod:`.store`), so every room,
:mod:`..state` included,
may read the settings without importing a room above it; the rooms enforce them.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from opentinker_common.documents import DocumentError, compose_yaml
from opentinker_common.yaml12 import Yaml12Loader, every_typography, tag_name, yaml11_bool_hint
from opentinker_common.spec import WORKLOAD_TYPES, did_you_mean

from opentinker_scheduler.config.artifacts import ArtifactsConfig, parse_artifacts
from opentinker_scheduler.config.auth import AuthConfig, parse_auth
from opentinker_scheduler.config.limits import LimitsConfig, parse_limits
from opentinker_scheduler.config.paths import PathsConfig, parse_paths
from opentinker_scheduler.config.queues import QueueConfig, check_queue_name, parse_queues
from opentinker_scheduler.config.model_names import ModelName, parse_model_names
from opentinker_scheduler.config.usage import UsageConfig, parse_usage
from opentinker_scheduler.config.store import StoreConfig, parse_store
from opentinker_scheduler.config.tls import HttpTlsConfig, TlsConfig, parse_http_tls, parse_tls


class ConfigError(ValueError):
    """The scheduler config is invalid; the message reads ``file:line:column: key: expected ...``
    (1-based line and column of the offending node; a file that cannot be read names the file
    only)."""


@dataclass(frozen=True)
class PoolNode:
    node_id: str
    gpu_count: int
    max_tasks: int


@dataclass(frozen=True)
class WorkloadTypeConfig:
    type: str
    priority: int


@dataclass(frozen=True)
class SchedulerConfig:
    resource_pool: tuple[PoolNode, ...] = ()
    # Used when the config has no workload_types: every workload, serving first.
    workload_types: tuple[WorkloadTypeConfig, ...] = (
        WorkloadTypeConfig("lora_finetune", 1),
        WorkloadTypeConfig("full_rl", 2),
        WorkloadTypeConfig("sft", 1),
        WorkloadTypeConfig("inference", 3),
        WorkloadTypeConfig("lora_session", 3),
    )
    state_dir: Path = Path("state")
    allow_unknown_nodes: bool = True
    unknown_node_max_tasks: int = 4
    heartbeat_interval_s: float = 2.0
    lease_s: float = 10.0
    default_model: str = ""
    default_max_attempts: int = 3
    #: The node loss of a task's attempt that ends it FAILED (the earlier ones are handed back).
    max_node_losses: int = 3
    restart_grace_s: float = 30.0
    forget_disconnected_after_s: float = 600.0
    max_tasks_per_gpu: int = 2
    preemption_timeout_s: float = 120.0
    #: ``(low, high)``, inclusive: ports a gang's member 0 hosts its rendezvous on (one per gang).
    gang_rendezvous_ports: tuple[int, int] = (29500, 29999)
    source: str = "<defaults>"
    auth: AuthConfig = AuthConfig()
    tls: TlsConfig | None = None
    limits: LimitsConfig = LimitsConfig()
    #: HTTPS on the HTTP port (``http_tls:``); None = plain HTTP.
    http_tls: HttpTlsConfig | None = None
    #: The bearer token ``/metrics`` wants (``http_metrics_token_file:``, read at start); None = open.
    http_metrics_token: str | None = field(default=None, repr=False)
    #: Local paths a spec may name (``paths:``); see opentinker_scheduler/admission/paths.py.
    paths: PathsConfig = PathsConfig()
    #: Where checkpoints live and how many are kept (``artifacts:``); see config/artifacts.py.
    artifacts: ArtifactsConfig = ArtifactsConfig()
    #: Answer HTTP/1.1 /health and /metrics on the (plaintext) gRPC port too (api/front.py).
    http_on_grpc_port: bool = True
    #: Where the state lives (``store:``): SQLite (default) or PostgreSQL; see config/store.py.
    store: StoreConfig = StoreConfig()
    #: Quota queues (``queues:``); see config/queues.py and policy/quota.py.
    queues: tuple[QueueConfig, ...] = ()
    #: The queue of owners that no queue lists ("": each owner is a queue of its own, no quota).
    default_queue: str = ""
    #: Prices per GPU-hour by node class (``usage:``); see config/usage.py and state/usage.py.
    usage: UsageConfig = UsageConfig()
    #: Tinker model names and their local folders (``model_names:``); see config/model_names.py.
    model_names: tuple[ModelName, ...] = ()

    def priority_of(self, workload_type: str) -> int | None:
        for w in self.workload_types:
            if w.type == workload_type:
                return w.priority
        return None

    @property
    def workload_names(self) -> tuple[str, ...]:
        return tuple(w.type for w in self.workload_types)

    def pool_node(self, node_id: str) -> PoolNode | None:
        for n in self.resource_pool:
            if n.node_id == node_id:
                return n
        return None


# ---------------------------------------------------------------------------------------------


class _Reader:
    """Walks a composed YAML node tree, producing errors with file, line and column."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, node: yaml.Node | None, key: str, expected: str) -> ConfigError:
        """``file:line:column: key: expected ...`` at ``node``'s start (1-based); without a node
        the file only."""
        return ConfigError(
            f"{_where(self.source, node.start_mark if node is not None else None)}: {key}: expected {expected}"
        )

    def untagged(self, node: yaml.Node, key: str, want: str, tags: tuple[str, ...]) -> None:
        """Refuse an explicit YAML tag (``!!set``, ``!!python/...``, ``!foo``) other than ``tags``."""
        if node.tag not in tags:
            raise self.fail(node, key, f"{want}, without a YAML tag; got the tag {tag_name(node.tag)}")

    def mapping(self, node: yaml.Node, key: str, allowed: dict[str, str]) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, key, "a mapping")
        self.untagged(node, key or "the top level", "a mapping", (_MAP_TAG,))
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in node.value:
            name = k.value if isinstance(k, yaml.ScalarNode) else None
            path = f"{key}.{name}" if key else str(name)
            if name not in allowed:
                hint = did_you_mean(name, allowed)
                raise self.fail(
                    k,
                    path,
                    f"one of the known keys ({', '.join(sorted(allowed))}); unknown key"
                    + (f"; {hint}" if hint else ""),
                )
            if name in out:
                raise self.fail(k, path, "each key once; duplicate key")
            out[name] = (k, v)
        return out

    def scalar(self, node: yaml.Node, key: str, kind: type, lo: float | None = None, hi: float | None = None):
        want = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[kind]
        if lo is not None and hi is not None:
            want += f" in [{lo}, {hi}]"
        elif lo is not None:
            want += f" >= {lo}"
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, key, want)
        self.untagged(node, key, want, _SCALAR_TAGS)
        try:
            value = yaml.load(yaml.serialize(node), Loader=Yaml12Loader)
        except (yaml.YAMLError, ValueError, TypeError):  # "!!int abc", "!!float x": the tag does not fit the text
            hint = yaml11_bool_hint(node.value) if kind is bool else None
            got = f"{tag_name(node.tag)} {node.value!r} ({node.value!r} is not a valid {tag_name(node.tag)})"
            raise self.fail(node, key, f"{want}, got {got}" + (f"; {hint}" if hint else "")) from None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is float and isinstance(value, float) and not math.isfinite(value):
            raise self.fail(node, key, f"{want}, got {node.value!r}")
        if kind is str and value is None:
            value = ""
        hint = yaml11_bool_hint(value) if kind is bool else None
        if hint:
            raise self.fail(node, key, f"{want}; {hint}")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(node, key, f"{want}, got {node.value!r}")
        if lo is not None and value < lo or hi is not None and value > hi:
            raise self.fail(node, key, f"{want}, got {value!r}")
        return value

    def sequence(self, node: yaml.Node, key: str) -> list[yaml.Node]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.fail(node, key, "a list")
        self.untagged(node, key, "a list", (_SEQ_TAG,))
        return list(node.value)


_MAP_TAG, _SEQ_TAG = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"
#: The scalar tags a config value may carry (implicit, or written as !!str, !!int ...).
_SCALAR_TAGS = tuple(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null"))


def _where(source: str, mark: yaml.Mark | None) -> str:
    """``source:line:column`` (1-based) of ``mark``; ``source`` alone without one."""
    return source if mark is None else f"{source}:{mark.line + 1}:{mark.column + 1}"


_TOP = {
    "resource_pool": "list of nodes",
    "workload_types": "list of workload types",
    "state_dir": "folder",
    "allow_unknown_nodes": "bool",
    "unknown_node_max_tasks": "int",
    "heartbeat_interval": "seconds",
    "lease": "seconds",
    "default_model": "model",
    "default_max_attempts": "int",
    "max_node_losses": "int",
    "restart_grace": "seconds",
    "forget_disconnected_after": "seconds",
    "max_tasks_per_gpu": "int",
    "preemption_timeout": "seconds",
    "gang_rendezvous_ports": "[low, high] TCP ports",
    "auth": "API keys",
    "tls": "TLS files",
    "http_tls": "HTTPS files",
    "http_metrics_token_file": "file",
    "limits": "limits",
    "paths": "local paths",
    "artifacts": "artifact store",
    "http_on_grpc_port": "bool",
    "store": "state store",
    "queues": "quota queues",
    "default_queue": "queue name",
    "usage": "usage accounting",
    "model_names": "Tinker model names",
}


@contextlib.contextmanager
def _collected(errors: list[str]):
    """Adds the message of a :class:`ConfigError` raised inside to ``errors`` and goes on."""
    try:
        yield
    except ConfigError as exc:
        errors.append(str(exc))


def _file_order(message: str) -> tuple[int, int]:
    """(line, column) of a ``source:line:column: ...`` message; (0, 0) without them."""
    m = re.search(r":(\d+):(\d+): ", message)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


#: Top-level keys that are one scalar each: key, SchedulerConfig field, type and its bounds.
_SCALARS: tuple[tuple, ...] = (
    ("allow_unknown_nodes", "allow_unknown_nodes", bool),
    ("http_on_grpc_port", "http_on_grpc_port", bool),
    ("unknown_node_max_tasks", "unknown_node_max_tasks", int, 1, 10_000),
    ("heartbeat_interval", "heartbeat_interval_s", float, 0.05, 3600),
    ("lease", "lease_s", float, 0.1, 86400),
    ("default_max_attempts", "default_max_attempts", int, 1, 100),
    ("max_node_losses", "max_node_losses", int, 1, 100),
    ("restart_grace", "restart_grace_s", float, 0, 86400),
    ("forget_disconnected_after", "forget_disconnected_after_s", float, 1, 365 * 86400),
    ("max_tasks_per_gpu", "max_tasks_per_gpu", int, 1, 1000),
    ("preemption_timeout", "preemption_timeout_s", float, 1, 86400),
)


def parse_config(text: str, source: str = "<string>", *, base_dir: Path | None = None) -> SchedulerConfig:
    """Parse and validate config text.

    Raises:
        ConfigError: YAML syntax, unknown key, wrong type or value out of range (a YAML 1.1
            boolean word such as ``no`` for a boolean key, with a hint), with file:line:column.
    """
    r = _Reader(source)
    typos = every_typography(text)
    if typos:  # before YAML reads it: "mapping values are not allowed here" names neither character
        raise ConfigError("\n".join(f"{source}:{t.line}:{t.column}: {t.message}" for t in typos))
    try:
        root = compose_yaml(text)
    except DocumentError as exc:
        at = f":{exc.line}:{exc.column}" if exc.line is not None else ""
        raise ConfigError(f"{source}{at}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        detail = str(exc).replace('"<unicode string>"', source)
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        raise ConfigError(f"{_where(source, mark)}: not valid YAML: {detail}") from None
    if root is None:
        return SchedulerConfig(source=source)
    if not isinstance(root, yaml.MappingNode):
        r.mapping(root, "", _TOP)  # raises: the top level is not a mapping
    # Every top-level key is checked, and each error is reported: one run shows them all.
    errors: list[str] = []
    known = []
    for pair in root.value:
        with _collected(errors):
            r.mapping(yaml.MappingNode(root.tag, [pair]), "", _TOP)
            known.append(pair)
    top: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    with _collected(errors):
        top = r.mapping(yaml.MappingNode(root.tag, known), "", _TOP)
    kw: dict[str, Any] = {"source": source}

    with _collected(errors):
        if "resource_pool" in top:
            pool, seen = [], set()
            for i, item in enumerate(r.sequence(top["resource_pool"][1], "resource_pool")):
                path = f"resource_pool[{i}]"
                m = r.mapping(item, path, {"node_id": "", "gpu_count": "", "max_tasks": ""})
                if "node_id" not in m:
                    raise r.fail(item, f"{path}.node_id", "a node id (required)")
                node_id = r.scalar(m["node_id"][1], f"{path}.node_id", str)
                if not node_id or len(node_id) > 128:
                    raise r.fail(m["node_id"][1], f"{path}.node_id", "a non-empty id of at most 128 characters")
                if node_id in seen:
                    raise r.fail(m["node_id"][1], f"{path}.node_id", f"a unique node id; {node_id!r} appears twice")
                seen.add(node_id)
                gpus = r.scalar(m["gpu_count"][1], f"{path}.gpu_count", int, 0, 1024) if "gpu_count" in m else 0
                max_tasks = (
                    r.scalar(m["max_tasks"][1], f"{path}.max_tasks", int, 1, 10_000)
                    if "max_tasks" in m
                    else max(1, gpus or 1)
                )
                pool.append(PoolNode(node_id, gpus, max_tasks))
            kw["resource_pool"] = tuple(pool)

    with _collected(errors):
        if "workload_types" in top:
            wts, seen = [], set()
            for i, item in enumerate(r.sequence(top["workload_types"][1], "workload_types")):
                path = f"workload_types[{i}]"
                m = r.mapping(item, path, {"type": "", "priority": ""})
                if "type" not in m:
                    raise r.fail(item, f"{path}.type", f"one of {', '.join(WORKLOAD_TYPES)} (required)")
                wtype = r.scalar(m["type"][1], f"{path}.type", str)
                if wtype not in WORKLOAD_TYPES:
                    raise r.fail(m["type"][1], f"{path}.type", f"one of {', '.join(WORKLOAD_TYPES)}, got {wtype!r}")
                if wtype in seen:
                    raise r.fail(m["type"][1], f"{path}.type", f"each workload type once; {wtype!r} appears twice")
                seen.add(wtype)
                prio = r.scalar(m["priority"][1], f"{path}.priority", int, -1000, 1000) if "priority" in m else 0
                wts.append(WorkloadTypeConfig(wtype, prio))
            kw["workload_types"] = tuple(wts)

    with _collected(errors):
        if "state_dir" in top:
            p = Path(r.scalar(top["state_dir"][1], "state_dir", str))
            kw["state_dir"] = p if p.is_absolute() or base_dir is None else base_dir / p
    for key, attr, *kind in _SCALARS:
        with _collected(errors):
            if key in top:
                kw[attr] = r.scalar(top[key][1], key, *kind)
    with _collected(errors):
        if "default_model" in top:
            model = r.scalar(top["default_model"][1], "default_model", str)
            # A relative folder next to the config file is made absolute, so trainers started
            # from another directory find it; anything else is a hub id and stays as it is.
            if model and base_dir is not None and not Path(model).is_absolute() and (base_dir / model).exists():
                model = str((base_dir / model).resolve())
            kw["default_model"] = model
    with _collected(errors):
        if "gang_rendezvous_ports" in top:
            node = top["gang_rendezvous_ports"][1]
            items = r.sequence(node, "gang_rendezvous_ports")
            if len(items) != 2:
                raise r.fail(node, "gang_rendezvous_ports", "a list of two ports [low, high]")
            low, high = (r.scalar(n, "gang_rendezvous_ports", int, 1024, 65535) for n in items)
            if low > high:
                raise r.fail(node, "gang_rendezvous_ports", "[low, high] with low <= high")
            kw["gang_rendezvous_ports"] = (low, high)

    for key, parse in (
        ("auth", parse_auth),
        ("limits", parse_limits),
        ("paths", parse_paths),
        ("artifacts", parse_artifacts),
        ("store", parse_store),
        ("queues", parse_queues),
        ("usage", parse_usage),
    ):
        with _collected(errors):
            if key in top:
                kw[key] = parse(r, top[key][1])
    for key, parse_with_files in (("tls", parse_tls), ("http_tls", parse_http_tls), ("model_names", parse_model_names)):
        with _collected(errors):  # these name files relative to the config's folder
            if key in top:
                kw[key] = parse_with_files(r, top[key][1], base_dir)
    with _collected(errors):
        if "http_metrics_token_file" in top:
            from opentinker_common.net.side_port import read_scrape_token

            node = top["http_metrics_token_file"][1]
            text = r.scalar(node, "http_metrics_token_file", str)
            path = Path(text) if Path(text).is_absolute() or base_dir is None else base_dir / text
            try:
                kw["http_metrics_token"] = read_scrape_token(path, "http_metrics_token_file")
            except ValueError as exc:
                raise r.fail(node, "http_metrics_token_file", str(exc).split(": expected ", 1)[-1]) from None
    with _collected(errors):
        if "default_queue" in top:
            name = r.scalar(top["default_queue"][1], "default_queue", str)
            bad = check_queue_name(name) if name else None
            if bad:
                raise r.fail(top["default_queue"][1], "default_queue", f"{bad}, got {name!r}")
            kw["default_queue"] = name

    if errors:
        raise ConfigError("\n".join(sorted(errors, key=_file_order)))

    cfg = SchedulerConfig(**kw)
    if cfg.lease_s <= cfg.heartbeat_interval_s:
        node = top["lease"][1] if "lease" in top else root
        raise r.fail(node, "lease", f"more seconds than heartbeat_interval ({cfg.heartbeat_interval_s})")
    return cfg


def load_config(path: str | Path) -> SchedulerConfig:
    """Read ``path``; relative ``state_dir`` is resolved against the config file's folder.

    Raises:
        ConfigError: missing file or invalid content.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte {exc.start})") from None
    return parse_config(text, str(p), base_dir=p.resolve().parent)
