"""The ``opentinker`` command: submit, watch, list, get and cancel tasks; list nodes.

::

    opentinker submit task.yaml --watch      # prints the task id, then follows it
    opentinker watch TASK_ID                 # a line per step (reward, loss) and per state change
    opentinker list --state running
    opentinker get TASK_ID
    opentinker cancel TASK_ID [TASK_ID ...]
    opentinker rm TASK_ID                    # delete a finished task's checkpoints from the store
    opentinker nodes                         # nodes and per-GPU telemetry
    opentinker logs TASK_ID [--follow]       # state changes, errors, checkpoints as lines
    opentinker plot TASK_ID -o curves.png    # reward and loss vs step (extra: plot)
    opentinker plot A B --x env_steps --smooth 0.6   # several tasks overlaid
    opentinker compare A B                   # final/best metrics, wall time, settings that differ
    opentinker export TASK_ID --tensorboard runs/tb   # TensorBoard event files (extra: tensorboard)

The scheduler is ``--scheduler-url``, else ``$SCHEDULER_URL``, else ``localhost:8888``; the API key
is ``--api-key``, else ``$OPENTINKER_API_KEY``. TLS: ``--tls-ca`` or ``$OPENTINKER_TLS_CA`` (the
scheduler's CA; for mTLS also ``--tls-cert``/``--tls-key`` or ``$OPENTINKER_TLS_CERT``/``$OPENTINKER_TLS_KEY``);
an ``https://`` scheduler URL always means TLS (the system roots when no CA is given).
``opentinker keys ...`` manages API keys; ``opentinker queues [set]`` shows and changes quota queues.

Exit codes: 0 success (for ``watch``: the task SUCCEEDED); 1 the task ended FAILED or CANCELLED;
2 an error (one line on stderr, the message first and the gRPC status code last:
``error: spec.hyperparameters.stesp: expected one of the known keys (...); did you mean 'steps'? [INVALID_ARGUMENT]``);
130 interrupted.
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
from pathlib import Path
from typing import Any, Mapping, Sequence

from opentinker_client.client import DEFAULT_SCHEDULER_URL, RLClient
from opentinker_client.types import TERMINAL_STATES, NodeInfo, TaskEvent, TaskInfo
from opentinker_client.errors import FailedPreconditionError, OpenTinkerError
from opentinker_client.cli.render import SafeLogText, error_text, markup, safe_text
from opentinker_client.cli.tables import print_fitted
from opentinker_common.attempts import attempts_text

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
    """A rich console on stdout (or stderr) that shows text as written: no emoji shortcodes, so a
    task name ``tinker ses-1:train:0`` stays that, not ``tinker ses-1🚋0``."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=_width(stream), highlight=False, emoji=False)


#: Columns of output off a terminal without ``$COLUMNS`` (rich's own default there, 80, squeezes tables).
PIPE_COLUMNS = 160


def _width(stream) -> int | None:
    """The output's width in columns: ``$COLUMNS`` when it is a positive whole number (on a
    terminal or a pipe: ``COLUMNS=100 opentinker list | less``), else the terminal's own (None:
    rich asks it), or :data:`PIPE_COLUMNS` off a terminal (pipes, CI logs)."""
    text = os.environ.get("COLUMNS", "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    return None if stream.isatty() else PIPE_COLUMNS


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
    """Server-provided text for rich output: control characters escaped, then markup escaped."""
    return markup(text)


def _why_ended(task: TaskInfo) -> tuple[str, str]:
    """``(heading, text)`` for a task's ``error``: a cancel is not an error, so a CANCELLED task's
    reads ``("cancelled", "by user: enough")`` (``cancelled by user: enough`` as a line); any
    other ``("error", error)``."""
    if task.state == "cancelled":
        text = task.error[len("cancelled ") :] if task.error.startswith("cancelled ") else task.error
        return "cancelled", text
    return "error", task.error


def _ended_line(task: TaskInfo) -> str:
    """``"cancelled by user: enough"`` or ``"error: CUDA out of memory"`` (escaped for rich)."""
    heading, text = _why_ended(task)
    sep = " " if heading == "cancelled" and task.error.startswith("cancelled ") else ": "
    return f"{heading}{sep}{_escape(text)}"


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


def _headline(m: Mapping[str, Any]) -> str:
    """The numbers that tell whether a step learned, named for what they are.

    SFT has no reward: its ``reward`` is the token accuracy, so it is shown as such. GRPO's loss
    is 0 on its first epoch by construction (each group's advantages sum to 0 at ratio 1), so
    the gradient norm is shown in its place. Other workloads show reward and loss.
    """
    if "train/token_accuracy" in m:
        return f"token accuracy {_fmt_num(m['train/token_accuracy'], '.3f')}  loss {_fmt_num(m.get('loss'))}"
    if "grpo/zero_std_frac" in m and "optim/grad_norm" in m:
        return f"reward {_fmt_num(m.get('reward'), '.3f')}  grad norm {_fmt_num(m['optim/grad_norm'])}"
    return f"reward {_fmt_num(m.get('reward'), '.3f')}  loss {_fmt_num(m.get('loss'))}"


def _metric_line(event: TaskEvent, total: int | None, units: _Units | None = None) -> str:
    m = event.metrics
    step = f"step {event.step}/{total}" if total else f"step {event.step}"
    parts = [step]
    if units is not None and units.unit == "env steps" and units.done(event) is not None:
        parts.append(f"env steps {int(units.done(event))}/{units.total}")
    parts.append(_headline(m))
    if event.attempt > 1:  # a resumed attempt: its first steps may repeat the previous attempt's
        parts.append(f"(attempt {event.attempt})")
    for key, label in (
        ("perf/tokens_per_s", "tok/s"),
        ("perf/samples_per_s", "samples/s"),
        ("perf/env_steps_per_s", "env steps/s"),
    ):
        if key in m:
            parts.append(f"{label} {_fmt_rate(m[key])}")
    return "  ".join(parts)


def _phase_line(event: TaskEvent) -> str:
    """``"loading model /models/SmolLM2 (attempt 1)"``: what an attempt does before its first step."""
    detail = f" {_escape(event.message)}" if event.message else ""
    return f"{_escape(event.phase)}{detail} (attempt {event.attempt})"


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


def _checkpoint_failed_line(event: TaskEvent) -> str:
    then = "the task fails" if event.fatal else "training goes on"
    return (
        f"[yellow]checkpoint step {event.step} not stored ({event.failures_in_a_row} in a row; {then}): "
        f"{_escape(event.message)}[/yellow]"
    )


# ---------------------------------------------------------------------------------------------
# Commands.


def _cmd_submit(client: RLClient, args: argparse.Namespace) -> int:
    from opentinker_client.config import load_with_overrides

    config = load_with_overrides(args.config, args.set)
    if args.dry_run:
        task, usage, basis = client.estimate(config)
        print(f"valid: {task.workload_type} on {task.model or '-'}, {task.gpu_count} GPU(s), priority {task.priority}")
        print(
            f"queue: {task.queue or '-'}" + (f" (would wait now: {task.pending_reason})" if task.pending_reason else "")
        )
        print(f"estimate: {_estimate_line(usage)}")
        print(f"basis: {basis}")
        for note in (_missing_model_note(task.model), _missing_data_note(task.env_config)):
            if note:
                print(safe_text(note), file=sys.stderr)
        return EXIT_OK
    task_id = client.submit_config(config, request_id=args.request_id)
    print(safe_text(task_id), flush=True)
    if config.init_from:  # say which checkpoint it starts from (a cancelled task's last one, ...)
        note = client.get_task(config.init_from).checkpoint_note
        print(safe_text(f"starting from task {config.init_from}'s {note}"), file=sys.stderr, flush=True)
    if args.watch:
        return _watching(task_id, lambda: _follow(client, task_id))
    return EXIT_OK


class _StoppedWatching(KeyboardInterrupt):
    """Ctrl-C while following ``task_id``: only the watch stops; the task goes on."""

    def __init__(self, task_id: str) -> None:
        super().__init__(task_id)
        self.task_id = task_id


def _watching(task_id: str, follow) -> int:
    """``follow()``, with a Ctrl-C turned into :class:`_StoppedWatching` for ``task_id`` (whose
    message says the task keeps running on the scheduler and how to cancel it)."""
    try:
        return follow()
    except KeyboardInterrupt:
        raise _StoppedWatching(task_id) from None


def _missing_model_note(model: str) -> str:
    """For a dry run: a note when ``model`` names a folder (not a hub id: ``org/name``) that is not
    on this machine; the scheduler cannot see the trainer nodes' disks, so neither it nor the dry
    run can tell whether the folder is there (``""`` when there is nothing to say)."""
    if not model or not (model.startswith((".", "/", "~")) or model.count("/") > 1):
        return ""
    if os.path.isdir(os.path.expanduser(model)):
        return ""
    return (
        f"note: model {model!r} is a folder that is not on this machine; the dry run cannot check the trainer "
        "nodes' disks: it must be there (else the task fails as it starts: no such folder on this trainer node)"
    )


def _missing_data_note(env_config: Any) -> str:
    """For a dry run: a note when the environment reads a file on the trainer node (``env.path``)
    that is not on this machine, as :func:`_missing_model_note` does for a model folder."""
    path = (env_config or {}).get("path") if isinstance(env_config, Mapping) else None
    if not isinstance(path, str) or not path or os.path.isfile(os.path.expanduser(path)):
        return ""
    return (
        f"note: env.path {path!r} is not on this machine; the dry run cannot check the trainer nodes' disks: it "
        "must be there (else the task fails as it starts: the dataset cannot be read on this trainer node)"
    )


def _cmd_watch(client: RLClient, args: argparse.Namespace) -> int:
    return _watching(
        args.task_id, lambda: _follow(client, args.task_id, after_sequence=args.after_sequence, plain=args.plain)
    )


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
        f"{_state(task.state)}",
        soft_wrap=True,
    )
    if task.state == "pending" and task.pending_reason:
        console.print(f"  pending: {_escape(task.pending_reason)}", soft_wrap=True)

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
    handler.addFilter(SafeLogText())  # client warnings quote the server (a pending reason)
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
                        progress.console.print(line, soft_wrap=True)
                    m = event.metrics
                    done = units.done(event) if units is not None else None
                    progress.update(
                        bar,
                        completed=done if done is not None else event.step,
                        stats=_headline(m),
                    )
                elif event.kind == "state":
                    progress.console.print(_state_line(event), soft_wrap=True)
                    if event.to_state in TERMINAL_STATES and event.time is not None:
                        ended[0] = event.time.timestamp()
                    elif event.to_state == "running" and event.time is not None and started_at is None:
                        started_at = event.time.timestamp()
                elif event.kind == "checkpoint":
                    progress.console.print(_checkpoint_line(event), soft_wrap=True)
                elif event.kind == "phase":
                    progress.console.print(_phase_line(event), soft_wrap=True)
                    if event.phase == "loading model":  # the bar's stats say so until the first step
                        progress.update(bar, stats=f"[dim]{_escape(event.phase)}...[/dim]")
                elif event.kind == "checkpoint_failed":
                    progress.console.print(_checkpoint_failed_line(event), soft_wrap=True)
    finally:
        logger.removeHandler(handler)

    final = client.get_task(task_id)
    if final.state not in TERMINAL_STATES:  # pragma: no cover - watch() only ends when the task has
        console.print(f"task {_escape(final.task_id)} is {_escape(final.state)}")
        return EXIT_ERROR
    summary = f"task [bold]{_escape(final.task_id)}[/bold] {_state(final.state)}"
    if final.latest_step:
        m = final.latest_metrics
        summary += (
            f" after {final.latest_step} steps (reward {_fmt_num(m.get('reward'), '.3f')}, loss "
            f"{_fmt_num(m.get('loss'))})"
        )
    # One line each at any width, as `logs` (soft_wrap): a path stays whole, to copy.
    console.print(summary, soft_wrap=True)
    if final.error:
        console.print(f"  {_ended_line(final)}", soft_wrap=True)
    if final.checkpoint_path:
        console.print(f"  checkpoint: {_escape(final.checkpoint_path)} (step {final.checkpoint_step})", soft_wrap=True)
    return EXIT_OK if final.state == "succeeded" else EXIT_TASK_FAILED


#: ``opentinker list`` columns: (header, may wrap). Ids, names and values never wrap or fold (a
#: task id split over two lines cannot be copied); CREATED wraps at its space and REASON at words.
_LIST_COLUMNS: tuple[tuple[str, bool], ...] = (
    ("TASK ID", False),
    ("NAME", False),
    ("WORKLOAD", False),
    ("ENV", False),
    ("STATE", False),
    ("ATTEMPT", False),
    ("GPUS", False),
    ("PRIO", False),
    ("STEP", False),
    ("REWARD", False),
    ("LOSS", False),
    ("NODE", False),
    ("CREATED", True),
    ("REASON", True),
)
#: Columns a narrow terminal moves out of the table into a line under each task, in this order,
#: until the table fits; the rest of a task's values stay in the table.
_LIST_MOVE_ORDER = ("REASON", "CREATED", "NODE", "ENV", "WORKLOAD", "PRIO", "LOSS", "REWARD", "NAME", "STEP")


#: Workloads that train on ``env_config`` and so on the default environment when it names none.
_ENV_WORKLOADS = ("lora_finetune", "full_rl")


def _env_id_shown(task: TaskInfo) -> str:
    """``list``'s ENV cell: the task's ``env_id``, the default one (arithmetic) for a training
    task whose ``env_config`` names none, else ``-`` (inference, sessions)."""
    from opentinker_common.spec.task import DEFAULT_ENV_ID

    env_id = task.env_config.get("env_id")
    if env_id:
        return str(env_id)
    return DEFAULT_ENV_ID if task.workload_type in _ENV_WORKLOADS else "-"


def _cmd_list(client: RLClient, args: argparse.Namespace) -> int:
    tasks = client.list_tasks(states=args.state or None, limit=args.limit)
    console = _console()
    if not tasks:
        console.print("no tasks")
        return EXIT_OK
    rows = []
    for t in tasks:
        m = t.latest_metrics
        reason = t.pending_reason if t.state == "pending" else t.error
        rows.append(
            (
                _escape(t.task_id),
                _escape(t.name) or "-",
                _escape(t.workload_type),
                _escape(_env_id_shown(t)),
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
        )
    print_fitted(console, _LIST_COLUMNS, rows, _LIST_MOVE_ORDER, unlabelled=frozenset({"REASON"}))
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


def _since(text: str | None) -> _dt.datetime | None:
    """``--since``: ``7d``, ``12h``, ``30m`` ago, or an ISO date/time (local time when no zone)."""
    if text is None:
        return None
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(seconds=float(text[:-1]) * units[text[-1]])
    try:
        when = _dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--since: expected 7d, 12h, 30m or an ISO date/time such as 2026-01-31, got {text!r}"
        ) from None
    return when if when.tzinfo else when.astimezone()


#: ``opentinker usage`` columns after the first (OWNER or QUEUE); on a narrow terminal the
#: counts move under each row first, the hours and the cost stay.
_USAGE_MOVE_ORDER = ("ENV STEPS", "ATTEMPTS", "TOKENS GEN", "TOKENS TRAINED", "CPU-TASK HOURS")


def _cmd_usage(client: RLClient, args: argparse.Namespace) -> int:
    report = client.usage(owner=args.owner, since=_since(args.since))
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return EXIT_OK
    currency = report["currency"]
    console = _console()
    for title, rows in (("OWNER", report["owners"]), ("QUEUE", report["queues"])):
        headers = (title, "GPU-HOURS", "CPU-TASK HOURS", "TOKENS GEN", "TOKENS TRAINED", "ENV STEPS", "ATTEMPTS",
                   f"COST ({currency})")  # fmt: skip
        cells = [
            (
                _escape(name) + (f" ({_escape(u['queue'])})" if u.get("queue") and u["queue"] != name else ""),
                f"{u['gpu_seconds'] / 3600:.3f}",
                f"{u['cpu_task_seconds'] / 3600:.3f}",
                f"{u['tokens_generated']:.0f}",
                f"{u['tokens_trained']:.0f}",
                f"{u['env_steps']:.0f}",
                str(int(u["attempts"])),
                f"{u['cost']:.2f}",
            )
            for name, u in sorted(rows.items())
        ]
        print_fitted(console, tuple((h, False) for h in headers), cells, _USAGE_MOVE_ORDER)
    return EXIT_OK


def usage_line(u) -> str:
    """A usage dict (TaskInfo.usage) in one line: ``0.125 GPU-h (450 GPU-s), 0 CPU-task s, ...``."""
    return (
        f"{u['gpu_seconds'] / 3600:.3f} GPU-h ({u['gpu_seconds']:.0f} GPU-s), {u['cpu_task_seconds']:.0f} CPU-task s, "
        f"{u['tokens_generated']:.0f} tokens generated, {u['tokens_trained']:.0f} trained, "
        f"{u['env_steps']:.0f} env steps, {int(u['attempts'])} attempt(s)"
    )


def _estimate_line(u) -> str:
    """A dry run's estimate (of one attempt) in one line: ``0.125 GPU-h (450 GPU-s) for one
    attempt, cost 0.2500``, a CPU task's seconds, or ``none`` when the scheduler had nothing to
    go on (its basis says why)."""
    if not u.get("attempts"):
        return "none (no step times to go on; see basis)"
    if u["gpu_seconds"]:
        used = f"{u['gpu_seconds'] / 3600:.3f} GPU-h ({u['gpu_seconds']:.0f} GPU-s)"
    else:
        used = f"{u['cpu_task_seconds']:.0f} CPU-task s"
    return f"{used} for one attempt, cost {u['cost']:.4f}"


def _first_start(client: RLClient, task: TaskInfo) -> _dt.datetime | None:
    """When ``task`` first ran: ``start_time`` is its current attempt's, so a task on a later
    attempt is read from its events, up to its first change to RUNNING (None: it never ran)."""
    if task.attempt <= 1:
        return task.start_time
    from contextlib import closing

    with closing(client.watch(task.task_id, follow=False)) as events:  # closed: the rest is not read
        for event in events:
            if event.kind == "state" and event.to_state == "running" and event.time is not None:
                return event.time
    return task.start_time


def _wall_time(task: TaskInfo, first_start: _dt.datetime | None, *, now: float, per_attempt: bool = True) -> str:
    """From the task's first start to its end (or ``now``, epoch seconds), every attempt and the
    time between them; with ``per_attempt``, the current attempt's own time beside it when there
    were several."""
    if first_start is None:
        return "-"
    end = task.end_time.timestamp() if task.end_time is not None else now
    text = _seconds(end - first_start.timestamp())
    if per_attempt and task.attempt > 1 and task.start_time is not None:
        text += f" (attempt {task.attempt}: {_seconds(end - task.start_time.timestamp())})"
    return text


def _endpoint_rows(t: TaskInfo) -> list[tuple[str, str]]:
    """The task's endpoints as ``(label, value)`` rows, escaped: the gRPC one and the OpenAI base
    URL, each when it has one (a running inference task or training session)."""
    rows = []
    if t.endpoint:
        rows.append(("endpoint", _escape(t.endpoint)))
    if t.openai_endpoint:
        rows.append(("openai endpoint", _escape(t.openai_endpoint)))
    return rows


def _cmd_get(client: RLClient, args: argparse.Namespace) -> int:
    import time

    from rich.table import Table

    t = client.get_task(args.task_id)
    if args.json:
        # json escapes every control character but DEL (it is ASCII); no raw one reaches the terminal.
        print(json.dumps(_task_json(t), indent=2, sort_keys=True).replace("\x7f", "\\u007f"))
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
        ("attempt", attempts_text(t.attempt, t.max_attempts, t.handed_back)),
        ("max runtime", f"{t.max_runtime:g} s" if t.max_runtime is not None else "none"),
        ("node", (_escape(t.node_id) + (f" devices {list(t.device_indices)}" if t.device_indices else "")) or "-"),
    ]
    rows += _endpoint_rows(t)
    if t.pending_reason:
        rows.append(("pending reason", _escape(t.pending_reason)))
    if t.error:
        heading, text = _why_ended(t)
        rows.append((heading, f"[red]{_escape(text)}[/red]" if heading == "error" else _escape(text)))
    rows.append(("step", str(t.latest_step)))
    if t.latest_metrics:
        metrics = ", ".join(f"{k}={_fmt_num(v, '.4g')}" for k, v in sorted(t.latest_metrics.items()))
        rows.append(("metrics", _escape(metrics)))
    rows.append(
        ("checkpoint", f"{_escape(t.checkpoint_path)} (step {t.checkpoint_step})" if t.checkpoint_path else "-")
    )
    if t.queue:
        rows.append(("queue", _escape(t.queue)))
    if t.usage:
        rows.append(("usage", _escape(usage_line(t.usage))))
        rows.append(("cost", f"{t.usage['cost']:.4f}"))
    first = _first_start(client, t)
    rows += [
        ("created", _fmt_time(t.create_time)),
        ("started", _fmt_time(first)),
    ]
    if t.attempt > 1 and t.start_time is not None and t.start_time != first:
        rows.append(("attempt started", f"{_fmt_time(t.start_time)} (attempt {t.attempt})"))
    rows += [
        ("ended", _fmt_time(t.end_time)),
        ("wall time", _wall_time(t, first, now=time.time())),
        # The environment as the worker builds it: defaults filled in, so a task that named
        # none shows the arithmetic task it runs, not {}.
        ("env", _escape(json.dumps(_shown_env(_resolved_settings(t)["env"]), sort_keys=True))),
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
    """Cancel each task named, in order: a line per task, ``error: TASK_ID: ...`` on stderr for
    one that cannot be (the others are still cancelled); the exit code is an error's when any was.
    A task that had already succeeded or failed cannot be cancelled: ``error: TASK_ID had already
    succeeded: nothing to cancel [FAILED_PRECONDITION]`` (exit 2); one already cancelled is fine
    (exit 0: what was asked holds)."""
    code = EXIT_OK
    for task_id in dict.fromkeys(args.task_id):  # each once, in the order given
        try:
            t = client.cancel(task_id, reason=args.reason)
        except (OpenTinkerError, ValueError) as err:
            if len(args.task_id) == 1:
                raise
            code = _error(f"{task_id}: {error_text(err)}")
            continue
        if t.state in ("succeeded", "failed"):
            # As an error from the scheduler reads (docs/usage.md): the state is the precondition not met
            code = _error(f"{t.task_id} had already {t.state}: nothing to cancel [FAILED_PRECONDITION]")
            continue
        _console().print(f"task {_escape(t.task_id)} is {_state(t.state)}")
    return code


def _cmd_endpoint_token(client: RLClient, args: argparse.Namespace) -> int:
    """Print a new endpoint token of an inference or lora_session task: the ``api_key`` for its
    OpenAI-compatible API (``openai.OpenAI(base_url=..., api_key=TOKEN)``). Its expiry goes to
    stderr, so ``$(opentinker endpoint-token TASK)`` is the token alone."""
    token = client.endpoint_token(args.task_id, ttl=args.ttl)
    if not token.token:
        print("the scheduler runs without authentication: its endpoints take any api_key", file=sys.stderr)
        return EXIT_OK
    print(token.token)
    expires = _dt.datetime.fromtimestamp(token.expire_time, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    print(f"expires {expires}", file=sys.stderr)
    return EXIT_OK


def _ttl(text: str) -> float:
    """``3600``, ``90s``, ``30m`` or ``1h`` -> seconds."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    number, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1.0)
    try:
        value = float(number) * unit
    except ValueError:
        value = -1.0
    if not 1 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"expected 1s to 24h (seconds, or a number with s, m or h), got {text!r}")
    return value


def _cmd_rm(client: RLClient, args: argparse.Namespace) -> int:
    t, keys, size = client.delete_artifacts(args.task_id)
    what = f"{len(keys)} artifact(s), {_mib(size)}" if keys else "nothing (no artifacts left)"
    _console().print(f"task {_escape(t.task_id)}: deleted {what}")
    return EXIT_OK


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size} bytes"


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


#: ``opentinker nodes`` tables: (header, may wrap) and the order a narrow terminal moves columns
#: onto a line under each row (as ``list`` does); node ids, GPU indices and counts stay.
_NODE_COLUMNS: tuple[tuple[str, bool], ...] = (
    ("NODE", False),
    ("CONNECTED", False),
    ("GPUS FREE", False),
    ("TASKS", False),
    ("CPU", False),
    ("MEMORY", False),
    ("VERSION", False),
    ("LAST HEARTBEAT", True),
    ("NOTES", True),
)
_NODE_MOVE_ORDER = ("NOTES", "LAST HEARTBEAT", "VERSION", "MEMORY", "CPU", "CONNECTED")
_GPU_COLUMNS: tuple[tuple[str, bool], ...] = (
    ("NODE", False),
    ("GPU", False),
    ("NAME", False),
    ("UTIL", False),
    ("MEMORY", False),
    ("TEMP", False),
    ("POWER", False),
    ("SM CLOCK", False),
    ("ECC", False),
)
_GPU_MOVE_ORDER = ("ECC", "SM CLOCK", "POWER", "TEMP", "NAME", "MEMORY")
_HOST_COLUMNS: tuple[tuple[str, bool], ...] = (
    ("NODE", False),
    ("BASE MODEL", False),
    ("GPUS", False),
    ("TENANTS", False),
    ("MEMORY (EST.)", False),
    ("PID", False),
    ("TASKS", True),
)
_HOST_MOVE_ORDER = ("TASKS", "MEMORY (EST.)", "PID", "BASE MODEL")


def _cmd_nodes(client: RLClient, args: argparse.Namespace) -> int:
    nodes: list[NodeInfo] = client.list_nodes()
    console = _console()
    if not nodes:
        console.print("no nodes")
        return EXIT_OK
    rows = []
    for n in nodes:
        simulated = any(d.simulated for d in n.devices)
        cpu, memory = _host_cells(n)
        rows.append(
            (
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
        )
    print_fitted(console, _NODE_COLUMNS, rows, _NODE_MOVE_ORDER, title="nodes")

    gpu_rows = []
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
            gpu_rows.append(
                (
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
            )
        for d in n.devices:  # devices with no telemetry yet
            if d.index not in seen:
                name = _escape(d.name) + (" (simulated)" if d.simulated else "")
                total = f"- / {_fmt_bytes(d.memory_total_bytes)}" if d.memory_total_bytes else "-"
                gpu_rows.append((_escape(n.node_id), str(d.index), name, "-", total, "-", "-", "-", "-"))
    if gpu_rows:
        console.print()
        print_fitted(console, _GPU_COLUMNS, gpu_rows, _GPU_MOVE_ORDER, title="gpus")
    else:
        console.print("no GPUs (CPU nodes)")
    hosts = [(n, h) for n in nodes for h in n.model_hosts]
    if hosts:  # nodes started with --tenants-per-host: LoRA tasks sharing one copy of a base model
        host_rows = [
            (
                _escape(n.node_id),
                _escape(h.model),
                ",".join(str(i) for i in h.device_indices) or "cpu",
                f"{len(h.task_ids)}/{h.max_tenants}",
                _host_memory(n, h),
                str(h.pid),
                _escape(" ".join(h.task_ids)),
            )
            for n, h in hosts
        ]
        console.print()
        print_fitted(console, _HOST_COLUMNS, host_rows, _HOST_MOVE_ORDER, title="model hosts")
    return EXIT_OK


def _host_memory(node, host) -> str:
    """A model host's memory estimate per GPU: ``base + tenants = booked / total`` of its first
    GPU as placement books it (``-`` when the scheduler does not know the model's shape)."""
    if not host.base_bytes_estimate:
        return "-"
    base, tenants = _fmt_mib(host.base_bytes_estimate), _fmt_mib(host.tenant_bytes_estimate)
    out = f"{base} + {tenants}"
    gpu = next((g for g in node.gpu_memory_estimates if g.index in host.device_indices), None)
    if gpu is not None:
        out += f" ({_fmt_mib(gpu.booked_bytes)} of {_fmt_bytes(gpu.total_bytes)} booked on GPU {gpu.index})"
    return out


def _fmt_mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _hidden_line(events: Sequence[TaskEvent]) -> str:
    """One line for a run of events ``logs`` does not print one by one: ``"3 training steps
    (1-3; --metrics shows each)"``, and a count of events of kinds this client does not know."""
    steps = [e.step for e in events if e.kind == "metric"]
    parts = []
    if steps:
        span = str(steps[0]) if len(steps) == 1 else f"{min(steps)}-{max(steps)}"
        parts.append(f"{len(steps)} training step{'s' if len(steps) != 1 else ''} ({span}; --metrics shows each)")
    other = len(events) - len(steps)
    if other:
        parts.append(f"{other} event{'s' if other != 1 else ''} of a kind this client does not show")
    return "[dim]" + ", ".join(parts) + "[/dim]"


def _cmd_logs(client: RLClient, args: argparse.Namespace) -> int:
    task = client.get_task(args.task_id)  # NOT_FOUND exits 2
    console = _console()
    for label, value in _endpoint_rows(task):  # where a running server answers, as `get` shows it
        console.print(f"{label} {value}", soft_wrap=True)
    # Following ends by itself after the terminal event; otherwise just the history so far.
    # `#N` is the task's event sequence, which state changes, checkpoints and training steps
    # share; the events not printed one per line (steps without --metrics, kinds this client does
    # not know) are summed up in one line per run, so the numbers shown never skip.
    events = client.watch(task.task_id, follow=bool(args.follow or task.done))
    hidden: list[TaskEvent] = []

    def flush() -> None:
        if hidden:
            first, last = hidden[0].sequence, hidden[-1].sequence
            seqs = f"#{first}" if first == last else f"#{first}-#{last}"
            console.print(f"{_fmt_time(hidden[-1].time)}  {seqs}  {_hidden_line(hidden)}", soft_wrap=True)
            hidden.clear()

    for event in events:
        if event.kind == "state":
            line = _state_line(event)
            if event.to_state == "failed":
                line = f"[red]{line}[/red]"
        elif event.kind == "checkpoint":
            line = _checkpoint_line(event)
        elif event.kind == "phase":
            line = _phase_line(event)
        elif event.kind == "checkpoint_failed":
            line = _checkpoint_failed_line(event)
        elif event.kind == "artifacts_deleted":
            line = f"artifacts deleted: {_escape(event.message)}"
        elif event.kind == "metric" and args.metrics:
            line = _metric_line(event, None)
        else:
            hidden.append(event)
            continue
        flush()
        # One event, one line at any width (soft_wrap: the terminal folds it, rich does not break
        # it), so `opentinker logs ID | grep` finds every word of an event on the line it is on.
        console.print(f"{_fmt_time(event.time)}  #{event.sequence}  {line}", soft_wrap=True)
    flush()
    final = client.get_task(task.task_id) if (args.follow or task.done) else task
    if final.error and final.done:
        console.print(_ended_line(final), soft_wrap=True)
    return EXIT_OK


def _env_kind(task: TaskInfo) -> str:
    from opentinker_common.spec.registry import env_entry

    entry = env_entry(str((task.env_config or {}).get("env_id", "arithmetic")))
    return entry.kind if entry is not None else ""


def _default_x(tasks: Sequence[TaskInfo]) -> str:
    """``env_steps`` when every task is PPO on an environment (sample efficiency), else ``step``."""
    from opentinker_common import curves

    axes = {curves.default_x_axis(t.workload_type, _env_kind(t)) for t in tasks}
    return axes.pop() if len(axes) == 1 else "step"


def _cmd_plot(client: RLClient, args: argparse.Namespace) -> int:
    from opentinker_client.cli.plot import MissingExtraError, plot_runs

    tasks = [client.get_task(t) for t in dict.fromkeys(args.task_id)]
    runs = [
        ((f"{t.task_id} {t.name}".strip() if len(tasks) > 1 else ""), client.get_timed_metric_history(t.task_id))
        for t in tasks
    ]
    x = args.x or _default_x(tasks)
    out = args.output or (f"{tasks[0].task_id}.png" if len(tasks) == 1 else "compare.png")
    if len(tasks) == 1:
        t = tasks[0]
        title = f"{t.task_id}" + (f" {t.name}" if t.name else "") + f" ({t.workload_type}, {t.state})"
    else:
        title = f"{len(tasks)} tasks"
    try:
        counts = plot_runs(runs, out, title=title, keys=tuple(args.key or ("reward", "loss")), x=x, smooth=args.smooth)
    except MissingExtraError as exc:
        return _error(exc)
    except ValueError as exc:
        which = f"task {tasks[0].task_id}" if len(tasks) == 1 else "tasks " + ", ".join(t.task_id for t in tasks)
        return _error(f"{which}: {error_text(exc)}")
    print(safe_text(f"wrote {out}: " + ", ".join(f"{n} {k} point(s)" for k, n in counts.items()) + f" against {x}"))
    return EXIT_OK


#: Metrics ``compare`` reports, and whether larger is better.
_COMPARE_KEYS = (("reward", True), ("loss", False))


def compare_rows(
    tasks: Sequence[TaskInfo],
    histories: Sequence[Sequence[tuple[int, Mapping[str, float]]]],
    *,
    now: float,
    first_starts: Sequence[_dt.datetime | None] | None = None,
) -> tuple[list[str], list[list[str]], list[tuple[str, list[str]]]]:
    """The ``compare`` table: ``(header, one row per task, [(setting, value per task)])`` with
    final and best reward/loss, steps, wall time (from each task's first start in
    ``first_starts``, :func:`_first_start`; its ``start_time`` when not given), usage
    (GPU-seconds, CPU-task seconds and cost over all attempts, from ``TaskInfo.usage``; ``-``
    where the scheduler did not say), and only the settings (model, env, hyper-parameters) whose
    values differ between the tasks, compared as the scheduler resolved them (defaults filled in:
    a task that left ``learning_rate`` at its default and one that set it to that value do not
    differ; :func:`_resolved_settings`)."""
    header = ["task", "name", "state", "steps", "wall time", "GPU-s", "CPU-task s", "cost"]
    for key, _ in _COMPARE_KEYS:
        header += [f"final {key}", f"best {key}"]
    rows = []
    starts = list(first_starts) if first_starts is not None else [t.start_time for t in tasks]
    for task, history, first in zip(tasks, histories, starts):
        wall = _wall_time(task, first, now=now, per_attempt=False)
        row = [task.task_id, task.name, task.state, str(task.latest_step), wall]
        u = task.usage or {}
        row += [f"{u['gpu_seconds']:.0f}", f"{u['cpu_task_seconds']:.0f}", f"{u['cost']:.4f}"] if u else ["-"] * 3
        for key, larger in _COMPARE_KEYS:
            values = [v[key] for _, v in history if key in v and math.isfinite(v[key])]
            row.append(f"{values[-1]:.4g}" if values else "-")
            row.append(f"{(max(values) if larger else min(values)):.4g}" if values else "-")
        rows.append(row)
    flat = [_flatten(_resolved_settings(t)) for t in tasks]
    names = sorted(set().union(*flat)) if flat else []
    differing = [
        (n, [json.dumps(f.get(n), default=str) if n in f else "-" for f in flat])
        for n in names
        if len({json.dumps(f.get(n), sort_keys=True, default=str) for f in flat}) > 1
    ]
    return header, rows, differing


def _resolved_settings(task: TaskInfo) -> dict[str, Any]:
    """``{"model", "env", hyper-parameter: value ...}`` of ``task`` as its worker runs it (the spec
    parsed by :func:`opentinker_common.spec.spec_from_proto`, defaults filled in); as submitted
    when there is no spec or it no longer parses (a task stored by an older scheduler)."""
    from opentinker_common.spec import SpecError, spec_from_proto

    spec = getattr(task.proto, "spec", None)
    if spec is not None:
        try:
            resolved = spec_from_proto(spec).to_dict()
        except (SpecError, ValueError, TypeError):
            pass
        else:
            return {"model": task.model or resolved["model"], "env": resolved["env"], **resolved["hyperparameters"]}
    return {"model": task.model, "env": dict(task.env_config or {}), **dict(task.hyperparameters or {})}


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _cmd_compare(client: RLClient, args: argparse.Namespace) -> int:
    import time

    from rich.table import Table

    tasks = [client.get_task(t) for t in dict.fromkeys(args.task_id)]
    histories = [client.get_metric_history(t.task_id) for t in tasks]
    first_starts = [_first_start(client, t) for t in tasks]
    header, rows, differing = compare_rows(tasks, histories, now=time.time(), first_starts=first_starts)
    console = _console()
    table = Table(*header, title="tasks")
    for row in rows:
        table.add_row(*(_escape(c) for c in row))
    console.print(table)
    if differing:
        hp = Table("setting", *(t.task_id for t in tasks), title="settings that differ (resolved)")
        for name, values in differing:
            hp.add_row(_escape(name), *(_escape(v) for v in values))
        console.print(hp)
    else:
        console.print("settings: the same for every task (resolved model, env and hyper-parameters)")
    return EXIT_OK


def _cmd_export(client: RLClient, args: argparse.Namespace) -> int:
    if args.merged or args.torchscript:
        return _export_model(client, args)
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
        safe_text(
            f"wrote {written} scalar(s) over {len(history)} step(s) to {folder} (view: tensorboard --logdir "
            f"{args.tensorboard})"
        )
    )
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# Checkpoints out: download, export a merged model or a policy, eval.


def _checkpoint_task(client: RLClient, task_id: str, step: int | None, nothing: str) -> tuple[TaskInfo, str]:
    """The task and a line saying which of its checkpoints is used (the newest, or ``step``).

    Raises:
        FailedPreconditionError: the task has no checkpoint (:meth:`TaskInfo.without_checkpoint`,
            ending in ``nothing``).
    """
    task = client.get_task(task_id)
    if not task.checkpoint_path:
        raise FailedPreconditionError(task.without_checkpoint(nothing, deleted=client.artifacts_deletion(task_id)))
    if step:
        return task, f"checkpoint at step {step}"
    return task, task.checkpoint_note


def _cmd_download(client: RLClient, args: argparse.Namespace) -> int:
    task, note = _checkpoint_task(client, args.task_id, args.step, "there is nothing to download")
    dest = Path(args.output or f"{task.task_id}-step{args.step or task.checkpoint_step}")
    client.download_checkpoint(task.task_id, dest, step=args.step)
    files = [p for p in dest.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    print(f"downloaded task {task.task_id}'s {note} to {dest} ({len(files)} files, {_fmt_bytes(size)})")
    return EXIT_OK


def _cmd_upload_adapter(client: RLClient, args: argparse.Namespace) -> int:
    task = client.upload_adapter(args.folder, model=args.model, name=args.name)
    print(task.task_id, flush=True)
    print(f"adapter on {task.model} stored as task {task.task_id}: use it as init_from, or serve it", file=sys.stderr)
    return EXIT_OK


def _export_model(client: RLClient, args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from opentinker_client.models import ACTING_FILE, MissingExtraError, merge_adapter

    task, note = _checkpoint_task(client, args.task_id, args.step, "there is nothing to export")
    target = Path(args.merged or args.torchscript)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        return _error(f"{target} exists; name a new {'folder' if args.merged else 'file'}")
    with tempfile.TemporaryDirectory(prefix="opentinker-export-") as tmp:
        folder = client.download_checkpoint(task.task_id, Path(tmp) / "checkpoint", step=args.step)
        try:
            if args.merged:
                merge_adapter(folder, target, base=args.base, dtype=args.dtype)
                what = (
                    f"a {args.dtype} transformers model with the adapter merged (its logits checked against the "
                    "adapter's)"
                )
            else:
                if not (folder / ACTING_FILE).is_file():
                    return _error(
                        f"task {task.task_id} ({task.workload_type}) has no exported policy in its checkpoint; "
                        "--torchscript is for single-agent full_rl (PPO) tasks"
                    )
                partial = target.with_name(f".{target.name}.part")
                shutil.copyfile(folder / ACTING_FILE, partial)
                partial.replace(target)
                what = "its TorchScript policy (torch.jit.load; obs [B, ...] -> (action, value))"
        except (MissingExtraError, ValueError) as exc:
            return _error(f"task {task.task_id}: {error_text(exc)}")
    print(f"wrote {target}: {what}, from task {task.task_id}'s {note}")
    return EXIT_OK


#: What the ± after a mean means, said under every evaluation.
PLUS_MINUS = (
    "± is one standard error of the mean over the episodes (sample std / sqrt(episodes)): about a 68% "
    "interval for the true mean; ±2 of them about 95%"
)


def _ints(value: Any) -> Any:
    """``value`` with whole floats as ints, nested: the spec travels as a protobuf Struct, whose
    numbers are all floats, and gymnasium's constructors want ``max_episode_steps=500``, not 500.0."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


def _eval_policy(client: RLClient, args: argparse.Namespace, task: TaskInfo) -> int:
    import tempfile

    from opentinker_client.models import MissingExtraError, evaluate_policy, load_policy

    env = _ints(dict(task.env_config))
    env_id = env.get("env_id") or ""
    note = task.checkpoint_note
    if not note:
        deleted = client.artifacts_deletion(task.task_id)
        return _error(task.without_checkpoint("there is no policy to evaluate", deleted=deleted))
    try:
        with tempfile.TemporaryDirectory(prefix="opentinker-eval-") as tmp:
            policy = load_policy(client.download_checkpoint(task.task_id, Path(tmp) / "checkpoint"))
        r = evaluate_policy(
            policy,
            env_id,
            episodes=args.episodes,
            seed=args.seed,
            env_kwargs=env.get("env_kwargs") or {},
            max_episode_steps=env.get("max_episode_steps"),
        )
    except (MissingExtraError, FileNotFoundError, ValueError) as exc:
        return _error(f"task {task.task_id}: {error_text(exc)}")
    print(
        f"policy of task {task.task_id} ({note}): mean return {r.mean_return:.3f} ± {r.stderr:.3f} over "
        f"{r.episodes} episodes of {r.env_id} (greedy actions, seeds {args.seed}..{args.seed + r.episodes - 1}, "
        f"mean length {sum(r.lengths) / r.episodes:.1f})"
    )
    print(PLUS_MINUS)
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
        description="Submit and follow OpenTinker reinforcement-learning tasks. The scheduler is "
        "--scheduler-url (before or after the command), else $SCHEDULER_URL, else "
        f"{DEFAULT_SCHEDULER_URL}: e.g. `opentinker --scheduler-url sched-host:9000 list` or "
        "`export SCHEDULER_URL=http://sched-host:9000`.",
        epilog="Exit codes: 0 ok; 1 the task ended FAILED or CANCELLED; 2 error; 130 interrupted.",
    )
    _add_connection_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("submit", help="submit a task from a YAML config; prints the task id")
    p.add_argument("config", metavar="CONFIG.yaml", help="task config file")
    p.add_argument("--watch", action="store_true", help="then follow it like `opentinker watch`")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a value of the file without editing it (repeatable): any top-level key (gpu_count=1, "
        "nodes=2, model=NAME, ...) or one inside env, hyperparameters or tracking (hyperparameters.steps=20, "
        "env.max_digits=2); VALUE is read as YAML (null removes a key or sets a top-level one back to its default)",
    )
    p.add_argument(
        "--request-id", default=None, help="idempotency key: resubmitting with the same id returns the same task"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate on the scheduler and estimate GPU-hours and cost; submit nothing",
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

    p = sub.add_parser("cancel", help="cancel pending or running tasks")
    p.add_argument("task_id", metavar="TASK_ID", nargs="+", help="one or more task ids")
    p.add_argument("--reason", default="", help="why, recorded on the task")
    p.set_defaults(func=_cmd_cancel)

    p = sub.add_parser(
        "endpoint-token",
        help="print a token for an inference or lora_session task's endpoints (the OpenAI API's api_key)",
    )
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument("--ttl", type=_ttl, default=3600.0, help="how long it works: 1s to 24h (default 1h)")
    p.set_defaults(func=_cmd_endpoint_token)

    p = sub.add_parser(
        "rm", help="delete a finished task's checkpoints from the artifact store (the task's record stays)"
    )
    p.add_argument("task_id", metavar="TASK_ID")
    p.set_defaults(func=_cmd_rm)

    p = sub.add_parser("nodes", help="list trainer nodes and per-GPU telemetry")
    p.set_defaults(func=_cmd_nodes)

    p = sub.add_parser("usage", help="accounted usage per owner and queue: GPU-hours, tokens, env steps, cost")
    p.add_argument("--owner", default="", help="only this owner (user keys: their own only)")
    p.add_argument(
        "--since", default=None, metavar="WHEN", help="only attempts assigned since: 2026-01-31, an ISO time, or 7d/12h"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_usage)

    # Operations: logs, plot, export (opentinker_client/cli/plot.py, opentinker_client/cli/export.py).
    p = sub.add_parser("logs", help="a task's state changes, errors and checkpoints as lines (--follow to keep going)")
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the task ends")
    p.add_argument("--metrics", action="store_true", help="also a line per training step")
    p.set_defaults(func=_cmd_logs)

    p = sub.add_parser(
        "plot", help="write a PNG of tasks' reward and loss curves, overlaid (needs the plot extra: matplotlib)"
    )
    p.add_argument("task_id", metavar="TASK_ID", nargs="+", help="one or more tasks, overlaid on each panel")
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
    p.add_argument(
        "--x",
        choices=("step", "env_steps", "tokens", "time"),
        default=None,
        help="x axis (default: env_steps for PPO on environments, else step)",
    )
    p.add_argument(
        "--smooth", type=float, default=0.0, metavar="W", help="EMA smoothing weight in [0, 1), as TensorBoard's"
    )
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("compare", help="a table of tasks' final and best metrics, wall time and differing settings")
    p.add_argument("task_id", metavar="TASK_ID", nargs="+")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser(
        "export",
        help="export a task's metrics (--tensorboard), its adapter merged into the base model (--merged) or its "
        "PPO policy (--torchscript); the last two need the models extra",
    )
    p.add_argument("task_id", metavar="TASK_ID")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="TensorBoard log folder; the task is the run DIR/TASK_ID (tensorboard extra)",
    )
    what.add_argument(
        "--merged", metavar="DIR", help="write a full transformers model with the task's LoRA adapter merged in"
    )
    what.add_argument(
        "--torchscript", metavar="FILE", help="write a full_rl task's policy as TorchScript (torch.jit.load FILE)"
    )
    p.add_argument("--step", type=int, default=None, help="the checkpoint at this step (default: the newest)")
    p.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="--merged weights (default %(default)s)"
    )
    p.add_argument(
        "--base", default=None, metavar="MODEL", help="--merged: base model to load (default: the one the task named)"
    )
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser(
        "upload-adapter",
        help="upload a PEFT LoRA adapter folder trained elsewhere; prints the task id that names it (init_from, serve)",
    )
    p.add_argument("folder", metavar="DIR", help="the adapter folder (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--model", default=None, help="base model it was trained on (default: its adapter_config.json's)")
    p.add_argument("--name", default=None, help="a name for people (default: the folder's name)")
    p.set_defaults(func=_cmd_upload_adapter)

    p = sub.add_parser("download", help="download a task's checkpoint folder (the newest, or --step N)")
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument("--step", type=int, default=None, help="the checkpoint at this step (default: the newest)")
    p.add_argument("-o", "--output", default=None, metavar="DIR", help="folder to create (default: TASK_ID-stepN)")
    p.set_defaults(func=_cmd_download)

    p = sub.add_parser(
        "serve",
        help="serve a lora_finetune/sft task's adapter (its newest checkpoint; while it trains, each request gets "
        "the newest), a lora_session's (ended: its newest checkpoint; running: its newest sampler save), a "
        "finished full-weight sft/full_rl task's weights, or a PPO task's policy; prints the endpoint",
    )
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument(
        "--ttl", type=float, default=3600.0, help="seconds a newly started server runs (default %(default)s)"
    )
    p.add_argument("--gpus", type=int, default=0, help="GPUs for a newly started server (default 0)")
    p.add_argument(
        "--step",
        type=int,
        default=0,
        help="a full-weight task's checkpoint, or a running session's sampler save, at this step (default: the newest)",
    )
    _add_inference_ca(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "eval",
        help="mean reward of a trained adapter and of its base model on the task's environment; of a full_rl "
        "task's policy, mean episode return (here, with the models extra)",
    )
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument("--episodes", type=int, default=32, help="problems or episodes per model (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="full_rl: episode i is reset with seed SEED + i (default 0)")
    p.add_argument("--max-tokens", type=int, default=16, help="reply length limit (default %(default)s)")
    _add_inference_ca(p)
    p.set_defaults(func=_cmd_eval)

    from opentinker_client.cli.keys import add_keys_parser

    add_keys_parser(sub)  # opentinker keys create|list|revoke|rotate
    from opentinker_client.cli.queues import add_queues_parser

    add_queues_parser(sub)  # opentinker queues [set]
    _connection_options_after_commands(parser)
    return parser


#: The options every command shares (where the scheduler is, how to talk to it).
_CONNECTION_OPTIONS = ("--scheduler-url", "--api-key", "--tls-ca", "--tls-cert", "--tls-key", "--timeout")


def _add_connection_options(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """The options of :data:`_CONNECTION_OPTIONS` on ``parser``: with their defaults on the top
    parser; with ``suppress`` (a command's parser) without any, so one given after the command
    (``opentinker list --scheduler-url host:9000``) overrides the top parser's and one left out
    leaves it alone."""
    env_url = os.environ.get("SCHEDULER_URL")

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--scheduler-url",
        default=default(env_url or DEFAULT_SCHEDULER_URL),
        metavar="URL",
        help="the scheduler's gRPC address: host:port, http://host:port or https://host:port (TLS); before or "
        "after the command (default: $SCHEDULER_URL, "
        + (f"now {safe_text(env_url).replace('%', '%%')!r})" if env_url else f"else {DEFAULT_SCHEDULER_URL})"),
    )
    parser.add_argument(
        "--api-key",
        default=default(None),
        help="API key (default: $OPENTINKER_API_KEY, preferred: arguments show in ps)",
    )
    parser.add_argument(
        "--tls-ca",
        default=default(None),
        metavar="PEM",
        help="CA of the scheduler's certificate; turns TLS on (default: $OPENTINKER_TLS_CA; an https:// URL "
        "without one trusts the system roots)",
    )
    parser.add_argument(
        "--tls-cert",
        default=default(None),
        metavar="PEM",
        help="client certificate for mTLS (default: $OPENTINKER_TLS_CERT)",
    )
    parser.add_argument(
        "--tls-key", default=default(None), metavar="PEM", help="key of --tls-cert (default: $OPENTINKER_TLS_KEY)"
    )
    parser.add_argument("--timeout", type=float, default=default(30.0), help="seconds per call (default: 30)")


def _connection_options_after_commands(parser: argparse.ArgumentParser) -> None:
    """Give every command's parser (and its subcommands', e.g. ``keys create``) the connection
    options too, so they work after the command as well as before it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in set(action.choices.values()):
                if not any(o in command._option_string_actions for o in _CONNECTION_OPTIONS):
                    _add_connection_options(command, suppress=True)
                _connection_options_after_commands(command)


def _cmd_serve(client: RLClient, args: argparse.Namespace) -> int:
    llm = client.serve(
        args.task_id, step=args.step, ttl=args.ttl, gpu_count=args.gpus, root_certificates=args.inference_ca
    )  # with the CLI's API key
    task = client.get_task(args.task_id)
    if task.workload_type == "lora_session" and llm.adapter and "@" in llm.adapter:  # a running session's save
        step = llm.adapter.rpartition("@")[2]
        print(
            safe_text(
                f"adapter {llm.adapter} (the running session's sampler save at step {step}) "
                f"served by inference task {llm.task_id} at {llm.endpoint}"
            )
        )
    else:
        print(safe_text(_served_line(task, step=args.step, server=llm.task_id, endpoint=llm.endpoint)))
    server = client.get_task(llm.task_id)
    for line in _serve_next_lines(server, model=llm.adapter or task.task_id):
        print(safe_text(line))
    return 0


def _serve_next_lines(server: TaskInfo, *, model: str) -> list[str]:
    """What ``serve`` prints after its line: the OpenAI base URL of inference task ``server`` when
    it has one, and a command that asks ``model`` there."""
    base = server.openai_endpoint
    if not base:
        return [
            f"inference task {server.task_id} has no OpenAI API (submit one with openai_port: docs/inference.md); "
            f'try from Python: RLClient().serve("{model}").generate("What is 4 + 5?")'
        ]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is 4 + 5?"}]})
    return [
        f"OpenAI API: {base} (model {model}; api_key: opentinker endpoint-token {server.task_id})",
        f'try: curl {base}/chat/completions -H "Authorization: Bearer $(opentinker endpoint-token {server.task_id})" '
        f"-H 'Content-Type: application/json' -d '{body}'",
    ]


def _served_what(task: TaskInfo, step: int = 0) -> str:
    """What ``serve`` serves of ``task``, named by what its checkpoints hold: ``policy`` (a PPO
    policy, ``torch_ppo``), ``model`` (all weights, ``hf_full``; or a ``--step`` of a full-weight
    task) or ``adapter`` (a LoRA adapter)."""
    fmt = task.proto.latest_checkpoint.format if task.proto is not None else ""
    if fmt == "torch_ppo" or (task.workload_type == "full_rl" and fmt not in ("hf_full", "peft_lora")):
        return "policy"
    return "model" if step or fmt == "hf_full" else "adapter"


def _served_line(task: TaskInfo, *, step: int, server: str, endpoint: str) -> str:
    """``serve``'s line: ``policy TASK (final checkpoint, step 20) served by inference task T at HOST:PORT``."""
    what = _served_what(task, step)
    note = f"step {step}" if step else task.checkpoint_note
    if not task.done and what == "adapter":  # served while it trains: each request gets the newest
        note += "; later requests get its newer checkpoints, or its live adapter on its own model host"
    return f"{what} {task.task_id} ({note}) served by inference task {server} at {endpoint}"


def _cmd_eval(client: RLClient, args: argparse.Namespace) -> int:
    from opentinker_client.evaluate import evaluate
    from opentinker_common.spec.gym import is_gym_id

    task = client.get_task(args.task_id)
    if task.workload_type == "full_rl" and is_gym_id(str((task.env_config or {}).get("env_id") or "")):
        return _eval_policy(client, args, task)  # a PPO policy: episodes here, with its TorchScript
    env = dict(task.env_config) or "arithmetic"
    llm = client.serve(args.task_id, root_certificates=args.inference_ca)  # with the CLI's API key
    print(safe_text(f"adapter {args.task_id}: {task.checkpoint_note}"))
    for label, adapter in (("base model", None), (f"adapter {args.task_id}", args.task_id)):
        r = evaluate(llm, env=env, episodes=args.episodes, adapter=adapter, max_tokens=args.max_tokens)
        print(
            safe_text(
                f"{label}: mean reward {r.mean_reward:.3f} ± {r.stderr:.3f} over {r.episodes} episodes of {r.env_id}"
            )
        )
    print(PLUS_MINUS)
    return 0


#: Problems ``_error`` shows one per line; the rest are counted in one more line.
MAX_ERROR_LINES = 20


def _error(message: Any) -> int:
    """One line ``error: ...`` on stderr per problem (an exception worded by :func:`error_text`:
    the message, then its status code in brackets); returns :data:`EXIT_ERROR`. A task file with
    several bad keys gives a line for each (``ConfigError.problems``, each ``file:line:col: key:
    ...``, as a compiler lists its errors), and so does a scheduler refusal naming several fields
    (``InvalidArgumentError.violations``). At most :data:`MAX_ERROR_LINES` are shown, then
    ``error: ... and N more``: a file that is not a task file (``/etc/passwd``) is not echoed."""
    lines = [message]
    problems = getattr(message, "problems", ())
    violations = getattr(message, "violations", ())
    if len(problems) > 1:
        lines = list(problems)
    elif not problems and len(violations) > 1:
        code = getattr(getattr(message, "code", None), "name", None)
        lines = [f"{field}: {description}" + (f" [{code}]" if code else "") for field, description in violations]
    for line in lines[:MAX_ERROR_LINES]:  # one line each; the server's words never act on the terminal
        text = safe_text(" ".join((line if isinstance(line, str) else error_text(line)).split()))
        print(f"error: {text}", file=sys.stderr, flush=True)
    if len(lines) > MAX_ERROR_LINES:
        print(f"error: ... and {len(lines) - MAX_ERROR_LINES} more", file=sys.stderr, flush=True)
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
    except _StoppedWatching as stop:
        interrupted = True
        task = safe_text(stop.task_id)
        print(
            f"interrupted: stopped watching; task {task} keeps running on the scheduler "
            f"(opentinker watch {task} follows it again, opentinker cancel {task} stops it)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
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
