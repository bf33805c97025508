"""A cluster on simulated hosts, set up by the commands of docs/cluster.md as printed: PostgreSQL
and SeaweedFS on ``db``, two schedulers (leader lease in PostgreSQL, checkpoints in S3), HAProxy
with the shipped ``deploy/haproxy.cfg`` on ``lb``, two trainers. Each host is a network namespace
with its own address, host name and private disk (tests/cluster/hosts.py); a client runs on
``lb`` (tests/cluster/probe.py). Then faults, one at a time, each healed before the next:
a trainer host killed, the leader killed, a trainer cut off and joined again, PostgreSQL
restarted under an open watch, SeaweedFS's S3 gateway down for a while. Workload: PPO on CartPole (CPU).
"""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from tests.cluster.harness import FAILOVER_BOUND_S, SCHEDULERS, TRAINERS, Cluster, ppo
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.set_up()
        yield c
    finally:
        c.close()


def test_the_guides_commands_set_up_a_cluster_that_runs_a_task(cluster: Cluster) -> None:
    leader = wait_for(cluster.leader, timeout=60, what="one leader")
    assert leader in SCHEDULERS
    task_id = cluster.call("submit", hyperparameters=ppo(4))
    done = cluster.wait_task(task_id, lambda t: t["state"] in ("succeeded", "failed"), "a task ends")
    assert done["state"] == "succeeded" and done["attempt"] == 1, done


def test_a_killed_trainer_host_resumes_its_task_on_the_other_from_s3(cluster: Cluster) -> None:
    task_id = cluster.call("submit", hyperparameters=ppo(300, checkpoint_every=5))
    before = cluster.running(task_id, checkpoint_step=5)
    victim = before["node_id"]
    cluster.hosts.kill(victim)  # power off: agent, worker and its disk gone
    (other,) = [t for t in TRAINERS if t != victim]
    done = cluster.finished(task_id)
    assert done["state"] == "succeeded", done
    events = cluster.call("events", task=task_id)
    started = [e for e in events if e["kind"] == "state" and e["to_state"] == "running"]
    assert [(e["attempt"], e["node_id"]) for e in started] == [(1, victim), (2, other)], started
    resumed = [e["step"] for e in events if e["kind"] == "metric" and e["sequence"] > started[1]["sequence"]]
    assert min(resumed) > before["checkpoint_step"], "attempt 2 began after the checkpoint, from S3"
    # the host comes back with an empty disk and joins again
    cluster.hosts.boot(victim)
    cluster.start_service(victim, "trainer")
    cluster.wait_trainers()


def test_a_killed_leader_is_replaced_and_running_work_goes_on(cluster: Cluster) -> None:
    task_id = cluster.call("submit", hyperparameters=ppo(200, checkpoint_every=10))
    cluster.running(task_id, checkpoint_step=10)
    leader = wait_for(cluster.leader, timeout=60, what="one leader")
    killed_at = time.time()
    cluster.stop_service(leader, "scheduler")  # kill -9
    acknowledged_at = cluster.call("leader_call", hyperparameters=ppo(1))
    failover = acknowledged_at - killed_at
    print(f"\nfailover through haproxy: kill -9 of the leader to the first acknowledged submit: {failover:.1f} s")
    assert failover < FAILOVER_BOUND_S
    assert cluster.leader() not in (None, leader)
    done = cluster.finished(task_id)
    assert (done["state"], done["attempt"]) == ("succeeded", 1), done
    cluster.start_service(leader, "scheduler")
    ready = "curl -sS --retry 60 --retry-connrefused --retry-delay 1 -o /dev/null http://localhost:8889/health"
    cluster.hosts.run(leader, ready)


def test_a_trainer_cut_off_and_joined_again_writes_nothing_stale(cluster: Cluster) -> None:
    task_id = cluster.call("submit", hyperparameters=ppo(200, checkpoint_every=5))
    before = cluster.running(task_id, checkpoint_step=5)
    cut = before["node_id"]
    cluster.hosts.cut(cut)
    moved = cluster.wait_task(task_id, lambda t: t["attempt"] == 2 and t["state"] == "running", "attempt 2 runs")
    assert moved["node_id"] != cut
    cluster.hosts.heal(cut)
    done = cluster.finished(task_id)
    assert done["state"] == "succeeded", done
    cluster.wait_trainers()
    wait_for(lambda: not cluster.workers(cut), timeout=120, what=f"the stale worker on {cut} stopped")
    events = cluster.call("events", task=task_id)
    second = next(e["sequence"] for e in events if e["kind"] == "state" and e["attempt"] == 2)
    stale = [e for e in events if e["sequence"] > second and e["kind"] == "checkpoint" and e["attempt"] == 1]
    assert not stale, stale
    # every checkpoint in the bucket is one the scheduler lists: nothing the fenced worker uploaded
    listed = {(k["attempt"], k["step"]) for k in cluster.call("checkpoints", task=task_id)}
    stored = set()
    for key in cluster.call("s3_keys"):
        m = re.match(rf"tasks/{task_id}/a(\d+)/(?:step|final)_(\d+)/", key)
        if m:
            stored.add((int(m.group(1)), int(m.group(2))))
    assert stored and stored <= listed, (stored, listed)


def test_a_watch_open_across_a_database_restart_ends_with_the_terminal_event(cluster: Cluster) -> None:
    task_id = cluster.call("submit", hyperparameters=ppo(200, checkpoint_every=10))
    node = cluster.running(task_id, checkpoint_step=10)["node_id"]
    out = cluster.tmp / "watch.jsonl"
    env = "export SCHEDULER_URL=http://lb:8888"
    watch = cluster.hosts.spawn("lb", f"{env}\nexec python -m tests.cluster.probe watch {task_id}", out)
    wait_for(lambda: out.exists() and out.read_text().count("\n") > 3, timeout=60, what="the watch streams")
    cluster.stop_service("db", "postgresql", signal.SIGINT)  # a fast shutdown
    # down until both schedulers say so (/health 503: the database unreachable), the task going on
    degraded = "! curl -sf -o /dev/null http://scheduler-a:8889/health && ! curl -sf -o /dev/null http://scheduler-b:8889/health"
    cluster.hosts.run("lb", f"until {degraded}; do sleep 0.5; done", timeout=120)
    trainer_log = cluster.log(node, "trainer")
    steps = trainer_log.read_text().count('"event": "update"')
    wait_for(
        lambda: trainer_log.read_text().count('"event": "update"') >= steps + 10,
        timeout=120,
        what="ten more steps while the database is down",
    )
    cluster.start_service("db", "postgresql")
    done = cluster.finished(task_id)
    assert done["state"] == "succeeded", done
    wait_for(lambda: watch.poll() is not None, timeout=120, what="the watch ends")
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    assert lines[-1] == {"end": True}, lines[-3:]
    terminal = [e for e in lines[:-1] if e.get("kind") == "state" and e["to_state"] == "succeeded"]
    assert terminal, lines[-5:]


def test_s3_down_for_a_while_costs_a_checkpoint_at_most(cluster: Cluster) -> None:
    """The S3 gateway killed -9 after a stored checkpoint and started again once an upload failed:
    training goes on, the upload is retried, the task ends with its final checkpoint."""
    task_id = cluster.call("submit", hyperparameters=ppo(300, checkpoint_every=100))
    node = cluster.running(task_id, checkpoint_step=100)["node_id"]
    cluster.stop_service("db", "s3")  # kill -9
    trainer_log = cluster.log(node, "trainer")
    wait_for(
        lambda: f'"key": "tasks/{task_id}/a1/step_200", "try_": 1, "error"' in trainer_log.read_text(),
        timeout=300,
        what="an upload to the stopped store failed",
    )
    cluster.start_service("db", "s3")
    done = cluster.finished(task_id)
    assert (done["state"], done["attempt"]) == ("succeeded", 1), done
    events = cluster.call("events", task=task_id)
    failed = [e for e in events if e["kind"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] in ([], [200]), failed
    assert [e["step"] for e in events if e["kind"] == "checkpoint" and e["final"]] == [300]


def test_the_cluster_stops_and_leaves_no_namespaces_or_processes(cluster: Cluster) -> None:
    cluster.close()
    assert cluster.hosts.leftovers() == ([], [])
