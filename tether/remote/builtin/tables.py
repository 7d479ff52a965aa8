"""The user's CSV or JSONL table, read and checked alike by the laptop's config check and the trainer (stdlib only)."""

from __future__ import annotations

import csv
import json
from typing import Dict, List, Tuple


def read_table(path: str, label_column: str) -> Tuple[List[str], List[Dict]]:
    """(feature columns, rows) of a CSV or JSONL file; ValueError naming what is wrong."""
    with open(path, newline="") as f:
        if path.endswith((".jsonl", ".ndjson")):
            rows = [json.loads(line) for line in f if line.strip()]
        else:
            rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError("the file is empty: it needs a header and at least one row")
    if label_column not in rows[0]:
        raise ValueError(f"no column {label_column!r}; columns: {', '.join(map(str, rows[0]))} "
                         f"(set trainer.data.label_column)")
    features = [c for c in rows[0] if c != label_column]
    for number, row in enumerate(rows, 2):
        for column in features:
            try:
                float(row[column])
            except (TypeError, ValueError, KeyError):
                raise ValueError(f"row {number}: column {column!r} is {row.get(column)!r}, not a number")
    return features, rows
