"""Quota queues changed at run time outlive a real scheduler restart (kill -9 included), on SQLite
and on PostgreSQL: ``opentinker queues`` shows which values come from the config and which from a
runtime override, ``opentinker queues reset`` clears one, and both are in the audit log."""

from __future__ import annotations

import json

from opentinker_client import NotFoundError, RLClient

from tests.integration.test_sharing_a_cluster import cli
from tests.support.waiting import wait_for

QUEUES = """\
queues:
  - {name: team-a, gpus: 8, cpu_tasks: 4, owners: [alice, bob]}
  - {name: team-b, gpus: 2, cpu_tasks: 2, owners: [dave]}
"""


def _restart(cluster, *, kill: bool) -> None:
    """Stop the scheduler (kill -9, or SIGTERM) and start it again on the same state; on
    PostgreSQL it leads once the old lease is gone (until then it follows, serving reads)."""
    if kill:
        cluster.scheduler.kill9()
    else:
        cluster.scheduler.terminate()
    cluster.start_scheduler()
    wait_for(lambda: cluster.health().get("role", "leader") == "leader", what="the restarted scheduler leads")


def _queues(cluster) -> dict:
    with RLClient(cluster.url) as client:
        return {q.name: q for q in client.queues.list()}


def test_runtime_quota_overrides_survive_restarts_until_reset(backend_cluster) -> None:
    cluster = backend_cluster
    cluster.config_path.write_text(cluster.config_path.read_text() + QUEUES)
    cluster.start_scheduler()
    with RLClient(cluster.url) as client:
        client.queues.set("team-a", gpu_quota=2, cpu_task_quota=4, owners=["alice"])
        client.queues.set("team-x", gpu_quota=1, cpu_task_quota=0, gpu_borrowing_limit=0, owners=["carol"])
    _restart(cluster, kill=True)  # acknowledged, so committed: kill -9 loses neither

    q = _queues(cluster)
    assert (q["team-a"].gpu_quota, q["team-a"].owners, q["team-a"].overridden) == (2, ("alice",), True)
    assert q["team-a"].overrides() == {"gpu_quota": (8, 2), "owners": (("alice", "bob"), ("alice",))}
    assert q["team-a"].override_by == "anonymous" and q["team-a"].override_time > 0
    assert q["team-x"].configured is None and q["team-x"].gpu_borrowing_limit == 0
    assert not q["team-b"].overridden and q["team-b"].overrides() == {}
    if "kind: postgres" in cluster.config_path.read_text():  # the CLI reads the same answer: once is enough
        with RLClient(cluster.url) as client:
            now, removed = client.queues.reset("team-a")
        assert (now.gpu_quota, now.overridden, removed.gpu_quota) == (8, False, 2)
    else:
        table = cli(cluster, "", "queues")
        # queue -> its row with any line under it (the columns that did not fit), words joined
        rows: dict[str, str] = {}
        for line in table.splitlines()[1:]:
            words = line.split()
            if words and words[0] in ("team-a", "team-b", "team-x"):
                rows[words[0]] = " ".join(words)
            elif words and rows:
                rows[list(rows)[-1]] += " " + " ".join(words)
        assert "override by anonymous" in rows["team-a"] and "config: GPUs 8; owners alice, bob" in rows["team-a"]
        assert "not in config" in rows["team-x"] and rows["team-b"].endswith(" config")
        said = cli(cluster, "", "queues", "reset", "team-a")
        assert said.startswith("queue team-a: runtime override removed (was 2 GPUs")
        assert "now the config's 8 GPUs" in said
    with RLClient(cluster.url) as client:
        try:
            client.queues.reset("team-z")
            raise AssertionError("a queue neither overridden nor configured was reset")
        except NotFoundError as err:
            assert "team-z" in str(err)
    _restart(cluster, kill=False)

    q = _queues(cluster)
    assert (q["team-a"].gpu_quota, q["team-a"].owners, q["team-a"].overridden) == (8, ("alice", "bob"), False)
    assert q["team-x"].overridden and q["team-x"].owners == ("carol",)
    with RLClient(cluster.url) as client:
        audit = [
            (r.action, r.outcome, r.detail["queue"])
            for r in client.keys.audit(limit=50)
            if r.action.startswith("queue.")
        ]
    assert audit[::-1] == [
        ("queue.set", "OK", "team-a"),
        ("queue.set", "OK", "team-x"),
        ("queue.reset", "OK", "team-a"),
        ("queue.reset", "NOT_FOUND", "team-z"),
    ], json.dumps(audit)
