"""The width of the ``opentinker`` command's output: ``$COLUMNS`` when set (also on a pipe), else
160 columns off a terminal; a ``$COLUMNS`` that is not a positive whole number is ignored."""

from __future__ import annotations

import io

import pytest

from opentinker_client.cli.commands import PIPE_COLUMNS, _console


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    "columns, tty, width",
    [
        ("100", False, 100),  # a pipe: COLUMNS=100 opentinker list | less
        ("300", False, 300),
        (None, False, PIPE_COLUMNS),
        ("", False, PIPE_COLUMNS),
        ("wide", False, PIPE_COLUMNS),
        ("0", False, PIPE_COLUMNS),
        ("-5", False, PIPE_COLUMNS),
        ("90", True, 90),
    ],
)
def test_output_width_follows_columns(monkeypatch, columns, tty, width) -> None:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    stream = _Tty() if tty else io.StringIO()
    monkeypatch.setattr("sys.stdout", stream)
    console = _console()
    assert console.width == width
    console.print("x" * (width + 20))
    assert max(len(line) for line in stream.getvalue().splitlines()) == width
