"""The Sandbox methods that every persistent-shell backend shares (``bwrap`` and ``local``).

A backend keeps one :class:`~coderl.sandbox.shell.Shell` per sandbox, restarts it when it died
(after a timeout killed it), runs one command at a time under a lock, and does its file
operations through :class:`~coderl.sandbox.files.FileOps` over the same shell. How the shell is
started (namespaces or none) and how the sandbox is torn down stay in each backend.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from coderl.sandbox.base import ExecResult, Limits, SandboxError
from coderl.sandbox.files import FileOps
from coderl.sandbox.shell import Shell


class ShellSandboxMethods:
    """``exec`` and the file methods of a sandbox backed by one persistent shell.

    A backend mixes this in before :class:`~coderl.sandbox.base.Sandbox` and sets, in its
    ``__init__``: ``limits``, ``files`` (a ``FileOps`` over :meth:`_run_internal`), ``_lock``,
    ``_closed`` and ``_shell``; it implements ``_start_shell`` (start a shell, carrying the
    old one's cwd and exported environment over, and store it in ``_shell``).
    """

    limits: Limits
    files: FileOps
    _lock: threading.Lock
    _closed: bool
    _shell: Shell | None

    _start_shell: Callable[[], None]
    """Starts ``self._shell``: each backend that mixes this in defines it."""

    def _ensure_shell(self) -> Shell:
        """The live shell, restarted if it died. Raises SandboxError once closed."""
        if self._closed:
            raise SandboxError("the sandbox is closed")
        if self._shell is None or not self._shell.alive:
            self._start_shell()
        assert self._shell is not None
        return self._shell

    def exec(self, cmd: str, *, timeout: float | None = None) -> ExecResult:
        limit = self.limits.timeout_s if timeout is None else timeout
        if not limit > 0:  # NaN too: a NaN deadline breaks the shell's select mid-command
            raise ValueError(f"timeout must be positive, got {limit}")
        with self._lock:
            shell = self._ensure_shell()
            return shell.run(cmd, timeout=limit, output_bytes=self.limits.output_bytes)

    def _run_internal(self, cmd: str, output_bytes: int) -> ExecResult:
        """A helper command (file operations): default timeout, larger output budget."""
        with self._lock:
            shell = self._ensure_shell()
            return shell.run(cmd, timeout=self.limits.timeout_s, output_bytes=output_bytes)

    def read_text(self, path: str) -> str:
        return self.files.read_text(path)

    def write_text(self, path: str, text: str) -> None:
        self.files.write_text(path, text)

    def list(self, path: str = ".") -> list[str]:
        return self.files.list(path)
