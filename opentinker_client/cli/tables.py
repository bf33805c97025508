"""Tables that fit the terminal with every value whole (``list``, ``nodes``, ``usage``, ``queues``,
``keys``): ids, names and numbers are never cut, folded or wrapped mid-value; columns that do not
fit move, in a given order, onto a line under each row. Cells are rich markup without emoji
shortcodes: ``:smile:`` in a task name stays text."""

from __future__ import annotations

__all__ = ["WRAP_MIN", "fit_columns", "pack", "print_fitted"]

#: The narrowest a wrapping column is counted at when fitting the table.
WRAP_MIN = 20


def fit_columns(
    widths: dict[str, int],
    width: int,
    columns: tuple[tuple[str, bool], ...],
    move_order: tuple[str, ...],
) -> list[str]:
    """The ``columns`` headers that stay in the table in ``width`` cells, given each column's
    widest cell (header included): all when they fit with the non-wrapping ones whole, else fewer
    (``move_order``); the others go to a line under each row, so every value is shown (a column
    not in ``move_order`` always stays in the table: for ``list``, TASK ID, STATE, ATTEMPT, GPUS)."""
    shown = [name for name, _ in columns]
    wraps = dict(columns)

    def need() -> int:
        return sum(min(widths[c], WRAP_MIN) if wraps[c] else widths[c] for c in shown) + 2 * len(shown)

    for name in move_order:
        if need() <= width:
            break
        shown.remove(name)
    return shown


def print_fitted(
    console,
    columns: tuple[tuple[str, bool], ...],
    rows: list[tuple[str, ...]],
    move_order: tuple[str, ...],
    *,
    title: str = "",
    unlabelled: frozenset[str] = frozenset(),
) -> None:
    """Print ``rows`` (rich markup cells, one per ``columns`` header: ``(header, may wrap)``) as a
    table that fits ``console.width``: no value is cut or folded mid-word. A narrow terminal moves
    columns out of the table in ``move_order`` (:func:`fit_columns`) onto a line under each row
    (``"node n1  created 12-02 01:53 <reason>"``), wrapped at words; a column in ``unlabelled``
    goes there as its words alone (a reason), the others as ``"header value"``."""
    from rich.padding import Padding
    from rich.segment import Segment, Segments
    from rich.table import Table
    from rich.text import Text

    if title:
        console.print(title, style="italic")
    headers = [name for name, _ in columns]
    widths = {
        name: max([len(name)] + [Text.from_markup(row[i], emoji=False).cell_len for row in rows])
        for i, name in enumerate(headers)
    }
    shown = fit_columns(widths, console.width, columns, move_order)
    moved = [i for i, name in enumerate(headers) if name not in shown]
    table = Table(box=None, header_style="bold")
    for name, wraps in columns:
        if name in shown:
            # no_wrap: never broken over lines (rich shrinks the wrapping columns first); a
            # wrapping column wraps at spaces and folds only a word longer than its column.
            table.add_column(name, no_wrap=not wraps, overflow="fold" if wraps else "ellipsis")
    keep = [headers.index(name) for name in shown]
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    if not moved:
        console.print(table)
        return
    # The columns that did not fit go on a line under each row, wrapped at words, so no value is
    # left out. The table left has no wrapping column (those move first), so each row is one line.
    lines = console.render_lines(table, console.options, pad=False)
    console.print(Segments([*lines[0], Segment.line()]))
    for row, line in zip(rows, lines[1:]):
        console.print(Segments([*line, Segment.line()]))
        units = []  # "label value" pairs kept whole on a line, then the words of an unlabelled one
        for i in moved:
            words = row[i].split()
            if not words:  # an empty cell (no notes) says nothing
                continue
            if headers[i] in unlabelled:
                units += [(w, " ") for w in words]
            elif columns[i][1]:  # a wrapping value (notes) breaks between its words, never inside one
                units += [(f"{headers[i].lower()} {words[0]}", " "), *((w, " ") for w in words[1:])]
                units[-1] = (units[-1][0], "  ")
            else:
                units.append((f"{headers[i].lower()} {row[i]}", "  "))
        for text in pack(units, console.width - 3):
            console.print(Padding(Text.from_markup(text, emoji=False), (0, 0, 0, 3)), no_wrap=True, overflow="fold")


def pack(units: list[tuple[str, str]], width: int) -> list[str]:
    """Lines of at most ``width`` cells from ``units`` (``(markup, separator before the next)``),
    each kept whole on one line (one longer than ``width`` gets a line of its own)."""
    from rich.text import Text

    lines: list[str] = []
    line, used, sep = "", 0, ""
    for unit, after in units:
        cells = Text.from_markup(unit, emoji=False).cell_len
        if line and used + len(sep) + cells > width:
            lines.append(line)
            line, used, sep = "", 0, ""
        line, used, sep = line + sep + unit, used + len(sep) + cells, after
    if line:
        lines.append(line)
    return lines
