"""The ``queues:`` and ``default_queue:`` sections: quota queues shared by teams (what they mean:
:mod:`opentinker_scheduler.policy.quota`, which decides with them).

.. code-block:: yaml

    queues:
      - name: team-a
        gpus: 8                # nominal GPU quota
        cpu_tasks: 16          # nominal quota of CPU tasks (gpu_count 0) running at once
        borrowing_limit:       # optional: how far beyond nominal it may go on other queues' idle
          gpus: 4              #   quota; a resource left out may borrow all there is idle, 0 never
          cpu_tasks: 0
        owners: [alice, bob]   # API key owners whose tasks count against this queue
        limits:                # optional: the per-owner limits (limits: section) for its owners
          max_pending_per_owner: 200
          submit_rate: 5       #   per owner, as limits.submit_rate
          submit_burst: 20
    default_queue: team-a      # owners in no queue's list go here; unset: each is a queue of its own
                               # with no quota
"""

from __future__ import annotations

from dataclasses import dataclass

#: Largest quota a queue may be given (GPUs or CPU tasks).
MAX_QUOTA = 1_000_000


@dataclass(frozen=True)
class QueueConfig:
    """One ``queues:`` entry. ``borrowing_*`` None: may borrow any idle quota."""

    name: str
    gpus: int = 0
    cpu_tasks: int = 0
    borrowing_gpus: int | None = None
    borrowing_cpu_tasks: int | None = None
    owners: tuple[str, ...] = ()
    #: Per-owner limits for this queue's owners (None: the ``limits:`` section's).
    max_pending_per_owner: int | None = None
    submit_rate: float | None = None
    submit_burst: int | None = None


def check_queue_name(name: str) -> str | None:
    """What is wrong with a queue name (None: fine): 1..64 characters, letters, digits, ``-_.``."""
    if not 1 <= len(name) <= 64 or not all(c.isalnum() or c in "-_." for c in name):
        return "a queue name of 1 to 64 letters, digits, '-', '_' or '.'"
    return None


def parse_queues(r, node) -> tuple[QueueConfig, ...]:
    """Parse the ``queues:`` list with the config reader ``r`` (file:line:key errors).

    Raises:
        ConfigError: unknown key, wrong type, out of range, a queue name twice, or an owner in two
            queues (via ``r``).
    """
    out: list[QueueConfig] = []
    names: set[str] = set()
    owner_of: dict[str, str] = {}
    for i, item in enumerate(r.sequence(node, "queues")):
        path = f"queues[{i}]"
        m = r.mapping(
            item, path, {"name": "", "gpus": "", "cpu_tasks": "", "borrowing_limit": "", "owners": "", "limits": ""}
        )
        if "name" not in m:
            raise r.fail(item, f"{path}.name", "a queue name (required)")
        name = r.scalar(m["name"][1], f"{path}.name", str)
        bad = check_queue_name(name)
        if bad:
            raise r.fail(m["name"][1], f"{path}.name", f"{bad}, got {name!r}")
        if name in names:
            raise r.fail(m["name"][1], f"{path}.name", f"a unique queue name; {name!r} appears twice")
        names.add(name)
        kw: dict = {"name": name}
        for key in ("gpus", "cpu_tasks"):
            if key in m:
                kw[key] = r.scalar(m[key][1], f"{path}.{key}", int, 0, MAX_QUOTA)
        if "borrowing_limit" in m:
            b = r.mapping(m["borrowing_limit"][1], f"{path}.borrowing_limit", {"gpus": "", "cpu_tasks": ""})
            for key in ("gpus", "cpu_tasks"):
                if key in b:
                    kw[f"borrowing_{key}"] = r.scalar(b[key][1], f"{path}.borrowing_limit.{key}", int, 0, MAX_QUOTA)
        owners: list[str] = []
        if "owners" in m:
            for j, o in enumerate(r.sequence(m["owners"][1], f"{path}.owners")):
                owner = r.scalar(o, f"{path}.owners[{j}]", str)
                if not owner:
                    raise r.fail(o, f"{path}.owners[{j}]", "a non-empty owner")
                if owner in owner_of:
                    raise r.fail(
                        o,
                        f"{path}.owners[{j}]",
                        f"each owner in one queue; {owner!r} is already in {owner_of[owner]!r}",
                    )
                owner_of[owner] = name
                owners.append(owner)
        kw["owners"] = tuple(owners)
        if "limits" in m:
            keys = {"max_pending_per_owner": (int, 0, 10_000_000), "submit_rate": (float, 0, 1e6),
                    "submit_burst": (int, 1, 1_000_000)}  # fmt: skip
            lm = r.mapping(m["limits"][1], f"{path}.limits", dict.fromkeys(keys, ""))
            for key, (kind, lo, hi) in keys.items():
                if key in lm:
                    kw[key] = r.scalar(lm[key][1], f"{path}.limits.{key}", kind, lo, hi)
        out.append(QueueConfig(**kw))
    return tuple(out)
