"""Quotas, borrowing, reclaim and fair share (policy/quota.py), alone and inside a placement round
(policy/placement.py place_round), with hypothesis properties: no queue above its quota plus its
borrowing, work-conserving rounds, a queue back within its nominal quota regains it within one
preemption round, and fair share at equal priority."""

from __future__ import annotations

from dataclasses import replace
import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from opentinker_scheduler.policy.placement import (
    FreeNodes,
    NodeCapacity,
    PlacementGroup,
    RoundHooks,
    place_round,
    reservation_node,
)
from opentinker_scheduler.policy.preemption import NodeState, RunningAlloc, choose_victims
from opentinker_scheduler.policy.quota import QueueQuota, QuotaBook, task_need


def book(*queues: QueueQuota, default: str = "") -> QuotaBook:
    return QuotaBook.of(queues, default, cluster=(8, 16))


def test_within_nominal_then_borrow_up_to_the_limit() -> None:
    b = book(QueueQuota("a", 2, 1, borrowing_gpus=1, owners=("alice",)), QueueQuota("b", 4, 1))
    assert b.queue_of("alice") == "a" and b.queue_of("carol") == "carol"  # unmapped: a queue of its own
    assert b.admits("a", (2, 0))
    b.add("a", (2, 0))
    assert b.admits("a", (1, 0))  # borrows 1 of b's idle 4
    b.add("a", (1, 0))
    why = b.why_not("a", (1, 0))
    assert why == (
        "queue a is at its quota: 3 GPUs in use of a nominal quota of 2, the task needs 1 more; "
        "its borrowing_limit is 1"
    )
    assert b.admits("carol", (100, 0))  # no quota: never limited


def test_borrowing_only_from_idle_quota_of_other_queues() -> None:
    b = book(QueueQuota("a", 2, 1), QueueQuota("b", 2, 1))
    b.add("b", (2, 0))  # b uses all of its quota: nothing idle to lend
    b.add("a", (2, 0))
    assert b.why_not("a", (1, 0)).endswith("other queues leave 0 idle to borrow")
    b.add("b", (-2, 0))  # b's 2 GPUs idle again
    assert b.admits("a", (2, 0)) and not b.admits("a", (3, 0))


def test_cpu_tasks_count_against_their_own_quota() -> None:
    b = book(QueueQuota("a", 0, 1, borrowing_cpu_tasks=0))
    assert task_need(0) == (0, 1) and task_need(2, nodes=3) == (6, 0)
    b.add("a", (0, 1))
    assert "1 CPU-task slot in use of a nominal quota of 1" in b.why_not("a", (0, 1))
    assert not b.admits("a", (1, 0))  # no GPU quota and no one to borrow from


def test_dominant_share_is_the_larger_fraction_of_quota() -> None:
    b = book(QueueQuota("a", 4, 10), QueueQuota("zero", 0, 0))
    b.add("a", (1, 5))
    assert b.dominant_share("a") == 0.5
    b.add("carol", (2, 0))  # no quota: share of the cluster (8 GPUs)
    assert b.dominant_share("carol") == 0.25
    b.add("zero", (1, 0))
    assert b.dominant_share("zero") == float("inf")


def test_reclaimable_is_the_newest_borrowed_work_only() -> None:
    b = book(QueueQuota("a", 2, 0), QueueQuota("b", 2, 0))
    b.add("b", (4, 0))  # b borrows 2
    running = [("b1", "b", (1, 0), 1.0), ("b2", "b", (1, 0), 2.0), ("b3", "b", (1, 0), 3.0), ("b4", "b", (1, 0), 4.0)]
    assert b.reclaimable(running) == {"b3", "b4"}
    b.add("carol", (1, 0))
    b.add("b", (2, 0), -1)  # b back at its nominal quota: borrows nothing
    assert b.reclaimable([*running[:2], ("c", "carol", (1, 0), 9.0)]) == set()  # and carol has no quota


def test_with_queue_moves_owners() -> None:
    b = book(QueueQuota("a", 2, 0, owners=("alice", "bob")))
    c = b.with_queue(QueueQuota("b", 1, 0, owners=("bob",)))
    assert (c.queue_of("alice"), c.queue_of("bob")) == ("a", "b") and b.queue_of("bob") == "a"


# ---------------------------------------------------------------- inside a placement round


def run_round(quotas: QuotaBook, caps: list[NodeCapacity], tasks: list[tuple[str, str, int, int, float]], fair=True):
    """One place_round over ``tasks`` = (task id, queue, gpus, priority, create time) with the core's
    admit/rank callbacks; returns the placed task ids (the caps and quotas are booked)."""
    by_id = {c.node_id: c for c in caps}
    free = FreeNodes()
    for c in caps:
        free.update(c)
    groups: dict = {}
    rows = {}
    for task_id, queue, gpus, prio, created in tasks:
        key = (-prio, created, task_id)
        rows[key] = (queue, gpus)
        groups.setdefault(PlacementGroup(gpus, None, queue), []).append(key)
    for keys in groups.values():
        keys.sort()
    placed: list[str] = []

    def take(key, g, node_id):
        cap = by_id[node_id]
        cap.book(cap.choose_devices(g.gpu_count, g.share_key), g.share_key)
        free.update(cap)
        quotas.add(g.queue, task_need(g.gpu_count))
        placed.append(key[2])

    hooks = RoundHooks(take, admit=lambda key, g: quotas.admits(g.queue, task_need(g.gpu_count)))
    if fair:
        hooks = replace(hooks, rank=lambda g, key: (key[0], quotas.dominant_share(g.queue), key[1], key[2]))
    place_round(groups, free, 0.0, hooks)
    return placed


queue_specs = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 3), st.one_of(st.none(), st.integers(0, 3))), min_size=1, max_size=4
)
task_specs = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2), st.integers(0, 1)), max_size=25)
node_specs = st.lists(st.tuples(st.integers(0, 4), st.integers(1, 4)), min_size=1, max_size=3)


@settings(max_examples=80, deadline=None)
@given(queue_specs, task_specs, node_specs)
def test_round_never_exceeds_quota_plus_borrowing_and_is_work_conserving(qs, ts, ns) -> None:
    queues = [QueueQuota(f"q{i}", g, c, borrowing_gpus=b, borrowing_cpu_tasks=b) for i, (g, c, b) in enumerate(qs)]
    quotas = QuotaBook.of(queues, cluster=(8, 8))
    caps = [NodeCapacity(f"n{i}", g, m, 0, list(range(g))) for i, (g, m) in enumerate(ns)]
    tasks = [(f"t{i:02d}", f"q{q % len(qs)}", gpus, prio, float(i)) for i, (q, gpus, prio) in enumerate(ts)]
    placed = set(run_round(quotas, caps, tasks))
    for q in queues:
        used = quotas.usage(q.name)
        for r in (0, 1):
            if q.borrowing[r] is not None:
                assert used[r] <= q.nominal[r] + q.borrowing[r], (q, used)
    # Borrowing is always reclaimable: the tasks reclaim may stop cover every queue's borrowed amount
    # (a queue admitted within its nominal quota after another borrowed its idle quota gets it back so).
    rows = [(t, q, task_need(g), c) for t, q, g, _, c in tasks if t in placed]
    reclaim = quotas.reclaimable(rows)
    for q in queues:
        for r in (0, 1):
            borrowed = max(0, quotas.usage(q.name)[r] - q.nominal[r])
            assert sum(need[r] for t, qn, need, _ in rows if qn == q.name and t in reclaim) >= borrowed
    for task_id, queue, gpus, _, _ in tasks:  # work-conserving: nothing left that fits and is admitted
        if task_id in placed:
            continue
        fits = any(c.free_slots > 0 and len(c.free_gpus) >= gpus for c in caps)
        assert not (fits and quotas.admits(queue, task_need(gpus))), (task_id, queue, gpus)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(2, 8),
    st.lists(st.integers(1, 3), min_size=1, max_size=3),
    st.data(),
)
def test_a_queue_within_nominal_quota_regains_it_in_one_preemption_round(gpus, borrower_tasks, data) -> None:
    """One node of ``gpus`` GPUs; queue a's nominal quota is ``nominal_a`` and b has the rest. b
    filled the node borrowing a's idle quota; a task of a within a's nominal quota, fitting the
    node, gets its GPUs from one choose_victims call over b's reclaimable (borrowed) tasks."""
    nominal_a = data.draw(st.integers(1, gpus))
    quotas = QuotaBook.of([QueueQuota("a", nominal_a, 0), QueueQuota("b", gpus - nominal_a, 0)], cluster=(gpus, 8))
    running: list[RunningAlloc] = []
    rows = []
    free = gpus
    for i, size in enumerate(borrower_tasks):  # b takes what the quotas admit, in 1..3 GPU tasks
        if size <= free and quotas.admits("b", (size, 0)):
            quotas.add("b", (size, 0))
            free -= size
            running.append(RunningAlloc(f"b{i}", 0, size, float(i)))
            rows.append((f"b{i}", "b", (size, 0), float(i)))
    while free and quotas.admits("b", (1, 0)):  # and fills the node with 1-GPU tasks
        i = len(borrower_tasks) + len(running)
        quotas.add("b", (1, 0))
        free -= 1
        running.append(RunningAlloc(f"b{i}", 0, 1, float(i)))
        rows.append((f"b{i}", "b", (1, 0), float(i)))
    need = data.draw(st.integers(1, nominal_a))
    assert quotas.within_nominal("a", (need, 0))
    if free >= need:
        return  # it fits without anyone stopping
    reclaim = quotas.reclaimable(rows)
    node = NodeState(
        "n0",
        gpus,
        8,
        free,
        tuple(RunningAlloc(r.task_id, -1 if r.task_id in reclaim else 5, r.gpu_count, r.start_time) for r in running),
    )
    choice = choose_victims(5, need, [node])
    assert choice is not None, (rows, reclaim, need)
    freed = sum(r.gpu_count for r in running if r.task_id in choice.victims)
    for r in running:
        if r.task_id in choice.victims:
            quotas.add("b", (r.gpu_count, 0), -1)
    assert free + freed >= need and quotas.admits("a", (need, 0))
    assert quotas.usage("b")[0] >= quotas.queues["b"].gpus - 2  # b was left (about) its nominal quota


def test_fair_share_at_equal_priority_interleaves_queues() -> None:
    """Owner a floods 20 one-GPU tasks, then b submits 2: the free GPUs go to b first, since its
    dominant share (0) is below a's; queue order alone would give them all to a's older tasks."""
    quotas = QuotaBook.of([], cluster=(4, 8))
    quotas.add("a", (2, 0))  # a already runs 2 of the node's 4 GPUs
    flood = [(f"a{i:02d}", "a", 1, 0, float(i)) for i in range(20)]
    late = [(f"b{i}", "b", 1, 0, 100.0 + i) for i in range(2)]
    caps = [NodeCapacity("n0", 4, 8, 2, [2, 3])]
    assert run_round(quotas, caps, flood + late) == ["b0", "b1"]
    caps = [NodeCapacity("n0", 4, 8, 2, [2, 3])]
    assert run_round(QuotaBook.of([], cluster=(4, 8)), caps, flood + late, fair=False) == ["a00", "a01"]


def test_higher_priority_still_goes_first_under_fair_share() -> None:
    quotas = QuotaBook.of([], cluster=(4, 8))
    tasks = [("b0", "b", 1, 0, 0.0), ("a0", "a", 1, 5, 1.0)]
    quotas.add("a", (3, 0))
    assert run_round(quotas, [NodeCapacity("n0", 4, 8, 3, [3])], tasks) == ["a0"]


# ---------------------------------------------------------------- kept sums against a recount


def recounted_why_not(b: QuotaBook, queue: str, need: tuple[int, int]) -> str | None:
    """:meth:`QuotaBook.why_not` worked out from scratch: the cohort's idle and borrowed amounts
    summed over every limited queue at the time of asking (what the book keeps as running sums)."""
    q = b.queues.get(queue)
    if q is None:
        return None
    used = b.usage(queue)
    for r in (0, 1):
        after = used[r] + need[r]
        if need[r] == 0 or after <= q.nominal[r]:
            continue
        borrowed, limit = after - q.nominal[r], q.borrowing[r]
        if limit is not None and borrowed > limit:
            return "limit"
        others = [(n, p) for n, p in b.queues.items() if n != queue]
        idle = sum(max(0, p.nominal[r] - b.usage(n)[r]) for n, p in others)
        lent = sum(max(0, b.usage(n)[r] - p.nominal[r]) for n, p in others)
        if borrowed > idle - lent:
            return "idle"
    return None


def recounted_share(b: QuotaBook, queue: str) -> float:
    used, q = b.usage(queue), b.queues.get(queue)
    denom = q.nominal if q is not None else b.cluster
    return max([used[r] / denom[r] if denom[r] else float("inf") for r in (0, 1) if used[r]], default=0.0)


book_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 4), st.integers(0, 3), st.integers(0, 2), st.sampled_from([1, -1])),
        st.tuples(st.just("cluster"), st.integers(1, 12), st.integers(1, 12)),
        st.tuples(st.just("clear")),
        st.tuples(st.just("requota"), st.integers(0, 4), st.integers(0, 4), st.one_of(st.none(), st.integers(0, 2))),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(queue_specs, book_ops)
def test_kept_sums_and_shares_equal_a_recount(qs, ops) -> None:
    """After any sequence of bookings, releases, cluster changes, clears and quota changes, every
    quota verdict and dominant share the book gives (from its running sums and remembered
    shares) equals the one recounted from scratch, for queues with and without a quota."""
    b = QuotaBook.of(
        [QueueQuota(f"q{i}", g, c, borrowing_gpus=lim, borrowing_cpu_tasks=lim) for i, (g, c, lim) in enumerate(qs)],
        cluster=(8, 8),
    )
    names = [f"q{i}" for i in range(5)]  # q{len(qs)}.. have no quota
    for op in ops:
        if op[0] == "add":
            _, q, gpus, cpus, sign = op
            if sign < 0:  # release at most what is in use
                used = b.usage(names[q])
                gpus, cpus = min(gpus, used[0]), min(cpus, used[1])
            b.add(names[q], (gpus, cpus), sign)
        elif op[0] == "cluster":
            b.cluster = (op[1], op[2])
        elif op[0] == "clear":
            b.clear_usage()
        else:
            _, q, gpus, lim = op
            b = b.with_queue(QueueQuota(names[q], gpus, gpus, borrowing_gpus=lim, borrowing_cpu_tasks=lim))
        for name in names:
            assert b.dominant_share(name) == recounted_share(b, name)
            for need in ((1, 0), (2, 0), (5, 0), (0, 1), (0, 3)):
                got, want = b.why_not(name, need), recounted_why_not(b, name, need)
                assert (got is None) == (want is None), (name, need, got, want)
                if got is not None:
                    assert ("borrowing_limit" in got) == (want == "limit"), (got, want)


def recomputed_round(groups, free, now, hooks: RoundHooks) -> int:
    """:func:`place_round` as first written: every group checked against the capacity and ranked
    afresh at every choice (the round now does either only when a take or a reservation may have
    changed it)."""
    not_before, take, reserve, admit, rank = hooks.not_before, hooks.take, hooks.reserve, hooks.admit, hooks.rank
    live = {g: keys for g, keys in groups.items() if keys}
    cursor = dict.fromkeys(live, 0)
    placed, reserved, blocked = 0, None, []
    while True:
        for g in [g for g in live if g.gpu_count > free.most_open(g.share_key, free.closed_to(g.gpu_count, reserved))]:
            keys = live.pop(g)
            if reserved is None:
                i = cursor[g]
                while i < len(keys) and not_before(keys[i]) > now:
                    i += 1
                if i < len(keys):
                    heapq.heappush(blocked, (rank(g, keys[i]), keys[i], g))
        g = min(live, key=lambda g: rank(g, live[g][cursor[g]])) if live else None
        if reserved is None and blocked and (g is None or blocked[0][0] < rank(g, live[g][cursor[g]])):
            _, bkey, bg = heapq.heappop(blocked)
            reserved = reserve(bkey, bg.gpu_count)
            if reserved is not None:
                blocked.clear()
            continue
        if g is None:
            break
        key = live[g][cursor[g]]
        cursor[g] += 1
        if cursor[g] == len(live[g]):
            del live[g]
        if not_before(key) > now:
            continue
        if not admit(key, g):
            live.pop(g, None)
            continue
        take(key, g, free.best_fit_for(g.gpu_count, g.share_key, free.closed_to(g.gpu_count, reserved)))
        placed += 1
    return placed


@settings(max_examples=200, deadline=None)
@given(
    queue_specs,
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 1), st.booleans()), max_size=30),
    node_specs,
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=4),
)
def test_round_with_kept_ranks_places_what_a_recomputed_round_places(qs, ts, ns, running) -> None:
    """With quotas, fair share, backoff and the reservation in play (queues already using some
    quota), the round that re-reads ranks and capacity only after a take or a reservation takes
    the same tasks, in the same order, on the same nodes and devices, reserving the same node, as
    the round that re-reads them at every choice."""

    def run(round_fn):
        quotas = QuotaBook.of(
            [QueueQuota(f"q{i}", g, c, borrowing_gpus=b, borrowing_cpu_tasks=b) for i, (g, c, b) in enumerate(qs)],
            cluster=(8, 8),
        )
        for q, gpus in running:
            quotas.add(f"q{q}", task_need(gpus))  # q4, q5: no quota
        caps = {f"n{i}": NodeCapacity(f"n{i}", g, m, 0, list(range(g))) for i, (g, m) in enumerate(ns)}
        free = FreeNodes()
        for c in caps.values():
            free.update(c)
        groups: dict = {}
        waiting = {}
        for i, (q, gpus, prio, backoff) in enumerate(ts):
            key = (-prio, float(i % 5), f"t{i:02d}")
            waiting[key] = 50.0 if backoff else 0.0
            groups.setdefault(PlacementGroup(gpus, None, f"q{q}"), []).append(key)
        for keys in groups.values():
            keys.sort()
        out = []

        def take(key, g, node_id):
            cap = caps[node_id]
            devices = cap.choose_devices(g.gpu_count, g.share_key)
            cap.book(devices, g.share_key)
            free.update(cap)
            quotas.add(g.queue, task_need(g.gpu_count))
            out.append((key[2], node_id, devices))

        def reserve(key, gpu_count):
            node_id = reservation_node(gpu_count, caps.values())
            out.append(("reserved", key[2], node_id))
            return node_id

        hooks = RoundHooks(
            take,
            not_before=waiting.__getitem__,
            admit=lambda key, g: quotas.admits(g.queue, task_need(g.gpu_count)),
            rank=lambda g, key: (key[0], quotas.dominant_share(g.queue), key[1], key[2]),
            reserve=reserve,
        )
        n = round_fn(groups, free, 10.0, hooks)
        return n, out, {q: quotas.usage(q) for q in quotas.used}

    assert run(place_round) == run(recomputed_round)
