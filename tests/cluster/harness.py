"""The simulated cluster of ``make test-cluster`` and ``make bench-cluster``: the hosts, the
services docs/cluster.md starts on them (by host and service name), and a client on ``lb``
(tests/cluster/probe.py) driven over a pipe."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.hosts import Hosts, netns_pids
from tests.support.waiting import wait_for, wait_progress

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "cluster.md"
HOSTS = ["db", "scheduler-a", "scheduler-b", "lb", "trainer-1", "trainer-2"]
TRAINERS = ["trainer-1", "trainer-2"]
SCHEDULERS = ["scheduler-a", "scheduler-b"]
#: Seconds from kill -9 of the leader to the first acknowledged submit through the balancer
#: that fail the test: generous, for a loaded machine. ``make bench-cluster`` measures it.
FAILOVER_BOUND_S = 60.0


def ppo(updates: int, checkpoint_every: int = 1) -> dict:
    """PPO on CartPole: ``updates`` steps of 2 envs x 64 env steps (a fraction of a second each)."""
    return {
        "total_timesteps": 128 * updates,
        "num_envs": 2,
        "num_steps": 64,
        "checkpoint_every": checkpoint_every,
        "hidden_sizes": [16],
    }


@dataclass
class Block:
    hosts: list[str]
    service: str  # its name in brackets, "" for a command that runs to its end
    script: str


def guide_blocks(text: str) -> list[Block]:
    """The ```sh blocks of the guide, in order; each starts ``# on HOST[ and HOST][, a service (NAME)]``."""
    openings = re.findall(r"(?m)^```(\w*)$", text)[::2]
    assert set(openings) == {"sh"}, f"docs/cluster.md: every command block is ```sh, got {openings}"
    blocks = []
    for body in re.findall(r"```sh\n(.*?)```", text, re.S):
        first, _, script = body.partition("\n")
        m = re.fullmatch(r"# on ([\w-]+(?: and [\w-]+)*)(?:, a service \(([\w-]+)\))?", first)
        assert m, f"docs/cluster.md: a block must start '# on HOST': {first!r}"
        blocks.append(Block(m.group(1).split(" and "), m.group(2) or "", script))
    return blocks


class Cluster:
    """The hosts, the guide's services on them (by host and service name) and the client on lb."""

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
                    self.wait_trainers()
                    out = self.hosts.run(host, block.script).stdout
                    assert all(t in out for t in TRAINERS), out
                else:
                    self.hosts.run(host, block.script, timeout=300)

    def start_probe(self) -> None:
        self.probe = self.open_probe("http://lb:8888")

    def open_probe(self, scheduler_url: str) -> subprocess.Popen:
        """A client on ``lb`` that reaches the schedulers at ``scheduler_url`` (the balancer, or a
        comma-separated URL list); see :meth:`call`."""
        env = f"SCHEDULER_URL={scheduler_url} AWS_ACCESS_KEY_ID=opentinker AWS_SECRET_ACCESS_KEY=change-me-s3"
        env += " S3_ENDPOINT=http://db:8333 S3_BUCKET=opentinker"
        argv = self.hosts.argv("lb", f"export {env}\nexec python -m tests.cluster.probe")
        return subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.tmp / "probe.log", "ab"), text=True
        )

    def call(self, op: str, *, probe: subprocess.Popen | None = None, **kw):
        """A request to the client on ``lb`` (or to ``probe``); its answer, or None on an error (logged)."""
        self.send(op, probe=probe, **kw)
        return self.answer(op, probe=probe)

    def send(self, op: str, *, probe: subprocess.Popen | None = None, **kw) -> None:
        """The first half of :meth:`call`: requests to several probes then run at once."""
        probe = probe or self.probe
        probe.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        probe.stdin.flush()

    def answer(self, op: str, *, probe: subprocess.Popen | None = None):
        """The second half of :meth:`call`."""
        line = (probe or self.probe).stdout.readline()
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

    def wait_trainers(self) -> None:
        wait_for(lambda: self.call("nodes") == TRAINERS, timeout=180, what="both trainers connected")

    def running(self, task_id: str, checkpoint_step: int = 2) -> dict:
        """Wait until the task runs and has stored a checkpoint at ``checkpoint_step`` or later."""
        return self.wait_task(
            task_id,
            lambda t: t["state"] == "running" and t["checkpoint_step"] >= checkpoint_step,
            f"task {task_id} running with a checkpoint",
        )

    def finished(self, task_id: str) -> dict:
        return self.wait_task(task_id, lambda t: t["state"] in ("succeeded", "failed", "cancelled"), f"{task_id} ends")

    def workers(self, host: str) -> list[int]:
        """The task worker processes on ``host``."""
        found = []
        for pid in netns_pids(self.hosts.hosts[host].ns):
            try:
                if b"opentinker_trainer.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                pass
        return found

    def close(self) -> None:
        if self.probe is not None and self.probe.poll() is None:
            self.probe.stdin.close()
            self.probe.kill()
            self.probe.wait(timeout=10)
        self.hosts.close()
