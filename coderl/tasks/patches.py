"""Unified diffs: write them, split them per file, apply them, and materialise task bases.

Diffs use ``a/`` and ``b/`` prefixes (``git diff`` style) and are applied with ``git apply``, which
works outside a git repository and refuses patches that do not match exactly.

A task's starting state (env snapshot + ``bug_patch``) is materialised once under
``<cache>/bases/<digest>``: unchanged files are hard links into the read-only snapshot, changed
files are fresh copies; sandboxes mount it as their read-only lower layer.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from coderl.tasks.snapshot import cache_dir, normalize_modes

_HEADER = re.compile(r"^diff --git (?:a/)?(\S+) (?:b/)?(\S+)$")


class PatchError(RuntimeError):
    """A patch did not apply; the message holds ``git apply``'s error."""


def make_diff(rel: str, old: str | None, new: str) -> str:
    """Unified diff of one file (``a/rel`` -> ``b/rel``), with no-newline-at-end markers;
    ``old=None``: a file the diff creates (``new file mode 100644``, from ``/dev/null``)."""
    out = [f"diff --git a/{rel} b/{rel}\n" + ("new file mode 100644\n" if old is None else "")]
    source = "/dev/null" if old is None else f"a/{rel}"
    lines = list(
        difflib.unified_diff((old or "").splitlines(True), new.splitlines(True), source, f"b/{rel}")
    )
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out) if lines else ""


_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def split_diff(diff: str) -> list[tuple[str, str]]:
    """Split a multi-file diff into ``(path, chunk)`` pairs (path without the ``a/``/``b/`` prefix).

    Handles ``diff --git`` headers and plain ``---``/``+++`` headers; a chunk for a deleted file
    is named by its old path, any other by its new path. Lines end at ``\\n`` only and a hunk's
    lines are counted from its ``@@`` header, as git reads them: a removed ``-- x`` line followed
    by an added ``++ y`` is hunk content, not the next file's header.
    """
    chunks: list[list[str]] = []
    lines = diff.split("\n")
    lines = [ln + "\n" for ln in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    old = new = 0  # lines the current hunk still holds
    for i, line in enumerate(lines):
        if old > 0 or new > 0:
            if line.startswith((" ", "\n")) or line == "":
                old, new = old - 1, new - 1
            elif line.startswith("-"):
                old -= 1
            elif line.startswith("+"):
                new -= 1
            elif not line.startswith("\\"):
                old = new = 0  # not hunk content: git ends the hunk here too
            if old > 0 or new > 0 or line.startswith(("-", "+", " ", "\\")):
                chunks[-1].append(line)
                continue
        header = line.startswith("diff --git ")  # git starts a patch at each, whatever its names
        plain = line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")
        if header or (plain and (not chunks or not _in_header(chunks[-1]))):
            chunks.append([])
        if chunks:
            chunks[-1].append(line)
            hunk = _HUNK.match(line)
            if hunk:
                old, new = _count(hunk.group(1)), _count(hunk.group(2))
    return [(_chunk_path(body), "".join(body)) for body in chunks]


_MAX_COUNT = 10**12
"""Hunk line counts above this (more lines than any diff holds) are read as this: a header of
5,000 digits would exceed Python's int conversion limit, and git refuses such a hunk anyway."""


def _count(digits: str | None) -> int:
    """A hunk header's line count (absent: 1), at most ``_MAX_COUNT``."""
    if not digits:
        return 1
    return _MAX_COUNT if len(digits) > 12 else min(int(digits), _MAX_COUNT)


def _in_header(body: list[str]) -> bool:
    """A ``diff --git`` chunk whose ``---``/``+++`` lines have not been seen yet."""
    return (
        bool(body)
        and body[0].startswith("diff --git")
        and not any(b.startswith("@@") for b in body)
    )


def _strip(p: str) -> str:
    p = p.split("\t")[0].strip()
    return p[2:] if p.startswith(("a/", "b/")) else p


def _chunk_path(body: list[str]) -> str:
    old = new = ""
    for line in body:
        if line.startswith("--- "):
            old = _strip(line[4:])
        elif line.startswith("+++ "):
            new = _strip(line[4:])
            break
        elif line.startswith(("rename to ", "copy to ")):
            new = line.split(" ", 2)[2].strip()
    if not new and not old:
        m = _HEADER.match(body[0].rstrip("\n"))
        return m.group(2) if m else ""
    return old if new in ("/dev/null", "") else new


def paths_in_diff(diff: str) -> list[str]:
    """Every path a diff touches (old and new names)."""
    out: list[str] = []
    for line in diff.splitlines():
        if line.startswith(("--- ", "+++ ")):
            p = _strip(line[4:])
            if p != "/dev/null":
                out.append(p)
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            out.append(line.split(" ", 2)[2].strip())
    return sorted(set(out))


def apply_patch(root: Path, diff: str) -> None:
    """Apply ``diff`` to the writable tree ``root`` with ``git apply``. Raises PatchError."""
    if not diff.strip():
        return
    with tempfile.NamedTemporaryFile("w", suffix=".diff", delete=False) as f:
        f.write(diff)
    try:
        # the ceiling keeps git from finding an enclosing repository: inside one, git apply
        # would resolve paths against that repository's root and silently skip ours
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(Path(root).resolve().parent))
        proc = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", f.name],
            cwd=root,
            capture_output=True,
            text=True,
            env=env,
        )
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise PatchError(proc.stderr.strip()[-2000:])


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


def materialize(snapshot: Path, bug_patch: str, *, cache: Path | None = None) -> Path:
    """The read-only starting state of a task: ``snapshot`` with ``bug_patch`` applied.

    Content-addressed by (snapshot path, patch); reused when it exists. Raises PatchError.
    """
    if not bug_patch.strip():
        return snapshot
    cache = cache or cache_dir()
    key = hashlib.sha256(f"{snapshot.name}\0{bug_patch}".encode()).hexdigest()[:16]
    target = cache / "bases" / key
    if target.exists():
        return target
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".base-"))
    touched = set(paths_in_diff(bug_patch))
    for dirpath, _, filenames in os.walk(snapshot):
        rel_dir = Path(dirpath).relative_to(snapshot)
        (staging / rel_dir).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            src, dst = Path(dirpath) / name, staging / rel_dir / name
            if rel in touched:
                shutil.copyfile(src, dst)
            else:
                os.link(src, dst)
    before = {rel: _read(staging / rel) for rel in touched}
    apply_patch(staging, bug_patch)
    unchanged = [rel for rel in touched if _read(staging / rel) == before[rel]]
    if unchanged:
        raise PatchError(f"the patch left {unchanged} unchanged")
    normalize_modes(staging)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.rename(target)
    except OSError:  # another process materialised it first
        shutil.rmtree(staging, ignore_errors=True)
    return target
