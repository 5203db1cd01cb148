"""The workspace's changes against its base, as a git-style unified diff, computed on the host.

Overlay workspaces are diffed from the overlay's upper directory alone (cost grows with what
changed, not with the repository): a regular file or symlink there is new or modified, a 0/0
character device is a whiteout (deleted), a directory with the ``trusted.overlay.opaque`` xattr
hides everything below it in the base (Linux Documentation/filesystems/overlayfs.rst, "whiteouts
and opaque directories"). Copy workspaces are diffed by walking both trees.

The sandbox may still be running while the host reads its files, so every path is opened
component by component relative to directory fds with O_NOFOLLOW: a symlink swapped into the
workspace is reported as a symlink and never followed out of it.

Limits: the walk is iterative and holds one directory fd per level; directories more than
``MAX_DEPTH`` levels below the workspace root are not entered, so changes there are left out of
the diff (a tree 1,000+ levels deep costs the agent those files, never the harness a crash). File
names that are not UTF-8 come back with ``surrogateescape`` (write the diff with that handler to
get the original bytes).
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_TEXT_BYTES = 2 * 1024**2
"""Files larger than this are reported like binary files (noted, not diffed)."""
MAX_DEPTH = 128
"""Deepest directory level the diff walks into (the workspace root is level 0)."""
MAX_DIFF_TEXT_BYTES = 16 * 1024**2
"""Bytes of file content (old plus new) one diff compares line by line, given to the smallest
changed files first; larger ones past it are noted like binary files. Bounds the host's time
and the diff's size on a workspace the policy filled (a 64 MiB workspace took 34 s and built a
96 MiB diff before), while a small fix beside large byproducts is still diffed."""


@dataclass(frozen=True)
class Entry:
    """One non-directory file: git mode (100644, 100755, 120000) and content (link target)."""

    mode: int
    data: bytes


def overlay_diff(base: Path, upper: Path, exclude: Sequence[str]) -> str:
    """Diff of an overlay workspace: ``upper`` (changes) over ``base`` (the lower layer)."""
    changes: dict[str, tuple[Entry | None, Entry | None]] = {}
    base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for rel, kind, new in _walk_upper(upper):
            if kind == "opaque":  # the base directory's content is hidden: all of it deleted
                for old_rel, old_entry in _walk_tree(base_fd, rel):
                    changes.setdefault(old_rel, (old_entry, None))
                continue
            found = _lookup(base_fd, rel)
            if found == "dir":  # a base directory deleted, or replaced by a file
                for old_rel, old_entry in _walk_tree(base_fd, rel):
                    changes[old_rel] = (old_entry, None)
            old = found if isinstance(found, Entry) else None
            if kind == "whiteout":
                if old is not None:
                    changes[rel] = (old, None)
            elif old != new:
                changes[rel] = (old, new)
            else:  # rewritten unchanged (possibly inside an opaque directory seen above)
                changes.pop(rel, None)
    finally:
        os.close(base_fd)
    return _render(changes, exclude)


def tree_diff(base: Path, tree: Path, exclude: Sequence[str]) -> str:
    """Diff of a full copy ``tree`` against ``base`` (both walked)."""
    base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    tree_fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        old = dict(_walk_tree(base_fd, ""))
        new = dict(_walk_tree(tree_fd, ""))
    finally:
        os.close(base_fd)
        os.close(tree_fd)
    changes = {
        rel: (old.get(rel), new.get(rel))
        for rel in old.keys() | new.keys()
        if old.get(rel) != new.get(rel)
    }
    return _render(changes, exclude)


def _walk_upper(upper: Path) -> Iterator[tuple[str, str, Entry | None]]:
    """(relative path, "file" | "whiteout" | "opaque", entry) for each change in ``upper``."""
    upper_fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for rel_dir, dirnames, filenames, dirfd in _fwalk(upper_fd, ""):
            for name in dirnames:
                if _is_opaque(name, dirfd):
                    yield os.path.join(rel_dir, name), "opaque", None
            for name in filenames:
                found = _stat_entry(name, dirfd)
                if found is not None:
                    yield os.path.join(rel_dir, name), *found
    finally:
        os.close(upper_fd)


def _stat_entry(name: str, dirfd: int) -> tuple[str, Entry | None] | None:
    """("whiteout", None) or ("file", entry) for a name in an upper directory; None for other
    file types and for a file that vanished or changed type while being read (the sandbox may
    still be running: a race it causes must not crash the diff)."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            return "whiteout", None
        if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            return "file", _entry(name, dirfd, st)
    except OSError:
        pass
    return None


def _is_opaque(name: str, dirfd: int) -> bool:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dirfd)
    except OSError:
        return False
    try:
        return os.getxattr(fd, "trusted.overlay.opaque") == b"y"
    except OSError:
        return False
    finally:
        os.close(fd)


def _entry(name: str, dirfd: int, st: os.stat_result) -> Entry:
    if stat.S_ISLNK(st.st_mode):
        return Entry(0o120000, os.readlink(name, dir_fd=dirfd).encode())
    mode = 0o100755 if st.st_mode & 0o100 else 0o100644
    # O_NONBLOCK: a file swapped for a FIFO since the stat must not block the host
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return Entry(mode, b"")
        return Entry(mode, f.read(MAX_TEXT_BYTES + 1))


def _lookup(root_fd: int, rel: str) -> Entry | str | None:
    """What ``rel`` is under ``root_fd``: an Entry, "dir", or None (absent / special file)."""
    *parents, name = rel.split("/")
    fd = os.dup(root_fd)
    try:
        for part in parents:
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = nxt
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stat.S_ISDIR(st.st_mode):
            return "dir"
        if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            return _entry(name, fd, st)
        return None
    finally:
        os.close(fd)


def _walk_tree(root_fd: int, rel: str) -> Iterator[tuple[str, Entry]]:
    """Every regular file and symlink at or below ``rel`` (relative to ``root_fd``)."""
    found = _lookup(root_fd, rel) if rel else "dir"
    if isinstance(found, Entry):
        yield rel, found
    if found != "dir":
        return
    top = os.open(rel or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
    try:
        for rel_dir, _dirs, filenames, dirfd in _fwalk(top, rel, rel.count("/") + bool(rel)):
            for name in filenames:
                found = _stat_entry(name, dirfd)
                if found is not None and found[1] is not None:
                    yield os.path.join(rel_dir, name), found[1]
    finally:
        os.close(top)


def _fwalk(
    dir_fd: int, rel: str, depth: int = 0
) -> Iterator[tuple[str, list[str], list[str], int]]:
    """``os.fwalk(follow_symlinks=False)`` from an open directory, without recursion: yields
    ``(rel_dir, dirnames, filenames, dirfd)`` top-down, never entering a level past
    ``MAX_DEPTH`` (``depth`` is the level of ``dir_fd``). Holds one fd per level; the caller's
    ``dir_fd`` stays open. Unreadable subdirectories are skipped."""
    stack: list[tuple[str, int, Iterator[str]]] = []
    current: tuple[str, int] | None = (rel, os.dup(dir_fd))
    try:
        while True:
            if current is not None:
                rel_dir, fd = current
                stack.append((rel_dir, fd, iter(())))
                current = None
                dirs, files = _scan(fd)
                yield rel_dir, dirs, files, fd
                if depth + len(stack) <= MAX_DEPTH:
                    stack[-1] = (rel_dir, fd, iter(dirs))
            if not stack:
                return
            rel_dir, fd, pending = stack[-1]
            name = next(pending, None)
            if name is None:
                stack.pop()
                os.close(fd)
                continue
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:  # replaced by a symlink or a file meanwhile, or unreadable
                continue
            current = (os.path.join(rel_dir, name) if rel_dir else name, sub)
    finally:
        for _, fd, _ in stack:
            os.close(fd)
        if current is not None:
            os.close(current[1])


def _scan(fd: int) -> tuple[list[str], list[str]]:
    """(subdirectory names, other names) of the directory open as ``fd``."""
    dirs, files = [], []
    with os.scandir(fd) as entries:
        for e in entries:
            (dirs if e.is_dir(follow_symlinks=False) else files).append(e.name)
    return dirs, files


def _excluded(rel: str, exclude: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(part, pat) for part in rel.split("/") for pat in exclude)


def _render(changes: dict[str, tuple[Entry | None, Entry | None]], exclude: Sequence[str]) -> str:
    kept = {rel: pair for rel, pair in changes.items() if not _excluded(rel, exclude)}
    noted = _over_budget(kept)
    parts = []
    for rel in sorted(kept):
        old, new = kept[rel]
        text = rel not in noted
        if old is not None and new is not None and (old.mode == 0o120000) != (new.mode == 0o120000):
            parts.append(_file_diff(rel, old, None, text) + _file_diff(rel, None, new, text))
        else:
            parts.append(_file_diff(rel, old, new, text))
    return "".join(parts)


def _over_budget(changes: dict[str, tuple[Entry | None, Entry | None]]) -> set[str]:
    """Paths left past ``MAX_DIFF_TEXT_BYTES`` when it is spent on the smallest changes first."""
    size = {rel: sum(len(e.data) for e in pair if e is not None) for rel, pair in changes.items()}
    left, over = MAX_DIFF_TEXT_BYTES, set()
    for rel in sorted(size, key=lambda r: (size[r], r)):
        if size[rel] > left:
            over.add(rel)
        else:
            left -= size[rel]
    return over


def _text(entry: Entry | None) -> str | None:
    """The entry's text, or None when it is binary or too large to diff ("" when absent)."""
    if entry is None:
        return ""
    if len(entry.data) > MAX_TEXT_BYTES or b"\0" in entry.data[:8192]:
        return None
    try:
        return entry.data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _file_diff(rel: str, old: Entry | None, new: Entry | None, text: bool = True) -> str:
    """git-style diff of one path: headers, then hunks or a ``Binary files ... differ`` note
    (also for text when ``text`` is False: past the diff's budget)."""
    head = f"diff --git {_quote('a/' + rel)} {_quote('b/' + rel)}\n"
    if old is None and new is not None:
        head += f"new file mode {new.mode:o}\n"
    elif new is None and old is not None:
        head += f"deleted file mode {old.mode:o}\n"
    elif old is not None and new is not None and old.mode != new.mode:
        head += f"old mode {old.mode:o}\nnew mode {new.mode:o}\n"
    if old is not None and new is not None and old.data == new.data:
        return head
    a, b = _text(old), _text(new)
    src = _quote(f"a/{rel}") if old is not None else "/dev/null"
    dst = _quote(f"b/{rel}") if new is not None else "/dev/null"
    if a is None or b is None or not text:
        return head + f"Binary files {src} and {dst} differ\n"
    if a == b:  # empty file created or deleted
        return head
    body = []
    for line in difflib.unified_diff(_lines(a), _lines(b), src, dst):
        body.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return head + "".join(body)


_ESCAPES = {7: "a", 8: "b", 9: "t", 10: "n", 11: "v", 12: "f", 13: "r", 34: '"', 92: "\\"}


def _quote(path: str) -> str:
    """A path as git writes it in diff headers: as is when plain printable ASCII, else in double
    quotes with C escapes and octal bytes (names that are not UTF-8 included: ``os`` hands them
    over with surrogate escapes), so the diff text is always ASCII-safe and ``git apply``
    reads back the exact bytes."""
    raw = os.fsencode(path)
    if all(0x20 <= b < 0x7F and b not in (34, 92) for b in raw):
        return path
    out = []
    for b in raw:
        if b in _ESCAPES:
            out.append("\\" + _ESCAPES[b])
        elif 0x20 <= b < 0x7F:
            out.append(chr(b))
        else:
            out.append(f"\\{b:03o}")
    return '"' + "".join(out) + '"'


def _lines(text: str) -> list[str]:
    """Lines split on ``\\n`` only, each keeping its ``\\n`` (the last may lack one)."""
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete ``path`` and everything below it, like ``shutil.rmtree``, but without recursion
    and without long paths (Python 3.11's ``rmtree`` and ``os.walk`` recurse, so a tree 1,000+
    levels deep raises RecursionError). Holds one directory fd at a time, walking back up
    through ``..``: only for trees no process is changing any more (a closed sandbox's).
    Directories without permissions are made traversable first. Raises OSError.
    """
    path = os.fspath(path)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    fd = os.open(path, flags)
    names: list[str] = []  # the directories entered below ``path``, outermost first
    try:
        while True:
            child = None
            with os.scandir(fd) as entries:
                for e in entries:
                    if e.is_dir(follow_symlinks=False):
                        child = e.name
                        break
                    os.unlink(e.name, dir_fd=fd)
            if child is not None:
                os.chmod(child, 0o700, dir_fd=fd)
                nxt = os.open(child, flags, dir_fd=fd)
                os.close(fd)
                fd = nxt
                names.append(child)
                continue
            if not names:
                break
            up = os.open("..", flags, dir_fd=fd)
            os.close(fd)
            fd = up
            os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)
