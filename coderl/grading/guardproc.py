"""The diff guard's scan of a graded tree (:func:`scan_change`), run in a child process bounded
in CPU time, memory and wall time; the policy itself is :mod:`coderl.grading.diffguard`.

Why. Parsing the agent's Python on the host costs what the agent chooses: one 2 MiB file once
took 16 s and 1.3 GB under the host's process-wide parse lock, and a file deeper than the host's
parser accepts was read as "not Python, no findings" while the sandbox compiled it. So
:func:`scan_bounded` hands the files to a fresh interpreter (``python -m
coderl.grading.guardproc``) that limits itself (``RLIMIT_CPU`` ``SCAN_CPU_S``, ``RLIMIT_AS``
``SCAN_MEMORY_BYTES``) and is killed after ``SCAN_WALL_S``; it reports each file when done.
Fail closed: a file the child did not finish (it ran out of CPU or memory, crashed or was
killed) is a finding (rule ``unscannable``), the agent's failure like any other finding, and a
Python file (``.py``) the child cannot parse for any reason is one too
(:func:`coderl.grading.diffguard.added_findings`). Nothing the host cannot read decides a pass.

The child runs only coderl's own code on the files' bytes (it never imports or runs them); it
holds no secret and writes nothing but its report to stdout.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from coderl.grading.diffguard import PYTHON_SUFFIXES, Finding, added_findings
from coderl.grading.guardself import unbound_methods

SCAN_CPU_S = 20
"""CPU seconds the scan of one change may take (all its files)."""
SCAN_MEMORY_BYTES = 1536 * 1024**2
"""Address space of the scanning process (bytes): parsing costs ~600x a file's size."""
SCAN_WALL_S = 120.0
"""Wall seconds before the scanning process is killed (a loaded host is slow, not wrong)."""
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding ``coderl``


def scan_bounded(
    jobs: list[tuple[str, str | None, str, str | None]],
    *,
    cpu_s: int = SCAN_CPU_S,
    memory_bytes: int = SCAN_MEMORY_BYTES,
    wall_s: float = SCAN_WALL_S,
    package: frozenset[str] = frozenset(),
) -> list[Finding]:
    """Findings of :func:`~coderl.grading.diffguard.added_findings` for each ``(rel, old,
    new, released)`` job (host paths of the base's file, the graded tree's file and the
    released file; ``None`` where absent), computed in a bounded child process. A file the child
    did not finish is one ``unscannable`` finding. ``cpu_s``, ``memory_bytes``, ``wall_s``: the
    child's bounds (defaults ``SCAN_CPU_S``, ``SCAN_MEMORY_BYTES``, ``SCAN_WALL_S``); ``package``:
    the storing methods of the package's unchanged files (:func:`package_storing`)."""
    if not jobs:
        return []
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": _PACKAGE_ROOT}
    try:
        proc = subprocess.run(
            # no site (starts faster); -P: the grader's own package, never one in the cwd
            [sys.executable, "-S", "-P", "-m", "coderl.grading.guardproc"],
            input=json.dumps(
                {
                    "cpu_s": cpu_s,
                    "memory_bytes": memory_bytes,
                    "jobs": jobs,
                    "package": sorted(package),
                }
            ).encode(),
            capture_output=True,
            env=env,
            timeout=wall_s,
        )
        out, why = proc.stdout, f"exit {proc.returncode}: {proc.stderr[-200:]!r}"
    except subprocess.TimeoutExpired as e:
        out, why = e.stdout or b"", f"killed after {wall_s:g} s"
    found: list[Finding] = []
    done: set[str] = set()
    for line in out.decode("utf-8", "surrogateescape").splitlines():
        try:
            rel, rows = json.loads(line)
        except ValueError:
            break  # the child died mid-line
        done.add(rel)
        found += [Finding(*row) for row in rows]
    for rel, *_ in jobs:
        if rel not in done:
            what = f"the host could not scan it within its bounds ({why})"
            found.append(Finding(rel, 0, "unscannable", what[:80]))
    return found


MAX_SCAN_BYTES = 4 * 1024**2
"""A changed file larger than this is not parsed; it is a finding (no bug fix needs it)."""


def _plain_path(path: Path | None) -> str | None:
    """``path`` as a string when it is a regular file (not a link), else None."""
    return str(path) if path is not None and path.is_file() and not path.is_symlink() else None


def scan_change(
    base: Path, tree: Path, changed: list[str], pristine: Path | None = None
) -> list[Finding]:
    """Findings in the files ``changed`` between ``base`` and ``tree`` (workspace-relative).

    ``pristine`` is the repository as released (the environment's snapshot, before the task's
    bug): what the released file has in a scope is allowed there (:func:`added_findings`), so
    restoring the original code is never denied (a synthesised bug may have deleted a line
    that used ``sys.modules``; its gold patch puts it back), but its lines are no licence to
    use the same facility anywhere else in the file.

    The files are parsed in a child process bounded in CPU, memory and wall time
    (:func:`scan_bounded`); what it cannot finish is a finding.
    """
    out: list[Finding] = []
    jobs: list[tuple[str, str | None, str, str | None]] = []
    for rel in changed:
        try:
            out += _check_entry(base, tree, rel, pristine, jobs)
        except OSError as e:  # a path the host cannot stat or read: closed, never open
            out.append(Finding(rel, 0, "unscannable", f"{type(e).__name__}: {e}"[:80]))
    return out + scan_bounded(jobs, package=package_storing(base, changed))


def _check_entry(
    base: Path,
    tree: Path,
    rel: str,
    pristine: Path | None,
    jobs: list[tuple[str, str | None, str, str | None]],
) -> list[Finding]:
    """The host-side findings of one changed path (a link, a file too large); a regular file
    to parse is appended to ``jobs``."""
    new, old = tree / rel, base / rel
    if new.is_symlink():
        if not (old.is_symlink() and old.readlink() == new.readlink()):
            return [Finding(rel, 0, "symlink", str(new.readlink())[:80])]
        return []
    if not new.is_file():
        return []  # deleted
    if byproduct(new, old):
        return []  # a new data file: nothing runs it as Python
    if new.stat().st_size > MAX_SCAN_BYTES:
        return [Finding(rel, 0, "size", f"{new.stat().st_size} bytes")]
    released = pristine / rel if pristine is not None else None
    jobs.append((rel, _plain_path(old), str(new), _plain_path(released)))
    return []


MAX_PACKAGE_FILES = 5000
"""Most Python files of a base read for :func:`package_storing` (a library has far fewer)."""
_STORING: dict[bytes, frozenset[str]] = {}  # a file's digest -> its storing methods


def package_storing(base: Path, changed: list[str]) -> frozenset[str]:
    """The methods that store through their ``self`` (:func:`~.guardself.unbound_methods`) in
    the Python files of ``base`` that ``changed`` leaves alone, for rule ``unbound``: a diff may
    reach one of them unbound (``Box.put(json.JSONEncoder, f)``) without changing its file.
    The base is the task's (environment snapshot and bug patch), not the agent's, so it is
    parsed here, once per file content (kept by digest for this process)."""
    skip, out = set(changed), set()
    for path in sorted(base.rglob("*.py"))[:MAX_PACKAGE_FILES]:
        if path.relative_to(base).as_posix() in skip or path.is_symlink() or not path.is_file():
            continue
        if path.stat().st_size > MAX_SCAN_BYTES:
            continue
        data = path.read_bytes()
        key = hashlib.sha1(data).digest()
        if key not in _STORING:
            if len(_STORING) >= 4 * MAX_PACKAGE_FILES:
                _STORING.clear()
            _STORING[key] = unbound_methods(data)
        out |= _STORING[key]
    return frozenset(out)


def byproduct(new: Path, old: Path) -> bool:
    """Whether ``new`` is a file the diff adds (``old`` absent) whose name Python does not import
    (not ``PYTHON_SUFFIXES``) and that does not start with a ``#!`` line naming python: data a
    test run may leave behind (a JSON report, a log, a CSV). The import system never runs it and
    a pristine test cannot name it, so it is not read with Python's rules: a JSON report holding
    ``/proc/cpuinfo`` or ``{0.name}`` parsed as Python and denied a correct fix (round 8).
    A file the base has, a new script with a python shebang, or a new file that holds a
    doctest prompt (``>>>``: a test may run it with ``doctest.testfile``) is scanned as before."""
    if new.name.endswith(PYTHON_SUFFIXES) or old.exists() or old.is_symlink():
        return False
    with new.open("rb") as f:
        first = f.readline(256)
        if first.startswith(b"#!") and b"python" in first:
            return False
        f.seek(0)
        last = b""
        while chunk := f.read(1 << 20):
            if b">>>" in last + chunk:
                return False
            last = chunk[-2:]
    return True


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def main() -> None:
    """The child: limit itself, then scan each job read from stdin and print ``[rel,
    findings]`` as one JSON line when it is done (so the parent knows which file it died on)."""
    import resource

    work = json.loads(sys.stdin.buffer.read())
    resource.setrlimit(resource.RLIMIT_CPU, (work["cpu_s"], work["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_AS, (work["memory_bytes"], work["memory_bytes"]))
    sys.setrecursionlimit(10_000)  # the parser's own depth checks follow it
    # a method of one changed file that stores through its ``self`` is named in all of them
    shared = frozenset().union(*(unbound_methods(_read(job[2])) for job in work["jobs"]))
    package = frozenset(work.get("package", ()))
    for rel, old, new, released in work["jobs"]:
        rows = added_findings(_read(old), _read(new) or b"", rel, _read(released), shared, package)
        line = json.dumps([rel, [[f.path, f.line, f.rule, f.what, f.scope] for f in rows]])
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
