"""The deploy files' HAProxy in front of two real schedulers on one real PostgreSQL: the committed
``deploy/haproxy.cfg``, its addresses from the environment and each check on its scheduler's own
HTTP port (two schedulers share one host here), run by a real ``haproxy``.

A client and a trainer given only the balancer's address reach the leader (the one scheduler
whose ``/ready`` passes); after kill -9 of the leader the balancer marks it down, cuts its
sessions, and both reach the new leader through the same address: the trainer re-registers, a
submit is acknowledged, and the task submitted before the kill is still there. Both happen well
within the leader lease: the dead leader's lock frees at once, the balancer checks every 500 ms,
and client and trainer retry within a second.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from opentinker_client import RLClient

from tests.support.ha import Balancer, HaCluster, find_haproxy, registrations
from tests.support.waiting import wait_for

LEASE = 15.0  # seconds: long, so that a failover that waited for it shows


@pytest.fixture
def balanced(tmp_path, postgres_server):
    haproxy = find_haproxy()
    if haproxy is None:
        pytest.skip("haproxy is not installed (make test-deps installs it as root: apt-get install haproxy)")
    ha = HaCluster(tmp_path, postgres_server, 2, lease=LEASE, renew=1.0)
    try:
        ha.start_all()
        lb = Balancer(haproxy, ha)
        try:
            yield ha, lb.address, lb.log
        finally:
            lb.close()
    finally:
        ha.close()


def test_through_the_balancer_a_client_and_a_trainer_follow_the_leader_across_a_kill9(balanced) -> None:
    ha, lb, lb_log = balanced
    leader = ha.wait_leader()
    trainer = ha.start_trainer("node-lb", url=lb)
    ha.wait_nodes(leader, 1)  # the balancer sent the node stream to the leader
    with RLClient(scheduler_url=lb) as client:
        before = client.submit_task(workload_type="lora_finetune", model="/models/none")
        assert client.get_task(before).task_id == before

        ha.schedulers[leader].popen.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        # The same address reaches the new leader: a submit is acknowledged, the trainer
        # registers again there, and the task acknowledged before the kill is still there.
        after = client.submit_task(workload_type="lora_finetune", model="/models/none")
        submitted = time.monotonic() - killed
        wait_for(lambda: len(registrations(trainer)) >= 2, timeout=60, what="the trainer registered again")
        registered = time.monotonic() - killed
        new = ha.wait_leader()
        assert new == 1 - leader
        ha.wait_nodes(new, 1)
        assert submitted < LEASE / 2, f"a submit through the balancer took {submitted:.1f} s after the kill"
        assert registered < LEASE / 2, f"the trainer registered again {registered:.1f} s after the kill"
        assert {t.task_id for t in client.list_tasks()} >= {before, after}
        assert ha.get(before, among=[new]).task_id == before
    text = lb_log.read_text(errors="replace")
    assert re.search(rf"scheduler-{'ab'[leader]} is DOWN", text), text[-3000:]
