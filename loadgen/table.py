"""Plain-text tables for the reports: MindIE's `+---+` bordered grid and borderless aligned columns."""

from __future__ import annotations

from collections.abc import Sequence


def _widths(rows: Sequence[Sequence[str]]) -> list[int]:
    return [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]


def bordered_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """MindIE Benchmark's grid: `+---+` rules above and below the header and at the bottom, every cell
    right-aligned with one space either side (as its prettytable output prints them)."""
    every = [list(header), *(list(row) for row in rows)]
    if any(len(row) != len(header) for row in every):
        raise ValueError("every row needs one cell per column")
    widths = _widths(every)
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(cells: Sequence[str]) -> str:
        return "|" + "|".join(f" {cell:>{w}} " for cell, w in zip(cells, widths, strict=True)) + "|"

    return "\n".join([rule, line(header), rule, *(line(row) for row in rows), rule])


def aligned_columns(rows: Sequence[Sequence[str]], gap: int = 2) -> str:
    """Borderless columns: the first left-aligned (labels), the others right-aligned (numbers)."""
    if not rows:
        return ""
    widths = _widths(rows)
    lines = []
    for row in rows:
        cells = [f"{row[0]:<{widths[0]}}", *(f"{cell:>{w}}" for cell, w in zip(row[1:], widths[1:], strict=True))]
        lines.append((" " * gap).join(cells).rstrip())
    return "\n".join(lines)
