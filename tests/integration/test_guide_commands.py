"""The deployment guide's commands, typed as it prints them, against real processes:
``python scheduler.py --config scheduler_config.yaml --port 8888`` (the guide's config, first as
printed, with its bullets and typographic quotes, then fixed), ``python train_server.py`` with
``SCHEDULER_URL``, ``curl http://scheduler-host:8888/health`` on the gRPC port, and the client
snippet. Only the port differs (a free one) and the host is loopback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import Proc, free_port_pair
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]

#: The guide's scheduler_config.yaml as printed.
GUIDE_CONFIG = """\
resource_pool:
• node_id: “gpu-node-01”
  gpu_count: 4
  max_tasks: 8

workload_types:

• type: “lora_finetune”
  priority: 1
• type: “full_rl”
  priority: 2
"""
#: The same, typed with ASCII list markers and quotes (what the refusal says to type).
FIXED_CONFIG = GUIDE_CONFIG.replace("•", "-").replace("“", '"').replace("”", '"')


@pytest.fixture
def guide_dir(tmp_path: Path) -> Path:
    """A folder laid out like the guide's: scheduler.py and train_server.py in the working folder."""
    for name in ("scheduler.py", "train_server.py"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _connected(client) -> list:
    """The connected nodes; none while the scheduler is still starting (not listening yet)."""
    from opentinker_client.errors import DeadlineExceededError, UnavailableError

    try:
        return [n for n in client.list_nodes() if n.connected]
    except (UnavailableError, DeadlineExceededError):
        return []


def test_the_guides_config_as_printed_is_refused_naming_the_bullet_and_what_to_type(guide_dir: Path) -> None:
    (guide_dir / "scheduler_config.yaml").write_text(GUIDE_CONFIG)
    r = subprocess.run(
        [sys.executable, "scheduler.py", "--config", "scheduler_config.yaml", "--port", str(free_port_pair())],
        cwd=guide_dir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    bullet = "'•' (U+2022 bullet) is not a YAML list marker; expected \"- \" (a hyphen, then a space)"
    assert r.stderr.strip().splitlines() == [  # every bullet of the guide's config, in one run
        f"error: scheduler_config.yaml:2:1: {bullet}",
        f"scheduler_config.yaml:8:1: {bullet}",
        f"scheduler_config.yaml:10:1: {bullet}",
    ]


def test_python_scheduler_py_and_train_server_py_run_a_cluster(guide_dir: Path) -> None:
    (guide_dir / "scheduler_config.yaml").write_text(FIXED_CONFIG)
    port = free_port_pair()
    procs = []
    try:
        sched = Proc(
            ["scheduler.py", "--config", "scheduler_config.yaml", "--port", str(port)],
            guide_dir / "scheduler.log",
            cwd=guide_dir,
        )
        procs.append(sched)
        # the guide's check, on the gRPC port; --retry-connrefused waits for the port to open
        retry = ["--retry", "100", "--retry-connrefused", "--retry-delay", "0"]
        health = subprocess.run(
            ["curl", "-sS", *retry, f"http://127.0.0.1:{port}/health"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert json.loads(health.stdout) == {"status": "ok"}, health.stderr + sched.log_text()
        trainer = Proc(
            ["train_server.py"],
            guide_dir / "trainer.log",
            env={"SCHEDULER_URL": f"http://127.0.0.1:{port}", "NODE_ID": "gpu-node-01"},
            cwd=guide_dir,
        )
        procs.append(trainer)
        from opentinker_client import RLClient

        with RLClient(scheduler_url=f"http://127.0.0.1:{port}") as client:
            nodes = wait_for(lambda: _connected(client), timeout=60, what="train_server.py connected")
        assert [n.node_id for n in nodes] == ["gpu-node-01"]
        assert (guide_dir / "state").is_dir()  # the config's folder: state_dir defaults to ./state
    finally:
        for p in procs:
            p.close()


def test_the_entry_points_accept_the_same_flags_as_the_modules() -> None:
    for script, module in (("scheduler.py", "opentinker_scheduler"), ("train_server.py", "opentinker_trainer")):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # from the checkout alone
        via_script = subprocess.run(
            [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
        )
        via_module = subprocess.run(
            [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert via_script.returncode == 0, via_script.stderr
        assert via_script.stdout.startswith(f"usage: {script} ")
        flags = set(re.findall(r"--[a-z][a-z0-9-]*", via_script.stdout))
        assert flags == set(re.findall(r"--[a-z][a-z0-9-]*", via_module.stdout))


#: The guide's client snippet as printed (only the scheduler's host differs).
GUIDE_CLIENT = """\
from opentinker import RLClient, Environment
# 定义环境交互逻辑
env = Environment(action_space=4, observation_space=100)
# 提交训练任务
client = RLClient(scheduler_url="http://scheduler-host:8888")
task_id = client.submit_task(
    env_config=env.to_dict(),
    workload_type="lora_finetune",
    gpu_count=1
)
# 监控训练进度
while not client.is_task_complete(task_id):
    metrics = client.get_metrics(task_id)
    print(f"Loss: {metrics['loss']:.4f}, Reward: {metrics['reward']:.2f}")
"""


def test_the_guides_client_snippet_says_why_its_task_waits_on_a_cluster_without_gpus(guide_dir: Path) -> None:
    """Its only trainer has no GPU and the task wants one: the loop prints NaN (no step yet) and the
    client warns, through logging, with the scheduler's pending reason."""
    # The repository's scheduler_config.yaml (the seed's form plus a default_model, which the
    # snippet needs: it names no model), with the model folder it names beside it.
    (guide_dir / "scheduler_config.yaml").write_text((ROOT / "scheduler_config.yaml").read_text())
    (guide_dir / ".cache").symlink_to(ROOT / ".cache")
    port = free_port_pair()
    url = f"http://127.0.0.1:{port}"
    (guide_dir / "snippet.py").write_text(GUIDE_CLIENT.replace("http://scheduler-host:8888", url))
    procs = []
    try:
        sched = Proc(
            ["scheduler.py", "--config", "scheduler_config.yaml", "--port", str(port)],
            guide_dir / "scheduler.log",
            cwd=guide_dir,
        )
        procs.append(sched)
        procs.append(Proc(["train_server.py"], guide_dir / "trainer.log", env={"SCHEDULER_URL": url}, cwd=guide_dir))
        from opentinker_client import RLClient

        with RLClient(scheduler_url=url) as client:
            wait_for(lambda: _connected(client), timeout=60, what="trainer connected")
        snippet = Proc(
            ["snippet.py"], guide_dir / "snippet.log", env={"OPENTINKER_PENDING_WARNING_AFTER": "2"}, cwd=guide_dir
        )
        procs.append(snippet)
        line = wait_for(
            lambda: next((x for x in snippet.log_text().splitlines() if "has been pending for" in x), None),
            timeout=60,
            what="the pending warning",
        )
        assert "Loss: nan, Reward: nan" in snippet.log_text()
        assert "has 1 GPU(s)" in line and "RLClient.pending_reason(task_id)" in line, line
        task_id = line.split("task ", 1)[1].split()[0]
        with RLClient(scheduler_url=url) as client:
            assert "has 1 GPU(s)" in client.pending_reason(task_id)
            assert client.get_task(task_id).state == "pending"
        assert snippet.log_text().count("has been pending for") == 1  # once, not every poll
    finally:
        for p in procs:
            p.close()
