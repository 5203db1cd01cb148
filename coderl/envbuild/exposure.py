"""No pristine copy of a task's source is readable in a rollout sandbox.

A synthesised bug is undone by one ``cp`` (or a symlink, or a one-line diff) if the rollout can
read the unmutated file anywhere: a vendored copy inside the environment's virtualenv (pip and
setuptools vendor six, idna, packaging, more_itertools, tomli, ...), a system site-packages
directory holding the library at the pinned version, a wheel, a build leftover in the workspace.
The sandbox hides the known places (``coderl.sandbox.bwrap.hidden_paths``); this module checks
that nothing else is left.

:func:`readable_copies` starts a sandbox with the rollout's own mounts (the workspace at
``/testbed``, the environment's virtualenv at ``/venv``, no network: the mount table of
``coderl.grading.grade.rollout_sandbox_args``, plus this check's own directory) and walks, as the
sandbox user, every directory it can read (not ``/proc``, ``/sys``, ``/dev``). Every regular file,
symlinks followed, whose size is that of a pristine file is hashed (SHA-256); members of zip
archives (``.whl``, ``.zip``, ``.egg``, ``.pyz``) are checked the same way. A match is a copy
unless it is the pristine file at its own place in ``/testbed`` (the workspace *is* the snapshot
at build time; in a rollout that file holds the bug) and the snapshot has no twin of it (two
identical files: mutating one leaves the other).

The pristine set: at environment build (``coderl tasks build-env``), every ``.py`` file of the
snapshot of at least ``MIN_BYTES`` (any of them may become a task); for a task
(``coderl tasks validate``), the files its bug patch touches and its held-out test files.

Not checked: copies that differ by a byte (a reformatted or older copy still gives most of a fix
away: the check compares exact content), compressed archives other than zip (``.tar.gz``), zip
archives Python's ``zipfile`` cannot read (corrupt, encrypted, an unknown compression),
files the sandbox user cannot read at walk time but could later, and files smaller than
``MIN_BYTES`` at build (one-line modules are too common to mean a copy).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterable
from pathlib import Path

from coderl.grading.runner import SandboxFactory, default_factory
from coderl.sandbox.base import Limits

MIN_BYTES = 200
"""Smallest snapshot file the build-time check looks for."""
CHECK_DIR = "/coderl/exposure"
LIMITS = Limits(timeout_s=300.0, cpu_s=300, memory_bytes=2 * 1024**3)

WALKER = r"""
import hashlib, json, os, stat, struct, sys, zipfile, zlib
want = json.load(open(sys.argv[1]))
sizes, hashes = set(want["sizes"]), set(want["hashes"])
skip = {"/proc", "/sys", "/dev", sys.argv[2]}
ARCHIVES = (".whl", ".zip", ".egg", ".pyz")

def check_zip(path):
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.file_size in sizes:
                    digest = hashlib.sha256(z.read(info)).hexdigest()
                    if digest in hashes:
                        print(json.dumps([path + "!" + info.filename, digest]))
    except (OSError, EOFError, ValueError, RuntimeError, struct.error, zipfile.BadZipFile,
            zlib.error):
        pass  # an archive zipfile cannot read (corrupt, encrypted, unknown compression)
    # any other error is a bug of this walk: it fails, and the check with it (fail closed)

for root, dirs, files in os.walk("/"):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
    for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
        path = os.path.join(root, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if path.endswith(ARCHIVES):
            check_zip(path)
        if st.st_size not in sizes:
            continue
        try:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            continue
        if digest in hashes:
            print(json.dumps([path, digest]))
"""


class ExposureError(RuntimeError):
    """A rollout sandbox can read a pristine copy of a task's source."""


def pristine_index(
    snapshot: Path, paths: Iterable[str] | None = None
) -> dict[str, tuple[int, set[str]]]:
    """SHA-256 -> (size, relative paths) of the pristine files of ``snapshot``: ``paths`` (those
    that exist) or, without it, every ``.py`` file of at least ``MIN_BYTES``."""
    if paths is None:
        files = [p for p in snapshot.rglob("*.py") if p.is_file() and p.stat().st_size >= MIN_BYTES]
    else:
        files = [snapshot / p for p in paths if (snapshot / p).is_file()]
    index: dict[str, tuple[int, set[str]]] = {}
    for path in files:
        data = path.read_bytes()
        if data:
            entry = index.setdefault(hashlib.sha256(data).hexdigest(), (len(data), set()))
            entry[1].add(path.relative_to(snapshot).as_posix())
    return index


def readable_copies(
    base: Path,
    ro_mounts: dict[str, str],
    index: dict[str, tuple[int, set[str]]],
    *,
    factory: SandboxFactory | None = None,
) -> list[tuple[str, str]]:
    """``(sandbox path, pristine relative path)`` for every copy of an ``index`` file a sandbox
    over ``base`` with ``ro_mounts`` can read (see the module docstring), sorted."""
    if not index:
        return []
    sizes = sorted({size for size, _ in index.values()})
    factory = factory or default_factory()
    with tempfile.TemporaryDirectory(prefix="coderl-exposure-") as tmp:
        Path(tmp, "walk.py").write_text(WALKER)
        Path(tmp, "want.json").write_text(json.dumps({"sizes": sizes, "hashes": sorted(index)}))
        Path(tmp).chmod(0o755)
        mounts = dict(ro_mounts) | {CHECK_DIR: tmp}
        sb = factory(base, limits=LIMITS, env={}, ro_mounts=mounts, rw_mounts={}, network=False)
        try:
            res = sb.exec(
                f"python3 -I {CHECK_DIR}/walk.py {CHECK_DIR}/want.json {CHECK_DIR}",
                timeout=LIMITS.timeout_s,
            )
        finally:
            sb.close()
    if res.exit_code != 0:
        raise RuntimeError(f"exposure walk failed ({res.exit_code}): {res.stderr[-500:]}")
    found = []
    for line in res.stdout.splitlines():
        path, digest = json.loads(line)
        rels = index[digest][1]
        if len(rels) > 1 or path.removeprefix("/testbed/") not in rels:  # a twin stays pristine
            found.append((path, sorted(rels)[0]))
    return sorted(found)


def check_readable(
    base: Path,
    ro_mounts: dict[str, str],
    snapshot: Path,
    paths: Iterable[str] | None = None,
    *,
    factory: SandboxFactory | None = None,
) -> None:
    """Raise :class:`ExposureError` naming the copies of ``snapshot``'s pristine files
    (:func:`pristine_index` of ``paths``) that a sandbox over ``base`` with ``ro_mounts``
    can read."""
    index = pristine_index(snapshot, paths)
    found = readable_copies(base, ro_mounts, index, factory=factory)
    if found:
        shown = ", ".join(f"{p} (= {rel})" for p, rel in found[:5])
        raise ExposureError(f"{len(found)} pristine copies readable in a rollout: {shown}")
