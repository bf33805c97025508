"""``python -m opentinker_trainer``: bad options and bad environment values give a one-line
argparse-style error and exit 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from opentinker_trainer.__main__ import main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV_VARS = ("SCHEDULER_URL", "NODE_ID", "MAX_TASKS", "OPENTINKER_WORK_DIR")


def run_trainer(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    return subprocess.run(
        [sys.executable, "-m", "opentinker_trainer", *args],
        env={**base, **env},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "args, env, message",
    [
        ((), {"MAX_TASKS": "abc"}, "error: environment variable MAX_TASKS: expected an integer >= 1, got 'abc'"),
        (
            (),
            {"SCHEDULER_URL": "ftp://host:1"},
            "error: environment variable SCHEDULER_URL: bad scheduler URL 'ftp://host:1'",
        ),
        (("--max-tasks", "abc"), {}, "error: argument --max-tasks: expected an integer >= 1, got 'abc'"),
    ],
)
def test_bad_value_exits_2_with_one_line(args, env, message):
    proc = run_trainer(*args, **env)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("opentinker-trainer: ") and message in last
    assert proc.stdout == ""


@pytest.fixture
def clean_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "args, env, message",
    [
        ((), {"MAX_TASKS": "0"}, "environment variable MAX_TASKS: expected an integer >= 1, got '0'"),
        ((), {"MAX_TASKS": "2.5"}, "environment variable MAX_TASKS: expected an integer >= 1, got '2.5'"),
        ((), {"SCHEDULER_URL": "http://:1"}, "environment variable SCHEDULER_URL: bad scheduler URL"),
        (("--scheduler-url", "nohost"), {}, "--scheduler-url: bad scheduler URL 'nohost'"),
        (("--max-tasks", "0"), {}, "argument --max-tasks: expected an integer >= 1, got '0'"),
        (("--simulate-gpus", "-1"), {}, "argument --simulate-gpus: expected an integer >= 0, got '-1'"),
        (("--kill-grace", "nan"), {}, "argument --kill-grace: expected a number of seconds >= 0, got 'nan'"),
        (("--kill-grace", "soon"), {}, "argument --kill-grace: expected a number of seconds >= 0, got 'soon'"),
        (("--node-id", " "), {}, "--node-id: expected a non-empty node id"),
    ],
)
def test_bad_values_in_process(clean_env, capsys, args, env, message):
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"opentinker-trainer: error: {message}" in err


def test_option_overrides_bad_env(clean_env, monkeypatch):
    """A valid --max-tasks wins over a bad MAX_TASKS (which is then never read); an empty
    variable counts as unset."""
    import opentinker_trainer.__main__ as entry

    seen = {}

    class Stop(Exception):
        pass

    def fake_agent(config):
        seen["config"] = config
        raise Stop

    monkeypatch.setattr(entry, "NodeAgent", fake_agent)
    clean_env.setenv("MAX_TASKS", "abc")
    with pytest.raises(Stop):
        main(["--max-tasks", "3", "--scheduler-url", "localhost:1"])
    assert seen["config"].max_tasks == 3
    clean_env.setenv("MAX_TASKS", "")
    with pytest.raises(Stop):
        main(["--scheduler-url", "localhost:1"])
    assert seen["config"].max_tasks == 4
    clean_env.setenv("MAX_TASKS", "7")
    with pytest.raises(Stop):
        main(["--scheduler-url", "localhost:1"])
    assert seen["config"].max_tasks == 7


def test_the_cli_and_the_trainer_never_print_the_password_of_a_url(capsys, tmp_path):
    from opentinker_client.cli.commands import main as cli_main

    assert cli_main(["--scheduler-url", "https://alice:hunter2@host:1", "list"]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and "alice" not in err and "https://***@host:1" in err, err
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENTINKER_", "SCHEDULER_URL"))}
    env["SCHEDULER_URL"] = "https://alice:hunter2@host:1"
    r = subprocess.run(
        [sys.executable, "-m", "opentinker_trainer", "--work-dir", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert r.returncode == 2 and "hunter2" not in r.stderr and "alice" not in r.stderr, r.stderr
    assert "environment variable SCHEDULER_URL: bad scheduler URL 'https://***@host:1'" in r.stderr
