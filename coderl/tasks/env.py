"""What a built environment is: :class:`EnvRecord` (snapshot + virtualenv + test command + the
tests that pass), stored as ``<cache>/envs/<env_id>/env.json``, and :func:`find_env` to look one
up. Building one is :mod:`coderl.envbuild.build`; this record is what tasks name (``Task.env_id``)
and what rollouts and the verifier mount.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from coderl.tasks.snapshot import cache_dir


@dataclass
class EnvRecord:
    """A built environment: snapshot + virtualenv + test command + the tests that pass."""

    env_id: str
    """``NAME-VERSION-<12 hex>``: hash of the snapshot digest, install commands and Python."""
    spec: str
    """What was built: ``NAME==VERSION`` or a local path."""
    name: str
    version: str
    snapshot_digest: str
    """SHA-256 of the snapshot (see ``snapshot.tree_digest``)."""
    snapshot: str
    """Host path of the read-only snapshot."""
    venv: str
    """Host path of the virtualenv, mounted read-only at ``/venv``."""
    install_plan: str
    install_commands: list[str]
    test_paths: list[str]
    """Arguments given to pytest (test directories or files, workspace-relative)."""
    test_command: str
    """A human-readable form of the test command."""
    passing: list[str]
    """Node ids that passed in both runs."""
    failing: list[str] = field(default_factory=list)
    """Node ids that failed, errored or were skipped in both runs (never used as tasks)."""
    flaky: list[str] = field(default_factory=list)
    """Node ids whose outcome differed between the two runs (dropped)."""
    canaries_ok: bool = True
    """The must-fail canaries behaved on this repository; if not, graders skip that check."""
    baseline_tampered: list[str] = field(default_factory=list)
    """Functions the repository's own tests replace (not counted as tampering at grading)."""
    info: dict[str, Any] = field(default_factory=dict)
    """What detection found (``ProjectInfo`` as a dict)."""
    license: str = "unknown"
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """Each install attempt: plan, step reached, error tail."""

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> EnvRecord:
        return cls(**json.loads(Path(path).read_text()))


def find_env(ref: str, *, cache: Path | None = None) -> EnvRecord:
    """Look up a built environment by env id, ``NAME==VERSION``, path spec or bare name.

    Raises:
        KeyError: nothing matches (lists what is built).
    """
    cache = cache or cache_dir()
    records = [EnvRecord.load(p) for p in sorted((cache / "envs").glob("*/env.json"))]
    for rec in records:
        if ref in (rec.env_id, rec.spec, rec.name) or ref == f"{rec.name}=={rec.version}":
            return rec
    raise KeyError(f"no built environment matches {ref!r}; built: {[r.env_id for r in records]}")
