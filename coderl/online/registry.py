"""Checkpoint registry: versions with lineage and gate reports, and one atomic champion pointer.

Layout under ``root``::

    versions/<n>/           the checkpoint the trainer wrote (any files) + meta.json
    CHAMPION                the shared champion's version number, the only source of truth
    populations/<name>      a population's own champion (absent: it is served the shared one)
    history.jsonl           one line per promotion or rejection (append-only audit log)

Versions are numbered across populations (a version is one adapter; its ``meta.json`` names
the population it was trained for). Every pointer is its own file, swapped on its own, so a
promotion of one population that fails or crashes leaves every other pointer as it was.

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

from coderl.config.online import SHARED, check_population_name

POINTER = "CHAMPION"
POPULATIONS = "populations"


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
        (self.root / POPULATIONS).mkdir(exist_ok=True)
        for pattern in ("*.tmp.*", f"{POPULATIONS}/*.tmp.*", "versions/*/*.tmp.*"):
            for stale in self.root.glob(pattern):
                stale.unlink()

    def _pointer(self, population: str | None) -> Path:
        if population is None or population == SHARED:
            return self.root / POINTER
        return self.root / POPULATIONS / check_population_name(population)

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

    def champion(self, population: str | None = None) -> int | None:
        """The champion of ``population`` (None or :data:`SHARED`: the shared one), or None
        before its first promotion.

        Raises:
            ValueError: a population name that cannot name a pointer file.
        """
        p = self._pointer(population)
        return int(p.read_text().strip()) if p.exists() else None

    def own_champions(self) -> dict[str, int]:
        """Every population that has an own champion -> its version."""
        return {
            p.name: int(p.read_text().strip())
            for p in sorted((self.root / POPULATIONS).iterdir())
            if ".tmp." not in p.name
        }

    def served(self, population: str | None) -> int:
        """The version ``population``'s requests are served: its own champion, else the shared
        one (also for a population nobody configured).

        Raises:
            RuntimeError: no shared champion yet.
        """
        own = None if population in (None, SHARED) else self.own_champions().get(population)
        shared = self.champion()
        if own is None and shared is None:
            raise RuntimeError(f"registry {self.root} has no champion yet")
        return own if own is not None else shared  # type: ignore[return-value]

    def promote(self, version: int, report: dict[str, Any], population: str | None = None) -> None:
        """Make ``version`` the champion of ``population`` (None: the shared one): report
        first, then the atomic swap of that population's pointer alone.

        Raises:
            KeyError: unknown version.
        """
        previous = self.champion(population)
        self.update_meta(version, status="promoted", gate_report=report, replaced=previous)
        _write_atomic(self._pointer(population), f"{version}\n")
        rec = {"event": "promote", "version": version, "previous": previous}
        self._log(rec | ({"population": population} if population not in (None, SHARED) else {}))

    def reject(self, version: int, report: dict[str, Any], population: str | None = None) -> None:
        """Record that ``version`` failed the gate; every champion is untouched."""
        self.update_meta(version, status="rejected", gate_report=report)
        rec = {"event": "reject", "version": version, "champion": self.champion(population)}
        self._log(rec | ({"population": population} if population not in (None, SHARED) else {}))

    def lineage(self, version: int) -> list[int]:
        """``[version, parent, grandparent, ...]``."""
        out = [version]
        while (parent := self.meta(out[-1]).get("parent")) is not None:
            out.append(int(parent))
        return out

    def promoted(self, population: str | None = None) -> list[int]:
        """Versions that were served to ``population`` at some time, in promotion order (from
        history): the shared champions until its first own promotion, then its own (None or
        :data:`SHARED`: the shared champions)."""
        own = population not in (None, SHARED)
        out: list[int] = []
        has_own = False
        h = self.root / "history.jsonl"
        for line in h.read_text().splitlines() if h.exists() else []:
            rec = json.loads(line) if line.strip() else {}
            if rec.get("event") not in ("promote", "init"):
                continue
            pop = rec.get("population")
            if pop is None and not has_own:
                out.append(rec["version"])
            elif own and pop == population:
                out.append(rec["version"])
                has_own = True
        champ = self.champion(population) if own else None
        if champ is None and not has_own:
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
