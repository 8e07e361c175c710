"""Where a JSONL corpus is bad, by file and line: what pyarrow's fast reader cannot say.

pyarrow reads a wiki-18-format corpus (13 GB) in seconds but names no line when it fails ("in row 2" counts JSON
objects, not lines), reads a line without ``contents`` as a null passage, and takes invalid UTF-8 in. On such a failure
:func:`first_bad_line` reads the file again line by line, which only a bad corpus pays for, and says what is wrong
where.
"""

from __future__ import annotations

import json
from pathlib import Path


def first_bad_line(path: str) -> str | None:
    """``"<path>:<line>: <what is wrong>"`` for the first line that is no ``{"contents": "...", ...}`` object in
    UTF-8, or that an empty file has none; None when every line is one."""
    size = Path(path).stat().st_size
    if size == 0:
        return f"{path}: the file is empty; expected one JSON object with a 'contents' string per line"
    read = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            read += len(raw)
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                bad = raw[error.start:error.start + 4]
                return f"{where}: not valid UTF-8 (byte {error.start + 1} of the line: {bad!r})"
            try:
                row = json.loads(text)
            except ValueError as error:
                if read == size and not raw.endswith(b"\n"):
                    return f"{where}: the last line is cut short ({error}); was the file copied whole?"
                return f"{where}: not a JSON object ({error})"
            if not isinstance(row, dict):
                return f"{where}: expected a JSON object with a 'contents' string, got a JSON {type(row).__name__}"
            if not isinstance(row.get("contents"), str):
                found = f"'contents' is {row['contents']!r:.40}" if "contents" in row else \
                    f"no 'contents' (keys: {', '.join(list(row)[:6])})"
                return f"{where}: {found}; expected a 'contents' string"
    return None
