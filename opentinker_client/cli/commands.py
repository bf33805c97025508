"""The ``opentinker`` command: submit, watch, list, get and cancel tasks; list nodes.

::

    opentinker submit task.yaml --watch      # prints the task id, then follows it
    opentinker watch TASK_ID                 # a line per step (reward, loss) and per state change
    opentinker list --state running
    opentinker get TASK_ID
    opentinker cancel TASK_ID
    opentinker nodes                         # nodes and per-GPU telemetry
    opentinker logs TASK_ID [--follow]       # state changes, errors, checkpoints as lines
    opentinker plot TASK_ID -o curves.png    # reward and loss vs step (extra: plot)
    opentinker export TASK_ID --tensorboard runs/tb   # TensorBoard event files (extra: tensorboard)

The scheduler is ``--scheduler-url``, else ``$SCHEDULER_URL``, else ``localhost:8888``; the API key
is ``--api-key``, else ``$OPENTINKER_API_KEY``. TLS: ``--tls-ca`` or ``$OPENTINKER_TLS_CA`` (the
scheduler's CA; for mTLS also ``--tls-cert``/``--tls-key`` or ``$OPENTINKER_TLS_CERT``/``$OPENTINKER_TLS_KEY``);
an ``https://`` scheduler URL always means TLS (the system roots when no CA is given).
``opentinker keys ...`` manages API keys.

Exit codes: 0 success (for ``watch``: the task SUCCEEDED); 1 the task ended FAILED or CANCELLED;
2 an error (one line on stderr: ``error: INVALID_ARGUMENT: ...``); 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import sys
from typing import Any, Sequence

from opentinker_client.client import DEFAULT_SCHEDULER_URL, RLClient
from opentinker_client.types import TERMINAL_STATES, NodeInfo, TaskEvent, TaskInfo
from opentinker_client.errors import OpenTinkerError

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_TASK_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
_STATES = ("pending", "assigned", "running", "succeeded", "failed", "cancelled")
_STATE_STYLE = {
    "pending": "yellow",
    "assigned": "cyan",
    "running": "blue",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "magenta",
}


# ---------------------------------------------------------------------------------------------
# Formatting helpers.


def _console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Off a terminal (pipes, CI logs) rich would squeeze tables into 80 columns; allow wider lines.
    width = None if stream.isatty() else max(160, int(os.environ.get("COLUMNS", "0") or 0))
    return Console(file=stream, width=width, highlight=False)


def _fmt_num(value: Any, spec: str = ".4f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return format(value, spec)


def _fmt_time(value: _dt.datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.1f} GiB"


def _state(state: str) -> str:
    style = _STATE_STYLE.get(state)
    return f"[{style}]{state}[/{style}]" if style else state


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _total_steps(task: TaskInfo) -> int | None:
    """Steps the task will run, from its hyper-parameters (defaults filled in) when known."""
    steps = task.hyperparameters.get("steps")
    if isinstance(steps, (int, float)) and not isinstance(steps, bool) and steps > 0:
        return int(steps)
    try:
        from opentinker_common.spec import validate_env_config, validate_hyperparameters

        env = validate_env_config(dict(task.env_config))
        return int(validate_hyperparameters(task.workload_type, dict(task.hyperparameters), env=env).steps)
    except Exception:  # noqa: BLE001 - unknown workload or odd values: no total, no bar
        return None


@dataclasses.dataclass(frozen=True)
class _Units:
    """What a task's progress counts: ``total`` of ``unit``, read from each metric event by ``done``."""

    total: int
    unit: str  # "steps" | "env steps"

    def done(self, event: TaskEvent) -> float | None:
        if self.unit == "steps":
            return float(event.step)
        value = event.metrics.get("env_steps")
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

    def rate_hint(self, metrics: dict) -> float | None:
        """Units per second that one step's own metrics tell (before two steps have been seen)."""
        if self.unit == "steps":
            step_s = metrics.get("perf/step_s")
            return 1.0 / step_s if isinstance(step_s, (int, float)) and step_s > 0 else None
        rate = metrics.get("perf/env_steps_per_s")
        return float(rate) if isinstance(rate, (int, float)) and rate > 0 else None


def _units(task: TaskInfo) -> _Units | None:
    """PPO (``full_rl`` on environments) counts env steps of ``total_timesteps``; the rest, steps."""
    timesteps = task.hyperparameters.get("total_timesteps")
    if isinstance(timesteps, (int, float)) and not isinstance(timesteps, bool) and timesteps > 0:
        return _Units(int(timesteps), "env steps")
    steps = _total_steps(task)
    return _Units(steps, "steps") if steps else None


class _Eta:
    """The finish time estimated from the step times seen: the rate over the last ``window``
    metric events (their scheduler times), or, with one event only, the rate its own metrics
    report (``perf/step_s``, ``perf/env_steps_per_s``). Steps far slower than rich's own speed
    window (30 s) still get an estimate."""

    def __init__(self, units: _Units, window: int = 20) -> None:
        import collections

        self.units = units
        self.points: collections.deque = collections.deque(maxlen=window)  # (epoch seconds, done)
        self.hint: float | None = None

    def add(self, event: TaskEvent) -> None:
        done = self.units.done(event)
        if done is None:
            return
        when = event.time.timestamp() if event.time is not None else _dt.datetime.now(_dt.timezone.utc).timestamp()
        if self.points and done <= self.points[-1][1]:  # a resumed attempt reports steps again
            self.points.clear()
        self.points.append((when, done))
        self.hint = self.units.rate_hint(event.metrics) or self.hint

    def finish_time(self) -> float | None:
        """Epoch seconds when the task should be done, or None when nothing tells yet."""
        if not self.points:
            return None
        (t0, d0), (t1, d1) = self.points[0], self.points[-1]
        rate = (d1 - d0) / (t1 - t0) if len(self.points) >= 2 and t1 > t0 and d1 > d0 else self.hint
        if not rate:
            return None
        return t1 + max(0.0, self.units.total - d1) / rate


def _fmt_duration(seconds: float | None) -> str:
    """``1:02:03`` (h:mm:ss), or ``-:--:--`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-:--:--"
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _fmt_rate(value: Any) -> str:
    """A throughput with its significant digits: ``1234``, ``12.3``, ``0.19``, ``0.00412``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _metric_line(event: TaskEvent, total: int | None, units: _Units | None = None) -> str:
    m = event.metrics
    step = f"step {event.step}/{total}" if total else f"step {event.step}"
    parts = [step]
    if units is not None and units.unit == "env steps" and units.done(event) is not None:
        parts.append(f"env steps {int(units.done(event))}/{units.total}")
    parts += [f"reward {_fmt_num(m.get('reward'), '.3f')}", f"loss {_fmt_num(m.get('loss'))}"]
    for key, label in (
        ("perf/tokens_per_s", "tok/s"),
        ("perf/samples_per_s", "samples/s"),
        ("perf/env_steps_per_s", "env steps/s"),
    ):
        if key in m:
            parts.append(f"{label} {_fmt_rate(m[key])}")
    return "  ".join(parts)


def _state_line(event: TaskEvent) -> str:
    if event.from_state in ("", "unspecified"):  # the first event of every task: it was submitted
        text = f"state {_state(event.to_state)} (submitted)"
    else:
        text = f"state {_state(event.from_state)} -> {_state(event.to_state)}"
    extra = []
    if event.attempt:
        extra.append(f"attempt {event.attempt}")
    if event.node_id:
        extra.append(f"node {_escape(event.node_id)}")
    if extra:
        text += f" ({', '.join(extra)})"
    if event.reason:
        text += f" {_escape(event.reason)}"
    if event.message:
        text += f": {_escape(event.message)}"
    return text


def _checkpoint_line(event: TaskEvent) -> str:
    final = " (final)" if event.final else ""
    fmt = f" ({_escape(event.checkpoint_format)})" if event.checkpoint_format else ""
    return f"checkpoint step {event.step}{final}: {_escape(event.checkpoint_path)}{fmt}"


# ---------------------------------------------------------------------------------------------
# Commands.


def _cmd_submit(client: RLClient, args: argparse.Namespace) -> int:
    from opentinker_client.config import apply_overrides, load_task_config

    config = apply_overrides(load_task_config(args.config), args.set)
    task_id = client.submit_config(config, request_id=args.request_id)
    print(task_id, flush=True)
    if args.watch:
        return _follow(client, task_id)
    return EXIT_OK


def _cmd_watch(client: RLClient, args: argparse.Namespace) -> int:
    return _follow(client, args.task_id, after_sequence=args.after_sequence, plain=args.plain)


def _follow(client: RLClient, task_id: str, *, after_sequence: int = 0, plain: bool = False) -> int:
    """Follow a task. On a terminal (and with a known step total, unless ``plain``): a progress
    bar (step of total, reward, loss, elapsed, ETA) under the state changes and checkpoints;
    otherwise (pipes, logs, tests) a line per step."""
    from rich.logging import RichHandler
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
    from rich.text import Text

    console = _console()
    task = client.get_task(task_id)  # NOT_FOUND exits 2 before anything is drawn
    units = _units(task)
    total = _total_steps(task)
    name = f" {_escape(task.name)}" if task.name else ""
    resources = f"{task.gpu_count} GPU{'s' if task.gpu_count > 1 else ''}" if task.gpu_count else "CPU"
    console.print(
        f"task [bold]{_escape(task.task_id)}[/bold]{name} ({_escape(task.workload_type)}, {resources}) is "
        f"{_state(task.state)}"
    )
    if task.state == "pending" and task.pending_reason:
        console.print(f"  pending: {_escape(task.pending_reason)}")

    # Elapsed counts from when the task started (or was submitted), not from when this watch
    # attached; the ETA comes from the step times seen (_Eta), history included.
    started = task.start_time or task.create_time
    started_at = started.timestamp() if started is not None else None
    ended = [task.end_time.timestamp() if task.end_time is not None else None]  # set by a final state event
    eta = _Eta(units) if units is not None else None

    class _Clock(ProgressColumn):
        def __init__(self, which: str) -> None:
            super().__init__()
            self.which = which

        def render(self, _task) -> Text:
            now = ended[0] or _dt.datetime.now(_dt.timezone.utc).timestamp()
            if self.which == "elapsed":
                return Text(_fmt_duration(now - started_at if started_at is not None else None), style="yellow")
            finish = eta.finish_time() if eta is not None and not ended[0] else now if ended[0] else None
            return Text(_fmt_duration(finish - now if finish is not None else None), style="cyan")

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        _Clock("elapsed"),
        TextColumn("ETA"),
        _Clock("eta"),
        console=console,
        disable=plain or not console.is_terminal or units is None,
        transient=False,
    )
    handler = RichHandler(console=console, show_path=False, show_time=False)
    logger = logging.getLogger("opentinker_client")
    logger.addHandler(handler)
    try:
        with progress:
            done0 = task.latest_step if units is None or units.unit == "steps" else 0
            description = units.unit if units else "steps"
            bar = progress.add_task(description, total=units.total if units else None, completed=done0, stats="")
            for event in client.watch(task_id, after_sequence=after_sequence):
                if event.kind == "metric":
                    if eta is not None:
                        eta.add(event)
                    if progress.disable:  # the bar shows the step otherwise
                        line = _metric_line(event, total, units)
                        finish = eta.finish_time() if eta is not None else None
                        if finish is not None and units is not None and (units.done(event) or 0) < units.total:
                            left = finish - _dt.datetime.now(_dt.timezone.utc).timestamp()
                            line += f"  eta {_fmt_duration(left)}"
                        progress.console.print(line)
                    m = event.metrics
                    done = units.done(event) if units is not None else None
                    progress.update(
                        bar,
                        completed=done if done is not None else event.step,
                        stats=f"reward {_fmt_num(m.get('reward'), '.3f')} loss {_fmt_num(m.get('loss'))}",
                    )
                elif event.kind == "state":
                    progress.console.print(_state_line(event))
                    if event.to_state in TERMINAL_STATES and event.time is not None:
                        ended[0] = event.time.timestamp()
                    elif event.to_state == "running" and event.time is not None and started_at is None:
                        started_at = event.time.timestamp()
                elif event.kind == "checkpoint":
                    progress.console.print(_checkpoint_line(event))
    finally:
        logger.removeHandler(handler)

    final = client.get_task(task_id)
    if final.state not in TERMINAL_STATES:  # pragma: no cover - watch() only ends when the task has
        console.print(f"task {final.task_id} is {final.state}")
        return EXIT_ERROR
    summary = f"task [bold]{_escape(final.task_id)}[/bold] {_state(final.state)}"
    if final.latest_step:
        m = final.latest_metrics
        summary += (
            f" after {final.latest_step} steps (reward {_fmt_num(m.get('reward'), '.3f')}, loss "
            f"{_fmt_num(m.get('loss'))})"
        )
    console.print(summary)
    if final.error:
        console.print(f"  error: {_escape(final.error)}")
    if final.checkpoint_path:
        console.print(f"  checkpoint: {_escape(final.checkpoint_path)} (step {final.checkpoint_step})")
    return EXIT_OK if final.state == "succeeded" else EXIT_TASK_FAILED


def _cmd_list(client: RLClient, args: argparse.Namespace) -> int:
    from rich.table import Table

    tasks = client.list_tasks(states=args.state or None, limit=args.limit)
    console = _console()
    if not tasks:
        console.print("no tasks")
        return EXIT_OK
    table = Table(box=None, header_style="bold")
    for col in (
        "TASK ID",
        "NAME",
        "WORKLOAD",
        "ENV",
        "STATE",
        "ATTEMPT",
        "GPUS",
        "PRIO",
        "STEP",
        "REWARD",
        "LOSS",
        "NODE",
        "CREATED",
        "REASON",
    ):
        table.add_column(col, no_wrap=col not in ("NAME", "REASON"), overflow="fold")
    for t in tasks:
        m = t.latest_metrics
        reason = t.pending_reason if t.state == "pending" else t.error
        table.add_row(
            _escape(t.task_id),
            _escape(t.name) or "-",
            _escape(t.workload_type),
            _escape(str(t.env_config.get("env_id") or "-")),
            _state(t.state),
            str(t.attempt),
            str(t.gpu_count),
            str(t.priority),
            str(t.latest_step),
            _fmt_num(m.get("reward"), ".3f"),
            _fmt_num(m.get("loss")),
            _escape(t.node_id) or "-",
            _fmt_time(t.create_time),
            _escape(reason),
        )
    console.print(table)
    return EXIT_OK


#: env_config keys never printed as they are: the client-hosted environment's access token and
#: its CA text (shown by size).
_SECRET_ENV_KEYS = ("token",)


def _shown_env(env_config: Any) -> dict[str, Any]:
    """``env_config`` for printing: the access token redacted, a PEM shown by its size; the same
    inside ``reward`` (a client-hosted reward of a ``prompts`` task has its own token)."""
    out = dict(env_config)
    for key in _SECRET_ENV_KEYS:
        if out.get(key):
            out[key] = "<redacted>"
    pem = out.get("tls_root_certificates")
    if isinstance(pem, str) and pem:
        out["tls_root_certificates"] = f"<PEM, {len(pem)} characters>"
    if isinstance(out.get("reward"), dict):
        out["reward"] = _shown_env(out["reward"])
    return out


def _task_json(task: TaskInfo) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(task):
        if f.name == "proto":
            continue
        value = getattr(task, f.name)
        if isinstance(value, _dt.datetime):
            value = value.isoformat()
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, dict):
            value = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in value.items()}
        if f.name == "env_config":
            value = _shown_env(value)
        out[f.name] = value
    return out


def _cmd_get(client: RLClient, args: argparse.Namespace) -> int:
    from rich.table import Table

    t = client.get_task(args.task_id)
    if args.json:
        print(json.dumps(_task_json(t), indent=2, sort_keys=True))
        return EXIT_OK
    table = Table(box=None, show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    rows: list[tuple[str, str]] = [
        ("task id", _escape(t.task_id)),
        ("name", _escape(t.name) or "-"),
        ("state", _state(t.state)),
        ("workload", _escape(t.workload_type)),
        ("model", _escape(t.model) or "(scheduler default)"),
        ("owner", _escape(t.owner) or "-"),
        ("priority", str(t.priority)),
        ("gpus", str(t.gpu_count)),
        ("attempt", f"{t.attempt} of {t.max_attempts}" if t.max_attempts else str(t.attempt)),
        ("max runtime", f"{t.max_runtime:g} s" if t.max_runtime is not None else "none"),
        ("node", (_escape(t.node_id) + (f" devices {list(t.device_indices)}" if t.device_indices else "")) or "-"),
    ]
    if t.endpoint:
        rows.append(("endpoint", _escape(t.endpoint)))
    if t.pending_reason:
        rows.append(("pending reason", _escape(t.pending_reason)))
    if t.error:
        rows.append(("error", f"[red]{_escape(t.error)}[/red]"))
    rows.append(("step", str(t.latest_step)))
    if t.latest_metrics:
        metrics = ", ".join(f"{k}={_fmt_num(v, '.4g')}" for k, v in sorted(t.latest_metrics.items()))
        rows.append(("metrics", _escape(metrics)))
    rows.append(
        ("checkpoint", f"{_escape(t.checkpoint_path)} (step {t.checkpoint_step})" if t.checkpoint_path else "-")
    )
    rows += [
        ("created", _fmt_time(t.create_time)),
        ("started", _fmt_time(t.start_time)),
        ("ended", _fmt_time(t.end_time)),
        ("env", _escape(json.dumps(_shown_env(t.env_config), sort_keys=True))),
    ]
    # The values the task runs with: the scheduler stores them resolved (defaults included) at submit.
    hp = dict(t.hyperparameters)
    rows.append(("hyperparameters", "" if hp else "-"))
    rows += [(f"  {_escape(k)}", _escape(json.dumps(v))) for k, v in sorted(hp.items())]
    for key, value in rows:
        table.add_row(key, value)
    _console().print(table)
    return EXIT_OK


def _cmd_cancel(client: RLClient, args: argparse.Namespace) -> int:
    t = client.cancel(args.task_id, reason=args.reason)
    _console().print(f"task {_escape(t.task_id)} is {_state(t.state)}")
    return EXIT_OK


def _telemetry_cell(value: Any, fmt: str, name: str, unavailable: dict[str, str]) -> str:
    if value is None:
        why = unavailable.get(name)
        return f"n/a ({_escape(why)})" if why else "-"
    return format(value, fmt)


def _host_cells(n: NodeInfo) -> tuple[str, str]:
    """The CPU (``37% of 16``) and MEMORY (``3.2 GiB / 31.3 GiB``) cells of a node's host."""
    h = n.host
    if h is None:
        return "-", "-"
    un = dict(h.unavailable)
    if h.cpu_utilization_percent is None:
        cpu = f"n/a ({_escape(un.get('cpu_utilization_percent', '?'))})"
    else:
        cpu = f"{h.cpu_utilization_percent:.0f}%" + (f" of {h.cpu_count}" if h.cpu_count else "")
    if h.memory_used_bytes is None:
        memory = f"n/a ({_escape(un.get('memory_used_bytes', '?'))})"
    else:
        memory = f"{_fmt_bytes(h.memory_used_bytes)} / {_fmt_bytes(h.memory_total_bytes)}"
    return cpu, memory


def _cmd_nodes(client: RLClient, args: argparse.Namespace) -> int:
    from rich.table import Table

    nodes: list[NodeInfo] = client.list_nodes()
    console = _console()
    if not nodes:
        console.print("no nodes")
        return EXIT_OK
    table = Table(box=None, header_style="bold", title="nodes", title_justify="left")
    for col in ("NODE", "CONNECTED", "GPUS FREE", "TASKS", "CPU", "MEMORY", "VERSION", "LAST HEARTBEAT", "NOTES"):
        table.add_column(col, no_wrap=col != "NOTES", overflow="fold")
    for n in nodes:
        simulated = any(d.simulated for d in n.devices)
        cpu, memory = _host_cells(n)
        table.add_row(
            _escape(n.node_id),
            "[green]yes[/green]" if n.connected else "[red]no[/red]",
            f"{n.gpus_free}/{n.gpu_count}" + (" (simulated)" if simulated else ""),
            f"{len(n.running_task_ids)}/{n.max_tasks}",
            cpu,
            memory,
            _escape(n.version) or "-",
            _fmt_time(n.last_heartbeat_time),
            _escape("; ".join(n.notes)),
        )
    console.print(table)

    gpus = Table(box=None, header_style="bold", title="gpus", title_justify="left")
    for col in ("NODE", "GPU", "NAME", "UTIL", "MEMORY", "TEMP", "POWER", "SM CLOCK", "ECC"):
        gpus.add_column(col, overflow="fold")
    any_gpu = False
    for n in nodes:
        names = {d.index: d for d in n.devices}
        seen = set()
        for t in n.telemetry:
            seen.add(t.index)
            dev = names.get(t.index)
            un = dict(t.unavailable)
            total = (
                t.memory_total_bytes if t.memory_total_bytes is not None else (dev.memory_total_bytes if dev else None)
            )
            mem = "-" if t.memory_used_bytes is None else f"{_fmt_bytes(t.memory_used_bytes)} / {_fmt_bytes(total)}"
            if t.memory_used_bytes is None and un.get("memory_used_bytes"):
                mem = f"n/a ({_escape(un['memory_used_bytes'])})"
            name = _escape(dev.name if dev else "")
            if t.simulated or (dev is not None and dev.simulated):
                name += " (simulated)"
            gpus.add_row(
                _escape(n.node_id),
                str(t.index),
                name,
                _telemetry_cell(t.utilization_percent, ".0f", "utilization_percent", un)
                + ("%" if t.utilization_percent is not None else ""),
                mem,
                _telemetry_cell(t.temperature_c, ".0f", "temperature_c", un)
                + (" C" if t.temperature_c is not None else ""),
                _telemetry_cell(t.power_w, ".0f", "power_w", un) + (" W" if t.power_w is not None else ""),
                _telemetry_cell(t.sm_clock_mhz, "d", "sm_clock_mhz", un)
                + (" MHz" if t.sm_clock_mhz is not None else ""),
                _telemetry_cell(t.ecc_errors, "d", "ecc_errors", un),
            )
            any_gpu = True
        for d in n.devices:  # devices with no telemetry yet
            if d.index not in seen:
                name = _escape(d.name) + (" (simulated)" if d.simulated else "")
                gpus.add_row(
                    _escape(n.node_id),
                    str(d.index),
                    name,
                    "-",
                    f"- / {_fmt_bytes(d.memory_total_bytes)}",
                    "-",
                    "-",
                    "-",
                    "-",
                )
                any_gpu = True
    if any_gpu:
        console.print()
        console.print(gpus)
    else:
        console.print("no GPUs (CPU nodes)")
    return EXIT_OK


def _cmd_logs(client: RLClient, args: argparse.Namespace) -> int:
    task = client.get_task(args.task_id)  # NOT_FOUND exits 2
    console = _console()
    # Following ends by itself after the terminal event; otherwise just the history so far.
    events = client.watch(task.task_id, follow=bool(args.follow or task.done))
    for event in events:
        if event.kind == "state":
            line = _state_line(event)
            if event.to_state == "failed":
                line = f"[red]{line}[/red]"
        elif event.kind == "checkpoint":
            line = _checkpoint_line(event)
        elif event.kind == "metric":
            if not args.metrics:
                continue
            line = _metric_line(event, None)
        else:
            continue
        console.print(f"{_fmt_time(event.time)}  #{event.sequence}  {line}")
    final = client.get_task(task.task_id) if (args.follow or task.done) else task
    if final.error and final.done:
        console.print(f"error: {_escape(final.error)}")
    return EXIT_OK


def _cmd_plot(client: RLClient, args: argparse.Namespace) -> int:
    from opentinker_client.cli.plot import MissingExtraError, plot_history

    task = client.get_task(args.task_id)
    history = client.get_metric_history(task.task_id)
    out = args.output or f"{task.task_id}.png"
    title = f"{task.task_id}" + (f" {task.name}" if task.name else "") + f" ({task.workload_type}, {task.state})"
    try:
        counts = plot_history(history, out, title=title, keys=tuple(args.key or ("reward", "loss")))
    except MissingExtraError as exc:
        return _error(exc)
    except ValueError as exc:
        return _error(f"task {task.task_id}: {exc}")
    print(f"wrote {out}: " + ", ".join(f"{n} {k} point(s)" for k, n in counts.items()))
    return EXIT_OK


def _cmd_export(client: RLClient, args: argparse.Namespace) -> int:
    from opentinker_client.cli.export import MissingExtraError, export_tensorboard

    task = client.get_task(args.task_id)
    history = client.get_metric_history(task.task_id)
    if not history:
        return _error(f"task {task.task_id}: nothing to export, no metric points yet (state {task.state})")
    description = {
        k: v
        for k, v in _task_json(task).items()
        if k in ("task_id", "name", "workload_type", "model", "state", "attempt", "env_config", "hyperparameters")
    }
    try:
        folder, written = export_tensorboard(history, args.tensorboard, run=task.task_id, description=description)
    except MissingExtraError as exc:
        return _error(exc)
    print(
        f"wrote {written} scalar(s) over {len(history)} step(s) to {folder} (view: tensorboard --logdir "
        f"{args.tensorboard})"
    )
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# Parser and entry point.


def _add_inference_ca(p: argparse.ArgumentParser) -> None:
    """``--inference-ca PEM`` of the commands that dial inference servers (``serve``, ``eval``)."""
    p.add_argument(
        "--inference-ca",
        default=None,
        metavar="PEM",
        help="CA of the inference servers' TLS certificate (default: $OPENTINKER_TLS_CA, else the system's roots)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opentinker",
        description="Submit and follow OpenTinker reinforcement-learning tasks.",
        epilog="Exit codes: 0 ok; 1 the task ended FAILED or CANCELLED; 2 error; 130 interrupted.",
    )
    parser.add_argument(
        "--scheduler-url",
        default=os.environ.get("SCHEDULER_URL") or DEFAULT_SCHEDULER_URL,
        help="scheduler address, http://host:port, https://host:port (TLS) or host:port (default: "
        "$SCHEDULER_URL, else %(default)s)"
        if not os.environ.get("SCHEDULER_URL")
        else "scheduler address, http://host:port, https://host:port (TLS) or host:port (default: "
        "$SCHEDULER_URL = %(default)s)",
    )
    parser.add_argument(
        "--api-key", default=None, help="API key (default: $OPENTINKER_API_KEY, preferred: arguments show in ps)"
    )
    parser.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="CA of the scheduler's certificate; turns TLS on (default: $OPENTINKER_TLS_CA; an https:// URL "
        "without one trusts the system roots)",
    )
    parser.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="client certificate for mTLS (default: $OPENTINKER_TLS_CERT)"
    )
    parser.add_argument(
        "--tls-key", default=None, metavar="PEM", help="key of --tls-cert (default: $OPENTINKER_TLS_KEY)"
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per call (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("submit", help="submit a task from a YAML config; prints the task id")
    p.add_argument("config", metavar="CONFIG.yaml", help="task config file")
    p.add_argument("--watch", action="store_true", help="then follow it like `opentinker watch`")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a value of the file without editing it (repeatable): hyperparameters.steps=20, "
        "env.max_digits=2, gpu_count=1, model=NAME; VALUE is read as YAML",
    )
    p.add_argument(
        "--request-id", default=None, help="idempotency key: resubmitting with the same id returns the same task"
    )
    p.set_defaults(func=_cmd_submit)

    p = sub.add_parser(
        "watch",
        help="follow a task: a progress bar on a terminal (else a line per step) and a line per state change; "
        "exit 0 if it succeeds",
    )
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument("--after-sequence", type=int, default=0, help="start after this event sequence number")
    p.add_argument("--plain", action="store_true", help="a line per step even on a terminal (no progress bar)")
    p.set_defaults(func=_cmd_watch)

    p = sub.add_parser("list", help="list tasks, newest first")
    p.add_argument("--state", action="append", choices=_STATES, help="only tasks in this state (repeatable)")
    p.add_argument("--limit", type=int, default=100, help="at most this many (default: %(default)s)")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("get", help="show one task: state, pending reason, error, metrics, checkpoint")
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_get)

    p = sub.add_parser("cancel", help="cancel a pending or running task")
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument("--reason", default="", help="why, recorded on the task")
    p.set_defaults(func=_cmd_cancel)

    p = sub.add_parser("nodes", help="list trainer nodes and per-GPU telemetry")
    p.set_defaults(func=_cmd_nodes)

    # Operations: logs, plot, export (opentinker_client/cli/plot.py, opentinker_client/cli/export.py).
    p = sub.add_parser("logs", help="a task's state changes, errors and checkpoints as lines (--follow to keep going)")
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the task ends")
    p.add_argument("--metrics", action="store_true", help="also a line per training step")
    p.set_defaults(func=_cmd_logs)

    p = sub.add_parser("plot", help="write a PNG of a task's reward and loss curves (needs the plot extra: matplotlib)")
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument(
        "-o", "--output", default=None, metavar="FILE", help="image file, .png/.svg/.pdf (default: TASK_ID.png)"
    )
    p.add_argument(
        "--key",
        action="append",
        default=None,
        metavar="KEY",
        help="metric to draw, one panel each (repeatable; default: reward and loss)",
    )
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("export", help="export a task's metrics (TensorBoard event files; needs the tensorboard extra)")
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument(
        "--tensorboard", required=True, metavar="DIR", help="TensorBoard log folder; the task is the run DIR/TASK_ID"
    )
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("serve", help="serve a finished lora_finetune/sft task's adapter; prints the endpoint")
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument(
        "--ttl", type=float, default=3600.0, help="seconds a newly started server runs (default %(default)s)"
    )
    p.add_argument("--gpus", type=int, default=0, help="GPUs for a newly started server (default 0)")
    _add_inference_ca(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("eval", help="mean reward of a trained adapter and of its base model on the task's environment")
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument("--episodes", type=int, default=32, help="problems per model (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="reply length limit (default %(default)s)")
    _add_inference_ca(p)
    p.set_defaults(func=_cmd_eval)

    from opentinker_client.cli.keys import add_keys_parser

    add_keys_parser(sub)  # opentinker keys create|list|revoke|rotate
    return parser


def _cmd_serve(client: RLClient, args: argparse.Namespace) -> int:
    llm = client.serve(
        args.task_id, ttl=args.ttl, gpu_count=args.gpus, root_certificates=args.inference_ca
    )  # with the CLI's API key
    print(f"adapter {args.task_id} served by inference task {llm.task_id} at {llm.endpoint}")
    return 0


def _cmd_eval(client: RLClient, args: argparse.Namespace) -> int:
    from opentinker_client.evaluate import evaluate

    env = dict(client.get_task(args.task_id).env_config) or "arithmetic"
    llm = client.serve(args.task_id, root_certificates=args.inference_ca)  # with the CLI's API key
    for label, adapter in (("base model", None), (f"adapter {args.task_id}", args.task_id)):
        r = evaluate(llm, env=env, episodes=args.episodes, adapter=adapter, max_tokens=args.max_tokens)
        print(f"{label}: mean reward {r.mean_reward:.3f} ± {r.stderr:.3f} over {r.episodes} episodes of {r.env_id}")
    return 0


def _error(message: Any) -> int:
    text = " ".join(str(message).split())  # always one line
    print(f"error: {text}", file=sys.stderr, flush=True)
    return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``opentinker`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    client: RLClient | None = None
    interrupted = False
    try:
        from opentinker_common.net.bearer import clean_api_key

        # Strip the newline of `--api-key "$(cat admin.key)"`-style values; name the source on bad ones.
        api_key = clean_api_key(
            args.api_key if args.api_key is not None else os.environ.get("OPENTINKER_API_KEY") or "",
            "--api-key" if args.api_key is not None else "$OPENTINKER_API_KEY",
        )
        client = RLClient(
            args.scheduler_url,
            timeout=args.timeout,
            api_key=api_key,
            root_certificates=args.tls_ca,
            client_cert=args.tls_cert,
            client_key=args.tls_key,
        )
        return args.func(client, args)
    except OpenTinkerError as err:
        return _error(err)
    except ValueError as err:  # a bad --scheduler-url, --api-key or TLS file
        return _error(err)
    except OSError as err:  # a config file that cannot be read
        name = getattr(err, "filename", None)
        reason = err.strerror or str(err)
        return _error(f"cannot read {name}: {reason}" if name else reason)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if client is not None:
            if interrupted:
                _close_within(client, CLOSE_AFTER_INTERRUPT_S)
            else:
                client.close()


#: Seconds Ctrl-C waits for the channel to close before the command exits anyway.
CLOSE_AFTER_INTERRUPT_S = 2.0


def _close_within(client: RLClient, seconds: float) -> None:
    """Close ``client`` but give up after ``seconds``: a Ctrl-C that lands inside a blocking gRPC
    call can leave ``Channel.close()`` waiting forever (grpc/grpc#19973), and an interrupted
    command must still exit."""
    import threading

    closer = threading.Thread(target=client.close, name="opentinker-close", daemon=True)
    closer.start()
    closer.join(seconds)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
