"""The Python examples run as their docstrings say, offline, against real scheduler and trainer
processes whose config names the real model as ``default_model``, as ``make scheduler`` does:
no ``--model``, no hub id, only the size flags a CPU try needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CONFIG = """heartbeat_interval: 0.5
lease: 3
default_model: {model}
workload_types:
  - type: lora_session
    priority: 3
  - type: lora_finetune
    priority: 1
"""
#: Each Python example with the flags of a quick CPU try; ``{data}`` is a folder of this run.
RUNS = {
    "own_loop_sft.py": ["--steps", "2", "--batch-size", "2"],
    "own_loop_rl.py": ["--steps", "1", "--problems", "2", "--group-size", "2"],
    "client_reward.py": ["--steps", "1", "--dataset", "{data}/word_problems.jsonl"],
}
#: What an example's docstring says to run first.
BEFORE = {
    "client_reward.py": [
        [sys.executable, "scripts/make_word_problems.py", "--out", "{data}/word_problems.jsonl", "-n", "300"]
    ],
}
#: A line each run prints once it trained.
TRAINED = {"own_loop_sft.py": "step 1:", "own_loop_rl.py": "step 1:", "client_reward.py": ": succeeded"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, real_model_dir: Path):
    from tests.support.procs import Cluster

    cluster = Cluster(tmp_path_factory.mktemp("examples"), CONFIG.format(model=real_model_dir))
    try:
        cluster.start_with_trainer()
        yield cluster
    finally:
        cluster.close()


def test_every_python_example_has_a_run_here() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py") if "def main(" in p.read_text()) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs_offline_on_the_schedulers_default_model(cluster, name: str, tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        argv = [a.format(data=tmp_path) for a in argv]
        out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
        assert out.returncode == 0, f"{argv} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
        return out

    for argv in BEFORE.get(name, []):
        run(argv)
    out = run([sys.executable, str(EXAMPLES / name), "--scheduler", cluster.url, *RUNS[name]])
    assert TRAINED[name] in out.stdout, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
