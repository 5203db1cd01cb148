"""Sandbox interface types shared by the harness, the grader and the environment builder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
    """Bytes of stdout and of stderr kept per command; the rest is cut with a marker."""


@dataclass
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    truncated: bool


class Sandbox(Protocol):
    """An isolated workspace at ``/testbed`` over a read-only base directory."""

    def exec(self, cmd: str, *, timeout: float | None = None) -> ExecResult: ...
    def read_text(self, path: str) -> str: ...
    def write_text(self, path: str, text: str) -> None: ...
    def list(self, path: str = ".") -> list[str]: ...
    def diff(self) -> str: ...
    def close(self) -> None: ...
