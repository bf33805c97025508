"""Placement: which pending task goes on which node's GPUs. Pure functions, no I/O.

Policy:
  * Order: larger priority first, then older (create time), then task id. The scheduler's rounds
    (:func:`place_round` with ``rank``) put fair share between the two: at equal priority the task
    of the quota queue with the lowest dominant share goes first (:mod:`.quota`), and a task its
    queue's quota does not admit waits (``admit``).
  * Gang: a task gets all ``gpu_count`` GPUs on one node at once, or nothing.
  * A node runs at most ``max_tasks`` tasks (CPU tasks, ``gpu_count == 0``, need only a slot).
  * Best fit: among nodes that fit, the one with the fewest free GPUs left over (packs small
    tasks, keeps large blocks free), then the fewest running tasks, then node id.
  * Backfill: a task that does not fit does not block smaller ones behind it, except on its
    reserved node (next point), so backfill cannot starve it.
  * Reservation: in each round, the first task in queue order (highest priority, then oldest)
    that does not fit now but could on some accepting node if that node were empty reserves one
    node (:func:`reservation_node`: the candidate with the most free GPUs now, then the fewest
    running tasks, then node id). Tasks behind it in that round are not placed on the reserved
    node, so its running work drains and the blocked task gets it; smaller tasks still backfill
    on every other node. On a one-node cluster this means no backfill past a blocked task.
    Exception: a CPU task needs none of the reserved GPUs, so it may take a slot on the reserved
    node while that leaves the ``RESERVATION_SLOTS`` the reservation needs
    (:func:`may_use_reserved`); the reserving task still finds its slot once its GPUs free. A task
    held back by the reservation says so (:func:`reserved_reason`).
  * A task whose retry backoff has not elapsed waits (``not_before``).
  * GPU sharing: LoRA tasks on the same base model (:func:`share_key`; an inference task on one
    GPU serving that base model's adapters counts as one) may share GPUs, at most
    ``max_tasks_per_gpu`` tasks on one GPU (per node: the config's, or the tenants a node's model
    host takes when larger, ``Register.tenants_per_host``) and always within the node's ``max_tasks``. A GPU is
    open to a task with key ``k`` when every task on it has key ``k`` and it has room
    (``NodeCapacity.shared[k]``). A shareable task goes where it uses the fewest free GPUs
    (packing onto open GPUs keeps whole GPUs free for gang tasks and other models), then best
    fit on the free GPUs left, then fewest running tasks, then node id; on the node it takes open
    GPUs first (fewest co-tenants first), then free ones. Other tasks only ever take free GPUs.
  * GPU memory of shared LoRA work: a shareable task whose :class:`MemoryNeed` is known (its base
    model's bytes and its tenant's adapter + optimizer bytes, :mod:`opentinker_common.lora_memory`)
    goes only on a GPU whose memory (``NodeCapacity.gpu_memory``, as the node reported it) less the
    estimates already booked there (``gpu_booked``) holds it: the tenant's bytes on a GPU open to
    its base model (the base is loaded once per GPU), the base's and the tenant's on a free GPU
    (:meth:`NodeCapacity.fits`). Since open GPUs are taken first, a task prefers a GPU that already
    hosts its base model. A GPU of unknown memory, or a task of unknown need, is counted in tasks only.
Every task left pending gets a reason a person can act on, in the style of Kubernetes
("no node has 4 free GPUs; largest free block is 2 on gpu-node-01").

:func:`plan` states the policy over plain lists. The scheduler runs the same policy
incrementally with :func:`place_round` over two indexes it keeps up to date — the pending queue
by ``gpu_count`` (:mod:`opentinker_scheduler.state.queue`) and :class:`FreeNodes` — so one round
costs O(placements + distinct gpu counts), not O(pending tasks x nodes). A property test keeps
the two in agreement.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
import heapq
from typing import Callable, Hashable, Iterable, Mapping, Sequence

from opentinker_common.lora_memory import fmt_bytes


@dataclass
class NodeCapacity:
    """What one node can take now. ``free_gpus`` are device indices."""

    node_id: str
    gpu_count: int
    max_tasks: int
    running: int
    free_gpus: list[int] = field(default_factory=list)
    accepting: bool = True  # False while draining or disconnected
    #: device -> (share key, tasks on it) for busy GPUs whose tasks all share that key; GPUs of
    #: tasks that need them to themselves are neither here nor free.
    gpu_share: dict[int, tuple[str, int]] = field(default_factory=dict)
    max_tasks_per_gpu: int = 1
    #: device -> its memory in bytes, as the node reported it (a device not here: unknown).
    gpu_memory: dict[int, int] = field(default_factory=dict)
    #: device -> bytes the estimates of its shared LoRA tasks take (their base once + each tenant).
    gpu_booked: dict[int, int] = field(default_factory=dict)

    def copy(self) -> NodeCapacity:
        """An independent copy to book against: ``free_gpus`` sorted ascending and ``gpu_share``
        copied, so booking on the copy leaves this one unchanged."""
        return NodeCapacity(
            self.node_id,
            self.gpu_count,
            self.max_tasks,
            self.running,
            sorted(self.free_gpus),
            self.accepting,
            dict(self.gpu_share),
            self.max_tasks_per_gpu,
            dict(self.gpu_memory),
            dict(self.gpu_booked),
        )

    @property
    def free_slots(self) -> int:
        return max(0, self.max_tasks - self.running)

    def memory_free(self, device: int) -> int | None:
        """Bytes of ``device`` not booked by estimates (None: its memory is unknown)."""
        total = self.gpu_memory.get(device)
        return None if total is None else total - self.gpu_booked.get(device, 0)

    def needs_on(self, device: int, key: str | None, need: MemoryNeed) -> int:
        """Bytes a task with ``need`` and share key ``key`` adds on ``device``: its tenant's alone
        where the GPU already holds its base model (open to ``key``), else the base's too."""
        shared = key is not None and self.gpu_share.get(device, (None, 0))[0] == key
        return need.tenant_bytes if shared else need.base_bytes + need.tenant_bytes

    def fits(self, device: int, key: str | None, need: MemoryNeed | None) -> bool:
        """Whether a task with ``need`` fits ``device``'s memory (always, when either is unknown)."""
        free = self.memory_free(device)
        return need is None or free is None or self.needs_on(device, key, need) <= free

    def open_gpus(self, key: str | None, need: MemoryNeed | None = None) -> list[int]:
        """Busy GPUs a task with share key ``key`` (and memory ``need``) may join, fewest
        co-tenants first, then index."""
        if key is None:
            return []
        return sorted(
            (
                d
                for d, (k, n) in self.gpu_share.items()
                if k == key and n < self.max_tasks_per_gpu and self.fits(d, key, need)
            ),
            key=lambda d: (self.gpu_share[d][1], d),
        )

    def usable_free(self, need: MemoryNeed | None = None) -> list[int]:
        """Free GPUs a task with memory ``need`` fits on (all of them when ``need`` is None)."""
        if need is None:
            return self.free_gpus
        return [d for d in self.free_gpus if self.fits(d, None, need)]

    def shared_keys(self) -> dict[str, int]:
        """share key -> how many busy GPUs are open to it."""
        out: dict[str, int] = {}
        for k, n in self.gpu_share.values():
            if n < self.max_tasks_per_gpu:
                out[k] = out.get(k, 0) + 1
        return out

    def open_to(self, key: str | None, need: MemoryNeed | None = None) -> int:
        """GPUs a task with share key ``key`` (and memory ``need``) could take here now (free plus
        open to ``key``)."""
        return len(self.usable_free(need)) + len(self.open_gpus(key, need))

    def choose_devices(self, gpu_count: int, key: str | None, need: MemoryNeed | None = None) -> tuple[int, ...]:
        """The devices a task gets here: GPUs open to ``key`` first, then free ones (lowest index),
        each with room for ``need``."""
        opened = self.open_gpus(key, need)[:gpu_count]
        return tuple(opened + self.usable_free(need)[: gpu_count - len(opened)])

    def book(self, devices: tuple[int, ...], key: str | None, need: MemoryNeed | None = None) -> None:
        """Record a task with share key ``key`` and memory ``need`` placed on ``devices``."""
        self.running += 1
        if need is not None:
            for d in devices:
                self.gpu_booked[d] = self.gpu_booked.get(d, 0) + self.needs_on(d, key, need)
        for d in devices:
            if d in self.free_gpus:
                self.free_gpus.remove(d)
                if key is not None:
                    self.gpu_share[d] = (key, 1)
            else:
                k, n = self.gpu_share[d]
                assert k == key, (d, k, key)
                self.gpu_share[d] = (k, n + 1)


#: Workload types whose tasks train a LoRA adapter on a frozen base model, so several may share
#: a GPU when they use the same base model: ``lora_finetune`` runs (GRPO) and training
#: sessions (``lora_session``, each a tenant of the node's model host).
LORA_WORKLOADS: frozenset[str] = frozenset({"lora_finetune", "lora_session"})


#: Workload types that serve a base model and its LoRA adapters: an inference task on one GPU
#: shares it (and the node's model host) with LoRA tasks on the same base model.
SERVING_WORKLOADS: frozenset[str] = frozenset({"inference"})


def share_key(workload_type: str, model: str, gpu_count: int, *, own_weights: bool = False) -> str | None:
    """The GPU-sharing key of a task: its base model for a LoRA workload on GPUs, or for an
    inference task on one GPU serving that model's adapters; else None (the task needs its GPUs
    to itself). ``own_weights``: the task holds weights of its own rather than an adapter on the
    shared base (an inference task's ``policies_only`` or another task's full weights; a
    training session with ``lora: false``), so it never shares."""
    if own_weights:
        return None
    if gpu_count > 0 and workload_type in LORA_WORKLOADS:
        return model
    if gpu_count == 1 and workload_type in SERVING_WORKLOADS and not own_weights:
        return model
    return None


@dataclass(frozen=True)
class MemoryNeed:
    """GPU memory a shareable LoRA task needs on each of its GPUs, in bytes: ``base_bytes`` for its
    base model (once per GPU: nothing more where the base is loaded already) and ``tenant_bytes``
    for its own adapter, gradients and optimizer state
    (:func:`opentinker_common.lora_memory.base_bytes`, :func:`~opentinker_common.lora_memory.tenant_bytes`)."""

    base_bytes: int
    tenant_bytes: int


def share_and_booked(
    holdings: Iterable[tuple[tuple[int, ...], str | None, MemoryNeed | None]],
) -> tuple[dict[int, tuple[str, int]], dict[int, int]]:
    """``(gpu_share, gpu_booked)`` of :class:`NodeCapacity` for the tasks on a node, each given as
    ``(devices, share key, memory estimate)``: device -> (share key, tasks) for busy GPUs whose
    tasks all share one key, and device -> bytes their estimates take there (each task's tenant
    bytes, plus its base model's once per share key, the largest should two differ)."""
    keys: dict[int, set[str | None]] = {}
    counts: dict[int, int] = {}
    booked: dict[int, int] = {}
    bases: dict[tuple[int, str | None], int] = {}
    for devices, key, need in holdings:
        for d in devices:
            keys.setdefault(d, set()).add(key)
            counts[d] = counts.get(d, 0) + 1
            if need is not None:
                booked[d] = booked.get(d, 0) + need.tenant_bytes
                bases[(d, key)] = max(bases.get((d, key), 0), need.base_bytes)
    for (d, _), b in bases.items():
        booked[d] += b
    share = {d: (next(iter(k)), counts[d]) for d, k in keys.items() if len(k) == 1 and None not in k}
    return share, booked  # type: ignore[return-value]


def _fit_key(
    cap: NodeCapacity, gpu_count: int, key: str | None, need: MemoryNeed | None = None
) -> tuple[int, int, int, str]:
    """Sort key of a node that fits: free GPUs used, free GPUs left, running tasks, node id."""
    opened = len(cap.open_gpus(key, need))
    used = max(0, gpu_count - opened)
    return (used, len(cap.free_gpus) - used, cap.running, cap.node_id)


@dataclass(frozen=True)
class PendingTask:
    task_id: str
    priority: int
    create_time: float
    gpu_count: int
    not_before: float = 0.0
    share_key: str | None = None  # see share_key(); None = needs its GPUs to itself
    memory: MemoryNeed | None = None  # a shareable task's GPU memory; None = counted in tasks only


@dataclass(frozen=True)
class Placement:
    task_id: str
    node_id: str
    device_indices: tuple[int, ...]


def queue_order(tasks: list[PendingTask]) -> list[PendingTask]:
    """Pending tasks in placement order: priority desc, then create time, then id."""
    return sorted(tasks, key=lambda t: (-t.priority, t.create_time, t.task_id))


def plan(tasks: list[PendingTask], nodes: list[NodeCapacity], now: float) -> tuple[list[Placement], dict[str, str]]:
    """Place what fits now.

    Args:
        tasks: pending tasks (any order).
        nodes: capacities; mutated copies are used internally, the inputs are not changed.
        now: unix seconds, compared with ``not_before``.

    Returns:
        (placements, reasons): placements in queue order; for every task not placed, why.
    """
    caps = [n.copy() for n in nodes]
    placements: list[Placement] = []
    reasons: dict[str, str] = {}
    ordered = queue_order(tasks)
    reserved: str | None = None
    reserver: PendingTask | None = None
    for position, task in enumerate(ordered, start=1):
        if task.not_before > now:
            reasons[task.task_id] = (
                f"waiting {task.not_before - now:.0f} s more before retrying (backoff after a failed attempt)"
            )
            continue
        key, need = task.share_key, task.memory
        room = [n for n in caps if n.accepting and n.free_slots > 0 and n.open_to(key, need) >= task.gpu_count]
        fits = [n for n in room if n.node_id != reserved or may_use_reserved(task.gpu_count, n)]
        if fits:
            best = min(fits, key=lambda n: _fit_key(n, task.gpu_count, key, need))
            devices = best.choose_devices(task.gpu_count, key, need)
            best.book(devices, key, need)
            placements.append(Placement(task.task_id, best.node_id, devices))
            continue
        if room and reserver is not None and reserved is not None:  # room only on the reserved node
            reasons[task.task_id] = reserved_reason(reserved, reserver, position, len(ordered))
            continue
        reasons[task.task_id] = why_pending(task, caps, position, len(ordered))
        if reserved is None:
            reserved = reservation_node(task.gpu_count, caps)
            if reserved is not None:
                reserver = task
                reasons[task.task_id] += f"; {reserved} is reserved for it"
    return placements, reasons


#: Task slots (``max_tasks``) a reservation keeps free on its node: the reserving task's own.
RESERVATION_SLOTS = 1


def may_use_reserved(gpu_count: int, cap: NodeCapacity) -> bool:
    """Whether a task of ``gpu_count`` GPUs behind a reservation may still go on the reserved
    node ``cap``: only a CPU task (it needs none of the reserved GPUs), and only in a slot beyond
    the ``RESERVATION_SLOTS`` the reservation needs, so the reserving task can start as soon as
    its GPUs free."""
    return gpu_count == 0 and cap.free_slots > RESERVATION_SLOTS


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def reserved_reason(node_id: str, reserver: PendingTask, position: int, queue_len: int) -> str:
    """Why a task that would fit on the reserved node ``node_id`` (and nowhere else) waits."""
    return (
        f"node {node_id} is reserved for {reserver.task_id} ({_gpus(reserver.gpu_count)}, priority "
        f"{reserver.priority}) until it starts; queue position {position} of {queue_len}"
    )


def reservation_node(gpu_count: int, caps: Iterable[NodeCapacity]) -> str | None:
    """The node a blocked task of ``gpu_count`` GPUs reserves: among accepting nodes that could
    hold it if empty, the one with the most free GPUs now, then the fewest running tasks, then
    node id. None when no accepting node could ever hold it."""
    best: tuple[int, int, str] | None = None
    for n in caps:
        if n.accepting and n.gpu_count >= gpu_count and n.max_tasks >= 1:
            key = (-len(n.free_gpus), n.running, n.node_id)
            if best is None or key < best:
                best = key
    return best[2] if best is not None else None


def why_pending(task: PendingTask, caps: list[NodeCapacity], position: int, queue_len: int) -> str:
    """A sentence saying what is short where, and the task's place in the queue."""
    where = f" (queue position {position} of {queue_len})"
    live = [n for n in caps if n.accepting]
    if not live:
        return "no trainer node is connected" + where
    if task.gpu_count == 0:
        return f"all {len(live)} connected node(s) are at max_tasks" + where
    ever = [n for n in live if n.gpu_count >= task.gpu_count]
    if not ever:
        biggest = max(live, key=lambda n: n.gpu_count)
        return (
            f"no connected node has {task.gpu_count} GPU(s); the largest is {biggest.node_id} with "
            f"{biggest.gpu_count}" + where
        )
    with_slots = [n for n in live if n.free_slots > 0]
    if not with_slots:
        return f"every node with {task.gpu_count}+ GPU(s) is at max_tasks" + where
    key = task.share_key if any(n.max_tasks_per_gpu > 1 for n in with_slots) else None
    if task.memory is not None and max(n.open_to(key) for n in with_slots) >= task.gpu_count:
        return memory_reason(task, with_slots) + where
    largest = max(with_slots, key=lambda n: (n.open_to(key), n.node_id))
    if key is None:
        return (
            f"no node has {task.gpu_count} free GPU(s); largest free block is {len(largest.free_gpus)} on "
            f"{largest.node_id}" + where
        )
    return (
        f"no node has {task.gpu_count} GPU(s) free or shareable with LoRA tasks on {key}; the most is "
        f"{largest.open_to(key)} on {largest.node_id}" + where
    )


def memory_reason(task: PendingTask, caps: Sequence[NodeCapacity]) -> str:
    """Why a shareable task that has GPUs by count waits for memory: what it needs (where its base
    is loaded, and where it is not) against the most a GPU has free by the estimates."""
    need = task.memory
    assert need is not None and task.share_key is not None
    key = task.share_key
    best: tuple[int, str, int, int] | None = None  # (free, node, device, total)
    for n in caps:
        for d in n.free_gpus + [d for d, (k, _) in n.gpu_share.items() if k == key]:
            free = n.memory_free(d)
            if free is not None and (best is None or (free, n.node_id) > best[:2]):
                best = (free, n.node_id, d, n.gpu_memory[d])
    most = (
        f"the most free is {fmt_bytes(best[0])} of {fmt_bytes(best[3])} on {best[1]} GPU {best[2]}"
        if best is not None
        else "no GPU reports its memory"
    )
    return (
        f"not enough GPU memory for a LoRA tenant on {key}: it needs {fmt_bytes(need.tenant_bytes)} "
        f"(adapter, gradients, AdamW moments) on a GPU that holds {key}, or "
        f"{fmt_bytes(need.base_bytes + need.tenant_bytes)} with the base model ({fmt_bytes(need.base_bytes)}) "
        f"on one that does not; {most} by the scheduler's estimates"
    )


#: Nodes a lookup leaves out: one node id (a reservation), several, or None.
Exclude = "str | frozenset[str] | None"


def _left_out(exclude) -> frozenset[str] | tuple[str, ...]:
    if exclude is None:
        return ()
    if isinstance(exclude, str):
        return (exclude,)
    return exclude


def with_left_out(closed: str | None, left_out: frozenset[str]) -> "str | frozenset[str] | None":
    """A reservation's closed node together with nodes left out for a group."""
    if not left_out:
        return closed
    return left_out | {closed} if closed is not None else left_out


class FreeNodes:
    """Nodes that can take a task now (accepting, with a free slot), in best-fit order: fewest
    free GPUs, then fewest running tasks, then node id. The owner calls :meth:`update` whenever a
    node's ledger or state changes."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int, str]] = []  # (free GPUs, running, node id), sorted
        self._key_of: dict[str, tuple[int, int, str]] = {}
        self._cap_of: dict[str, NodeCapacity] = {}  # the capacity each indexed node was given as
        # share key -> node id -> capacity, for nodes that can take a task and have busy GPUs
        # open to that key (few: one entry per base model in use on the node).
        self._shared: dict[str, dict[str, NodeCapacity]] = {}
        self._shared_of: dict[str, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def update(self, cap: NodeCapacity) -> None:
        self.remove(cap.node_id)
        if cap.accepting and cap.free_slots > 0:
            key = (len(cap.free_gpus), cap.running, cap.node_id)
            self._key_of[cap.node_id] = key
            self._cap_of[cap.node_id] = cap
            bisect.insort(self._keys, key)
            shared = tuple(cap.shared_keys())
            if shared:
                self._shared_of[cap.node_id] = shared
                for k in shared:
                    self._shared.setdefault(k, {})[cap.node_id] = cap

    def remove(self, node_id: str) -> None:
        old = self._key_of.pop(node_id, None)
        self._cap_of.pop(node_id, None)
        if old is not None:
            del self._keys[bisect.bisect_left(self._keys, old)]
        for k in self._shared_of.pop(node_id, ()):
            nodes = self._shared[k]
            del nodes[node_id]
            if not nodes:
                del self._shared[k]

    def most_open(self, share_key: str | None, exclude: Exclude = None, need: MemoryNeed | None = None) -> int:
        """Most GPUs a task with ``share_key`` (and memory ``need``) could take on one node now
        (free plus open to the key; -1 when no node can take a task), leaving out the node(s)
        ``exclude``. With a ``need`` every indexed node is looked at (memory is not indexed)."""
        left_out = _left_out(exclude)
        if need is not None:
            return max(
                (c.open_to(share_key, need) for c in self._cap_of.values() if c.node_id not in left_out), default=-1
            )
        most = self.most_free_gpus(exclude)
        if share_key is not None:
            for cap in self._shared.get(share_key, {}).values():
                if cap.node_id not in left_out:
                    most = max(most, cap.open_to(share_key))
        return most

    def best_fit_for(
        self, gpu_count: int, share_key: str | None, exclude: Exclude = None, need: MemoryNeed | None = None
    ) -> str | None:
        """The node :func:`plan` picks for a task of ``gpu_count`` GPUs, ``share_key`` and memory
        ``need``, or None.

        A node with GPUs open to the key uses fewer free GPUs than any node without, so those
        are tried first (by :func:`plan`'s order); otherwise it is :meth:`best_fit`. With a
        ``need``, every indexed node is looked at in :func:`plan`'s order. ``exclude``: node(s) left out."""
        left_out = _left_out(exclude)
        if need is not None:
            fits = [
                c
                for c in self._cap_of.values()
                if c.node_id not in left_out and c.open_to(share_key, need) >= gpu_count
            ]
            return min(fits, key=lambda c: _fit_key(c, gpu_count, share_key, need)).node_id if fits else None
        if share_key is not None:
            fits = [
                c
                for c in self._shared.get(share_key, {}).values()
                if c.node_id not in left_out and c.open_to(share_key) >= gpu_count
            ]
            if fits:
                return min(fits, key=lambda c: _fit_key(c, gpu_count, share_key)).node_id
        return self.best_fit(gpu_count, exclude)

    def most_free_gpus(self, exclude: Exclude = None) -> int:
        """Largest free GPU block on a node that can take a task (-1 when none can), leaving
        out the node(s) ``exclude`` (a reserved node; nodes a task cannot run on)."""
        left_out = _left_out(exclude)
        for key in reversed(self._keys):  # one step more per node left out
            if key[2] not in left_out:
                return key[0]
        return -1

    def best_fit(self, gpu_count: int, exclude: Exclude = None) -> str | None:
        """The node :func:`plan` would pick for a task of ``gpu_count`` GPUs, or None, leaving
        out the node(s) ``exclude``."""
        left_out = _left_out(exclude)
        i = bisect.bisect_left(self._keys, (gpu_count, -1, ""))
        while i < len(self._keys) and self._keys[i][2] in left_out:
            i += 1
        return self._keys[i][2] if i < len(self._keys) else None

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._key_of

    def closed_to(self, gpu_count: int, reserved: str | None) -> str | None:
        """The node a task of ``gpu_count`` GPUs behind a reservation of node ``reserved`` may
        not use: ``reserved``, unless :func:`may_use_reserved` lets it in; None when none."""
        cap = self._cap_of.get(reserved) if reserved is not None else None
        return None if cap is not None and may_use_reserved(gpu_count, cap) else reserved


@dataclass(frozen=True)
class PlacementGroup:
    """Pending tasks that fit in exactly the same places and count against the same quota.

    A placement round may drop a group whole (:func:`place_round`). The scheduler keeps one
    ordered list of pending tasks per group (:mod:`opentinker_scheduler.state.queue`).
    """

    #: GPUs each task takes on one node; 0 for a CPU task.
    gpu_count: int
    #: Base model a shareable LoRA task shares GPUs by (:func:`share_key`), or None.
    share_key: str | None = None
    #: Quota queue of the tasks' owners (:mod:`.quota`).
    queue: str = ""
    #: GPU memory each task needs when estimated, or None: counted in tasks only.
    memory: MemoryNeed | None = None
    #: ``spec.tracking`` loggers the tasks name; a node must be able to write them.
    loggers: frozenset[str] = frozenset()


def _no_backoff(key: Hashable) -> float:
    return 0.0


def _admit_all(key: Hashable, group: PlacementGroup) -> bool:
    return True


def _no_node_left_out(group: PlacementGroup) -> frozenset[str]:
    return frozenset()


def _queue_order(group: PlacementGroup, key: Hashable) -> Hashable:
    return key


@dataclass(frozen=True)
class RoundHooks:
    """What a placement round asks its caller, in the shape of the Kubernetes scheduler framework.

    Tasks are the sortable keys of :func:`place_round`'s groups. ``admit`` is the pre-filter,
    ``left_out`` the filter, ``rank`` the score, ``take`` the reserve-and-bind, and ``reserve``
    the post-filter that holds a node for the first blocked task.
    """

    #: ``take(key, group, node_id)`` puts the task on the node: best fit from the round's
    #: :class:`FreeNodes`, devices by :meth:`NodeCapacity.choose_devices`. It must keep that index
    #: current and book what the task uses.
    take: Callable[[Hashable, PlacementGroup, str], None]
    #: ``not_before(key)``: unix seconds before which the task may not start (retry backoff).
    not_before: Callable[[Hashable], float] = _no_backoff
    #: ``admit(key, group)``: whether the task may start under its queue's quota
    #: (:meth:`~opentinker_scheduler.policy.quota.QuotaBook.admits`, with ``take`` booking what it
    #: starts). Usage only grows within a round, so a refused task's whole group is dropped.
    admit: Callable[[Hashable, PlacementGroup], bool] = _admit_all
    #: ``left_out(group)``: nodes the group's tasks may not run on, such as nodes that cannot
    #: write the ``spec.tracking`` loggers they name. They are kept out like a reserved node.
    left_out: Callable[[PlacementGroup], frozenset[str]] = _no_node_left_out
    #: ``rank(group, key)``: the sort key the next task is chosen by among the groups' first
    #: tasks; queue order by default. Fair share ranks by ``(-priority, dominant share of the
    #: group's queue, create time, id)``. It may change only through ``take``: every group's rank
    #: is read again after each ``take``, one group's alone when its first task changes otherwise.
    rank: Callable[[PlacementGroup, Hashable], Hashable] = _queue_order
    #: ``reserve(key, gpu_count)`` is called for the first blocked task in queue order, at the
    #: point of the queue where :func:`plan` meets it. It returns the node it reserves
    #: (:func:`reservation_node` over the current capacities), or None when no node could ever
    #: hold the task; then the next blocked task is asked. Tasks after it are not placed on that
    #: node, except CPU tasks in its spare slots (:meth:`FreeNodes.closed_to`). None: no reservation.
    reserve: Callable[[Hashable, int], str | None] | None = None


def place_round(
    groups: Mapping[PlacementGroup, Sequence[Hashable]],
    free: FreeNodes,
    now: float,
    hooks: RoundHooks,
) -> int:
    """One placement round of :func:`plan`'s policy, over indexes instead of lists.

    Args:
        groups: each group -> its pending tasks as sortable keys, in queue order (the keys of
            all groups share one order). Not changed here. A group's ``memory`` is what each of
            its tasks needs on a GPU.
        free: nodes that can take a task now; ``hooks.take`` must keep it current.
        now: unix seconds, compared with ``hooks.not_before(key)``.
        hooks: what the round asks its caller (:class:`RoundHooks`).

    Returns:
        How many tasks were placed. Tasks are considered in queue order; a group whose GPU
        count no node can offer any more is dropped whole (capacity only shrinks in a round, and
        only at a ``take`` or a reservation, so groups are checked again only then),
        which gives the same placements as :func:`plan`. A dropped group's first task not in
        backoff is the group's candidate for the reservation.
    """
    not_before, take, reserve, admit = hooks.not_before, hooks.take, hooks.reserve, hooks.admit
    order, out_of = hooks.rank, hooks.left_out
    live = {g: keys for g, keys in groups.items() if keys}
    cursor = dict.fromkeys(live, 0)
    placed = 0
    reserved: str | None = None
    blocked: list[tuple[Hashable, int]] = []  # heap of dropped groups' first eligible keys
    heads: dict[PlacementGroup, Hashable] = {}  # group -> order(group, its first key)
    stale = True  # capacity (a take, a reservation) or ranks (a take) changed since the last check
    while True:
        if stale:  # else no group can have stopped fitting, and no rank can have changed
            for g in [
                g
                for g in live
                if g.gpu_count
                > free.most_open(g.share_key, with_left_out(free.closed_to(g.gpu_count, reserved), out_of(g)), g.memory)
            ]:
                keys = live.pop(g)
                if reserve is not None and reserved is None:
                    i = cursor[g]
                    while i < len(keys) and not_before(keys[i]) > now:
                        i += 1
                    if i < len(keys):
                        heapq.heappush(blocked, (order(g, keys[i]), keys[i], g))
            heads = {g: order(g, keys[cursor[g]]) for g, keys in live.items()}
            stale = False
        g = min(live, key=heads.__getitem__) if live else None
        if reserve is not None and reserved is None and blocked and (g is None or blocked[0][0] < heads[g]):
            _, bkey, bg = heapq.heappop(blocked)
            reserved = reserve(bkey, bg.gpu_count)
            if reserved is not None:
                blocked.clear()
                stale = True  # capacity outside the reserved node is less: drop groups again
            continue
        if g is None:
            break
        key = live[g][cursor[g]]
        cursor[g] += 1
        if cursor[g] == len(live[g]):
            del live[g], heads[g]
        else:
            heads[g] = order(g, live[g][cursor[g]])
        if not_before(key) > now:
            continue
        if not admit(key, g):
            live.pop(g, None)  # the rest of the group is over the same quota
            heads.pop(g, None)
            continue
        node_id = free.best_fit_for(
            g.gpu_count, g.share_key, with_left_out(free.closed_to(g.gpu_count, reserved), out_of(g)), g.memory
        )
        assert node_id is not None  # the group fits on a node with a free slot
        take(key, g, node_id)
        placed += 1
        stale = True
    return placed
