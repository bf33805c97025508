"""The deploy files' HAProxy in front of two real schedulers on one real PostgreSQL: the committed
``deploy/haproxy.cfg``, its addresses from the environment and each check on its scheduler's own
HTTP port (two schedulers share one host here), run by a real ``haproxy``.

A client and a trainer given only the balancer's address reach the leader (the one scheduler
whose ``/ready`` passes); after kill -9 of the leader the balancer marks it down, cuts its
sessions, and both reach the new leader through the same address: the trainer re-registers, a
submit is acknowledged, and the task submitted before the kill is still there.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from opentinker_client import RLClient

from tests.support.ha import HaCluster, registrations
from tests.support.procs import free_port
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
HAPROXY_CFG = REPO / "deploy" / "haproxy.cfg"


def loopback_config(text: str, schedulers: list[tuple[int, int]]) -> str:
    """``deploy/haproxy.cfg`` for two schedulers on one host: each server's check on its own HTTP
    port of ``(grpc port, http port)`` instead of the shared 8889; addresses come from the
    environment (:func:`loopback_env`), every check, timeout and the cut of a down server's
    sessions as committed."""
    servers = [line for line in text.splitlines() if re.match(r"\s*server scheduler-", line)]
    assert len(servers) == len(schedulers), servers
    for line, (_, http_port) in zip(servers, schedulers):
        text = text.replace(line, f"{line} port {http_port}")
    return text


def loopback_env(lb_port: int, schedulers: list[tuple[int, int]]) -> dict[str, str]:
    """The variables deploy/haproxy.cfg reads, for the frontend on ``lb_port`` and the schedulers."""
    env = {"OPENTINKER_LB_BIND": f"127.0.0.1:{lb_port}"}
    for letter, (port, _) in zip("AB", schedulers):
        env[f"OPENTINKER_SCHEDULER_{letter}"] = f"127.0.0.1:{port}"
    return env


@pytest.fixture
def balanced(tmp_path, postgres_server):
    haproxy = shutil.which("haproxy") or (Path("/usr/sbin/haproxy") if Path("/usr/sbin/haproxy").exists() else None)
    if haproxy is None:
        pytest.skip("haproxy is not installed (make test-deps installs it as root: apt-get install haproxy)")
    ha = HaCluster(tmp_path, postgres_server, 2)
    ha.start_all()
    lb_port = free_port()
    cfg = tmp_path / "haproxy.cfg"
    schedulers = list(zip(ha.ports, ha.http_ports))
    cfg.write_text(loopback_config(HAPROXY_CFG.read_text(), schedulers))
    env = {**os.environ, **loopback_env(lb_port, schedulers)}
    check = subprocess.run([str(haproxy), "-c", "-f", str(cfg)], capture_output=True, text=True, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    log = open(tmp_path / "haproxy.log", "wb")
    proc = subprocess.Popen([str(haproxy), "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield ha, f"127.0.0.1:{lb_port}", tmp_path / "haproxy.log"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
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
        new = wait_for(lambda: (i,) if (i := ha.leader(among=[1 - leader])) is not None else None, timeout=60)[0]
        assert new == 1 - leader
        # The same address now reaches the new leader: the trainer registers again there, a
        # submit is acknowledged, and the task acknowledged before the kill is still there.
        ha.wait_nodes(new, 1)
        wait_for(lambda: len(registrations(trainer)) >= 2, timeout=60, what="the trainer registered again")
        after = client.submit_task(workload_type="lora_finetune", model="/models/none")
        assert {t.task_id for t in client.list_tasks()} >= {before, after}
        assert ha.get(before, among=[new]).task_id == before
    text = lb_log.read_text(errors="replace")
    assert re.search(rf"scheduler-{'ab'[leader]} is DOWN", text), text[-3000:]
