"""The rows of a prompt file, checked when it loads: every prompt (and, for training, every
reference answer) is text that is not missing, null, empty or only whitespace. A bad row is one
line naming the file, the row (and, in a JSONL file, its line) and the column, before anything
is trained: a row scored against the text "None" trains silently otherwise.

The checks run on the Arrow columns `datasets` loaded (no Python loop over the rows); a JSON
Lines file that does not parse is scanned once more, line by line, to name the first bad line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastdraft.errors import FastdraftError


def check_text_column(table: Any, file: Path, column: str, role: str) -> None:
    """table: a pyarrow Table; column: its name; role: "prompt" or "answer" (what it holds).
    Raises a FastdraftError naming the first bad row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = table.column(column)
    kind = values.type
    if pa.types.is_null(kind):   # no row has a value: the first row is the one to name
        raise bad_row(file, 0, column, role, "has none")
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        example = " (e.g. \"3\", not 3)" if pa.types.is_integer(kind) or pa.types.is_floating(
            kind) else ""
        found = _first_non_text_json_row(file, column)
        if found is not None:   # a JSON file: the row is named (its type is not the column's)
            row, value = found
            raise bad_row(file, row, column, role, f"is {json.dumps(value)}, not text (write "
                           f"it as a string, e.g. \"{value}\")")
        raise FastdraftError(
            f"{file}: column {column!r} ({role}) holds {kind} values, not text: write every "
            f"{role} as a string{example}" + _key_hint(role))
    if values.null_count:
        first = pc.index(pc.is_null(values), True).as_py()
        raise bad_row(file, first, column, role, "has none (missing or null)")
    blank = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(values)), 0)
    if pc.any(blank).as_py():
        first = pc.index(blank, True).as_py()
        empty = values[first].as_py() == ""
        raise bad_row(file, first, column, role, "is empty" if empty else "is only whitespace")


def first_bad_json_line(file: Path) -> str | None:
    """`line N: <why>` for the first line of a JSON Lines file that is not one JSON object;
    None when every line is (the reader failed for another reason)."""
    with file.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                return f"line {number}: {err.msg} (column {err.colno})"
            if not isinstance(value, dict):
                return f"line {number}: a JSON {type(value).__name__}, not an object"
    return None


def _first_non_text_json_row(file: Path, column: str) -> tuple[int, Any] | None:
    """(row, value) of the first row of a JSON Lines file whose `column` holds a value that is
    not a string (None: not a JSON Lines file, or no such row)."""
    if file.suffix.lower() != ".jsonl":
        return None
    row = -1
    with file.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not line.strip():
                continue
            row += 1
            try:
                value = json.loads(line).get(column)
            except (json.JSONDecodeError, AttributeError):
                return None
            if value is not None and not isinstance(value, str):
                return row, value
    return None


def jsonl_line_of_row(file: Path, row: int) -> int | None:
    """The line number (from 1) of row `row` in a JSON Lines file (blank lines hold no row)."""
    seen = -1
    with file.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            seen += bool(line.strip())
            if seen == row:
                return number
    return None


def bad_row(file: Path, row: int, column: str, role: str, what: str) -> FastdraftError:
    where = f"row {row}"
    if file.suffix.lower() == ".jsonl":
        line = jsonl_line_of_row(file, row)
        where += f" (line {line})" if line is not None else ""
    return FastdraftError(
        f"{file}: {where}: its {role} (column {column!r}) {what}: every row needs a non-empty "
        f"{role}; fix or drop the row" + _key_hint(role))


def _key_hint(role: str) -> str:
    return f" (or point data.{role}_key at another column)"
