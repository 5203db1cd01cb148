"""Isolated copy-on-write workspaces over real repositories: ``Sandbox.create(base, ...)``.

See ``coderl.sandbox.bwrap`` for what is and is not isolated, ``coderl.sandbox.local`` for the
unisolated fallback, ``coderl.sandbox.pool`` (``SandboxPool``) for sandboxes started ahead of
time, and ``coderl.sandbox.base`` for the interface.
"""

from coderl.sandbox import backends  # noqa: F401  - fills base.BACKENDS
from coderl.sandbox.base import (
    DIFF_EXCLUDES,
    ExecResult,
    Limits,
    Sandbox,
    SandboxError,
    WorkspaceError,
)

__all__ = ["DIFF_EXCLUDES", "ExecResult", "Limits", "Sandbox", "SandboxError", "WorkspaceError"]
