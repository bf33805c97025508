"""Several real scheduler processes on one real PostgreSQL (one schema), and trainers and clients
given all their URLs: for failover tests and the HA benchmark.

Each scheduler has its own ports, state folder and log; instance ``i`` may reach the database
through its own address (``db_ports``, e.g. a :class:`~tests.support.tcp_proxy.TcpProxy` a test
cuts). Nothing here sleeps for a fixed time: waits are on /health, task states and log lines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import grpc

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from tests.support.procs import Proc, free_port, scheduler_args, trainer_proc
from tests.support.waiting import wait_for


REPO = Path(__file__).resolve().parents[2]
HAPROXY_CFG = REPO / "deploy" / "haproxy.cfg"


def find_haproxy() -> str | None:
    """The ``haproxy`` binary, or None when it is not installed."""
    found = shutil.which("haproxy")
    return found or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)


def loopback_config(text: str, schedulers: list[tuple[int, int]]) -> str:
    """``deploy/haproxy.cfg`` for schedulers on one host: each server's check on its own HTTP port
    of ``(grpc port, http port)`` instead of the shared 8889; addresses come from the environment
    (:func:`loopback_env`), every check, timeout and the cut of a down server's sessions as
    committed."""
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


class Balancer:
    """A real ``haproxy`` with the shipped ``deploy/haproxy.cfg`` (:func:`loopback_config`) in
    front of ``cluster``'s schedulers; :attr:`address` is its frontend, :attr:`log` its log file.

    Raises:
        AssertionError: ``haproxy -c`` refuses the configuration.
    """

    def __init__(self, haproxy: str, cluster: "HaCluster") -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        cfg = cluster.tmp / "haproxy.cfg"
        schedulers = list(zip(cluster.ports, cluster.http_ports))
        cfg.write_text(loopback_config(HAPROXY_CFG.read_text(), schedulers))
        env = {**os.environ, **loopback_env(self.port, schedulers)}
        check = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True, env=env)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = cluster.tmp / "haproxy.log"
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [haproxy, "-db", "-f", str(cfg)], stdout=self._log_file, stderr=subprocess.STDOUT, env=env
        )

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


def ha_config(dsn: str, schema: str, *, lease: float, renew: float, extra: str = "") -> str:
    """A scheduler config on PostgreSQL: heartbeat 0.5 s, node lease 3 s, leader lease ``lease``."""
    return (
        "heartbeat_interval: 0.5\nlease: 3\n"
        f'store:\n  kind: postgres\n  dsn: "{dsn}"\n  schema: {schema}\n'
        f"  leader_lease: {lease}\n  renew_interval: {renew}\n  call_timeout: 2\n{extra}"
    )


class HaCluster:
    """``n`` schedulers (not started) sharing ``schema`` of ``server``, torn down by :meth:`close`."""

    def __init__(
        self,
        tmp: Path,
        server,
        n: int = 2,
        *,
        lease: float = 3.0,
        renew: float = 0.5,
        db_ports: list[int] | None = None,
        extra_config: str = "",
    ) -> None:
        self.tmp = tmp
        self.server = server
        self.schema = server.new_schema("ha")
        self.ports = [free_port() for _ in range(n)]
        self.http_ports = [free_port() for _ in range(n)]
        self.configs = []
        for i in range(n):
            db_port = (db_ports or [server.port] * n)[i]
            dsn = f"host=127.0.0.1 port={db_port} user={server.user} dbname=postgres"
            path = tmp / f"scheduler-{i}.yaml"
            path.write_text(ha_config(dsn, self.schema, lease=lease, renew=renew, extra=extra_config))
            self.configs.append(path)
        self.schedulers: list[Proc | None] = [None] * n
        self.procs: list[Proc] = []

    @property
    def urls(self) -> str:
        """Every scheduler's address, comma-separated (``SCHEDULER_URL``)."""
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def start(self, i: int) -> Proc:
        """Start scheduler ``i`` (returns at once; see :meth:`wait_up`)."""
        p = Proc(
            scheduler_args(
                self.configs[i],
                port=self.ports[i],
                http_port=self.http_ports[i],
                state_dir=self.tmp / f"state-{i}",
                host="127.0.0.1",
            ),
            self.tmp / f"scheduler-{i}.log",
        )
        self.procs.append(p)
        self.schedulers[i] = p
        return p

    def wait_up(self, i: int, timeout: float = 60) -> dict:
        """Wait until scheduler ``i`` answers /health with ok (as leader or follower)."""

        def up():
            p = self.schedulers[i]
            if p is not None and p.popen.poll() is not None:
                raise RuntimeError(f"scheduler {i} exited: {p.log_text()[-3000:]}")
            h = self.health(i)
            return h if h and h.get("status") == "ok" else None

        return wait_for(up, timeout=timeout, what=f"scheduler {i} healthy")

    def start_all(self) -> None:
        for i in range(len(self.ports)):
            self.start(i)
        for i in range(len(self.ports)):
            self.wait_up(i)

    def health(self, i: int, path: str = "/health") -> dict | None:
        """The JSON body of scheduler ``i``'s /health (or /ready), also of a 503; None when it
        does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_ports[i]}{path}", timeout=2) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return json.loads(err.read())
        except (OSError, ValueError):
            return None

    def ready(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_ports[i]}/ready", timeout=2) as resp:
                return resp.status == 200
        except (OSError, ValueError):
            return False

    def leader(self, among=None) -> int | None:
        """The index of the scheduler that is ready (the leader), None when none is."""
        found = [i for i in (among if among is not None else range(len(self.ports))) if self.ready(i)]
        return found[0] if len(found) == 1 else None

    def wait_leader(self, among=None, timeout: float = 60) -> int:
        """Wait until exactly one of ``among`` (default all) is the leader; its index."""

        def one():
            found = self.leader(among)
            return (found,) if found is not None else None  # index 0 is a leader too

        return wait_for(one, timeout=timeout, what="exactly one leader")[0]

    def start_trainer(self, node_id: str, *extra: str, url: str | None = None) -> Proc:
        p = trainer_proc(self.tmp, node_id, *extra, url=url or self.urls)
        self.procs.append(p)
        return p

    def stub(self, i: int):
        channel = grpc.insecure_channel(self.address(i))
        return channel, scheduler_pb2_grpc.SchedulerServiceStub(channel)

    def get(self, task_id: str, among=None) -> common_pb2.Task | None:
        """The task as any live scheduler of ``among`` reads it from the database."""
        for i in among if among is not None else range(len(self.ports)):
            channel, stub = self.stub(i)
            try:
                return stub.GetTask(scheduler_pb2.GetTaskRequest(task_id=task_id), timeout=5).task
            except grpc.RpcError:
                continue
            finally:
                channel.close()
        return None

    def wait_state(self, task_id: str, states, timeout: float = 180, what=None, among=None) -> common_pb2.Task:
        states = set(states) if isinstance(states, (set, list, tuple)) else {states}

        def check():
            task = self.get(task_id, among)
            return task if task is not None and task.state in states and (what is None or what(task)) else None

        return wait_for(check, timeout=timeout, what=f"task {task_id} in {states}")

    def wait_nodes(self, i: int, n: int, timeout: float = 60) -> list:
        """Wait until the leader ``i`` has ``n`` connected nodes."""

        def enough():
            channel, stub = self.stub(i)
            try:
                nodes = [x for x in stub.ListNodes(scheduler_pb2.ListNodesRequest(), timeout=5).nodes if x.connected]
            except grpc.RpcError:
                return None
            finally:
                channel.close()
            return nodes if len(nodes) >= n else None

        return wait_for(enough, timeout=timeout, what=f"{n} node(s) connected to scheduler {i}")

    def close(self) -> None:
        for p in self.procs:
            p.close()


def registrations(trainer: Proc) -> list[dict]:
    """The trainer's "registered with scheduler" log events, oldest first."""
    return [e for e in trainer.log_events() if e.get("event") == "registered with scheduler"]


def wait_log(proc: Proc, event: str, timeout: float = 60, **fields) -> dict:
    """Wait until ``proc`` logged ``event`` (with ``fields``); that event."""

    def found():
        for e in proc.log_events():
            if e.get("event") == event and all(e.get(k) == v for k, v in fields.items()):
                return e
        return None

    return wait_for(found, timeout=timeout, what=f"log event {event!r} {fields or ''}")
