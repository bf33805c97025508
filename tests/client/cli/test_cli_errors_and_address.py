"""The CLI in-process: where it finds the scheduler (``--scheduler-url`` before or after the
command, else ``$SCHEDULER_URL``), and how it words an error (the message first, the gRPC code
last in brackets, exit 2; a typo'd key in a task file gets a "did you mean" at its line and
column)."""

from __future__ import annotations

import pytest

from opentinker_client.cli.commands import build_parser, main


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_scheduler_url_works_before_or_after_the_command_and_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("SCHEDULER_URL", raising=False)
    assert build_parser().parse_args(["list"]).scheduler_url == "localhost:8888"
    assert build_parser().parse_args(["--scheduler-url", "a:1", "list"]).scheduler_url == "a:1"
    assert build_parser().parse_args(["list", "--scheduler-url", "b:2"]).scheduler_url == "b:2"
    assert build_parser().parse_args(["keys", "list", "--scheduler-url", "c:3"]).scheduler_url == "c:3"
    args = build_parser().parse_args(["get", "task-1", "--timeout", "5", "--api-key", "k"])
    assert (args.timeout, args.api_key, args.task_id) == (5.0, "k", "task-1")
    monkeypatch.setenv("SCHEDULER_URL", "http://env-host:9000")
    assert build_parser().parse_args(["list"]).scheduler_url == "http://env-host:9000"
    assert build_parser().parse_args(["list", "--scheduler-url", "d:4"]).scheduler_url == "d:4"


def test_help_says_where_the_scheduler_is_taken_from(capsys, monkeypatch) -> None:
    monkeypatch.delenv("SCHEDULER_URL", raising=False)
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--scheduler-url (before or after the command), else $SCHEDULER_URL, else localhost:8888" in text


def test_a_typod_top_level_key_gets_did_you_mean_at_its_line(capsys, tmp_path) -> None:
    path = tmp_path / "task.yaml"
    path.write_text("workload_type: lora_finetune\nenv: {env_id: arithmetic}\nhyperparamters:\n  steps: 3\n")
    code, err = _run(capsys, "submit", str(path))
    assert code == 2
    assert err.startswith(f"error: {path}:3:1: hyperparamters: unknown key, expected one of the known keys (")
    assert err.rstrip().endswith("; did you mean 'hyperparameters'? [INVALID_ARGUMENT]")


def test_a_typod_hyperparameter_gets_did_you_mean_at_its_line_and_column(capsys, tmp_path) -> None:
    path = tmp_path / "task.yaml"
    path.write_text("workload_type: lora_finetune\nenv: {env_id: arithmetic}\nhyperparameters:\n  stesp: 3\n")
    code, err = _run(capsys, "submit", str(path))
    assert code == 2
    assert err.startswith(f"error: {path}:4:3: hyperparameters.stesp: unknown key, expected one of the known keys (")
    assert err.rstrip().endswith("; did you mean 'steps'? [INVALID_ARGUMENT]")
    code, err = _run(capsys, "submit", str(path).replace("task.yaml", "none.yaml"))
    assert code == 2 and err.startswith("error: cannot read ")  # no status code: the message alone


def _dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_admin_commands_explain_an_unreachable_scheduler_as_every_other_command(capsys) -> None:
    port = _dead_port()
    for argv in (["list"], ["keys", "list"], ["queues", "reset", "team-a"]):
        code, err = _run(capsys, "--scheduler-url", f"127.0.0.1:{port}", *argv, "--timeout", "5")
        assert code == 2, argv
        expected = f"error: cannot reach the scheduler at 127.0.0.1:{port}: nothing is listening"
        assert err.startswith(expected), (argv, err)
        assert err.rstrip().endswith("[UNAVAILABLE]") and "failed to connect to all addresses" not in err


def test_a_timeout_against_a_dead_port_names_the_dead_port_not_only_the_deadline(capsys) -> None:
    port = _dead_port()
    code, err = _run(capsys, "--scheduler-url", f"127.0.0.1:{port}", "get", "task-x", "--timeout", "0.5")
    assert code == 2
    # gRPC keeps retrying the connection until the deadline (or gives up first, on a slow
    # machine); either way the error says why nothing answered.
    assert f"cannot reach the scheduler at 127.0.0.1:{port}: nothing is listening" in err, err
    if err.rstrip().endswith("[DEADLINE_EXCEEDED]"):
        assert err.startswith("error: no answer within the call's timeout: "), err
    else:
        assert err.rstrip().endswith("[UNAVAILABLE]"), err


def test_a_file_with_many_bad_lines_shows_the_first_twenty_errors_and_counts_the_rest(capsys, tmp_path) -> None:
    path = tmp_path / "passwd"  # not a task file: a line of `user: /home/user` per account
    path.write_text("".join(f"user{i}: /home/user{i}\n" for i in range(50)))
    code, err = _run(capsys, "submit", str(path))
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 21, err
    assert lines[0].startswith(f"error: {path}:1:1: user0: unknown key, expected one of the known keys (")
    assert lines[1].startswith(f"error: {path}:1:1: missing workload_type")
    assert lines[19].startswith(f"error: {path}:19:1: user18: unknown key")
    assert lines[20] == "error: ... and 31 more"


@pytest.mark.parametrize(
    ("first", "problem"),
    [
        ("workload_type: lora_finetuen", "workload_type: expected one of lora_finetune, "),
        ("workload_type: 3", "workload_type: expected one of lora_finetune, "),
        ("name: x", "missing workload_type (one of lora_finetune, "),
    ],
    ids=["unknown", "not-a-string", "missing"],
)
def test_a_bad_workload_type_still_reports_the_other_fields_and_says_what_went_unchecked(
    capsys, tmp_path, first, problem
) -> None:
    path = tmp_path / "task.yaml"
    path.write_text(
        f"{first}\nhyperparameters:\n  steps: ten\nenv: {{env_id: arithmetic, max_digits: x}}\ngpu_count: -1\n"
    )
    code, err = _run(capsys, "submit", str(path))
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 4, err
    assert lines[0].startswith(f"error: {path}:1:1: {problem}")
    assert lines[1] == (
        f"error: {path}:2:1: hyperparameters: not checked: the keys and values a workload takes depend on "
        "workload_type, which is not one of the known ones; fix workload_type to have them checked [INVALID_ARGUMENT]"
    )
    assert lines[2].startswith(f"error: {path}:4:27: env.max_digits: expected an integer in [1, 9], got 'x'")
    assert lines[3].startswith(f"error: {path}:5:1: gpu_count: expected an integer in [0, 1024]")
