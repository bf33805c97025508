"""The `opentinker` command, run in a subprocess (against the TEST DOUBLE where it needs a scheduler,
a real in-process scheduler for Ctrl-C during `logs --follow`)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from opentinker_client import RLClient

from tests.support.fake_scheduler import S, finished_task
from tests.support.procs import interruptible
from tests.support.waiting import wait_for


def run(*args, url=None, timeout=60):
    env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
    env["COLUMNS"] = "200"
    cmd = [sys.executable, "-m", "opentinker_client"]
    if url:
        cmd += ["--scheduler-url", url]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=env, timeout=timeout)


def one_line_error(proc, *needles):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


def test_help():
    proc = run("--help")
    assert proc.returncode == 0
    for word in ("submit", "watch", "list", "get", "cancel", "nodes", "--scheduler-url", "SCHEDULER_URL"):
        assert word in proc.stdout
    proc = run("submit", "--help")
    assert proc.returncode == 0 and "--watch" in proc.stdout


def test_console_script_installed():
    script = os.path.join(os.path.dirname(sys.executable), "opentinker")
    if not os.path.exists(script):
        pytest.skip("console script not installed in this environment")
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "submit" in proc.stdout


def test_bad_config_exits_2_with_one_line(tmp_path):
    path = tmp_path / "task.yaml"
    path.write_text("workload_type: lora_finetune\nhyperparameters:\n  steps: 15\n  lr: 0.1\n")
    line = one_line_error(run("submit", str(path)), "INVALID_ARGUMENT", f"{path}:4:3: hyperparameters.lr: unknown key")
    assert line.startswith(f"error: {path}:4:3: ") and line.endswith(" [INVALID_ARGUMENT]")
    path.write_text("workload_type: lora_finetun\n")
    one_line_error(run("submit", str(path)), f"{path}:1:1: workload_type: expected one of lora_finetune")


def test_missing_file_and_bad_url(tmp_path):
    one_line_error(run("submit", str(tmp_path / "nope.yaml")), "cannot read", "nope.yaml")
    one_line_error(
        run("--scheduler-url", "ftp://h:1", "list"), "unknown scheme"
    )  # (https:// means TLS: tests/scheduler/security/test_auth.py)
    one_line_error(run("--scheduler-url", "h", "list"), "port is missing")


def test_unreachable_scheduler(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one_line_error(run("get", "t1", url=f"127.0.0.1:{port}"), "UNAVAILABLE")


def test_submit_prints_the_task_id(fake, tmp_path):
    servicer, server = fake
    path = tmp_path / "task.yaml"
    path.write_text(
        textwrap.dedent("""\
        name: cli-demo
        workload_type: lora_finetune
        env: {env_id: arithmetic, max_digits: 2}
        hyperparameters: {steps: 3}
        """)
    )
    proc = run("submit", str(path), url=server.url)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "task-0001"
    assert servicer.submits[0].spec.name == "cli-demo"


def test_watch_success_and_failure(fake):
    servicer, server = fake
    ok = finished_task(servicer, steps=3)
    proc = run("watch", ok, url=server.url)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "step 1/15" in out or "step 1" in out
    assert "reward 0.100" in out and "loss 1.0000" in out
    assert "running -> succeeded" in out
    assert "checkpoint step 3 (final): /ckpt/final (peft_lora)" in out
    assert f"task {ok} succeeded after 3 steps" in out

    bad = finished_task(servicer, final=S.TASK_STATE_FAILED)
    proc = run("watch", bad, url=server.url)
    assert proc.returncode == 1, proc.stderr
    assert "running -> failed" in proc.stdout and "error: boom" in proc.stdout

    one_line_error(run("watch", "missing", url=server.url), "NOT_FOUND")


def test_watch_shows_total_steps_from_hyperparameters(fake):
    from opentinker.common.v1 import common_pb2
    from opentinker_client._convert import dict_to_struct

    servicer, server = fake
    spec = common_pb2.TaskSpec(workload_type="lora_finetune", hyperparameters=dict_to_struct({"steps": 2}))
    task_id = servicer.add_task(S.TASK_STATE_RUNNING, spec=spec).task_id
    servicer.add_metric(task_id, 1, 0.5, 0.25)
    servicer.add_state(task_id, S.TASK_STATE_SUCCEEDED)
    proc = run("watch", task_id, url=server.url)
    assert proc.returncode == 0 and "step 1/2  reward 0.250  loss 0.5000" in proc.stdout


def test_submit_watch(fake, tmp_path):
    import threading

    servicer, server = fake
    path = tmp_path / "task.yaml"
    path.write_text("workload_type: lora_finetune\nhyperparameters: {steps: 1}\n")

    def finish():  # the submitted task runs and succeeds while the CLI watches
        # The CLI process starting and submitting: a fixed wait, long for what it takes (about 1 s).
        wait_for(lambda: "task-0001" in servicer.tasks, timeout=60, what="the CLI submitted", interval=0.05)
        servicer.add_state("task-0001", S.TASK_STATE_RUNNING, reason="STARTED")
        servicer.add_metric("task-0001", 1, 0.1, 1.0)
        servicer.add_state("task-0001", S.TASK_STATE_SUCCEEDED, reason="COMPLETED")

    t = threading.Thread(target=finish)
    t.start()
    proc = run("submit", str(path), "--watch", url=server.url)
    t.join()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "task-0001"
    assert "step 1/1" in proc.stdout and "succeeded" in proc.stdout


def test_list_get_cancel(fake):
    servicer, server = fake
    pending = servicer.add_task(
        S.TASK_STATE_PENDING, pending_reason="no node has 4 free GPUs; largest free block is 2 on gpu-node-01"
    ).task_id
    running = servicer.add_task(S.TASK_STATE_RUNNING, node_id="gpu-node-01").task_id
    proc = run("list", url=server.url)
    assert proc.returncode == 0, proc.stderr
    assert pending in proc.stdout and running in proc.stdout
    assert "no node has 4 free GPUs; largest free block is 2 on gpu-node-01" in proc.stdout
    proc = run("list", "--state", "running", url=server.url)
    assert running in proc.stdout and pending not in proc.stdout
    assert run("list", "--state", "bogus", url=server.url).returncode == 2  # argparse refuses

    proc = run("get", pending, url=server.url)
    assert proc.returncode == 0 and "pending reason" in proc.stdout and "largest free block" in proc.stdout
    proc = run("get", pending, "--json", url=server.url)
    data = json.loads(proc.stdout)
    assert data["state"] == "pending" and data["pending_reason"].startswith("no node")

    proc = run("cancel", running, "--reason", "enough", url=server.url)
    assert proc.returncode == 0 and f"task {running} is cancelled" in proc.stdout
    proc = run("get", running, url=server.url)
    # A cancel is not an error: the row is "cancelled", its text who and why.
    assert "cancelled by user: enough" in " ".join(proc.stdout.split()) and "error" not in proc.stdout
    one_line_error(run("cancel", "missing", url=server.url), "NOT_FOUND")


def test_get_shows_the_environment_a_task_runs_when_it_named_none(fake):
    from opentinker.common.v1 import common_pb2

    servicer, server = fake
    spec = common_pb2.TaskSpec(workload_type="lora_finetune", model="m")  # no env_config: the default
    task = servicer.add_task(S.TASK_STATE_PENDING, spec=spec).task_id
    proc = run("get", task, url=server.url)
    env = next(line for line in proc.stdout.splitlines() if line.split()[:1] == ["env"])
    assert '"env_id": "arithmetic"' in env and "{}" not in env, proc.stdout


def test_list_keeps_task_ids_and_names_whole(fake):
    from opentinker.common.v1 import common_pb2

    from tests.support.tty import run_on_tty

    servicer, server = fake
    name = "arithmetic-lora-rank16-with-a-long-descriptive-name"
    reason = "no node has 4 free GPUs; largest free block is 2 on gpu-node-01 (queue position 3 of 7)"
    ids = [
        servicer.add_task(
            S.TASK_STATE_PENDING,
            task_id=f"task-1a2332c291bd4cf30a{i}",
            spec=common_pb2.TaskSpec(workload_type="lora_finetune", model="m", name=name),
            pending_reason=reason,
            node_id="gpu-node-01",
        ).task_id
        for i in range(2)
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
    for columns in (200, 120, 100, 80):
        if columns == 200:  # a pipe (off a terminal the CLI allows lines of 160 or COLUMNS)
            proc = run("list", url=server.url)
            assert proc.returncode == 0, proc.stderr
            out = proc.stdout
        else:  # a terminal this wide
            rc, out = run_on_tty(["--scheduler-url", server.url, "list"], env={**env, "COLUMNS": str(columns)})
            assert rc == 0, out
        lines = out.splitlines()
        for task_id in ids:
            (at,) = [n for n, line in enumerate(lines) if task_id in line]
            # whole, in its row or (a narrow terminal) on the line under it
            assert name in lines[at] or name in lines[at + 1], f"at {columns} columns the name was broken:\n{out}"
        assert all(len(line.rstrip()) <= columns for line in lines), out
        words = " ".join(lines).split()
        assert "position" in words and "gpu-node-01" in words, f"the reason wraps at words:\n{out}"
        assert {"ATTEMPT", "GPUS", "STATE"} <= set(lines[0].split()), f"at {columns} columns:\n{out}"
        # Every value is shown: what does not fit in the table goes on a line under its task.
        assert " ".join(out.split()).count(reason) == 2, f"at {columns} columns:\n{out}"
        assert "left out" not in out


def shown_sequences(out: str) -> list[int]:
    """The event numbers `opentinker logs` printed (``#3`` and ranges ``#3-#5``), in order."""
    import re

    seqs: list[int] = []
    for first, last in re.findall(r"  #(\d+)(?:-#(\d+))?  ", out):
        seqs.extend(range(int(first), int(last or first) + 1))
    return seqs


def test_logs_numbers_never_skip(fake):
    servicer, server = fake
    task_id = finished_task(servicer, steps=3)  # 2 states, 3 steps, a checkpoint, the end: #1-#7
    proc = run("logs", task_id, url=server.url)
    assert proc.returncode == 0, proc.stderr
    assert shown_sequences(proc.stdout) == list(range(1, 8)), proc.stdout
    assert "#3-#5  3 training steps (1-3; --metrics shows each)" in proc.stdout
    assert "reward" not in proc.stdout
    proc = run("logs", task_id, "--metrics", url=server.url)
    assert shown_sequences(proc.stdout) == list(range(1, 8)), proc.stdout
    assert "training steps" not in proc.stdout


def _two_nodes() -> list:
    """A GPU node with telemetry and a model host, and a disconnected simulated one."""
    from opentinker.common.v1 import common_pb2
    from opentinker.scheduler.v1 import scheduler_pb2

    return [
        scheduler_pb2.Node(
            node_id="gpu-node-01",
            connected=True,
            gpu_count=2,
            gpus_free=1,
            max_tasks=8,
            running_task_ids=["t1"],
            model_hosts=[
                common_pb2.ModelHost(
                    model="SmolLM2-135M",
                    device_indices=[1],
                    task_ids=["t7", "t8"],
                    pid=4242,
                    max_tenants=8,
                    base_bytes_estimate=269_030_016,
                    tenant_bytes_estimate=2 * 29_491_200,
                )
            ],
            gpu_memory_estimates=[
                scheduler_pb2.GpuMemoryEstimate(index=1, booked_bytes=328_012_416, total_bytes=150 * 2**30)
            ],
            devices=[
                common_pb2.Device(index=0, name="NVIDIA H200", memory_total_bytes=150 * 2**30),
                common_pb2.Device(index=1, name="NVIDIA H200"),
            ],
            telemetry=[
                common_pb2.DeviceTelemetry(
                    index=0,
                    utilization_percent=87.0,
                    memory_used_bytes=40 * 2**30,
                    memory_total_bytes=150 * 2**30,
                    temperature_c=61.0,
                    sm_clock_mhz=1980,
                    unavailable={"power_w": "NotSupported"},
                )
            ],
        ),
        scheduler_pb2.Node(
            node_id="sim-node",
            connected=False,
            gpu_count=1,
            devices=[common_pb2.Device(index=0, name="sim", simulated=True)],
            notes=["simulated GPUs"],
        ),
    ]


def test_nodes(fake):
    servicer, server = fake
    proc = run("nodes", url=server.url)
    assert proc.returncode == 0 and "no nodes" in proc.stdout
    servicer.nodes = _two_nodes()
    proc = run("nodes", url=server.url)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "gpu-node-01" in out and "1/2" in out and "1/8" in out
    assert "87%" in out and "40.0 GiB / 150.0 GiB" in out and "61 C" in out and "1980 MHz" in out
    assert "n/a (NotSupported)" in out
    assert "simulated" in out
    host_row = next(line for line in out.splitlines() if "SmolLM2-135M" in line)  # the model hosts table
    assert "2/8" in host_row and "4242" in host_row and "t7 t8" in host_row and "gpu-node-01" in host_row
    # the scheduler's memory estimate: base once + both tenants, and what that books of GPU 1
    assert "257 MiB + 56 MiB (313 MiB of 150.0 GiB booked on GPU 1)" in " ".join(out.split())


def test_nodes_fit_a_narrow_terminal_with_every_value_whole(fake):
    from tests.support.tty import run_on_tty

    servicer, server = fake
    servicer.nodes = _two_nodes()
    env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
    for columns in (120, 80):
        rc, out = run_on_tty(["--scheduler-url", server.url, "nodes"], env={**env, "COLUMNS": str(columns)})
        assert rc == 0, out
        lines = out.splitlines()
        assert all(len(line.rstrip()) <= columns for line in lines), out
        # Ids, names and values are never cut, folded or wrapped mid-value; what does not fit in a
        # table goes on a line under its row.
        for value in ("gpu-node-01", "sim-node", "0/1 (simulated)", "NVIDIA H200", "40.0 GiB / 150.0 GiB"):
            assert any(value in line for line in lines), f"{value!r} at {columns} columns:\n{out}"
        for value in ("n/a (NotSupported)", "1980 MHz", "SmolLM2-135M", "simulated GPUs", "t7 t8", "4242"):
            assert any(value in line for line in lines), f"{value!r} at {columns} columns:\n{out}"
        assert "257 MiB + 56 MiB (313 MiB of 150.0 GiB booked on GPU 1)" in " ".join(out.split())
        assert "…" not in out, out
        for header in ("NODE", "GPUS FREE", "TASKS", "GPU", "UTIL", "TENANTS"):
            assert header in out


def test_ctrl_c_during_logs_follow_exits_promptly(tmp_path) -> None:
    """A real scheduler, a task that never starts, `opentinker logs --follow` interrupted."""
    import signal
    import time

    from opentinker_client.cli.commands import EXIT_INTERRUPTED

    from tests.support.security import LoopbackScheduler

    sched = LoopbackScheduler(tmp_path / "state")
    try:
        with RLClient(sched.target) as client:
            task_id = client.submit_task(workload_type="lora_finetune", model="/models/m")
        # PYTHONFAULTHANDLER: a CLI still running 20 s after the signal is sent SIGABRT, and its
        # threads' stacks go into the failure.
        env = {**os.environ, "SCHEDULER_URL": sched.target, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
        proc = subprocess.Popen(
            interruptible("opentinker_client.cli.commands", "logs", task_id, "--follow"),  # Ctrl-C as on a terminal
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = proc.stdout.readline()  # the first event arrived: the stream is open
            assert "pending" in line
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                masks = [ln for ln in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if ln.startswith("Sig")]
                proc.send_signal(signal.SIGABRT)
                _, err = proc.communicate(timeout=20)
                pytest.fail(f"the CLI did not exit within 20 s of SIGINT ({masks}); stderr and stacks:\n{err[-8000:]}")
            assert rc == EXIT_INTERRUPTED
            assert "interrupted" in proc.stderr.read()
        finally:
            proc.kill()
    finally:
        sched.close()


def test_ctrl_c_during_submit_watch_says_the_task_goes_on_and_how_to_cancel_it(tmp_path) -> None:
    """A real scheduler without trainers: `submit --watch` of a task that stays pending, then SIGINT."""
    import signal

    from opentinker_client.cli.commands import EXIT_INTERRUPTED

    from tests.support.security import LoopbackScheduler

    task_file = tmp_path / "task.yaml"
    task_file.write_text("workload_type: lora_finetune\nmodel: /models/m\n")
    sched = LoopbackScheduler(tmp_path / "state")
    try:
        env = {**os.environ, "SCHEDULER_URL": sched.target, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            interruptible("opentinker_client", "submit", str(task_file), "--watch"),  # Ctrl-C as on a terminal
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            task_id = proc.stdout.readline().strip()  # submitted: its id, then the watch
            assert proc.stdout.readline().startswith(f"task {task_id} ")  # the watch is on
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == EXIT_INTERRUPTED
            assert proc.stderr.read().strip().splitlines()[-1] == (
                f"interrupted: stopped watching; task {task_id} keeps running on the scheduler (opentinker watch "
                f"{task_id} follows it again, opentinker cancel {task_id} stops it)"
            )
        finally:
            proc.kill()
        assert sched.core.api.get(task_id).state == S.TASK_STATE_PENDING  # it goes on
    finally:
        sched.close()


def test_watch_attached_later_counts_from_the_start_and_estimates_slow_steps(fake):
    """A task started an hour ago, 5 minutes a step: lines say the ETA from those step times; on a
    terminal the bar's elapsed counts from the task's start, not from attaching."""
    import time

    from opentinker.common.v1 import common_pb2
    from opentinker_client._convert import dict_to_struct
    from tests.support.fake_scheduler import ts
    from tests.support.tty import run_on_tty

    servicer, server = fake
    now = int(time.time())
    spec = common_pb2.TaskSpec(workload_type="lora_finetune", hyperparameters=dict_to_struct({"steps": 10}))
    task_id = servicer.add_task(S.TASK_STATE_RUNNING, spec=spec, start_time=ts(now - 3600)).task_id
    servicer.add_metric(task_id, 1, 0.5, 0.25, at=now - 600, **{"perf/tokens_per_s": 0.19})
    servicer.add_metric(task_id, 2, 0.4, 0.30, at=now - 300)  # 300 s a step, 8 to go: ETA about 2100 s

    servicer.add_state(task_id, S.TASK_STATE_SUCCEEDED, at=now)  # (ends early: the watch returns)

    proc = run("watch", task_id, "--plain", url=server.url)
    assert proc.returncode == 0, proc.stderr
    (first,) = [x for x in proc.stdout.splitlines() if x.startswith("step 1/10")]
    assert "tok/s 0.19" in first  # not "tok/s 0"
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("step 2/10")]
    h, m, sec = (int(x) for x in line.rsplit("eta ", 1)[1].split(":"))
    assert 2000 <= h * 3600 + m * 60 + sec <= 2100  # (now - 300) + 8 * 300 s, read a moment later

    env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
    rc, out = run_on_tty(["--scheduler-url", server.url, "watch", task_id], env={**env, "COLUMNS": "200"})
    assert rc == 0 and "2/10" in out
    assert "1:00:00" in out  # elapsed from the task's start to its end, though attached just now


def test_watch_draws_a_bar_of_env_steps_for_full_rl(fake):
    from opentinker.common.v1 import common_pb2
    from opentinker_client._convert import dict_to_struct
    from tests.support.tty import run_on_tty

    servicer, server = fake
    hp = dict_to_struct({"total_timesteps": 4096})
    spec = common_pb2.TaskSpec(workload_type="full_rl", hyperparameters=hp)
    task_id = servicer.add_task(S.TASK_STATE_RUNNING, spec=spec).task_id
    servicer.add_metric(task_id, 1, 0.5, 10.0, env_steps=2048.0, **{"perf/env_steps_per_s": 512.0})
    servicer.add_metric(task_id, 2, 0.4, 20.0, env_steps=4096.0, **{"perf/env_steps_per_s": 530.0})
    servicer.add_state(task_id, S.TASK_STATE_SUCCEEDED)
    env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
    rc, out = run_on_tty(["--scheduler-url", server.url, "watch", task_id], env={**env, "COLUMNS": "200"})
    assert rc == 0 and "env steps" in out and "4096/4096" in out and "━" in out
    proc = run("watch", task_id, url=server.url)  # off a terminal: a line per update
    assert "step 2  env steps 4096/4096  reward 20.000" in proc.stdout and "env steps/s 530" in proc.stdout
