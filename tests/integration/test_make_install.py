"""`make install` (which `make scheduler`, `make trainer` and `make test` run first) installs into
the venv only when it is missing or its package set is out of date, and says why in one line.

The real Makefile runs under real `make` in a copy of the repository's install inputs; the venv's
python is a recording stand-in (FAKE: it logs its arguments instead of running pip), so nothing is
installed and no network is used."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    for name in ("Makefile", "pyproject.toml", "constraints.txt", "scripts/venv_stamp.py", "scripts/prepare_model.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    old = time.time() - 3600
    os.utime(tmp_path / "scripts/prepare_model.py", (old, old))
    return tmp_path


def _fake_venv(checkout: Path) -> Path:
    """FAKE venv python: records each call (``-m pip install ...``) in pip.log."""
    python = checkout / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$@" >> {checkout / "pip.log"}\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def _make_install(checkout: Path) -> tuple[str, list[str]]:
    log = checkout / "pip.log"
    log.unlink(missing_ok=True)
    proc = subprocess.run(
        ["make", "-s", "--no-print-directory", "install", f"PYTHON={sys.executable}", "MODEL_DIR=model"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    return proc.stdout, calls


def test_install_runs_only_when_the_package_set_is_out_of_date(checkout: Path) -> None:
    _fake_venv(checkout)
    out, calls = _make_install(checkout)  # a venv without a record of its install
    assert out.splitlines() == ["installing into .venv: no record of an install there (.venv/.installed is missing)"]
    assert any("pip install" in c and ".[scheduler,trainer,dev" in c for c in calls), calls

    # A newer pyproject.toml with the same content (a checkout, `touch`, an editor) changes nothing.
    future = time.time() + 60
    os.utime(checkout / "pyproject.toml", (future, future))
    os.utime(checkout / "constraints.txt", (future, future))
    out, calls = _make_install(checkout)
    assert (out, calls) == ("", []), "an unchanged package set was reinstalled"

    # A changed pin reinstalls, and says so in one line.
    with (checkout / "constraints.txt").open("a") as f:
        f.write("example-pin==1.0\n")
    out, calls = _make_install(checkout)
    assert out.splitlines() == [
        "installing into .venv: pyproject.toml or constraints.txt (or the install command) "
        "changed since its last install"
    ]
    assert any("pip install" in c for c in calls)
    out, calls = _make_install(checkout)
    assert (out, calls) == ("", [])


def test_install_creates_a_missing_venv_and_says_so(checkout: Path) -> None:
    fake_python = checkout / "python3"
    fake_python.write_text(
        "#!/bin/sh\n"
        '[ "$1" = "-m" ] && [ "$2" = "venv" ] || exec ' + sys.executable + ' "$@"\n'
        f'mkdir -p "$3/bin" && cp {checkout / "fake-venv-python"} "$3/bin/python"\n'
    )
    fake_python.chmod(0o755)
    (checkout / "fake-venv-python").write_text(f'#!/bin/sh\necho "$@" >> {checkout / "pip.log"}\n')
    (checkout / "fake-venv-python").chmod(0o755)
    proc = subprocess.run(
        ["make", "-s", "--no-print-directory", "install", f"PYTHON={fake_python}", "MODEL_DIR=model"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["installing into .venv: it has no bin/python yet (a new venv)"]
    assert (checkout / ".venv/.installed").is_file()
    assert "pip install" in (checkout / "pip.log").read_text()


def _trainer_node_id(*make_args: str) -> str:
    proc = subprocess.run(
        ["make", "-n", "-s", "--no-print-directory", "trainer", *make_args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if "-m opentinker_trainer" in line]
    return line.split("--node-id", 1)[1].split()[0]


def test_make_trainer_joins_as_the_pool_node_of_make_schedulers_config(tmp_path: Path) -> None:
    from opentinker_scheduler.config import load_config

    pool = [n.node_id for n in load_config(ROOT / "scheduler_config.yaml").resource_pool]
    # Not "not in resource_pool (joined dynamically)" in `opentinker nodes`: the pool's own node.
    assert _trainer_node_id() == pool[0]
    other = tmp_path / "cluster.yaml"
    other.write_text('resource_pool:\n  - node_id: "rack-2-node-7"  # quoted, with a comment\n    gpu_count: 8\n')
    assert _trainer_node_id(f"SCHEDULER_CONFIG={other}") == "rack-2-node-7"
    assert _trainer_node_id("NODE_ID=mine") == "mine"


def _make_line(target: str, module: str, *make_args: str) -> str:
    proc = subprocess.run(
        ["make", "-n", "-s", "--no-print-directory", target, *make_args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if f"-m {module}" in line]
    return line


def test_make_trainer_and_scheduler_pass_extra_flags_on() -> None:
    line = _make_line("trainer", "opentinker_trainer", "TRAINER_ARGS=--max-tasks 2 --simulate-gpus 4")
    assert line.endswith("--max-tasks 2 --simulate-gpus 4")
    line = _make_line("scheduler", "opentinker_scheduler", "SCHEDULER_ARGS=--host 0.0.0.0")
    assert line.endswith("--host 0.0.0.0")


def test_a_venv_stamped_by_the_older_makefile_is_not_reinstalled(checkout: Path) -> None:
    _fake_venv(checkout)
    (checkout / ".venv/.installed").touch()  # what `touch $@` left, newer than the inputs
    out, calls = _make_install(checkout)
    assert (out, calls) == ("", []), "an install that was current got redone"
    assert len((checkout / ".venv/.installed").read_text().split()[0]) == 64  # its hash is recorded now
    with (checkout / "pyproject.toml").open("a") as f:
        f.write("\n# changed\n")
    out, calls = _make_install(checkout)
    assert out.startswith("installing into .venv: pyproject.toml or constraints.txt") and calls
