"""What ``Sandbox.fork()`` carries from a parent sandbox to its child, and the tree copy it uses.

A fork is a new sandbox (its own uid, limits, scratch directory, stage and shell) whose workspace
starts as a copy of the parent's: for an overlay workspace the parent's upper layer (its changes,
whiteouts and opaque directories) over the same read-only base, otherwise the parent's whole
tree. The parent's shell state (cwd and exported variables, recorded by the shell after every
command, ``coderl.sandbox.shell``) is replayed into the child's fresh shell.

Not carried: running processes (a server or a background job of the parent is not running in
the child), non-exported shell variables, functions and aliases, ``/dev/shm``, open files. The
copy is made while the parent's shell is idle (its lock is held), but a background process of
the parent that writes during the copy may leave the child a half-written file. Hard links
inside the copied tree stay hard links (``cp -a``); nothing is shared between parent and child.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from coderl.sandbox.base import SandboxError
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


def copy_tree(
    src: str, dst: str, *, owner: int | None = None, new_owner: int | None = None
) -> None:
    """Copy the contents of directory ``src`` into the existing directory ``dst``.

    ``cp -a`` keeps modes, times, symlinks, hard links, device nodes (overlay whiteouts) and
    extended attributes (``trusted.overlay.*``, as root); every inode is new, so a write on one
    side never shows on the other. Then files owned by ``owner`` are given to ``new_owner``
    (uid and gid) when both are set and differ. Raises SandboxError (the copy failed, e.g. the
    child's ``disk_bytes`` is smaller than the parent's workspace).
    """
    _run(["/usr/bin/cp", "-a", "--no-target-directory", "--", src, dst])
    if owner is not None and new_owner is not None and owner != new_owner:
        _run(["/usr/bin/chown", "-hR", f"--from={owner}:{owner}", f"{new_owner}:{new_owner}", dst])


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()[:1] or ["no message"]
        raise SandboxError(f"fork: {argv[0]} failed: {why[0]}")
