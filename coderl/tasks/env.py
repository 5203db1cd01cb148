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

from coderl.progress import KnownFault
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


class EnvNotBuilt(KnownFault, KeyError):
    """No built environment matches a reference (``coderl tasks build-env`` builds it); masked
    episodes log it in one line (:func:`coderl.progress.warn_masked`)."""


def _records(cache: Path | None) -> list[EnvRecord]:
    return [EnvRecord.load(p) for p in sorted(((cache or cache_dir()) / "envs").glob("*/env.json"))]


def _refs(rec: EnvRecord) -> tuple[str, ...]:
    """What :func:`find_env` matches ``rec`` by."""
    return rec.env_id, rec.spec, rec.name, f"{rec.name}=={rec.version}"


def find_env(ref: str, *, cache: Path | None = None) -> EnvRecord:
    """Look up a built environment by env id, ``NAME==VERSION``, path spec or bare name.

    Raises:
        EnvNotBuilt: a KeyError: nothing matches (lists what is built).
    """
    records = _records(cache)
    for rec in records:
        if ref in _refs(rec):
            return rec
    raise EnvNotBuilt(f"no built environment matches {ref!r}; built: {[r.env_id for r in records]}")


def check_built(tasks: list[Any], *, cache: Path | None = None) -> None:
    """Refuse repository ``tasks`` whose environment is not built, in one line that names the
    missing environments and the ``coderl tasks build-env`` command (a task's ``source``
    ``pypi:NAME==VERSION`` gives the spec to build); function tasks need none.

    Raises:
        ValueError: some environments are not built (the command line prints the one line).
    """
    built = {ref for rec in _records(cache) for ref in _refs(rec)}
    missing: dict[str, str | None] = {}
    for t in tasks:
        if t.kind == "repo" and t.env_id not in built:
            src = str(getattr(t, "source", "") or "")
            missing[t.env_id] = src.removeprefix("pypi:") if src.startswith("pypi:") else None
    if not missing:
        return
    specs = sorted({s for s in missing.values() if s})
    build = f"coderl tasks build-env {' '.join(specs)}" if specs else "coderl tasks build-env SPEC"
    if len(specs) < len(missing):
        build += " (SPEC: each environment's NAME==VERSION)"
    n = sum(1 for t in tasks if t.kind == "repo" and t.env_id in missing)
    raise ValueError(
        f"{n} repository tasks need environments that are not built in {cache or cache_dir()} "
        f"({', '.join(sorted(missing))}): build them first with `{build}`"
    )
