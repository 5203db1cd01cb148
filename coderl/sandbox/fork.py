"""What ``Sandbox.fork()`` carries from a parent sandbox to its child, and the tree copy it uses.

A fork is a new sandbox (its own uid, limits, scratch directory, stage and shell) whose workspace
starts as a copy of the parent's: for an overlay workspace the parent's upper layer (its changes,
whiteouts and opaque directories) over the same read-only base, otherwise the parent's whole
tree. The parent's shell state (cwd and exported variables, recorded by the shell after every
command, ``coderl.sandbox.shell``) is replayed into the child's fresh shell.

Not carried: running processes (a server or a background job of the parent is not running in
the child), non-exported shell variables, functions and aliases, ``/dev/shm``, open files. The
copy is made while the parent's shell is idle (its lock is held) and, on the bwrap backend as
root, with every process of the parent stopped (SIGSTOP to its uid, SIGCONT after), so a
background job cannot change the tree under the copy. Hard links inside the copied tree stay
hard links (``cp -a``); nothing is shared between parent and child.

Who a failed copy belongs to: a cause that the parent's workspace content makes (a path longer
than PATH_MAX, a symlink loop, more bytes or inodes than the child's own bounded disk holds) is
:class:`coderl.sandbox.base.WorkspaceError`, the agent's failure (its continuation is scored);
anything else is a :class:`SandboxError` (infrastructure, masked). NOT done: a copy that does
not depend on path lengths (``cp`` and ``tar`` both walk by full paths), so a tree deeper than
PATH_MAX is not forked, it is scored as the policy's failure.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from coderl.sandbox.base import SandboxError, WorkspaceError
from coderl.sandbox.shell import ShellState


@dataclass(frozen=True)
class Seed:
    """The parent's side of a fork, handed to the child's constructor."""

    tree: str
    """Host path of the parent's scratch directory (bwrap) or workspace (local), reachable from
    any mount namespace (``/proc/<pid>/fd/<n>`` for a tmpfs that exists only in a stage)."""
    uid: int
    """The parent's sandbox uid: files it owns become the child's."""
    mode: str
    """The parent's workspace mode (``"overlay"`` or ``"copy"``); the child must get the same."""
    state: ShellState
    """The parent shell's cwd and exported variables after its last command."""


WORKSPACE_CAUSES = ("File name too long", "Too many levels of symbolic links")
"""``cp``'s messages (C locale) for copy failures that the tree being copied causes."""
FULL_DISK = ("No space left on device", "Disk quota exceeded")
"""Its messages for a destination that is full: the workspace's doing when that destination is
the child's own bounded disk (``bounded``), a host fault otherwise."""


def copy_tree(
    src: str,
    dst: str,
    *,
    owner: int | None = None,
    new_owner: int | None = None,
    bounded: bool = False,
) -> None:
    """Copy the contents of directory ``src`` into the existing directory ``dst``.

    ``cp -a`` keeps modes, times, symlinks, hard links, device nodes (overlay whiteouts) and
    extended attributes (``trusted.overlay.*``, as root); every inode is new, so a write on one
    side never shows on the other. Then files owned by ``owner`` are given to ``new_owner``
    (uid and gid) when both are set and differ. ``bounded``: ``dst`` is on the child's own
    size-limited tmpfs, so a full disk there is the workspace's doing.

    Raises:
        WorkspaceError: the tree's content made the copy fail (see ``WORKSPACE_CAUSES`` and
            ``FULL_DISK``): the policy's failure.
        SandboxError: any other failure (infrastructure).
    """
    causes = WORKSPACE_CAUSES + (FULL_DISK if bounded else ())
    _run(["/usr/bin/cp", "-a", "--no-target-directory", "--", src, dst], causes)
    if owner is not None and new_owner is not None and owner != new_owner:
        chown = ["/usr/bin/chown", "-hR", f"--from={owner}:{owner}", f"{new_owner}:{new_owner}"]
        _run([*chown, dst], causes)


def _run(argv: list[str], causes: tuple[str, ...]) -> None:
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}  # messages in one language to classify
    done = subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL, env=env)
    if done.returncode != 0:
        text = done.stderr.decode(errors="replace")
        why = (text.strip().splitlines()[:1] or ["no message"])[0]
        cause = next((c for c in causes if c in text), None)
        if cause is not None:
            raise WorkspaceError(f"fork: {argv[0]} failed on the workspace: {cause}: {why[:200]}")
        raise SandboxError(f"fork: {argv[0]} failed: {why[:300]}")
