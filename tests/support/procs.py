"""Real scheduler and trainer processes on loopback ports, for integration tests.

Each process runs in its own session (process group) so a test can ``kill -9`` it, and every
process left is killed at teardown.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from tests.support.waiting import CAP_S, STALL_S, wait_for, wait_progress

#: Seconds a scheduler gets to answer /health, or a trainer to connect: a fixed wait, for that
#: does not grow with any work; about 30 times what a quiet 2-core machine needs (each imports in
#: about 1 s, then binds or registers).
START_S = 60.0

#: A tiny LoRA task that runs long enough to be watched while it runs (400 steps, no checkpoints).
LONG_TINY_LORA_HP = {
    "steps": 400,
    "prompts_per_step": 2,
    "group_size": 2,
    "max_new_tokens": 4,
    "lora_rank": 4,
    "checkpoint_every": 0,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A free port P whose P + 1 is free too (a scheduler's default HTTP port is --port + 1)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of ports")


#: ``python -c`` code: SIGINT raises KeyboardInterrupt, as Ctrl-C on a terminal does, then the
#: module named by the first argument runs as under ``python -m``.
_INTERRUPTIBLE = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


def interruptible(module: str, *args: str) -> list[str]:
    """The argv of ``python -m module args`` that a SIGINT interrupts as Ctrl-C on a terminal
    would. A suite started in the background (``make test &``, nohup, some CI runners) runs with
    SIGINT ignored, which a child inherits. This resets it in the child itself: a ``preexec_fn``
    would fork this process, whose gRPC threads make a fork unsafe."""
    return [sys.executable, "-c", _INTERRUPTIBLE, module, *args]


def scheduler_args(
    config: Path, *, port: int | str, http_port: int | str, state_dir: Path, host: str | None = None
) -> list[str]:
    """``-m opentinker_scheduler`` and its flags (no ``--host`` unless given: the default binds all)."""
    return [
        "-m",
        "opentinker_scheduler",
        "--config",
        str(config),
        *(["--host", host] if host else []),
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--state-dir",
        str(state_dir),
    ]


def run_worker(
    assign, folder: Path, checkpoint_dir: Path, *, cwd: Path, env: dict[str, str] | None = None
) -> tuple[int, list[dict]]:
    """Run ``python -m opentinker_trainer.worker`` on ``assign`` (an ``AssignTask``, written to
    ``folder/assignment.pb``) on the CPU, with no ``OPENTINKER_*`` variables but ``env``; its exit
    code and the JSON reports it printed."""
    path = folder / "assignment.pb"
    path.write_bytes(assign.SerializeToString())
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OPENTINKER_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "opentinker_trainer.worker",
            str(path),
            "--checkpoint-dir",
            str(checkpoint_dir),
            "--device",
            "cpu",
        ],
        cwd=cwd,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def task_fields(task: common_pb2.Task | None) -> tuple:
    """What of a task moves while it makes progress: state, attempt, node, step, checkpoint step
    (``()`` before the first answer)."""
    if task is None:
        return ()
    state = common_pb2.TaskState.Name(task.state)
    return (state, task.attempt, task.node_id, task.latest_step, task.latest_checkpoint.step)


def wait_connected(client, n: int = 1, timeout: float = 60) -> list:
    """The connected nodes, once ``client`` (an ``RLClient``) lists at least ``n``."""

    def enough() -> list | None:
        nodes = [x for x in client.list_nodes() if x.connected]
        return nodes if len(nodes) >= n else None

    return wait_for(enough, timeout=timeout, what=f"{n} node(s) connected")


class Proc:
    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        *,
        prefix: list[str] = (),
    ) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        full_env = {**os.environ, "OPENTINKER_LOG_FORMAT": "json", **(env or {})}
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            cwd=cwd,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_events(self) -> list[dict]:
        """The JSON log lines so far. Other lines (a library's warning) are skipped, but a line
        that holds a log record and does not parse (two processes' output run together) fails
        the test here, instead of its event going missing."""
        out = []
        lines = self.log_text().splitlines()
        for i, line in enumerate(lines):
            try:
                out.append(json.loads(line))
            except ValueError:
                if '"event": ' in line and i < len(lines) - 1:  # the last line may still be written
                    raise AssertionError(
                        f"{self.log_path}:{i + 1}: a log record run together with other output: {line!r}"
                    )
        return out

    def mentions(self, text: str) -> int:
        """How often ``text`` (a task id, say) occurs in the log so far: the agent's lines about a
        task and its worker's (``loading model``, one per step, ``checkpoint written`` ...)."""
        try:
            return self.log_path.read_bytes().count(text.encode())
        except FileNotFoundError:
            return 0

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def wait_exit(self, *, stall: float = STALL_S, what: str = "") -> int:
        """The exit code, once the process ended; waits while its log grows (a drain writing its
        checkpoint and ending its workers, say). ``TimeoutError`` when it stops logging for
        ``stall`` seconds without exiting."""
        wait_progress(
            lambda: self.popen.poll() is not None,
            self.log_size,
            stall=stall,
            what=what or f"process {self.pid} exits",
        )
        return self.popen.returncode

    def kill9(self) -> None:
        """SIGKILL the whole process group (the agent and its workers)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=10)

    def terminate(self, timeout: float = 30) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill9()
        return self.popen.returncode

    def close(self) -> None:
        if self.popen.poll() is None:
            self.kill9()
        self._log.close()


def trainer_proc(tmp: Path, node_id: str, *extra: str, url: str, prefix: list[str] = ()) -> Proc:
    """``python -m opentinker_trainer`` as node ``node_id`` of scheduler(s) ``url`` (one URL or
    several, comma-separated), its work dir ``tmp/runs/<node_id>``, its log ``tmp/trainer-<node_id>.log``,
    a 3 s kill grace; ``extra``: more trainer flags; ``prefix``: a command the trainer runs under."""
    return Proc(
        [
            "-m",
            "opentinker_trainer",
            "--node-id",
            node_id,
            "--work-dir",
            str(tmp / "runs" / node_id),
            "--kill-grace",
            "3",
            *extra,
        ],
        tmp / f"trainer-{node_id}.log",
        env={"SCHEDULER_URL": url},
        prefix=prefix,
    )


class _PortTaken(RuntimeError):
    """The scheduler exited because another process holds one of its ports."""


class Cluster:
    """A scheduler and any number of trainers, torn down with :meth:`close`."""

    def __init__(self, tmp: Path, config_text: str = "") -> None:
        self.tmp = tmp
        self.port = free_port()
        self.http_port = free_port()
        self.config_path = tmp / "scheduler_config.yaml"
        self.config_path.write_text(config_text or "heartbeat_interval: 0.5\nlease: 3\n")
        self.state_dir = tmp / "state"
        self.procs: list[Proc] = []
        self.scheduler: Proc | None = None
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_scheduler(self, *, host: str | None = "127.0.0.1") -> Proc:
        """The scheduler on ``host`` (None: its default, every address), once /health says ok.

        A first start whose port another process took since :func:`free_port` chose it starts
        again on other free ports (at most twice); a restart keeps its ports."""
        first = self.scheduler is None and not self.procs
        for tries_left in (2, 1, 0):
            try:
                return self._start_scheduler(host)
            except _PortTaken:
                if not first or not tries_left:
                    raise
                self.procs.clear()
                self.scheduler = None
                self.port, self.http_port = free_port(), free_port()
                self.channel.close()
                self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
                self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        raise AssertionError("unreachable")

    def _start_scheduler(self, host: str | None) -> Proc:
        p = Proc(
            scheduler_args(
                self.config_path, port=self.port, http_port=self.http_port, state_dir=self.state_dir, host=host
            ),
            self.tmp / "scheduler.log",
        )
        self.procs.append(p)
        self.scheduler = p
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if p.popen.poll() is not None:
                log = p.log_text()
                if "cannot listen on" in log and "in use" in log:
                    raise _PortTaken(f"scheduler exited: {log}")
                raise RuntimeError(f"scheduler exited: {log}")
            try:
                if self.health()["status"] == "ok":
                    return p
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"scheduler did not become healthy in {START_S} s: {p.log_text()}")

    def admin_key(self) -> str:
        """The admin key the scheduler wrote into its state folder on first start (auth on)."""
        return (self.state_dir / "admin.key").read_text().strip()

    def start_with_trainer(self, node_id: str = "node-a") -> Proc:
        """Start the scheduler and one trainer, and wait until the trainer is connected."""
        self.start_scheduler()
        trainer = self.start_trainer(node_id)
        self.wait_nodes(1)
        return trainer

    def health(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=2) as resp:
            return json.loads(resp.read())

    def start_trainer(self, node_id: str, *extra: str, url: str | None = None, private: bool = False) -> Proc:
        """A trainer with its work dir ``runs/<node_id>``. ``private``: in its own mount namespace
        (``unshare -m``, root only) with empty tmpfs over ``runs/`` and the scheduler's state dir,
        so it shares no path with the scheduler or any other trainer."""
        prefix: list[str] = []
        if private:
            hidden = [self.tmp / "runs", self.state_dir]
            for d in hidden:
                d.mkdir(parents=True, exist_ok=True)
            mounts = " && ".join(f"mount -t tmpfs -o size=2g tmpfs '{d}'" for d in hidden)
            prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$0" "$@"']
        p = trainer_proc(self.tmp, node_id, *extra, url=url or self.url, prefix=prefix)
        self.procs.append(p)
        return p

    def wait_nodes(self, n: int, timeout: float = START_S) -> list:
        """The connected nodes, once there are ``n`` (a fixed wait, :data:`START_S`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = [x for x in self.stub.ListNodes(scheduler_pb2.ListNodesRequest()).nodes if x.connected]
            if len(nodes) >= n:
                return nodes
            time.sleep(0.1)
        raise TimeoutError(f"{n} node(s) did not connect in {timeout} s")

    def get(self, task_id: str) -> common_pb2.Task:
        return self.stub.GetTask(scheduler_pb2.GetTaskRequest(task_id=task_id)).task

    def said_about(self, task_id: str) -> int:
        """Lines of the cluster's logs naming ``task_id`` (the trainers log their workers' lines:
        loading the model, each step, each checkpoint); grows while the task's work goes on,
        even while the scheduler is down or nothing reaches it yet."""
        return sum(p.mentions(task_id) for p in self.procs)

    def wait_state(
        self, task_id: str, states, what=None, *, stall: float = STALL_S, cap: float = CAP_S
    ) -> common_pb2.Task:
        """The task (as the scheduler reports it, no API key) once in one of ``states`` and, with
        ``what``, ``what(task)`` true. Waits while the task moves (:func:`task_fields`) or the
        cluster logs about it (:meth:`said_about`); ``TimeoutError`` after ``stall`` seconds of
        neither (:func:`tests.support.waiting.wait_progress`)."""
        states = set(states) if isinstance(states, (set, list, tuple)) else {states}
        seen: list = [None]

        def arrived() -> common_pb2.Task | None:
            try:
                seen[0] = task = self.get(task_id)
            except grpc.RpcError:
                return None  # the scheduler restarting, say: no news
            return task if task.state in states and (what is None or what(task)) else None

        names = sorted(common_pb2.TaskState.Name(x) for x in states)
        return wait_progress(
            arrived,
            lambda: (task_fields(seen[0]), self.said_about(task_id)),
            stall=stall,
            cap=cap,
            what=f"task {task_id} in {names}{' with the condition given' if what else ''}",
        )

    def wait_done(self, client, task_id: str, *, stall: float = STALL_S, cap: float = CAP_S):
        """``client.wait(task_id)`` (an ``RLClient``, with its API key and TLS) following progress
        as :meth:`wait_state` does: the final ``TaskInfo`` of a task that SUCCEEDED.

        Raises:
            TaskFailedError: it ended FAILED or CANCELLED. TimeoutError: no progress for ``stall`` s.
        """
        from opentinker_client import TaskFailedError
        from opentinker_client.errors import DeadlineExceededError, UnavailableError

        seen: list = [None]

        def ended():
            try:
                seen[0] = info = client.get_task(task_id)
            except (UnavailableError, DeadlineExceededError):
                return None
            return info if info.done else None

        info = wait_progress(
            ended,
            lambda: (task_fields(seen[0].proto if seen[0] else None), self.said_about(task_id)),
            stall=stall,
            cap=cap,
            what=f"task {task_id} ended",
        )
        if info.state != "succeeded":
            raise TaskFailedError(info)
        return info

    def close(self) -> None:
        self.channel.close()
        for p in self.procs:
            p.close()
