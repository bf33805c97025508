"""The CLI against a real scheduler with auth on shows server-provided text (task names, cancel
reasons, errors, event messages, key descriptions, table cells) with control characters escaped:
an ESC sequence cannot retitle or recolour the admin's terminal and a newline cannot forge a row.
The task name, the cancel reason and the key description are written into the store as ones
stored before the scheduler refused control characters in them."""

from __future__ import annotations

import json
import logging

import pytest

from opentinker.common.v1 import common_pb2
from opentinker_client import RLClient
from opentinker_client.cli.commands import main
from opentinker_client.cli.render import SafeLogText, markup, safe_text

from tests.support.security import LoopbackScheduler

EVIL_NAME = "\x1b]0;PWNED\x07\x1b[31mRED\x1b[0m\nforged-row | running"
EVIL_REASON = "\x1b[2Jcleared\nforged line \u202eevil"
RAW = ("\x1b", "\x07", "\u202e")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LoopbackScheduler(tmp_path_factory.mktemp("cli") / "state", "auth: {enabled: true}\n") as s:
        with RLClient(s.target, api_key=s.admin_key) as root:
            _, alice = root.keys.create("alice", "user", description="laptop")
        with RLClient(s.target, api_key=alice) as c:
            task_id = c.submit_task(workload_type="lora_finetune", model="org/m", name="clean")
            c.cancel(task_id, reason="clean")

        def tamper() -> None:  # as a task, a cancel and a key stored before such text was refused
            from opentinker.common.v1 import common_pb2 as C
            from opentinker_scheduler.state.store import cancel_error

            row = s.core.api.get(task_id)
            row.spec.name = EVIL_NAME
            row.error = cancel_error(EVIL_REASON)
            db = s.core.store.db
            seq, payload = db.execute(
                "SELECT seq, payload FROM events WHERE task_id=? AND kind='state' ORDER BY seq DESC LIMIT 1", (task_id,)
            ).fetchone()
            event = C.TaskEvent.FromString(payload)
            event.state_change.message = EVIL_REASON
            with s.core.store._tx():
                db.execute(
                    "UPDATE tasks SET spec=?, error=? WHERE task_id=?",
                    (row.spec.SerializeToString(), row.error, task_id),
                )
                db.execute(
                    "UPDATE events SET payload=? WHERE task_id=? AND seq=?", (event.SerializeToString(), task_id, seq)
                )
                db.execute("UPDATE api_keys SET description=? WHERE owner='alice'", ("laptop \x1b[31m[bold]x[/bold]",))

        s.do(tamper)
        yield s, alice, task_id


def _cli(capsys, s, key, *argv) -> tuple[int, str]:
    code = main(["--scheduler-url", s.target, "--api-key", key, *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def _assert_safe(text: str) -> None:
    assert not [c for c in RAW if c in text], repr(text)
    assert not any(line.lstrip().startswith(("forged", "cleared")) for line in text.splitlines()), text


def test_list_get_and_logs_escape_names_reasons_and_messages(cluster, capsys) -> None:
    s, alice, task_id = cluster
    code, text = _cli(capsys, s, alice, "list")
    assert code == 0
    _assert_safe(text)
    assert "\\x1b]0;PWNED\\x07" in text and "\\nforged-row" in text  # the NAME cell folds over lines
    rows = [line for line in text.splitlines() if task_id in line]
    assert len(rows) == 1  # the newline in the name forged no row

    code, text = _cli(capsys, s, alice, "get", task_id)
    assert code == 0
    _assert_safe(text)
    flat = " ".join(text.replace("\n", "").split())
    assert "cancelled by user: \\x1b[2Jcleared\\nforged line \\u202eevil" in flat  # the row "cancelled  by user: ..."

    code, text = _cli(capsys, s, alice, "get", task_id, "--json")
    assert code == 0
    _assert_safe(text)
    assert json.loads(text)["name"] == EVIL_NAME  # JSON escapes, and keeps the value exact

    code, text = _cli(capsys, s, alice, "logs", task_id)
    assert code == 0
    _assert_safe(text)
    assert "\\x1b[2Jcleared\\nforged line" in text


def test_errors_and_key_listings_escape_too(cluster, capsys) -> None:
    s, alice, _ = cluster
    code, text = _cli(capsys, s, alice, "get", "task-\x1b[31mnope")
    assert code == 2
    _assert_safe(text)
    assert text.startswith("error: ") and text.rstrip().endswith("[NOT_FOUND]") and len(text.strip().splitlines()) == 1

    code, text = _cli(capsys, s, s.admin_key, "keys", "list", "--owner", "alice")
    assert code == 0
    _assert_safe(text)
    assert "laptop \\x1b[31m[bold]x[/bold]" in text  # markup shown as text, not applied


def test_the_one_helper_escapes_every_control_character() -> None:
    assert safe_text("plain text, ünïcode ✓") == "plain text, ünïcode ✓"
    assert safe_text("a\x1bb\x07c\nd\te\x7ff\x9bg\u202eh\u2028i") == "a\\x1bb\\x07c\\nd\\te\\x7ff\\x9bg\\u202eh\\u2028i"
    assert markup("[red]x\x1b[/red]") == "\\[red]x\\x1b\\[/red]"
    assert safe_text(common_pb2.TASK_STATE_RUNNING) == "3"  # not a string: str() first
    record = logging.LogRecord("opentinker_client", logging.WARNING, "", 0, "pending: %s", ("\x1b[31mno node",), None)
    assert SafeLogText().filter(record) and record.getMessage() == "pending: \\x1b[31mno node"


def test_list_get_and_compare_show_colons_in_names_as_written_not_as_emoji(cluster, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # wide enough that no table folds the name
    s, alice, _ = cluster
    name = "a:train:b :smile:"  # the gateway names its tasks `tinker ses-...:train:0`
    with RLClient(s.target, api_key=alice) as c:
        task_id = c.submit_task(workload_type="lora_finetune", model="org/m", name=name)
    for argv in (["list"], ["get", task_id], ["compare", task_id]):
        code, text = _cli(capsys, s, alice, *argv)
        assert code == 0, argv
        assert "\U0001f60a" not in text and "\U0001f604" not in text and "\U0001f68b" not in text, (argv, text)
        assert name in text, (argv, text)
