"""How every GPU benchmark reports: one JSON line per measurement on stdout, appended to the JSONL file that
``experiments/results/`` keeps when ``--out`` names one."""

from __future__ import annotations

import json


def report(row: dict, out: str | None) -> None:
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
