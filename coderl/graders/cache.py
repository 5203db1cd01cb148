"""An on-disk store of judgements: SQLite, one row per (rubric version, judge model, input hash).

Re-running an evaluation with the same rubric, judge and inputs reads the judgements back instead
of generating them again. Only well-formed judgements are stored: a masked (malformed) one is
tried again on the next run. Limits: no eviction; concurrent writers rely on SQLite's locking
(fine for a few processes, not for a cluster: give each worker its own file).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path
from typing import Any


def input_hash(payload: Any) -> str:
    """SHA-256 of the canonical JSON of ``payload`` (sorted keys), hex. The encoding is total
    (``surrogatepass``: a lone surrogate a policy wrote hashes instead of raising, which would
    turn a learned term's sample into a mask); valid text encodes as plain UTF-8, so keys of
    existing caches do not change."""
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return hashlib.sha256(blob).hexdigest()


class JudgementCache:
    """``get`` / ``put`` JSON values by (rubric version, model id, input hash)."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        self.path = p
        self._db = sqlite3.connect(p, check_same_thread=False)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS judgements (rubric TEXT, model TEXT, input TEXT, "
            "value TEXT NOT NULL, PRIMARY KEY (rubric, model, input))"
        )
        self._db.commit()

    def get(self, rubric: str, model: str, key: str) -> Any | None:
        row = self._db.execute(
            "SELECT value FROM judgements WHERE rubric=? AND model=? AND input=?",
            (rubric, model, key),
        ).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, rubric: str, model: str, key: str, value: Any) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO judgements VALUES (?, ?, ?, ?)",
            (rubric, model, key, json.dumps(value)),
        )
        self._db.commit()

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM judgements").fetchone()[0])

    def close(self) -> None:
        self._db.close()
