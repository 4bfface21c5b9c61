"""Plain-text tables and JSON result files for the benchmarks."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell: text columns left-aligned, the others right-aligned.

    A column is text when every value in it is a string (numbers and ``None``, shown as ``-``, go right).
    """
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, expected {len(headers)}")
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    text = [bool(rows) and all(isinstance(row[i], str) for row in rows) for i in range(len(headers))]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [c.ljust(w) if left else c.rjust(w) for c, w, left in zip(row, widths, text, strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base`` to three decimals; None when either is missing or ``base`` is zero."""
    return None if value is None or not base else round(value / base, 3)


def format_ratio(value: float | None) -> str | None:
    """A ratio as ``1.23x`` (None stays None, shown as ``-`` in a table)."""
    return None if value is None else f"{value:.2f}x"


def write_json(path: str | Path, data: dict) -> None:
    """Write ``data`` as indented JSON, creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def publish(result: dict, out: str | None, table: Callable[[dict], str]) -> None:
    """Write ``result`` as JSON to ``out`` when one is given, then print its table on stdout."""
    if out:
        write_json(out, result)
        progress(f"wrote {out}")
    print(table(result))


def progress(message: str) -> None:
    """One progress line on stderr, so stdout keeps only the results."""
    print(message, file=sys.stderr, flush=True)
