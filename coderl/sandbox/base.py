"""Sandbox interface types shared by the harness, the grader and the environment builder.

``Sandbox.create(...)`` is the one entry point; ``BACKENDS`` (filled by ``coderl.sandbox.backends``) is
the only place where a backend name selects an implementation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, TypedDict

DIFF_EXCLUDES: tuple[str, ...] = ("__pycache__", "*.pyc", ".pytest_cache", "*.egg-info")
"""Glob patterns (matched against each path component) that ``Sandbox.diff`` leaves out by
default: byproducts of running Python and pytest in the workspace, not edits."""


BACKENDS: dict[str, Any] = {}
"""Backend name -> sandbox class, the only place a name selects an implementation: filled by
``coderl.sandbox.backends`` (which the package imports), so this module imports no backend and
no backend imports back into a module that imports it."""


BACKEND_ENV = "CODERL_SANDBOX_BACKEND"
"""Environment variable naming the backend ``Sandbox.create`` uses when none is given (default
``bwrap``): the run's ``sandbox.backend`` sets it, so worker processes started later inherit it."""


def default_backend() -> str:
    """The backend of a ``Sandbox.create`` call that names none: ``$CODERL_SANDBOX_BACKEND`` or
    ``bwrap``."""
    return os.environ.get(BACKEND_ENV) or "bwrap"


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, lost its shell): infrastructure, not the
    command's fault. Command failures are reported in ``ExecResult``, never raised."""


class WorkspaceError(SandboxError):
    """A sandbox operation failed because of what the commands left in the workspace (a path
    longer than PATH_MAX, a symlink loop, a tree that does not fit the sandbox's own bounded
    disk): the policy's doing, so the episode it belongs to is scored as the agent's failure,
    never masked as infrastructure."""


DIFF_FAULTS: tuple[type[Exception], ...] = (SandboxError, OSError, RecursionError, UnicodeError)
"""What ``Sandbox.diff`` raises: the sandbox or the host's I/O failed, or the workspace the
commands left cannot be walked or named (RecursionError: a tree too deep; UnicodeError: a name or
link target that is not UTF-8; :func:`coderl.agent.episode.diff_failure` says whose fault). The
diff walks a bounded tree iteratively (``coderl.sandbox.workspace``); anything else is a bug and
propagates."""


BYTES_PER_INODE = 16 * 1024
"""``Limits.inodes`` by default: one inode per this many bytes of ``disk_bytes``."""
MIN_INODES = 4096
"""The fewest inodes a sandbox's tmpfs may have (a workspace, /tmp and home need a few)."""


@dataclass(frozen=True)
class Limits:
    """Hard limits for one sandbox."""

    timeout_s: float = 30.0
    """Default wall-clock limit per command (seconds)."""
    cpu_s: int = 120
    """CPU-time limit per command (seconds, RLIMIT_CPU)."""
    memory_bytes: int = 2 * 1024**3
    """Address-space limit per process (bytes, RLIMIT_AS)."""
    processes: int = 256
    """Process limit for the sandbox's uid (RLIMIT_NPROC)."""
    file_size_bytes: int = 256 * 1024**2
    """Largest file a command may write (bytes, RLIMIT_FSIZE)."""
    output_bytes: int = 1024**2
    """Bytes of stdout and of stderr kept per command (the first and the last half); the middle
    is cut and replaced by a ``[... N bytes truncated ...]`` marker."""
    disk_bytes: int = 4 * 1024**3
    """Bytes the workspace's changes, ``/tmp`` and the home directory may hold together (the size
    of the sandbox's private tmpfs; ``bwrap`` backend only)."""
    inodes: int | None = None
    """Files, directories and links the sandbox's private tmpfs may hold together (its
    ``nr_inodes``; ``bwrap`` backend only). Each costs the host kernel memory outside
    ``disk_bytes`` (about 0.75 KB per empty file: an inode and its dentry), so without this bound
    100,000 empty files in a 1 MiB sandbox took ~75 MB of host memory. None: one per
    ``BYTES_PER_INODE`` of ``disk_bytes``, at least ``MIN_INODES`` (4 GiB -> 262,144 inodes,
    ~200 MB of kernel memory at most; 1 MiB -> 4,096, ~3 MB). Read it through ``inode_limit``."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_bytes", "processes", "file_size_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)!r}")
        if self.output_bytes < 2 or self.disk_bytes < 1024**2:
            raise ValueError("Limits.output_bytes must be >= 2 and disk_bytes >= 1 MiB")
        if self.inodes is not None and self.inodes < MIN_INODES:
            raise ValueError(f"Limits.inodes must be >= {MIN_INODES}, got {self.inodes!r}")

    @property
    def inode_limit(self) -> int:
        """``inodes``, or the default derived from ``disk_bytes`` (see ``inodes``)."""
        if self.inodes is not None:
            return self.inodes
        return max(MIN_INODES, self.disk_bytes // BYTES_PER_INODE)


@dataclass
class ExecResult:
    """What one command did."""

    exit_code: int
    """Exit status (0-255); 124 when the wall timeout killed it; 128+N when killed by signal N."""
    stdout: str
    """Captured stdout, UTF-8 decoded with replacement, at most ``Limits.output_bytes`` kept."""
    stderr: str
    """Captured stderr, same rules as ``stdout``."""
    timed_out: bool
    """True when the wall timeout expired; every process of the sandbox was then killed."""
    duration_s: float
    """Wall-clock seconds from sending the command to its end (or to the kill)."""
    truncated: bool
    """True when stdout or stderr was longer than ``Limits.output_bytes`` and was cut."""


class SandboxOptions(TypedDict, total=False):
    """The keyword arguments of :meth:`Sandbox.create` that describe the sandbox itself (all but
    ``backend`` and ``pool``; each is documented there): what ``SandboxPool.create`` takes and
    keys its ready sandboxes by."""

    limits: Limits | None
    env: dict[str, str] | None
    ro_mounts: dict[str, str] | None
    rw_mounts: dict[str, str] | None
    network: bool


class Sandbox(Protocol):
    """An isolated workspace at ``/testbed`` over a read-only base directory.

    Relative paths given to ``read_text``/``write_text``/``list`` are relative to ``/testbed``
    (not to the shell's current directory). Implementations subclass this protocol to inherit
    ``create`` and the context-manager methods.
    """

    @staticmethod
    def create(
        base: str | Path,
        *,
        limits: Limits | None = None,
        env: dict[str, str] | None = None,
        ro_mounts: dict[str, str] | None = None,
        rw_mounts: dict[str, str] | None = None,
        network: bool = False,
        backend: str | None = None,
        pool: Any = None,
    ) -> Sandbox:
        """Start a sandbox whose workspace ``/testbed`` is a copy-on-write view of ``base``.

        base: host directory (a repository snapshot); never modified.
        limits: per-command and per-sandbox limits (default ``Limits()``).
        env: variables set in the shell over the defaults (PATH, HOME, LANG, ...); the host
            environment is never inherited.
        ro_mounts / rw_mounts: sandbox path -> host path, mounted read-only / read-write.
        network: True shares the host network (for install steps only); default: none.
        backend: ``"bwrap"`` (isolated), ``"container"`` (a podman container from
            ``$CODERL_CONTAINER_IMAGE``; ``coderl.sandbox.container``) or ``"local"`` (no
            isolation, warns; see ``coderl.sandbox.local``); None: :func:`default_backend`.
        pool: hand out a sandbox started ahead of time by this ``SandboxPool`` when one is
            ready (``coderl.sandbox.pool``; ``bwrap`` backend only), else start one now.
        Raises ValueError (unknown backend, bad mount paths, a pool with another backend),
        FileNotFoundError (``base`` or a mount source missing), SandboxError (the sandbox
        failed to start, the pool is closed).
        """
        backend = backend or default_backend()
        if backend not in BACKENDS:
            raise ValueError(f"unknown sandbox backend {backend!r}; valid: {sorted(BACKENDS)}")
        if pool is not None:
            if backend != "bwrap":
                raise ValueError(f"a SandboxPool holds bwrap sandboxes only, not {backend!r}")
            return pool.create(
                base,
                limits=limits,
                env=env,
                ro_mounts=ro_mounts,
                rw_mounts=rw_mounts,
                network=network,
            )
        return BACKENDS[backend](
            Path(base),
            limits=limits or Limits(),
            env=env or {},
            ro_mounts=ro_mounts or {},
            rw_mounts=rw_mounts or {},
            network=network,
        )

    def exec(self, cmd: str, *, timeout: float | None = None) -> ExecResult:
        """Run bash source ``cmd`` in the sandbox's persistent shell; ``timeout`` seconds
        (default ``Limits.timeout_s``). Never raises for the command's own failures."""
        ...

    def read_text(self, path: str) -> str:
        """Text of a file (UTF-8, undecodable bytes replaced). Raises FileNotFoundError,
        IsADirectoryError, PermissionError."""
        ...

    def write_text(self, path: str, text: str) -> None:
        """Create or replace a file (parent directories are created). Raises PermissionError,
        IsADirectoryError, OSError."""
        ...

    def list(self, path: str = ".") -> list[str]:
        """Sorted names in a directory; subdirectories end with ``/``. Raises
        FileNotFoundError, NotADirectoryError."""
        ...

    def diff(self, *, exclude: Sequence[str] = DIFF_EXCLUDES) -> str:
        """Unified diff (git format, ``a/`` and ``b/`` prefixes) of ``/testbed`` against the
        base; binary files are noted, not dumped. ``exclude``: glob patterns matched against
        each path component."""
        ...

    def fork(self, *, limits: Limits | None = None) -> Sandbox:
        """A new, independent sandbox that starts where this one is now (see ``docs/sandbox.md``,
        "Fork", and ``coderl.sandbox.fork``).

        The child gets a copy of the workspace (``bwrap``: the overlay's upper layer over the same
        read-only base, plus ``/tmp`` and the home directory; ``local``: the whole tree), the
        shell's cwd and exported variables, the same backend, environment, mounts (``rw_mounts``
        stay shared host directories) and network setting, and its own uid, scratch directory,
        shell and ``close``. Afterwards neither side sees the other's writes. Running processes,
        non-exported variables, functions and ``/dev/shm`` are not carried.
        limits: the child's limits (default: this sandbox's).
        Raises SandboxError (this sandbox is closed; the copy or the child's start failed, e.g.
        its ``disk_bytes`` cannot hold this sandbox's changes).
        """
        ...

    def close(self) -> None:
        """Kill every process and delete every file of the sandbox; idempotent."""
        ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
