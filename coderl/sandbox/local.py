"""The ``local`` backend: the same shell and file interface with NO isolation.

Exists only for hosts without user namespaces or root, where ``bwrap`` cannot run; it must be
asked for explicitly (``backend="local"``) and warns on every sandbox it creates.

What it does: copies ``base`` into a fresh temporary directory (the workspace; ``/testbed`` in
paths given to the file methods means that directory), runs the persistent bash there with a
cleared environment, and applies RLIMIT_CPU/AS/FSIZE per process. A timeout kills the shell's
process group.

Not isolated: everything. Commands run as the calling user with its network, its filesystem
(they can read the home directory and write anywhere the user can) and its processes; a command
that leaves the process group (``setsid``) survives a timeout; no process limit is applied
(RLIMIT_NPROC would count every process of the user). ``ro_mounts``/``rw_mounts`` are refused
(there is no mount namespace to place them in).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

from coderl.sandbox.base import DIFF_EXCLUDES, Limits, Sandbox, SandboxError
from coderl.sandbox.files import FileOps
from coderl.sandbox.fork import Seed, copy_tree
from coderl.sandbox.persistent import ShellSandboxMethods
from coderl.sandbox.shell import Shell, ShellState, init_script, restore_script
from coderl.sandbox.workspace import remove_tree, tree_diff


class UnisolatedSandboxWarning(UserWarning):
    """A sandbox without isolation was created (``backend="local"``)."""


class LocalSandbox(ShellSandboxMethods, Sandbox):
    """An unisolated workspace copy; build it with ``Sandbox.create(..., backend="local")``."""

    def __init__(
        self,
        base: Path,
        *,
        limits: Limits,
        env: dict[str, str],
        ro_mounts: dict[str, str],
        rw_mounts: dict[str, str],
        network: bool,
        seed: Seed | None = None,
    ) -> None:
        """``seed``: the parent of a fork (:meth:`fork`), whose tree and shell state the new
        sandbox starts from; None for a fresh sandbox."""
        if ro_mounts or rw_mounts:
            raise ValueError("the local backend cannot mount trees; use the bwrap backend")
        base = Path(base).resolve()
        if not base.is_dir():
            raise FileNotFoundError(f"base {base} is not an existing directory")
        warnings.warn(
            "coderl sandbox backend 'local' runs commands WITHOUT ISOLATION "
            "(host filesystem, network and processes are reachable)",
            UnisolatedSandboxWarning,
            stacklevel=3,
        )
        self.base, self.limits, self.network = base, limits, network
        self.env = {"PATH": os.defpath, "LANG": "C.UTF-8", "TERM": "dumb"} | dict(env)
        self.tmp = Path(tempfile.mkdtemp(prefix="coderl-local-"))
        self.root = self.tmp / "testbed"
        self._seed = None if seed is None else _moved(seed, str(self.root))
        try:
            if seed is None:
                shutil.copytree(base, self.root, symlinks=True)
            else:
                self.root.mkdir()
                copy_tree(seed.tree, str(self.root))
        except BaseException:
            remove_tree(self.tmp)
            raise
        self._lock = threading.Lock()
        self._closed = False
        self._shell: Shell | None = None
        self.files = FileOps(self._run_internal, root=str(self.root))
        self._start_shell()

    def _start_shell(self) -> None:
        ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
        try:
            proc = subprocess.Popen(
                ["/bin/bash", "--noprofile", "--norc"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.root,
                env=self.env,
                pass_fds=(ctl_w,),
                start_new_session=True,
            )
        finally:
            os.close(ctl_w)
        shell = Shell(proc, ctl_r, kill=lambda: _kill_group(proc, ctl_r))
        lim = self.limits
        ulimits = (
            f"ulimit -c 0 -t {lim.cpu_s} -v {lim.memory_bytes // 1024} "
            f"-f {max(1, lim.file_size_bytes // 1024)}"
        )
        script = init_script(ctl_w, [], ulimits)
        old = self._shell or self._seed  # a restarted shell, or a fork's first one
        if old is not None:
            script += restore_script(old.state.cwd, old.state.env_decls)
            shell.state = old.state
        shell.send(script)
        self._shell = shell

    def diff(self, *, exclude: Sequence[str] = DIFF_EXCLUDES) -> str:
        return tree_diff(self.base, self.root, exclude)

    def fork(self, *, limits: Limits | None = None) -> LocalSandbox:
        with self._lock:
            if self._closed:
                raise SandboxError("cannot fork a closed sandbox")
            assert self._shell is not None
            seed = Seed(str(self.root), os.getuid(), "copy", self._shell.state)
            return LocalSandbox(
                self.base,
                limits=limits or self.limits,
                env=self.env,
                ro_mounts={},
                rw_mounts={},
                network=self.network,
                seed=seed,
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._shell is not None:
                self._shell.kill()
            with contextlib.suppress(OSError):  # a deep tree too: rmtree would recurse
                remove_tree(self.tmp)


def _moved(seed: Seed, root: str) -> Seed:
    """``seed`` with its shell's cwd and exported variables pointing into ``root`` where they
    pointed into the parent's workspace (the local backend has no fixed ``/testbed``)."""
    cwd = seed.state.cwd
    if cwd is not None and (cwd == seed.tree or cwd.startswith(seed.tree + "/")):
        cwd = root + cwd[len(seed.tree) :]
    state = ShellState(cwd=cwd, env_decls=seed.state.env_decls.replace(seed.tree, root))
    return Seed(seed.tree, seed.uid, seed.mode, state)


def _kill_group(proc: subprocess.Popen[bytes], ctl_r: int) -> None:
    """SIGKILL the shell's process group and reap the shell."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    try:
        os.close(ctl_r)
    except OSError:  # already closed by an earlier kill
        pass
