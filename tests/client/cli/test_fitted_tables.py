"""``print_fitted`` on a narrow terminal: columns that do not fit go on a line under their row,
and a long value there (a node's notes) breaks between words, never inside one."""

from __future__ import annotations

import io

from rich.console import Console

from opentinker_client.cli.tables import print_fitted

COLUMNS = (("NODE", False), ("GPUS FREE", False), ("VERSION", False), ("NOTES", True))
MOVE_ORDER = ("NOTES", "VERSION")
NOTES = "4 SIMULATED GPU(s); the telemetry library is missing so utilisation and memory are unknown"


def _render(width: int) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False)
    print_fitted(console, COLUMNS, [("gpu-node-01", "4/4", "0.9.0", NOTES)], MOVE_ORDER)
    return out.getvalue().splitlines()


def test_long_notes_moved_under_the_row_break_between_words() -> None:
    lines = _render(40)
    assert lines[0].split() == ["NODE", "GPUS", "FREE", "VERSION"]  # NOTES moved out of the table
    under = [line.strip() for line in lines[2:]]
    assert len(under) > 1 and all(len(line) <= 40 for line in lines)
    assert " ".join(under) == "notes " + NOTES  # every word whole, in order, nothing left out
    assert under[0].startswith("notes 4 SIMULATED")  # the label stays with the first word


def test_notes_that_fit_stay_in_the_table() -> None:
    lines = _render(200)
    assert "NOTES" in lines[0] and NOTES in lines[1]
