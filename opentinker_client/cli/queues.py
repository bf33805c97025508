"""``opentinker queues [set|reset]``: quota queues shared by teams, from the command line.

::

    opentinker queues                                   # quotas, use now, pending, per-owner limits,
                                                        # SOURCE: config or runtime override
    opentinker --api-key "$ADMIN_KEY" queues set team-a --gpus 8 --cpu-tasks 16 --borrow-gpus 4 \\
        --owner alice --owner bob                       # now, without a restart (audited: queue.set);
                                                        # kept across restarts until reset
    opentinker --api-key "$ADMIN_KEY" queues reset team-a   # back to the config (queue.reset)

See docs/operations.md, "Sharing a cluster".
"""

from __future__ import annotations

import argparse
import sys
import time

from opentinker_client.cli.render import markup
from opentinker_client.cli.tables import print_fitted


def _limit(n: int | None) -> str:
    return "any" if n is None else str(n)


def _rate(q) -> str:
    pending = str(q.max_pending_per_owner) if q.max_pending_per_owner else "none"
    rate = f"{q.submit_rate:g}/s burst {q.submit_burst}" if q.submit_rate else "none"
    return f"{pending} pending, {rate}"


_LABELS = {
    "gpu_quota": "GPUs",
    "cpu_task_quota": "CPU tasks",
    "gpu_borrowing_limit": "borrow GPUs",
    "cpu_task_borrowing_limit": "borrow CPU tasks",
    "owners": "owners",
}


def _value(field: str, v) -> str:
    if field == "owners":
        return ", ".join(v) or "none"
    return _limit(v) if field.endswith("borrowing_limit") else str(v)


def _source(q) -> str:
    """Where a queue's values come from: ``config``, or the runtime override and what the config
    says of each value it changed."""
    if not q.limited:
        return "-"
    diff = q.overrides()
    if not q.overridden:
        if not diff:
            return "config"
        return "config; moved by an override: " + "; ".join(
            f"{_LABELS[f]} (config {_value(f, was)})" for f, (was, _) in diff.items()
        )
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(q.override_time)) if q.override_time else "?"
    head = f"override by {q.override_by or '?'} {when}"
    if q.configured is None:
        return f"{head}; not in config"
    if not diff:
        return f"{head}; same as config"
    return f"{head}; config: " + "; ".join(f"{_LABELS[f]} {_value(f, was)}" for f, (was, _) in diff.items())


def _describe(q) -> str:
    return (
        f"{q.gpu_quota} GPUs, {q.cpu_task_quota} CPU tasks, borrowing {_limit(q.gpu_borrowing_limit)} GPUs / "
        f"{_limit(q.cpu_task_borrowing_limit)} CPU tasks, owners {', '.join(q.owners) or '-'}"
    )


#: ``opentinker queues`` columns (none wraps); on a narrow terminal they move under each row in
#: ``_MOVE_ORDER``, QUEUE, GPUS, CPU TASKS and PENDING stay.
_COLUMNS = tuple(
    (h, False)
    for h in (
        "QUEUE",
        "GPUS",
        "CPU TASKS",
        "BORROW",
        "PENDING",
        "SHARE",
        "OWNERS",
        "PER-OWNER LIMITS",
        "GPU-H",
        "COST",
        "SOURCE",
    )
)
_MOVE_ORDER = ("SOURCE", "PER-OWNER LIMITS", "OWNERS", "BORROW", "COST", "GPU-H", "SHARE")


def _cmd_list(client, args: argparse.Namespace) -> int:
    from rich.console import Console

    rows = []
    for q in client.queues.list():
        if q.limited:
            gpus, cpus = f"{q.gpus_in_use}/{q.gpu_quota}", f"{q.cpu_tasks_in_use}/{q.cpu_task_quota}"
            borrow = f"{_limit(q.gpu_borrowing_limit)} GPUs, {_limit(q.cpu_task_borrowing_limit)} CPU"
            share = f"{q.dominant_share:.2f}"
        else:
            gpus, cpus, borrow, share = f"{q.gpus_in_use}/-", f"{q.cpu_tasks_in_use}/-", "no quota", "-"
        rows.append(
            (
                markup(q.name),
                gpus,
                cpus,
                borrow,
                str(q.pending_tasks),
                share,
                markup(", ".join(q.owners)) or "-",
                markup(_rate(q)),
                f"{q.usage.gpu_seconds / 3600:.2f}",
                f"{q.usage.cost:.2f}",
                markup(_source(q)),
            )
        )
    print_fitted(Console(width=None if sys.stdout.isatty() else 220, emoji=False), _COLUMNS, rows, _MOVE_ORDER)
    return 0


def _cmd_set(client, args: argparse.Namespace) -> int:
    now, before = client.queues.set(
        args.name,
        gpu_quota=args.gpus,
        cpu_task_quota=args.cpu_tasks,
        gpu_borrowing_limit=args.borrow_gpus,
        cpu_task_borrowing_limit=args.borrow_cpu_tasks,
        owners=args.owner,
    )
    was = "new" if before is None else f"was {before.gpu_quota} GPUs, {before.cpu_task_quota} CPU tasks"
    print(
        f"queue {now.name}: {now.gpu_quota} GPUs, {now.cpu_task_quota} CPU tasks, borrowing "
        f"{_limit(now.gpu_borrowing_limit)} GPUs / {_limit(now.cpu_task_borrowing_limit)} CPU tasks, owners "
        f"{', '.join(now.owners) or '-'} ({was}); in use {now.gpus_in_use} GPUs, {now.cpu_tasks_in_use} CPU tasks"
    )
    return 0


def _cmd_reset(client, args: argparse.Namespace) -> int:
    now, removed = client.queues.reset(args.name)
    if removed is None:
        print(f"queue {args.name}: no runtime override; the config's {_describe(now)}")
    elif now is None:
        print(
            f"queue {args.name}: runtime override removed (was {_describe(removed)}); not in the config, so the "
            "queue is gone and its owners go back to their config queue, the default queue or their own"
        )
    else:
        print(
            f"queue {args.name}: runtime override removed (was {_describe(removed)}); now the config's {_describe(now)}"
        )
    return 0


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError(f"expected a whole number in [0, 1000000], got {text!r}")
    return value


def add_queues_parser(sub) -> None:
    """Add ``queues`` (list) and ``queues set`` to the ``opentinker`` sub-parsers."""
    queues = sub.add_parser("queues", help="quota queues: quotas, use, pending tasks, limits; `queues set` changes one")
    queues.set_defaults(func=_cmd_list)
    qs = queues.add_subparsers(dest="queues_command", metavar="QUEUES_COMMAND")
    p = qs.add_parser(
        "set", help="add or change a queue now (admin key needed; audited); kept across restarts until `queues reset`"
    )
    p.add_argument("name", help="queue name (letters, digits, -_.)")
    p.add_argument("--gpus", type=_count, required=True, help="nominal GPU quota")
    p.add_argument("--cpu-tasks", type=_count, default=0, help="nominal quota of CPU tasks at once (default 0)")
    p.add_argument("--borrow-gpus", type=_count, default=None, help="GPUs it may borrow beyond (default: any idle)")
    p.add_argument("--borrow-cpu-tasks", type=_count, default=None, help="CPU tasks it may borrow (default: any idle)")
    p.add_argument("--owner", action="append", default=[], help="an API key owner of this queue (repeatable)")
    p.set_defaults(func=_cmd_set)
    r = qs.add_parser("reset", help="remove a queue's runtime override: back to the config (admin key; audited)")
    r.add_argument("name", help="queue name")
    r.set_defaults(func=_cmd_reset)
