"""Checkpoint registry: versions with lineage and gate reports, and one atomic champion pointer.

Layout under ``root``::

    versions/<n>/           the checkpoint the trainer wrote (any files) + meta.json
    CHAMPION                the champion's version number, the only source of truth
    history.jsonl           one line per promotion or rejection (append-only audit log)

Promotion writes the gate report into the candidate's ``meta.json`` first, then replaces
``CHAMPION`` with ``os.replace`` of a fsynced temporary file (atomic on POSIX file systems), then
fsyncs the directory. A crash at any point leaves ``CHAMPION`` naming exactly one version, the
old or the new; a leftover temporary file is removed when the registry is opened again.

Limits: one writer at a time (no lock across processes); POSIX local file systems only (a network
file system may not make ``os.replace`` atomic).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

POINTER = "CHAMPION"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Registry:
    """Versioned checkpoints under ``root`` (created if missing)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        (self.root / "versions").mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob("*.tmp.*"):
            stale.unlink()
        for stale in (self.root / "versions").glob("*/*.tmp.*"):
            stale.unlink()

    def version_dir(self, version: int) -> Path:
        return self.root / "versions" / str(version)

    def versions(self) -> list[int]:
        return sorted(
            int(p.name)
            for p in (self.root / "versions").iterdir()
            if p.name.isdigit() and (p / "meta.json").exists()
        )

    def new_version(self, *, parent: int | None, info: dict[str, Any] | None = None) -> int:
        """Allocate the next version number and its directory, record its parent.

        Returns:
            the version number; the trainer writes the checkpoint into :meth:`version_dir`.
        """
        existing = [int(p.name) for p in (self.root / "versions").iterdir() if p.name.isdigit()]
        version = max(existing, default=-1) + 1
        d = self.version_dir(version)
        d.mkdir()
        meta = {"version": version, "parent": parent, "created_at": time.time(), **(info or {})}
        meta.setdefault("status", "candidate")
        _write_atomic(d / "meta.json", json.dumps(meta, indent=1, default=str))
        return version

    def meta(self, version: int) -> dict[str, Any]:
        """The version's metadata.

        Raises:
            KeyError: unknown version.
        """
        p = self.version_dir(version) / "meta.json"
        if not p.exists():
            raise KeyError(f"unknown version {version}; known: {self.versions()}")
        return json.loads(p.read_text())  # type: ignore[no-any-return]

    def update_meta(self, version: int, **fields: Any) -> None:
        meta = self.meta(version) | fields
        _write_atomic(self.version_dir(version) / "meta.json", json.dumps(meta, indent=1))

    def champion(self) -> int | None:
        """The champion version, or None before the first promotion."""
        p = self.root / POINTER
        return int(p.read_text().strip()) if p.exists() else None

    def promote(self, version: int, report: dict[str, Any]) -> None:
        """Make ``version`` the champion: report first, then the atomic pointer swap.

        Raises:
            KeyError: unknown version.
        """
        previous = self.champion()
        self.update_meta(version, status="promoted", gate_report=report, replaced=previous)
        _write_atomic(self.root / POINTER, f"{version}\n")
        self._log({"event": "promote", "version": version, "previous": previous})

    def reject(self, version: int, report: dict[str, Any]) -> None:
        """Record that ``version`` failed the gate; the champion is untouched."""
        self.update_meta(version, status="rejected", gate_report=report)
        self._log({"event": "reject", "version": version, "champion": self.champion()})

    def lineage(self, version: int) -> list[int]:
        """``[version, parent, grandparent, ...]``."""
        out = [version]
        while (parent := self.meta(out[-1]).get("parent")) is not None:
            out.append(int(parent))
        return out

    def promoted(self) -> list[int]:
        """Versions that were champion at some time, in promotion order (from history)."""
        h = self.root / "history.jsonl"
        if not h.exists():
            return [v] if (v := self.champion()) is not None else []
        out = [
            rec["version"]
            for line in h.read_text().splitlines()
            if line.strip() and (rec := json.loads(line))["event"] in ("promote", "init")
        ]
        champ = self.champion()
        if champ is not None and (not out or out[-1] != champ):
            out.append(champ)  # crash between the pointer swap and the history line
        return out

    def _log(self, rec: dict[str, Any]) -> None:
        with open(self.root / "history.jsonl", "a") as f:
            f.write(json.dumps({**rec, "at": time.time()}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def init_champion(self, version: int) -> None:
        """Make ``version`` the first champion (no gate: there is nothing to compare with).

        Raises:
            RuntimeError: a champion already exists.
        """
        if self.champion() is not None:
            raise RuntimeError(f"registry already has champion {self.champion()}")
        self.update_meta(version, status="promoted")
        _write_atomic(self.root / POINTER, f"{version}\n")
        self._log({"event": "init", "version": version})
