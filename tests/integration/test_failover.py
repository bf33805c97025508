"""Several real schedulers on one real PostgreSQL, a real trainer and client given all their URLs:
the leader killed (-9), its lock session ended, stopped past its lease, cut off from the database;
the database restarted; two schedulers started at once; a schema from a newer scheduler. Each
time: exactly one leader, running work keeps running as the same attempt, nothing acknowledged
is lost. A leader's death frees its lock at once, so a follower leads well within the lease and
no follower names the dead leader after that."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psycopg
import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client import RLClient
from opentinker_common.net.leader import not_leader

from tests.support.ha import HaCluster, registrations, wait_log
from tests.support.procs import scheduler_args
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_for

TINY_HP = {"steps": 3, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4}
STEPS = 40


@pytest.fixture
def ha(tmp_path, postgres_server):
    cluster = HaCluster(tmp_path, postgres_server, 2)
    yield cluster
    cluster.close()


def _started(trainer, task_id: str) -> int:
    return sum(1 for e in trainer.log_events() if e.get("event") == "Task started" and e.get("task_id") == task_id)


def _check_finished_whole(client: RLClient, ha: HaCluster, trainer, task_id: str, among) -> None:
    """The task ended SUCCEEDED as attempt 1, every metric point once, its worker started once."""
    task = ha.wait_state(task_id, C.TASK_STATE_SUCCEEDED, timeout=300, among=among)
    assert task.attempt == 1, "the trainer re-announced the task to the new leader; it must not restart"
    assert [s for s, _ in client.get_metric_history(task_id)] == list(range(1, STEPS + 1))
    reasons = [e.reason for e in client.watch(task_id, follow=False) if e.kind == "state"]
    assert "NODE_LOST" not in reasons and reasons.count("STARTED") == 1, reasons
    assert _started(trainer, task_id) == 1, "the worker was started once"


def _running_task(ha: HaCluster, client: RLClient, model: Path) -> str:
    task_id = client.submit_task(
        workload_type="lora_finetune", model=str(model), hyperparameters={**TINY_HP, "steps": STEPS}
    )
    ha.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: t.latest_step >= 2)
    return task_id


def test_leader_kill9_mid_task_a_follower_takes_over_and_nothing_is_lost(ha, tiny_model_dir: Path) -> None:
    ha.start_all()
    first = ha.wait_leader()
    other = 1 - first
    trainer = ha.start_trainer("node-a")
    ha.wait_nodes(first, 1)
    with RLClient(scheduler_url=ha.urls, min_poll_interval=0) as client:
        task_id = _running_task(ha, client, tiny_model_dir)
        ha.schedulers[first].kill9()
        # Submitted while there is no leader: the client goes from the dead address to the
        # follower (which names the dead leader until its lease runs out) until the new leader
        # takes it; its request id makes the retries one task.
        during = client.submit_task(workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=TINY_HP)
        assert ha.wait_leader(among=[other]) == other
        assert ha.health(other)["epoch"] == 2
        ha.wait_nodes(other, 1)  # the trainer re-registered with the new leader
        _check_finished_whole(client, ha, trainer, task_id, among=[other])
        assert ha.wait_state(during, C.TASK_STATE_SUCCEEDED, among=[other]).attempt == 1
        assert sorted(t.task_id for t in client.list_tasks()) == sorted([task_id, during]), "acknowledged once"
    assert ha.health(other) == {"status": "ok", "role": "leader", "leader": ha.address(other), "epoch": 2}


def _leader_named(ha: HaCluster, i: int) -> str | None:
    return (ha.health(i) or {}).get("leader")


def test_leader_kill9_a_follower_leads_well_within_the_lease_and_none_names_the_dead_leader(
    tmp_path, postgres_server
) -> None:
    lease = 12.0
    ha = HaCluster(tmp_path, postgres_server, 3, lease=lease, renew=1.0)
    try:
        ha.start_all()
        first = ha.wait_leader()
        dead = ha.address(first)
        others = [i for i in range(3) if i != first]
        for i in others:
            wait_for(lambda i=i: _leader_named(ha, i) == dead, what=f"scheduler {i} names the leader")
        ha.schedulers[first].kill9()
        killed = time.monotonic()
        named: dict[int, list] = {i: [] for i in others}  # whom each follower named, in order

        def led():
            for i in others:
                named[i].append(_leader_named(ha, i))
            found = ha.leader(among=others)
            return (found,) if found is not None else None

        new = wait_for(led, timeout=60, interval=0.05, what="a follower leads")[0]
        took = time.monotonic() - killed
        # Its lock freed with its session: no wait for the lease to expire.
        assert took < lease / 2, f"a follower led {took:.1f} s after the kill (lease {lease:g} s)"
        assert ha.health(new)["epoch"] == 2
        third = next(i for i in others if i != new)
        wait_for(lambda: _leader_named(ha, third) == ha.address(new), what="the other follower names the new leader")
        channel, stub = ha.stub(third)
        try:
            with pytest.raises(grpc.RpcError) as info:
                stub.SubmitTask(scheduler_pb2.SubmitTaskRequest(spec=C.TaskSpec(model="m")), timeout=10)
        finally:
            channel.close()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and not_leader(info.value) == ha.address(new)
        for _ in range(10):
            named[third].append(_leader_named(ha, third))
        for i, seen in named.items():
            later = seen[next((k for k, v in enumerate(seen) if v != dead), len(seen)) :]
            assert dead not in later, f"scheduler {i} named the dead leader again: {seen}"
    finally:
        ha.close()


def test_leader_whose_lock_session_is_ended_steps_down_and_one_leader_follows(ha, postgres_server) -> None:
    ha.start_all()
    first = ha.wait_leader()
    with psycopg.connect(postgres_server.dsn(), autocommit=True) as admin:
        (pid,) = admin.execute(f'SELECT lock_pid FROM "{ha.schema}".leader_lease').fetchone()
        assert pid, "the lease names the leader's lock session"
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    down = wait_log(ha.schedulers[first], "stepped down; no longer leading")
    assert "lock session" in down["reason"], down
    leader = wait_for(
        lambda: (i,) if (i := ha.leader()) is not None and (ha.health(i) or {}).get("epoch", 0) >= 2 else None,
        what="one leader, with a new epoch",
    )[0]
    assert ha.leader() == leader
    with psycopg.connect(postgres_server.dsn(), autocommit=True) as admin:

        def locked_again():
            (now,) = admin.execute(f'SELECT lock_pid FROM "{ha.schema}".leader_lease').fetchone()
            held = admin.execute(
                "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = %s", (now,)
            ).fetchone()
            return now != pid and held is not None

        wait_for(locked_again, what="the new leader's lease names its own live lock session")


def test_leader_stopped_past_its_lease_steps_down_when_it_wakes(ha, tiny_model_dir: Path) -> None:
    ha.start_all()
    first = ha.wait_leader()
    other = 1 - first
    trainer = ha.start_trainer("node-a")
    ha.wait_nodes(first, 1)
    old = ha.schedulers[first]
    with RLClient(scheduler_url=ha.urls, min_poll_interval=0) as client:
        task_id = _running_task(ha, client, tiny_model_dir)
        os.kill(old.pid, signal.SIGSTOP)
        try:
            # The follower takes the expired lease while the leader cannot run at all.
            ha.wait_leader(among=[other])
        finally:
            os.kill(old.pid, signal.SIGCONT)
        # Awake, the old leader finds its lease gone: it steps down and ends its node streams;
        # the trainer follows to the new leader and re-announces its task.
        wait_log(old, "stepped down; no longer leading")
        wait_for(lambda: (ha.health(first) or {}).get("role") == "follower", what="the old leader is a follower")
        wait_for(lambda: (ha.health(first) or {}).get("leader") == ha.address(other), what="it names the new leader")
        ha.wait_nodes(other, 1)
        assert not ha.ready(first) and ha.ready(other)
        _check_finished_whole(client, ha, trainer, task_id, among=[other])
    assert len(registrations(trainer)) >= 2, "the trainer registered again, with the new leader"
    assert [e["epoch"] for e in old.log_events() if e.get("event") == "leader lease taken"] == [1]


def test_database_restart_mid_run_health_degrades_and_nothing_acknowledged_is_lost(
    ha, postgres_server, tiny_model_dir: Path
) -> None:
    ha.start_all()
    first = ha.wait_leader()
    trainer = ha.start_trainer("node-a")
    ha.wait_nodes(first, 1)
    with RLClient(scheduler_url=ha.urls, min_poll_interval=0) as client:
        task_id = _running_task(ha, client, tiny_model_dir)
        queued = client.submit_task(workload_type="lora_finetune", model="/models/later", hyperparameters=TINY_HP)
        postgres_server.stop("fast")
        try:
            for i in (0, 1):
                wait_for(
                    lambda i=i: (ha.health(i) or {}).get("status") == "degraded",
                    what=f"scheduler {i} says degraded",
                )
        finally:
            postgres_server.start()
        leader = ha.wait_leader()
        ha.wait_nodes(leader, 1)
        assert client.get_task(queued).task_id == queued, "an acknowledged task was lost"
        _check_finished_whole(client, ha, trainer, task_id, among=[leader])


def test_leader_cut_off_from_the_database_is_replaced_and_follows_after(
    tmp_path, postgres_server, tiny_model_dir
) -> None:
    proxy = TcpProxy("127.0.0.1", postgres_server.port)
    ha = HaCluster(tmp_path, postgres_server, 2, db_ports=[proxy.port, postgres_server.port])
    try:
        ha.start(0)
        ha.wait_up(0)
        assert ha.wait_leader(among=[0]) == 0
        ha.start(1)
        ha.wait_up(1)
        trainer = ha.start_trainer("node-a")
        ha.wait_nodes(0, 1)
        with RLClient(scheduler_url=ha.urls, min_poll_interval=0) as client:
            task_id = _running_task(ha, client, tiny_model_dir)
            proxy.pause()  # scheduler 0 can no longer reach the database; nothing tells it so
            assert ha.wait_leader(among=[1]) == 1
            wait_for(lambda: (ha.health(0) or {}).get("status") == "degraded", what="the cut-off one says degraded")
            wait_log(ha.schedulers[0], "stepped down; no longer leading")
            ha.wait_nodes(1, 1)
            _check_finished_whole(client, ha, trainer, task_id, among=[1])
            proxy.resume()
            wait_for(
                lambda: ha.health(0) == {"status": "ok", "role": "follower", "leader": ha.address(1), "epoch": 2},
                what="scheduler 0 back as a follower of scheduler 1",
            )
    finally:
        ha.close()
        proxy.close()


def test_leader_cut_off_from_the_database_is_replaced_within_the_lease_and_its_epoch_is_fenced(
    tmp_path, postgres_server
) -> None:
    """A partition leaves the leader's session open on the database's side: the timed lease
    decides. The database ends that session once idle past the lease, so the new leader, which
    took the lease without the lock, takes the lock too."""
    lease = 4.0
    proxy = TcpProxy("127.0.0.1", postgres_server.port)
    ha = HaCluster(tmp_path, postgres_server, 2, lease=lease, renew=0.5, db_ports=[proxy.port, postgres_server.port])
    try:
        ha.start(0)
        ha.wait_up(0)
        assert ha.wait_leader(among=[0]) == 0
        ha.start(1)
        wait_for(lambda: _leader_named(ha, 1) == ha.address(0), what="scheduler 1 follows scheduler 0")
        old_epoch = ha.health(0)["epoch"]
        with psycopg.connect(postgres_server.dsn(), autocommit=True) as admin:
            (old_pid,) = admin.execute(f'SELECT lock_pid FROM "{ha.schema}".leader_lease').fetchone()
            proxy.pause()  # scheduler 0 can no longer reach the database; nothing tells it so
            cut = time.monotonic()
            assert ha.wait_leader(among=[1]) == 1
            took = time.monotonic() - cut
            assert took < lease + 2, f"the cut-off leader was replaced {took:.1f} s after the cut (lease {lease:g} s)"
            admin.execute(f'SET search_path TO "{ha.schema}"')
            with pytest.raises(psycopg.Error) as fenced:  # what the old leader would still commit
                admin.execute("SELECT ot_fence(%s)", (old_epoch,))
            assert fenced.value.sqlstate == "OTF01"
            wait_log(ha.schedulers[0], "stepped down; no longer leading")

            def new_leader_locked():
                (pid,) = admin.execute(f'SELECT lock_pid FROM "{ha.schema}".leader_lease').fetchone()
                held = admin.execute(
                    "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = %s", (pid,)
                ).fetchone()
                return pid not in (0, old_pid) and held is not None

            wait_for(new_leader_locked, what="the old session ended and the new leader holds the lock")
        proxy.resume()
        wait_for(
            lambda: (ha.health(0) or {}).get("role") == "follower" and _leader_named(ha, 0) == ha.address(1),
            what="scheduler 0 back as a follower naming scheduler 1",
        )
        assert ha.leader() == 1
    finally:
        ha.close()
        proxy.close()


def test_two_schedulers_started_at_once_elect_exactly_one_leader(ha) -> None:
    for i in (0, 1):
        ha.start(i)
    for i in (0, 1):
        ha.wait_up(i)
    leader = ha.wait_leader()
    follower = 1 - leader
    assert not ha.ready(follower)
    wait_for(lambda: (ha.health(follower) or {}).get("leader") == ha.address(leader), what="the follower names it")
    assert ha.health(leader)["epoch"] == ha.health(follower)["epoch"] == 1


def test_a_schema_from_a_newer_scheduler_is_refused_at_start(ha, postgres_server) -> None:
    ha.start(0)
    ha.wait_up(0)
    ha.schedulers[0].terminate()
    with psycopg.connect(postgres_server.dsn(), autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{ha.schema}".schema_migrations (version, description, applied_time, scheduler_version) '
            "VALUES (99, 'from the future', 0, '9.0.0')"
        )
    out = subprocess.run(
        [
            sys.executable,
            *scheduler_args(ha.configs[1], port=ha.ports[1], http_port=ha.http_ports[1], state_dir=ha.tmp / "s1"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    assert out.returncode == 1, out.stderr
    assert "the state store's schema is version 99 ('from the future'" in out.stderr
    assert "newer than this scheduler understands" in out.stderr
