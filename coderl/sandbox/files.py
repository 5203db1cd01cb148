"""File operations done by the sandbox's own shell, as the sandbox user, inside its namespaces.

Going through the sandbox (rather than opening files from the host) means a path is resolved
exactly as a command would resolve it, symlinks included, with the sandbox's permissions: a
symlink planted in the workspace can never make the host read or write its own files. Each
operation is one round trip to the persistent shell, using absolute tool paths (the user's PATH,
functions and aliases cannot interfere) and no ``cd`` (the terminal's state is untouched).
"""

from __future__ import annotations

import base64
import errno
import posixpath
from collections.abc import Callable

from coderl.sandbox.base import ExecResult
from coderl.sandbox.shell import bash_quote

READ_LIMIT_BYTES = 64 * 1024**2
"""Largest file ``read_text`` returns; bigger files raise ValueError."""

_ERRORS: tuple[tuple[str, type[OSError], int], ...] = (
    ("No such file or directory", FileNotFoundError, errno.ENOENT),
    ("Is a directory", IsADirectoryError, errno.EISDIR),
    ("Not a directory", NotADirectoryError, errno.ENOTDIR),
    ("Permission denied", PermissionError, errno.EACCES),
    ("Read-only file system", PermissionError, errno.EROFS),
    ("No space left on device", OSError, errno.ENOSPC),
    ("File too large", OSError, errno.EFBIG),
)


class FileOps:
    """``read_text``/``write_text``/``list`` over ``run(cmd, output_bytes) -> ExecResult``.

    ``root``: the directory relative paths start from (``/testbed`` in a sandbox); absolute
    paths under ``/testbed`` are moved under ``root`` (for the ``local`` backend).
    """

    def __init__(self, run: Callable[[str, int], ExecResult], root: str = "/testbed") -> None:
        self._run = run
        self.root = root

    def resolve(self, path: str) -> str:
        """Absolute sandbox path for ``path`` (relative paths start at ``root``)."""
        if not path or "\0" in path:
            raise ValueError(f"invalid path {path!r}")
        full = posixpath.normpath(posixpath.join("/testbed", path))
        if self.root != "/testbed" and (full == "/testbed" or full.startswith("/testbed/")):
            full = self.root + full[len("/testbed") :]
        return full

    def read_text(self, path: str) -> str:
        target = bash_quote(self.resolve(path))
        res = self._run(f"/usr/bin/cat -- {target}", READ_LIMIT_BYTES + 2)
        _raise_for(res, path)
        if res.truncated:
            raise ValueError(f"{path}: larger than {READ_LIMIT_BYTES} bytes; read it in parts")
        return res.stdout

    def write_text(self, path: str, text: str) -> None:
        full = self.resolve(path)
        payload = base64.encodebytes(text.encode("utf-8")).decode()
        cmd = (
            f"/usr/bin/mkdir -p -- {bash_quote(posixpath.dirname(full))} && "
            f"/usr/bin/base64 -d >| {bash_quote(full)} <<'__CODERL_EOF__'\n"
            f"{payload}__CODERL_EOF__"
        )
        _raise_for(self._run(cmd, 64 * 1024), path)

    def list(self, path: str = ".") -> list[str]:
        target = bash_quote(self.resolve(path))
        cmd = (
            f"if [ -d {target} ]; then /usr/bin/find {target} -mindepth 1 -maxdepth 1 "
            f"-printf '%y%f\\0'; elif [ -e {target} ]; then "
            "echo 'Not a directory' >&2; false; else echo 'No such file or directory' >&2; false; fi"
        )
        res = self._run(cmd, READ_LIMIT_BYTES)
        _raise_for(res, path)
        names = [e[1:] + ("/" if e[0] == "d" else "") for e in res.stdout.split("\0") if e]
        return sorted(names)


def _raise_for(res: ExecResult, path: str) -> None:
    """Turn a failed helper command into the matching OSError subclass."""
    if res.timed_out:
        raise TimeoutError(f"{path}: file operation timed out")
    if res.exit_code == 0:
        return
    for text, exc, code in _ERRORS:
        if text in res.stderr:
            raise exc(code, f"{text}: {path}")
    raise OSError(f"{path}: {res.stderr.strip() or f'exit code {res.exit_code}'}")
