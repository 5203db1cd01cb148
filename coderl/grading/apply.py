"""Applying an agent's diff for grading: ``git apply`` on a hard-linked copy of the task's base,
bounded in what it may write, with protected paths put back (step 2 of :mod:`coderl.grading.grade`).

The decision is made on the tree git produced (:func:`apply_to_copy` compares every entry with the
base), so no quoting, escaping or header trick in the diff text gets a protected path through.
Writing diffs, splitting them and materialising task bases is :mod:`coderl.tasks.patches`.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

from coderl.grading.diffguard import PYTHON_SUFFIXES
from coderl.sandbox.workspace import remove_tree
from coderl.tasks.patches import PatchError, split_diff

MAX_AGENT_DIFF_BYTES = 16 * 1024**2
"""Largest agent diff applied (bytes); a larger one is the agent's failure."""
MAX_APPLY_FILES = 1000
"""Most files applying one agent diff may write (created, changed, copied, renamed, chmod'ed)."""
MAX_APPLY_BYTES = 64 * 1024**2
"""Most bytes applying one agent diff may write, whatever its allowance (``write_bound``)."""
APPLY_SLACK_BYTES = 256 * 1024
"""What applying may write beyond the diff's own bytes and one rewrite of each file it edits."""
HOST_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM)
"""``OSError`` numbers that are the host's fault while a diff is applied or read back (a full
disk, quota or memory): masked as infrastructure. Any other ``OSError`` there (a path past
``PATH_MAX`` on the host, a name the file system refuses) comes from what the diff wrote: the
agent's failure."""

_QUOTED = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


def _unquote(name: str) -> str:
    """A path as git writes it in a header: C-quoted (``"a/\\303\\251.py"``) when it holds
    special bytes, else bare (a tab ends it); no ``a/``/``b/`` prefix is removed here."""
    if not name.startswith('"'):
        return name.split("\t")[0].rstrip("\n")
    out, i = bytearray(), 1
    while i < len(name) and name[i] != '"':
        c = name[i]
        if c == "\\" and i + 1 < len(name):
            nxt = name[i + 1]
            if nxt in "01234567":
                out.append(int(name[i + 1 : i + 4], 8) & 0xFF)
                i += 4
                continue
            out.append(_QUOTED.get(nxt, ord(nxt) & 0xFF))
            i += 2
            continue
        out += c.encode("utf-8", "surrogateescape")
        i += 1
    return out.decode("utf-8", "surrogateescape")


def _noprefix(name: str) -> str:
    name = _unquote(name)
    return name[2:] if name.startswith(("a/", "b/")) else name


def _patch_paths(chunk: str) -> tuple[str | None, str | None, str]:
    """``(source, target, how)`` of one file's patch; ``how`` is ``"copy"``, ``"rename"``,
    ``"new"``, ``"delete"`` or ``"edit"``; a name that cannot be read is None."""
    src = dst = None
    how = "edit"
    for line in chunk.splitlines():
        if line.startswith("@@"):
            break
        for word in ("copy", "rename"):
            if line.startswith(f"{word} from "):
                src, how = _unquote(line[len(word) + 6 :]), word
            elif line.startswith(f"{word} to "):
                dst = _unquote(line[len(word) + 4 :])
        if line.startswith("new file mode") or line == "--- /dev/null":
            how = "new"
        elif line.startswith("deleted file mode") or line.startswith("+++ /dev/null"):
            how = "delete"
        elif line.startswith("--- ") and how == "edit":
            src = _noprefix(line[4:])
        elif line.startswith("+++ ") and how != "delete":
            dst = _noprefix(line[4:])
    if src is None and dst is None and chunk.startswith("diff --git "):
        names = chunk.split("\n", 1)[0][len("diff --git ") :]
        half = (len(names) - 1) // 2  # "a/NAME b/NAME": the one split where both names agree
        if names[half : half + 1] == " " and _noprefix(names[:half]) == _noprefix(
            names[half + 1 :]
        ):
            src = dst = _noprefix(names[:half])
    if how == "edit" and dst is None:
        dst = src
    return src, dst, how


def write_bound(diff: str, sizes: dict[str, int]) -> tuple[int, int, int]:
    """``(bytes, files, allowance)``: at most how many bytes and files ``git apply`` writes for
    ``diff`` on a tree whose files have ``sizes`` (path -> bytes), and the bytes it may write.

    Each file's patch writes at most its source's size plus the patch's own bytes; the source of
    a copy, a rename or a second patch to one path is what an earlier patch left there, so chains
    add up. A source whose name cannot be read counts as the largest file. The allowance is the
    diff's own bytes, plus one rewrite of each existing file it edits or renames (counted once),
    plus ``APPLY_SLACK_BYTES``: copies, mode changes and repeated patches of one file earn none,
    so a ``copy from``/``copy to`` header (no content) cannot make the host write a file's size.
    """
    left = dict(sizes)
    written = files = 0
    allowance = len(diff.encode("utf-8", "surrogateescape")) + APPLY_SLACK_BYTES
    earned: set[str] = set()
    for _, chunk in split_diff(diff):
        src, dst, how = _patch_paths(chunk)
        if how == "delete":
            left.pop(src or "", None)
            continue
        if how == "new":
            pre = 0
        elif src is None or src not in left:  # a name we read differently from git: the worst
            pre = max(left.values(), default=0)
        else:
            pre = left[src]
        post = pre + len(chunk.encode("utf-8", "surrogateescape"))
        written, files = written + post, files + 1
        if how in ("edit", "rename") and src in sizes and src not in earned:
            earned.add(src)
            allowance += sizes[src]
        if how == "rename" and src is not None:
            left.pop(src, None)
        left[dst if dst is not None else src or ""] = post
    return written, files, min(allowance, MAX_APPLY_BYTES)


def _check_bound(written: int, files: int, allowance: int, when: str) -> None:
    if files > MAX_APPLY_FILES:
        raise PatchError(f"applying the diff {when} {files} files (at most {MAX_APPLY_FILES})")
    if written > allowance:
        raise PatchError(
            f"applying the diff {when} {written} bytes, more than the {allowance} it may write "
            "(its own bytes plus one rewrite of each file it edits)"
        )


def _entries(root: Path) -> dict[str, os.stat_result]:
    """Relative path -> lstat of every file and symlink below ``root`` (not directories).

    Iterative (no recursion limit: a tree 1,000+ levels deep is walked), never follows links;
    names that are not UTF-8 come back with surrogate escapes, as ``os`` gives them.
    """
    out: dict[str, os.stat_result] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for entry in it:
                sub = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir(follow_symlinks=False):
                    stack.append(sub)
                else:
                    out[sub] = entry.stat(follow_symlinks=False)
    return out


def _same(a: Path, b: Path, sa: os.stat_result, sb: os.stat_result) -> bool:
    if (sa.st_ino, sa.st_dev) == (sb.st_ino, sb.st_dev):
        return True
    if stat.S_IFMT(sa.st_mode) != stat.S_IFMT(sb.st_mode):
        return False
    if stat.S_ISLNK(sa.st_mode):
        return os.readlink(a) == os.readlink(b)
    if (sa.st_mode & 0o111 != 0) != (sb.st_mode & 0o111 != 0) or sa.st_size != sb.st_size:
        return False
    return a.read_bytes() == b.read_bytes()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        remove_tree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _restore(base: Path, tree: Path, rel: str) -> None:
    """Put ``base/rel`` back at ``tree/rel`` (a hard link), clearing whatever is in the way."""
    parent = tree
    for part in Path(rel).parts[:-1]:
        parent = parent / part
        if parent.is_symlink() or (parent.exists() and not parent.is_dir()):
            parent.unlink()
        parent.mkdir(exist_ok=True)
    _remove(tree / rel)
    os.link(base / rel, tree / rel, follow_symlinks=False)


_BINARY_NOTE = re.compile(r"^(Binary files .* differ|GIT binary patch)$", re.MULTILINE)
_TO_SYMLINK = re.compile(r"^new (file )?mode 120000$", re.MULTILINE)

TOOL_OUTPUT_DIRS = frozenset(
    "build dist .eggs .venv venv .tox .nox .mypy_cache .ruff_cache .hypothesis htmlcov "
    "node_modules".split()
)
"""Top-level directories tools create in the working directory (``pip install .``'s and
``python -m build``'s output, virtualenvs, tox, type checkers', linters' and test tools' caches,
coverage's HTML). A file a diff *creates* under one is a byproduct (:func:`drop_binary`); files
the base already has there are applied as any other. No shipped gold patch writes under one."""


def _dropped(path: str, chunk: str, venvs: set[str]) -> bool:
    """Whether one file patch is a byproduct :func:`drop_binary` drops."""
    if _BINARY_NOTE.search(chunk) or "\0" in chunk:
        return True
    head = chunk.split("\n@@", 1)[0]
    if _TO_SYMLINK.search(head):
        return True
    if _patch_paths(chunk)[2] != "new":
        return False
    parts = path.split("/")
    return parts[0] in TOOL_OUTPUT_DIRS or any(
        "/".join(parts[:i]) in venvs for i in range(1, len(parts))
    )


def drop_binary(diff: str) -> tuple[str, list[str]]:
    """The diff without the file patches that are byproducts, not work: ``(diff, dropped
    paths)``.

    What a binary or untracked artefact means: the verdict grades the text the agent changed. A
    file patch that only notes a binary file (``Binary files a/x and b/x differ``, what
    ``Sandbox.diff`` writes for binary, non-UTF-8 and over-2-MiB files) or carries a ``GIT
    binary patch`` holds nothing ``git apply`` can use without the blobs, and git refuses the
    whole diff for it; a test run's byproduct (a SQLite file, a coverage database, a log in
    latin-1) would then void a correct fix. Such patches are dropped: not applied, not graded,
    listed in ``GradeResult.dropped_paths``. A file patch written as text that holds a NUL byte
    is binary content too (``Sandbox.diff`` never writes one; ``git apply`` would write it: a
    native module that shadows the library's source, which no guard reads) and is dropped the
    same way. So are what tools leave behind, which voided a correct fix as well: a new
    symlink (the guard denies one; a virtualenv holds several), a new file under a top-level
    :data:`TOOL_OUTPUT_DIRS` directory (``build/lib/pkg.py``, a copy of the package that the
    guard read as new code, denied; a type checker's cache past ``MAX_APPLY_FILES``), and a new
    file under a new directory holding a ``pyvenv.cfg`` (a virtualenv of any name). A diff
    still over ``MAX_APPLY_FILES`` file patches loses its new data files (not Python, no
    python ``#!`` line, no ``>>>``), which git would refuse with the rest. Other untracked text
    files are ordinary new files and are applied like any other. Dropping only
    removes what the agent wrote, so it cannot raise a grade; a fix that needs a binary file,
    a symlink or a new file in those directories cannot be graded (no shipped task has one).
    """
    chunks = split_diff(diff)
    venvs = {
        p[: -len("/pyvenv.cfg")]
        for p, c in chunks
        if p.endswith("/pyvenv.cfg") and _patch_paths(c)[2] == "new"
    }
    kept, dropped = [], []
    for path, chunk in chunks:
        if _dropped(path, chunk, venvs):
            dropped.append(path or "<unparsed chunk>")
        else:
            kept.append((path, chunk))
    if len(kept) > MAX_APPLY_FILES:  # more files than any fix: a run's output, its data goes
        data = [pc for pc in kept if _new_data(*pc)]
        dropped += [p for p, _ in data]
        kept = [pc for pc in kept if not _new_data(*pc)]
    return ("".join(c for _, c in kept), dropped) if dropped else (diff, [])


def _new_data(path: str, chunk: str) -> bool:
    """A new file Python does not import and no doctest reads (the guard's
    ``guardproc.byproduct``, read from the patch)."""
    if path.endswith(PYTHON_SUFFIXES) or _patch_paths(chunk)[2] != "new" or ">>>" in chunk:
        return False
    first = next((ln for ln in chunk.split("\n") if ln.startswith("+") and ln[:4] != "+++ "), "")
    return not (first.startswith("+#!") and "python" in first)


def apply_to_copy(
    base: Path, diff: str, protected: Callable[[str], bool], dest: Path
) -> tuple[list[str], list[str]]:
    """Apply ``diff`` to ``dest``, a hard-linked copy of ``base``, then undo every change git made
    to a ``protected`` path; returns ``(changed, stripped)`` workspace-relative paths.

    The paths are decided on the tree git produced (every file compared with ``base``), not on
    the diff's text, so no quoting, escaping or header trick can hide a path. ``git apply``
    replaces a file by unlinking it first, so ``base`` is never written through the links; it
    refuses paths outside ``dest`` and paths through symbolic links. File modes end 0644/0755
    (no setuid bit survives). Raises PatchError when git refuses the diff, it is larger than
    ``MAX_AGENT_DIFF_BYTES``, holds a ``GIT binary patch`` (a compressed literal could fill the
    host's disk), git takes more than a minute, or applying it would write more files or bytes
    than ``write_bound`` allows (decided before git writes anything; checked again on the tree it
    wrote, and no single file may grow past the allowance while git writes): all the agent's
    doing. Raises OSError when the tree git wrote cannot be read back (``HOST_ERRNOS`` are the
    host's fault; any other number is the agent's).
    """
    base_entries = _entries(base)
    for rel in base_entries:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(base / rel, dest / rel, follow_symlinks=False)
    if not diff.strip():
        return [], []
    data = diff.encode("utf-8", "surrogateescape")
    if len(data) > MAX_AGENT_DIFF_BYTES:
        raise PatchError(f"the diff is larger than {MAX_AGENT_DIFF_BYTES} bytes")
    if re.search(rb"^GIT binary patch", data, re.MULTILINE):
        # compressed literals could inflate to any size on the host; workspace diffs never
        # carry them (Sandbox.diff notes binary files instead of dumping them)
        raise PatchError("binary patches are not applied")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GIT_CEILING_DIRECTORIES": str(dest.resolve().parent),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "HOME": str(dest),
    }
    sizes = {rel: st.st_size for rel, st in base_entries.items()}
    written, files, allowance = write_bound(diff, sizes)
    _check_bound(written, files, allowance, "would write up to")
    seen = _git_apply(["--numstat"], data, dest, env).count(b"\n")
    if seen != len(split_diff(diff)):  # git reads more file patches than the bound counted
        raise PatchError(
            f"git reads {seen} file patches in the diff, coderl {len(split_diff(diff))}"
        )
    _git_apply([], data, dest, env, fsize=allowance)
    after = [st for rel, st in _entries(dest).items() if _new_inode(rel, st, base_entries)]
    _check_bound(sum(st.st_size for st in after), len(after), allowance, "wrote")
    changed = _changed(base, dest, base_entries)
    stripped = [rel for rel in changed if protected(rel)]
    for rel in stripped:
        if rel in base_entries:
            _restore(base, dest, rel)
        else:
            _remove(dest / rel)
            parent = (dest / rel).parent
            while parent != dest and not (base / parent.relative_to(dest)).exists():
                if any(parent.iterdir()):
                    break
                parent.rmdir()  # a directory git made only for the removed file
                parent = parent.parent
    for rel, st in _entries(dest).items():
        if _new_inode(rel, st, base_entries) and stat.S_ISREG(st.st_mode):
            os.chmod(dest / rel, 0o755 if st.st_mode & 0o111 else 0o644)
    return (_changed(base, dest, base_entries) if stripped else changed), stripped


def _git_apply(
    flags: list[str], data: bytes, dest: Path, env: dict[str, str], fsize: int = 0
) -> bytes:
    """``git apply FLAGS -`` on ``data`` in ``dest``; its stdout. With ``fsize``, no file git
    writes can grow past that many bytes (``prlimit``, where the host has it). Raises
    PatchError when git refuses the diff or takes more than a minute."""
    cmd = ["git", "apply", "--whitespace=nowarn", *flags, "-"]
    if fsize and shutil.which("prlimit"):
        cmd = ["prlimit", f"--fsize={fsize}", "--", *cmd]
    try:
        proc = subprocess.run(cmd, cwd=dest, input=data, capture_output=True, env=env, timeout=60)
    except subprocess.TimeoutExpired:
        raise PatchError("git apply took longer than 60 s") from None
    if proc.returncode != 0:
        why = proc.stderr.decode("utf-8", "replace").strip()[-2000:]
        raise PatchError(why or f"git apply ended with status {proc.returncode}")
    return proc.stdout


def _new_inode(rel: str, st: os.stat_result, base_entries: dict[str, os.stat_result]) -> bool:
    """A file git wrote (not the hard link into the base that the copy started with)."""
    old = base_entries.get(rel)
    return old is None or (st.st_ino, st.st_dev) != (old.st_ino, old.st_dev)


def _changed(base: Path, tree: Path, base_entries: dict[str, os.stat_result]) -> list[str]:
    after = _entries(tree)
    return sorted(
        rel
        for rel in set(base_entries) | set(after)
        if rel not in base_entries
        or rel not in after
        or not _same(base / rel, tree / rel, base_entries[rel], after[rel])
    )
