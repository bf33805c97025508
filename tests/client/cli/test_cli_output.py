"""What the CLI prints about a task, in-process: the first history line reads "submitted", and a
client-hosted environment's token and certificates are never shown."""

from __future__ import annotations


def test_the_first_history_line_reads_submitted_not_unspecified() -> None:
    from opentinker_client.cli.commands import _state_line
    from opentinker_client.types import TaskEvent

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


def test_the_cli_never_prints_a_client_environment_token() -> None:
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


def test_the_cli_never_prints_a_client_reward_token() -> None:
    from opentinker_client.cli.commands import _shown_env

    env = {
        "env_id": "prompts",
        "reward": {"verifier": "client", "endpoint": "h:1", "token": "s3cret-token-value-123456"},
    }
    shown = _shown_env(env)
    assert "s3cret" not in repr(shown) and shown["reward"]["token"] == "<redacted>"
    assert env["reward"]["token"] == "s3cret-token-value-123456"
