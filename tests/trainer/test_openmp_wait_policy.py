"""Workers and model hosts start with OpenMP's passive wait policy: their OpenMP threads sleep
between parallel ops instead of spinning, so on a node with every core busy a task's ops do not
wait for a spinning neighbour's time slice. An operator's own ``OMP_WAIT_POLICY`` is kept."""

from __future__ import annotations

import subprocess
import sys

from opentinker_trainer.agent import AgentConfig, NodeAgent
from opentinker_trainer.process_env import WORKER


def _child_env(tmp_path, monkeypatch, policy: str | None) -> dict[str, str]:
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    agent = NodeAgent(AgentConfig(target="127.0.0.1:1", node_id="n1", work_dir=tmp_path))
    return agent._child_env([], WORKER)


def test_a_worker_starts_with_openmp_threads_that_sleep_while_waiting(tmp_path, monkeypatch) -> None:
    env = _child_env(tmp_path, monkeypatch, None)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    # The child's OpenMP runtime reads it at start: a process started with it sees it.
    seen = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ['OMP_WAIT_POLICY'])"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert seen == "PASSIVE"


def test_the_operators_wait_policy_is_kept(tmp_path, monkeypatch) -> None:
    assert _child_env(tmp_path, monkeypatch, "ACTIVE")["OMP_WAIT_POLICY"] == "ACTIVE"
