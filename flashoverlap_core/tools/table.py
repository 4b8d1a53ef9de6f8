"""Plain-text tables, the one format every tool and benchmark prints."""
from __future__ import annotations


def format_table(rows, right: bool = False) -> list[str]:
    """The lines of a table whose first row is the header, underlined; cells are converted
    with ``str``. Columns are left-aligned (``right=True``: right-aligned, for numbers); a
    left-aligned last column is not padded."""
    cells = [[str(c) for c in row] for row in rows]
    cells.insert(1, ["-" * len(c) for c in cells[0]])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    if right:
        return ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
