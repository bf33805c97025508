"""Owners see their own usage and queues' totals, never another owner's name: against a real
in-process scheduler with auth on, a user key's ListQueues shows the configured queues with their
totals and only its own owner, not other owners' own queues; /metrics, on the HTTP port and on the
gRPC port, names owners only to an admin key, and a user or anonymous scrape gets totals."""

from __future__ import annotations

import urllib.request

import pytest

from opentinker_client import RLClient
from tests.support.http import metric_samples
from tests.support.security import LoopbackScheduler
from tests.support.waiting import wait_for

CONFIG = """auth: {enabled: true}
heartbeat_interval: 0.5
queues:
  - {name: team-a, gpus: 1, cpu_tasks: 4, owners: [alice, bob]}
"""
CARTPOLE = dict(workload_type="full_rl", model="mlp", env_config={"env_id": "CartPole-v1"})


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    with LoopbackScheduler(tmp_path_factory.mktemp("privacy") / "state", CONFIG, http_port=0) as s:
        with RLClient(s.target, api_key=s.admin_key) as root:
            keys = {name: root.keys.create(name, "user")[1] for name in ("alice", "bob", "carol")}
            root.queues.set("team-x", gpu_quota=0, cpu_task_quota=1, owners=["dave"])  # set by the admin
        for name in ("alice", "bob", "carol"):
            with RLClient(s.target, api_key=keys[name]) as client:
                client.submit_task(**CARTPOLE)
        yield s, keys


def _scrape(url: str, key: str | None = None) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read().decode()


def test_a_user_lists_queues_totals_and_only_its_own_name(shared) -> None:
    s, keys = shared
    with RLClient(s.target, api_key=keys["alice"]) as alice:
        queues = {q.name: q for q in alice.queues.list()}
    assert set(queues) == {"team-a", "team-x"}  # carol's own queue is named after carol: not shown
    assert queues["team-a"].owners == ("alice",) and queues["team-a"].pending_tasks == 2  # bob's counts
    assert queues["team-x"].owners == ()
    with RLClient(s.target, api_key=keys["carol"]) as carol:
        assert {q.name: q.owners for q in carol.queues.list()} == {"team-a": (), "team-x": (), "carol": ()}
    with RLClient(s.target, api_key=s.admin_key) as root:
        queues = {q.name: q for q in root.queues.list()}
    assert set(queues) == {"team-a", "team-x", "carol"} and queues["team-a"].owners == ("alice", "bob")


@pytest.mark.parametrize("port", ["http", "grpc"])
def test_metrics_name_owners_only_to_an_admin(shared, port) -> None:
    s, keys = shared
    base = f"http://127.0.0.1:{s.running.http.port}" if port == "http" else f"http://{s.target}"

    def admin_view() -> str | None:
        text = _scrape(base + "/metrics", s.admin_key)
        return text if 'queue="carol"' in text else None

    admin = wait_for(admin_view, what="the owners' queues on /metrics")
    assert 'opentinker_queue_pending_tasks{queue="team-a"} 2.0' in admin
    for key in (None, keys["alice"], "otk_00000000_" + "x" * 43):
        text = _scrape(base + "/metrics", key)
        assert "carol" not in text and "owner=" not in text, key
        samples = metric_samples(text)
        assert samples["opentinker_queue_pending_tasks"] == [({"queue": "team-a"}, 2.0), ({"queue": "team-x"}, 0.0)]
        assert samples["opentinker_usage_gpu_seconds_total"] == [({}, 0.0)]  # all owners' usage, summed
