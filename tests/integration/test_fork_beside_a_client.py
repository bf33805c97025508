"""A process holding a live client (a call made, a watch open, an environment hosted) forks
safely: gymnasium's AsyncVectorEnv and torch's DataLoader with the fork context work, again and
again (:mod:`tests.support.fork_beside_client` runs in its own process, started without a fork)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.security import LoopbackScheduler

ITERATIONS = 20


def test_async_vector_env_and_data_loader_fork_beside_a_live_client(tmp_path) -> None:
    with LoopbackScheduler(tmp_path / "state") as sched:
        env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}  # the client's default
        proc = subprocess.run(
            [sys.executable, "-m", "tests.support.fork_beside_client", sched.target, str(ITERATIONS)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    done = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert proc.returncode == 0 and len(done) == ITERATIONS, (
        f"{len(done)} of {ITERATIONS} iterations worked (exit {proc.returncode}):\n"
        f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    )
