"""Refusals a newcomer ran into: each is a clear error before any work starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from opentinker_client import InvalidArgumentError, RLClient


def test_evaluate_bounds_episodes() -> None:
    from opentinker_client.evaluate import MAX_EPISODES, evaluate

    for bad in (0, -5, MAX_EPISODES + 1, 99_999_999_999):
        with pytest.raises(InvalidArgumentError, match=r"episodes: expected an integer in \[1, 10000\]"):
            evaluate(object(), episodes=bad)


def test_upload_dataset_of_a_folder_says_so(tmp_path) -> None:
    with RLClient("127.0.0.1:1", min_poll_interval=0) as client:  # refused before any call
        with pytest.raises(IsADirectoryError, match="is a folder"):
            client.upload_dataset(tmp_path)


def test_plot_needs_an_existing_folder_and_writes_an_ordinary_file(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from opentinker_client.cli.plot import plot_history

    history = [(1, {"reward": 0.1, "loss": 1.0}), (2, {"reward": 0.5, "loss": 0.5})]
    with pytest.raises(FileNotFoundError, match="no such folder"):
        plot_history(history, tmp_path / "missing" / "x.png")
    assert not (tmp_path / "missing").exists()
    out = tmp_path / "x.png"
    plot_history(history, out)
    umask = os.umask(0)
    os.umask(umask)
    assert (os.stat(out).st_mode & 0o777) == (0o666 & ~umask)


def test_scheduler_refuses_bad_ports_and_a_file_as_state_dir(tmp_path) -> None:
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "opentinker_scheduler", *a], capture_output=True, text=True, timeout=60
    )  # noqa: E731
    r = run("--port", "99999")
    assert r.returncode == 2 and "expected a port number 0-65535, got 99999" in r.stderr
    state = tmp_path / "file"
    state.write_text("x")
    r = run("--state-dir", str(state), "--port", "0", "--http-port", "0")
    assert r.returncode != 0 and f"state_dir {state}: not a folder" in (r.stderr + r.stdout)


def test_client_hosted_environment_needs_both_reset_and_step() -> None:
    from opentinker_client import Environment
    from opentinker_client.environment import client_env_config

    class OnlyReset(Environment):
        def reset(self, seed=None):
            return 0

    env = OnlyReset(action_space=2, observation_space=3)
    assert env.is_client_hosted
    with pytest.raises(
        InvalidArgumentError, match=r"defines both reset\(\) and step\(\); OnlyReset does not define step\(\)"
    ):
        client_env_config(env, endpoint="127.0.0.1:5000")


def test_client_only_options_on_a_built_in_environment_say_what_to_do() -> None:
    from opentinker_client import Environment

    with pytest.raises(
        InvalidArgumentError, match=r"only client-hosted environments take action_names: subclass Environment"
    ) as err:
        Environment(action_names=["left", "right"]).to_dict()
    assert err.value.field == "spec.env_config.action_names"
    with pytest.raises(InvalidArgumentError, match="timeout_s"):
        Environment(env_id="CartPole-v1", timeout_s=3).to_dict()
    assert Environment(env_id="CartPole-v1", seed=3).to_dict() == {"env_id": "CartPole-v1", "seed": 3}


def test_empty_env_id_is_refused_but_a_missing_one_is_arithmetic() -> None:
    from opentinker_client import Environment
    from opentinker_common.spec import SpecError, validate_env_config

    with pytest.raises(
        InvalidArgumentError,
        match=r"spec.env_config.env_id: expected an environment id.*leave env_id out for arithmetic",
    ) as err:
        Environment(env_id="").to_dict()
    assert err.value.field == "spec.env_config.env_id"
    with pytest.raises(SpecError):
        validate_env_config({"env_id": ""})
    assert validate_env_config({}).env_id == "arithmetic"
    assert validate_env_config({"max_digits": 3}).env_id == "arithmetic"


def test_first_history_line_reads_submitted_not_unspecified() -> None:
    from opentinker_client.cli.commands import _state_line
    from opentinker_client.convert import TaskEvent

    first = TaskEvent(task_id="t", sequence=1, time=None, kind="state", from_state="unspecified", to_state="pending")
    assert (
        "unspecified" not in _state_line(first)
        and "pending" in _state_line(first)
        and "submitted" in _state_line(first)
    )
    later = TaskEvent(
        task_id="t",
        sequence=2,
        time=None,
        kind="state",
        from_state="pending",
        to_state="assigned",
        attempt=1,
        node_id="n1",
    )
    assert _state_line(later).startswith("state ") and "-> " in _state_line(later) and "attempt 1" in _state_line(later)


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
        env = {**os.environ, "SCHEDULER_URL": sched.target, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "opentinker_client.cli.commands", "logs", task_id, "--follow"],
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
            assert proc.wait(timeout=20) == EXIT_INTERRUPTED
            assert "interrupted" in proc.stderr.read()
        finally:
            proc.kill()
    finally:
        sched.close()


def test_cli_never_prints_a_client_environment_token() -> None:
    from opentinker_client.cli.commands import _shown_env

    env = {
        "env_id": "client",
        "endpoint": "127.0.0.1:5000",
        "token": "s3cret-token-value-123456",
        "tls": True,
        "tls_root_certificates": "-----BEGIN CERTIFICATE-----\nxyz\n",
    }
    shown = _shown_env(env)
    assert "s3cret" not in repr(shown) and shown["token"] == "<redacted>"
    assert shown["tls_root_certificates"].startswith("<PEM, ") and shown["endpoint"] == env["endpoint"]
    assert env["token"] == "s3cret-token-value-123456"  # the task's own value is untouched
    assert _shown_env({"env_id": "arithmetic"}) == {"env_id": "arithmetic"}
