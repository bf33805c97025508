"""`opentinker logs | plot | export | watch | nodes` against a real scheduler and real trainer
processes on loopback (tasks on a tiny random Llama): the PNG opens, the SVG has one marker per
point, the TensorBoard event file reads back, logs are lines, watch draws a bar on a terminal and
lines off one, nodes shows per-GPU telemetry."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import Cluster
from tests.support.tty import run_on_tty as _run_on_tty

TINY_HP = {
    "steps": 4,
    "prompts_per_step": 2,
    "group_size": 2,
    "max_new_tokens": 4,
    "lora_rank": 4,
    "checkpoint_every": 2,
}


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
    env["COLUMNS"] = "200"
    return env


def run(url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "opentinker_client", "--scheduler-url", url, *args],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=timeout,
    )


def run_on_tty(url: str, *args: str, timeout: float = 60) -> tuple[int, str]:
    return _run_on_tty(["--scheduler-url", url, *args], env=cli_env(), timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def ran(tmp_path_factory, tiny_model_dir):
    """A real cluster (a CPU node and a node with 2 simulated GPUs) with one task that succeeded
    after 4 steps and one that failed at once (its model does not exist)."""
    from opentinker_client import RLClient, TaskFailedError

    cluster = Cluster(tmp_path_factory.mktemp("ops"))
    try:
        cluster.start_scheduler()
        cluster.start_trainer("cpu-node")
        cluster.start_trainer("sim-node", "--simulate-gpus", "2")
        cluster.wait_nodes(2)
        with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
            ok = client.submit_task(
                workload_type="lora_finetune",
                model=str(tiny_model_dir),
                gpu_count=0,
                hyperparameters=TINY_HP,
                name="ops-demo",
            )
            bad = client.submit_task(
                workload_type="lora_finetune", model="/no/such/model", gpu_count=0, hyperparameters=TINY_HP
            )
            for task_id in (ok, bad):
                try:
                    cluster.wait_done(client, task_id)
                except TaskFailedError:  # the bad one
                    pass
            assert client.get_task(ok).state == "succeeded"
            assert client.get_task(bad).state == "failed"
        yield cluster, ok, bad
    finally:
        cluster.close()


# --------------------------------------------------------------------------------------- plot


def test_plot_writes_a_png(ran, tmp_path) -> None:
    cluster, ok, _ = ran
    out = tmp_path / "curves.png"
    proc = run(cluster.url, "plot", ok, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote {out}: 4 reward point(s), 4 loss point(s) against step"
    from PIL import Image

    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (800, 520)  # 8 x 5.2 inches at 100 dpi
        assert len(img.convert("RGB").getcolors(1 << 20)) > 2  # something was drawn
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]  # no temporary file left


def test_plot_overlays_tasks_and_compare_tables_them(ran, tmp_path, capsys, monkeypatch) -> None:
    from opentinker_client.cli import commands

    cluster, ok, bad = ran
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "both.svg"
    argv = ["--scheduler-url", cluster.url, "plot", ok, bad, "--x", "time", "--smooth", "0.5", "-o", str(out)]
    assert commands.main(argv) == 0  # in process: the CLI's own code, without a Python start per call
    assert capsys.readouterr().out.strip() == f"wrote {out}: 4 reward point(s), 4 loss point(s) against time"
    assert 'id="curve-reward-0"' in out.read_text()  # the first task's curve; the failed one has none
    assert commands.main(["--scheduler-url", cluster.url, "compare", ok, bad]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    row = next(line for line in lines if ok in line and "succeeded" in line)
    assert "final reward" in text and "best loss" in text and " s " in row
    cells = [c.strip() for c in row.split("│")]
    assert "CPU-task s" in text and float(cells[cells.index("succeeded") + 4]) > 0  # a CPU task's usage
    assert any(line.split("│")[1].strip() == "model" for line in lines if line.count("│") >= 3)  # models differ


def test_plot_errors_are_one_line(ran, tmp_path) -> None:
    cluster, _, bad = ran
    one_line_error(run(cluster.url, "plot", bad, "-o", str(tmp_path / "x.png")), f"task {bad}: nothing to plot")
    one_line_error(run(cluster.url, "plot", "task-000000000000"), "NOT_FOUND")
    assert list(tmp_path.iterdir()) == []


def test_plot_without_matplotlib_says_which_extra(ran, tmp_path, monkeypatch, capsys) -> None:
    from opentinker_client.cli import commands

    cluster, ok, _ = ran
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    assert commands.main(["--scheduler-url", cluster.url, "plot", ok, "-o", str(tmp_path / "x.png")]) == 2
    assert "error: plotting needs matplotlib: pip install 'opentinker[plot]'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- export


def read_tfrecords(path: Path) -> list[bytes]:
    """Records of a TFRecord file, checking both masked CRC32C checksums of each."""
    from tensorboardX.crc32c import crc32c

    def masked(data: bytes) -> int:
        crc = crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    data = path.read_bytes()
    out, i = [], 0
    while i < len(data):
        header = data[i : i + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[i + 8 : i + 12])
        assert length_crc == masked(header)
        body = data[i + 12 : i + 12 + length]
        (body_crc,) = struct.unpack("<I", data[i + 12 + length : i + 16 + length])
        assert body_crc == masked(body)
        out.append(body)
        i += 16 + length
    return out


def test_export_tensorboard_event_file_reads_back(ran, tmp_path) -> None:
    from tensorboardX.proto import event_pb2

    from opentinker_client import RLClient

    cluster, ok, _ = ran
    proc = run(cluster.url, "export", ok, "--tensorboard", str(tmp_path / "tb"))
    assert proc.returncode == 0, proc.stderr
    assert f"to {tmp_path / 'tb' / ok}" in proc.stdout
    (event_file,) = (tmp_path / "tb" / ok).glob("events.out.tfevents.*")
    scalars: dict[str, dict[int, float]] = {}
    texts = []
    for record in read_tfrecords(event_file):
        ev = event_pb2.Event.FromString(record)
        for v in ev.summary.value:
            if v.HasField("simple_value"):
                scalars.setdefault(v.tag, {})[ev.step] = v.simple_value
            elif v.HasField("tensor"):
                texts.append(b"".join(v.tensor.string_val).decode())
    with RLClient(scheduler_url=cluster.url) as client:
        history = client.get_metric_history(ok)
    assert sorted(scalars["reward"]) == [1, 2, 3, 4] and sorted(scalars["loss"]) == [1, 2, 3, 4]
    for step, values in history:
        for key in ("loss", "reward", "perf/step_s"):
            assert scalars[key][step] == pytest.approx(values[key], rel=1e-6, abs=1e-6)
    assert f"wrote {sum(len(v) for v in scalars.values())} scalar(s) over 4 step(s)" in proc.stdout
    assert any('"workload_type": "lora_finetune"' in t and ok in t for t in texts)


def test_export_errors_are_one_line(ran, tmp_path) -> None:
    cluster, _, bad = ran
    one_line_error(run(cluster.url, "export", bad, "--tensorboard", str(tmp_path)), f"task {bad}: nothing to export")
    assert run(cluster.url, "export", bad).returncode == 2  # --tensorboard is required (argparse)


# --------------------------------------------------------------------------------------- logs


def test_logs_of_finished_tasks(ran) -> None:
    cluster, ok, bad = ran
    proc = run(cluster.url, "logs", ok)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "state pending -> assigned" in proc.stdout and "state running -> succeeded" in proc.stdout
    assert any(re.search(r"#\d+  checkpoint step 2: ", line) for line in lines)
    assert any("checkpoint step 4 (final): " in line for line in lines)
    assert "reward" not in proc.stdout  # metric lines only with --metrics
    # The model load is reported before the first step (a long first load is not silence).
    loading = next(i for i, line in enumerate(lines) if "loading model " in line)
    loaded = next(i for i, line in enumerate(lines) if re.search(r"model loaded .* in \d+\.\d s \(attempt 1\)", line))
    assert loading < loaded < next(i for i, line in enumerate(lines) if "checkpoint step 2" in line)
    # Every event is accounted for: the steps not shown are summed up under their numbers.
    numbers = [(int(a), int(b or a)) for a, b in re.findall(r"  #(\d+)(?:-#(\d+))?  ", proc.stdout)]
    assert [n for a, b in numbers for n in range(a, b + 1)] == list(range(1, numbers[-1][1] + 1)), proc.stdout
    with_metrics = run(cluster.url, "logs", ok, "--metrics")
    assert [int(m) for m in re.findall(r"step (\d+)  reward", with_metrics.stdout)] == [1, 2, 3, 4]

    proc = run(cluster.url, "logs", bad)
    assert proc.returncode == 0, proc.stderr
    assert "-> failed" in proc.stdout and "/no/such/model" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("error: ")
    one_line_error(run(cluster.url, "logs", "task-000000000000"), "NOT_FOUND")


def test_logs_of_a_running_task_returns_without_follow(ran, tiny_model_dir) -> None:
    from opentinker_client import RLClient

    cluster, _, _ = ran
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = client.submit_task(
            workload_type="lora_finetune",
            model=str(tiny_model_dir),
            gpu_count=0,
            hyperparameters={**TINY_HP, "steps": 400, "checkpoint_every": 0},
        )
        cluster.wait_state(task_id, 3, what=lambda t: t.latest_step >= 1)  # RUNNING
        proc = run(cluster.url, "logs", task_id, timeout=30)  # returns: the task is still running
        assert proc.returncode == 0, proc.stderr
        assert "state assigned -> running" in proc.stdout and "succeeded" not in proc.stdout
        client.cancel(task_id, reason="test over")
        followed = run(cluster.url, "logs", task_id, "--follow", timeout=60)
        lines = followed.stdout.splitlines()
        at = next(i for i, line in enumerate(lines) if "-> cancelled" in line)
        # The worker checkpoints the step it finished on SIGTERM, after the CANCELLED event; logs
        # shows it, and the task's step is that checkpoint's step.
        assert any("checkpoint step" in line for line in lines[at + 1 :]), followed.stdout
        assert lines[-1] == "cancelled by user: test over", followed.stdout
        task = client.get_task(task_id)
        assert task.checkpoint_step >= 1 and task.latest_step == task.checkpoint_step, task


# ------------------------------------------------------------------------------- watch, nodes


def test_watch_bar_on_a_terminal_lines_off_one(ran) -> None:
    cluster, ok, _ = ran
    rc, out = run_on_tty(cluster.url, "watch", ok)
    assert rc == 0, out
    assert "━" in out and "4/4" in out and "ETA" in out  # the bar: step of total, ETA
    assert re.search(r"reward -?\d\.\d{3}  grad norm \d", out)  # GRPO: its first epoch's loss is 0
    assert "step 1/4  reward" not in out  # no per-step lines under the bar
    assert "running -> succeeded" in out and f"task {ok} succeeded after 4 steps" in out

    rc, plain = run_on_tty(cluster.url, "watch", ok, "--plain")
    assert rc == 0 and "━" not in plain
    assert [int(m) for m in re.findall(r"step (\d)/4  reward", plain)] == [1, 2, 3, 4]

    piped = run(cluster.url, "watch", ok)  # not a terminal: lines, no bar
    assert piped.returncode == 0 and "━" not in piped.stdout
    assert [int(m) for m in re.findall(r"step (\d)/4  reward", piped.stdout)] == [1, 2, 3, 4]


def test_nodes_table_shows_telemetry(ran) -> None:
    cluster, _, _ = ran
    proc = run(cluster.url, "nodes")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "cpu-node" in out and "sim-node" in out and "2/2 (simulated)" in out
    gpu_rows = [
        line.strip()
        for line in out.splitlines()
        if line.strip().startswith("sim-node") and "Simulated GPU (simulated)" in line
    ]
    assert len(gpu_rows) == 2
    for row in gpu_rows:
        assert "0%" in row and "0.0 GiB / 80.0 GiB" in row
        assert row.count("n/a (simulated device)") == 4  # temperature, power, SM clock, ECC: absent, with the reason
