"""How many torch intra-op threads a worker and a model host run with, as the node agent starts
them: the host, which holds the model for every tenant of the node, a thread per core; a worker,
one of up to ``max_tasks`` tasks, its share of the cores. The operator's ``OMP_NUM_THREADS``
is kept. ``scripts/bench_multitenant.py`` starts its processes with the same settings."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from opentinker_trainer.agent import AgentConfig, NodeAgent
from opentinker_trainer.process_env import HOST, WORKER, cpu_cores, process_env

REPO = Path(__file__).resolve().parents[2]
CPU_KEYS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "TOKENIZERS_PARALLELISM", "HF_HUB_DISABLE_PROGRESS_BARS")


def _agent_env(tmp_path, monkeypatch, role: str, max_tasks: int) -> dict[str, str]:
    agent = NodeAgent(AgentConfig(target="127.0.0.1:1", node_id="n1", work_dir=tmp_path, max_tasks=max_tasks))
    return agent._child_env([], role)


def _torch_threads(env: dict[str, str]) -> int:
    """What a process started with ``env`` runs with: torch's intra-op threads."""
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.strip())


@pytest.fixture
def no_operator_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)


def test_a_model_host_runs_a_thread_per_core(tmp_path, monkeypatch, no_operator_threads) -> None:
    env = _agent_env(tmp_path, monkeypatch, HOST, max_tasks=8)
    assert _torch_threads(env) == cpu_cores()


def test_a_worker_runs_its_share_of_the_cores(tmp_path, monkeypatch, no_operator_threads) -> None:
    cores = cpu_cores()
    # More tasks than cores: one thread each, not torch's default of a thread per core.
    assert _torch_threads(_agent_env(tmp_path, monkeypatch, WORKER, max_tasks=2 * cores)) == 1
    # The only task of its node: every core.
    assert _torch_threads(_agent_env(tmp_path, monkeypatch, WORKER, max_tasks=1)) == cores


def test_shares_of_the_cores() -> None:
    assert process_env({}, role=WORKER, max_tasks=4, cores=16)["OMP_NUM_THREADS"] == "4"
    assert process_env({}, role=WORKER, max_tasks=3, cores=16)["OMP_NUM_THREADS"] == "5"
    assert process_env({}, role=WORKER, max_tasks=32, cores=16)["OMP_NUM_THREADS"] == "1"
    assert process_env({}, role=HOST, max_tasks=32, cores=16)["OMP_NUM_THREADS"] == "16"
    with pytest.raises(ValueError, match="role: expected 'host' or 'worker', got 'gang'"):
        process_env({}, role="gang", max_tasks=1)


def test_the_operators_thread_count_is_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _agent_env(tmp_path, monkeypatch, HOST, max_tasks=1)["OMP_NUM_THREADS"] == "3"
    assert _agent_env(tmp_path, monkeypatch, WORKER, max_tasks=64)["OMP_NUM_THREADS"] == "3"


def test_the_multitenant_benchmark_starts_processes_as_the_agent_does(tmp_path, monkeypatch, no_operator_threads):
    spec = importlib.util.spec_from_file_location("bench_multitenant", REPO / "scripts" / "bench_multitenant.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for role in (HOST, WORKER):
        ours = bench.child_env(role, 8)
        agents = _agent_env(tmp_path, monkeypatch, role, max_tasks=8)
        assert {k: ours.get(k) for k in CPU_KEYS} == {k: agents[k] for k in CPU_KEYS}, role
