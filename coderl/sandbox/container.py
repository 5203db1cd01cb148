"""The container sandbox: one OCI container per sandbox, run by ``podman``, behind ``Sandbox``.

What one sandbox is (as root; the only mode measured here):
- a private tmpfs of ``Limits.disk_bytes`` (and ``Limits.inode_limit`` files) on a host directory
  under ``CONTAINER_ROOT`` holding the overlay's upper and work directories, ``/tmp``,
  ``/dev/shm`` and the home directory (``/root``);
- one container from ``image`` (``podman run --rm -i``), labelled ``coderl.sandbox`` and with its
  owner's pid and start time (``coderl.owner``); its ``/testbed`` is a podman overlay volume
  (``-v BASE:/testbed:O,upperdir=...,workdir=...``) over the read-only ``base`` with the upper layer
  in the tmpfs, so ``diff`` reads the changes from the host exactly as the ``bwrap`` backend does
  (``coderl.sandbox.workspace.overlay_diff``) and a restarted shell (after a timeout) finds them;
- the host Python's prefix (``sys.base_prefix``) mounted read-only at the same path, as the bwrap
  backend mounts it, so an environment's virtualenv (``/venv``, built over that Python) and the
  grader's boot script run unchanged inside the container;
- the persistent ``bash`` of ``coderl.sandbox.shell`` as the container's process 1's child
  (``--init``), its control pipe passed in as fd 3 (``--preserve-fds``): the end-of-command record
  cannot be forged by a command (fd 3 is closed for it), as in the bwrap backend.

Limits: ``--memory`` (the whole container, cgroup) and ``ulimit -v`` per process, ``--pids-limit``
(the cgroup pids controller; RLIMIT_NPROC does not bind uid 0), ``ulimit -t`` (CPU seconds per
process) and ``-f`` (file size), ``disk_bytes`` (the tmpfs: workspace changes, ``/tmp`` and home
together; the image's own filesystem is read-only), output size and wall time (the shell; a timeout
kills the container and the next command starts a new one over the same tmpfs).

Isolated: network (``--network none`` unless ``network=True``), the host filesystem (only the
image, the Python prefix and the given mounts), host processes (own PID namespace), every
capability (``--cap-drop ALL``, ``no-new-privileges``, podman's default seccomp profile).

Not isolated: there is no user namespace: uid 0 in the container is uid 0 on the host, held back
only by the dropped capabilities and seccomp (the bwrap backend runs as a distinct unprivileged
uid); the kernel is shared; world-readable files in mounted trees are readable.

Cleanup: ``close`` kills and removes the container, unmounts the tmpfs and removes its directory.
A host process killed with SIGKILL leaves its containers (a command still running keeps its shell
alive) and its tmpfs mounts; the first container sandbox of any later process (the *reaper*,
:func:`reap`) removes every container whose ``coderl.owner`` process is gone and unmounts and
deletes the scratch directories of dead owners. An idle container whose owner died ends by
itself: its shell reads end of file on stdin.

Only podman is supported: the backend needs ``--preserve-fds`` (the control pipe) and overlay
volumes with an upper directory (``:O,upperdir=``), which Docker's CLI does not have; with only
``docker`` installed :func:`container_cli` raises and says so.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from itertools import count
from pathlib import Path

import coderl.sandbox.mounts as mounts
from coderl.sandbox.base import DIFF_EXCLUDES, Limits, Sandbox, SandboxError
from coderl.sandbox.bwrap import _check_dir, _check_mounts, hidden_paths
from coderl.sandbox.files import FileOps
from coderl.sandbox.fork import Seed, copy_tree
from coderl.sandbox.persistent import ShellSandboxMethods
from coderl.sandbox.shell import Shell, init_script, restore_script
from coderl.sandbox.workspace import overlay_diff

WORKDIR = "/testbed"
HOME = "/root"
LABEL = "coderl.sandbox"
"""Label on every container this backend starts (the reaper lists them by it)."""
OWNER_LABEL = "coderl.owner"
"""``<pid>:<start time in clock ticks>`` of the host process that owns the container."""
CONTAINER_ROOT = Path(os.environ.get("CODERL_CONTAINER_DIR") or "/dev/shm/coderl-containers")
"""Host directory of the sandboxes' scratch tmpfs mounts (``<pid>-<n>`` each)."""
IMAGE_ENV = "CODERL_CONTAINER_IMAGE"
"""Environment variable naming the default image (``sandbox.image`` sets it for the run)."""
CLI_ENV = "CODERL_CONTAINER_CLI"
"""Environment variable naming the container CLI (``sandbox.cli``; default: found on PATH)."""
_START_S = 120.0
"""Longest wait for a new container's shell to answer (image layers may be set up first)."""
_counter = count()
_reap_lock = threading.Lock()
_reaped: list[bool] = []
_live: weakref.WeakSet[ContainerSandbox] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for sb in list(_live):
        sb.close()


@functools.cache
def container_cli() -> list[str]:
    """The container command line prefix: ``podman`` with the runtime flags this host needs.

    ``CODERL_CONTAINER_CLI`` names the program (default: ``podman`` on PATH). Uses ``runc`` when
    ``crun`` is absent and ``--cgroup-manager cgroupfs`` when systemd is not process 1.
    Raises SandboxError (no podman; only docker, which lacks what this backend needs).
    """
    name = os.environ.get(CLI_ENV) or "podman"
    path = shutil.which(name)
    if path is None or Path(path).name == "docker":
        docker = " (docker is installed, but this backend needs podman's --preserve-fds and "
        docker += "overlay volumes)" if shutil.which("docker") else ""
        raise SandboxError(f"podman is not installed (make sysdeps){docker}")
    argv = [path]
    if shutil.which("crun") is None and shutil.which("runc") is not None:
        argv += ["--runtime", "runc"]
    if Path("/proc/1/comm").read_text().strip() != "systemd":
        argv += ["--cgroup-manager", "cgroupfs"]
    return argv


def run_cli(args: Sequence[str], *, timeout: float = 120.0, check: bool = True) -> str:
    """Run ``podman ARGS`` and return its stdout. Raises SandboxError when it fails (``check``)."""
    try:
        done = subprocess.run(
            container_cli() + list(args),
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"podman {args[0]} timed out after {timeout} s") from e
    if check and done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise SandboxError(f"podman {args[0]} failed: {why[0]}")
    return done.stdout.decode(errors="replace")


def default_image() -> str:
    """The image sandboxes start from when none is given: ``$CODERL_CONTAINER_IMAGE``.
    Raises SandboxError when it is not set."""
    image = os.environ.get(IMAGE_ENV)
    if not image:
        raise SandboxError(
            f"no container image: set sandbox.image (or {IMAGE_ENV}); "
            "`coderl tasks build-env SPEC --image` or coderl.sandbox.images.base_image() builds one"
        )
    return image


def _start_time(pid: int) -> str | None:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22),
    None when it does not exist: a pid together with its start time names one process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner() -> str:
    return f"{os.getpid()}:{_start_time(os.getpid())}"


def _alive(owner: str) -> bool:
    pid, _, start = owner.partition(":")
    return pid.isdigit() and _start_time(int(pid)) == start


def reap() -> tuple[int, int]:
    """Remove the containers and scratch directories of dead owner processes.

    Lists every container labelled ``coderl.sandbox`` (running or not) and removes (``rm -f``)
    those whose ``coderl.owner`` process no longer exists; then unmounts and deletes the scratch
    directories under ``CONTAINER_ROOT`` whose owner pid is gone. Returns ``(containers,
    directories)`` removed. Raises SandboxError when podman cannot list containers.
    """
    listing = run_cli(["ps", "-a", "--filter", f"label={LABEL}", "--format", "json"])
    dead = [
        c["Id"]
        for c in json.loads(listing or "[]")
        if not _alive((c.get("Labels") or {}).get(OWNER_LABEL, ""))
    ]
    if dead:
        run_cli(["rm", "-f", "--time", "0", *dead], check=False)
    dirs = 0
    if CONTAINER_ROOT.is_dir():
        for entry in CONTAINER_ROOT.iterdir():
            owner = entry.name.rsplit("-", 1)[0].replace("-", ":", 1)
            if _alive(owner):
                continue
            try:
                _remove_scratch(entry)
            except (OSError, SandboxError):
                continue
            dirs += 1
    return len(dead), dirs


def _reap_once() -> None:
    with _reap_lock:
        if not _reaped:
            _reaped.append(True)
            reap()


class ContainerSandbox(ShellSandboxMethods, Sandbox):
    """A sandbox in a podman container; build it with ``Sandbox.create(..., backend="container")``
    (image from ``$CODERL_CONTAINER_IMAGE``) or directly to name the image."""

    def __init__(
        self,
        base: Path,
        *,
        limits: Limits,
        env: dict[str, str],
        ro_mounts: dict[str, str],
        rw_mounts: dict[str, str],
        network: bool,
        image: str | None = None,
        seed: Seed | None = None,
    ) -> None:
        """``image``: the image to run (default :func:`default_image`); ``seed``: the parent of a
        fork, whose workspace, ``/tmp``, home and shell state the new sandbox starts from."""
        self.cli = container_cli()
        self.image = image or default_image()
        self.base = _check_dir(Path(base), "base")
        self.limits, self.network = limits, network
        self.ro_mounts = _podman_mounts(ro_mounts, "ro_mounts")
        self.rw_mounts = _podman_mounts(rw_mounts, "rw_mounts")
        self.env = {"HOME": HOME, "LANG": "C.UTF-8", "TERM": "dumb", "TMPDIR": "/tmp"} | env
        self._lock = threading.Lock()
        self._shell: Shell | None = None
        self._closed = False
        self._seed = seed
        self._starts = 0
        self._podman_said = ""
        _reap_once()
        self.owner = _owner()
        self.scratch = CONTAINER_ROOT / f"{self.owner.replace(':', '-')}-{next(_counter)}"
        try:
            self._build_scratch()
            self._start_shell()
        except BaseException:
            self.close()
            raise
        self.files = FileOps(self._run_internal)
        _live.add(self)

    def _build_scratch(self) -> None:
        s = str(self.scratch)
        self.scratch.mkdir(parents=True, mode=0o700)
        mounts.mount_tmpfs(s, self.limits.disk_bytes, self.limits.inode_limit, 0, 0)
        for name in ("upper", "work", "tmp", "shm", "home"):
            os.mkdir(f"{s}/{name}")
        for name in ("tmp", "shm"):
            os.chmod(f"{s}/{name}", 0o1777)
        if self._seed is not None:
            for name in ("upper", "tmp", "home"):
                copy_tree(f"{self._seed.tree}/{name}", f"{s}/{name}")

    def _argv(self, name: str) -> list[str]:
        """The ``podman run`` command line of one shell's container."""
        s, lim = str(self.scratch), self.limits
        argv = self.cli + ["run", "--rm", "-i", "--init", "--name", name, "--preserve-fds", "3"]
        argv += ["--label", f"{LABEL}=1", "--label", f"{OWNER_LABEL}={self.owner}"]
        argv += ["--network", "host" if self.network else "none", "--hostname", "sandbox"]
        argv += ["--memory", str(lim.memory_bytes), "--memory-swap", str(lim.memory_bytes)]
        argv += ["--pids-limit", str(lim.processes), "--ulimit", "nofile=1024:1024"]
        argv += ["--ulimit", f"nproc={lim.processes}:{lim.processes}", "--log-driver", "none"]
        argv += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only"]
        argv += ["--read-only-tmpfs=false", "--tmpfs", "/run:size=16m"]
        argv += ["-v", f"{self.base}:{WORKDIR}:O,upperdir={s}/upper,workdir={s}/work"]
        argv += ["-v", f"{s}/tmp:/tmp", "-v", f"{s}/shm:/dev/shm", "-v", f"{s}/home:{HOME}"]
        prefix = sys.base_prefix
        argv += ["-v", f"{prefix}:{prefix}:ro"]
        argv += [a for d, h in self.ro_mounts.items() for a in ("-v", f"{h}:{d}:ro")]
        argv += [a for d, h in self.rw_mounts.items() for a in ("-v", f"{h}:{d}")]
        if not self.network:  # the same library trees the bwrap backend hides
            for path in hidden_paths(self.ro_mounts):
                argv += ["--tmpfs", f"{path}:ro,size=4k,notmpcopyup"]
        argv += ["-w", WORKDIR]
        argv += [a for k, v in self.env.items() for a in ("-e", f"{k}={v}")]
        return argv + [self.image, "/bin/bash", "--noprofile", "--norc"]

    def _start_shell(self) -> None:
        self._starts += 1
        name = f"coderl-{self.scratch.name}-{self._starts}"
        ends = [os.pipe2(os.O_CLOEXEC) for _ in range(3)]  # control, stdout, stderr
        ctl_r, out_r, err_r = (r for r, _ in ends)
        writes = tuple(_high(w) for _, w in ends)  # never one of 3-5, which bash assigns
        # podman passes its fds 3-5 into the container (--preserve-fds 3), where the shell's
        # stdout and stderr go straight to 4 and 5: its output is in our pipes before the
        # end-of-command record is (podman's attach relay would deliver it later)
        moves = " ".join(f"{3 + i}>&{fd}" for i, fd in enumerate(writes))
        closes = " ".join(f"{fd}>&-" for fd in writes)
        try:
            proc = subprocess.Popen(
                ["/bin/bash", "-c", f'exec "$@" {moves} {closes}', "bash", *self._argv(name)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=writes,
                start_new_session=True,
            )
        except BaseException:
            for fd in (ctl_r, out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in writes:
                os.close(fd)
        kill = functools.partial(self._kill, proc, (ctl_r, out_r, err_r), name)
        shell = Shell(proc, ctl_r, kill=kill, streams=(out_r, err_r))
        old = self._shell or self._seed
        state = None if old is None else old.state
        lim = self.limits
        ulimits = (
            f"ulimit -c 0 -t {lim.cpu_s} -v {lim.memory_bytes // 1024} "
            f"-f {max(1, lim.file_size_bytes // 1024)}"
        )
        script = "exec 1>&4 2>&5 4>&- 5>&-\n" + init_script(3, [], ulimits)
        if state is not None:
            script += restore_script(state.cwd, state.env_decls)
        shell.send(script)
        started = shell.run(":", timeout=_START_S, output_bytes=4096)
        if started.exit_code != 0 or not shell.alive:
            shell.kill()
            why = self._podman_said or f"exit {started.exit_code}"
            raise SandboxError(f"the container did not start: {why}")
        if state is not None:
            shell.state = state
        self._shell = shell

    def _kill(self, proc: subprocess.Popen[bytes], fds: tuple[int, ...], name: str) -> None:
        """Kill the container (every process in it), reap the podman client, close the pipes;
        idempotent."""
        if proc.stderr is None or proc.stderr.closed:
            return
        if proc.poll() is None:
            run_cli(["rm", "-f", "--time", "0", name], check=False, timeout=60)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._podman_said = _podman_error(proc)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:  # already closed by an earlier kill
                pass

    # --- the Sandbox interface (exec and the file methods: ShellSandboxMethods) --------

    def diff(self, *, exclude: Sequence[str] = DIFF_EXCLUDES) -> str:
        return overlay_diff(self.base, self.scratch / "upper", exclude)

    def fork(self, *, limits: Limits | None = None) -> ContainerSandbox:
        with self._lock:
            if self._closed:
                raise SandboxError("cannot fork a closed sandbox")
            assert self._shell is not None
            seed = Seed(str(self.scratch), 0, "overlay", self._shell.state)
            return ContainerSandbox(
                self.base,
                limits=limits or self.limits,
                env=self.env,
                ro_mounts=self.ro_mounts,
                rw_mounts=self.rw_mounts,
                network=self.network,
                image=self.image,
                seed=seed,
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._shell is not None:
                self._shell.kill()
            if self.scratch.exists():
                _remove_scratch(self.scratch)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()


def _high(fd: int) -> int:
    """``fd`` moved to a number >= 100 (close-on-exec), the original closed."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100)
    os.close(fd)
    return moved


def _podman_error(proc: subprocess.Popen[bytes]) -> str:
    """The last line an exited podman client wrote to its stderr (its own errors: the shell's
    output goes elsewhere)."""
    assert proc.stderr is not None
    os.set_blocking(proc.stderr.fileno(), False)
    try:
        data = proc.stderr.read() or b""
    except OSError:
        data = b""
    lines = data.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def _remove_scratch(scratch: Path) -> None:
    """Unmount the scratch tmpfs (when mounted) and remove its directory."""
    if os.path.ismount(scratch):
        mounts.umount(str(scratch))
    try:
        scratch.rmdir()
    except OSError as e:
        raise SandboxError(f"could not remove {scratch}: {e}") from e


def _podman_mounts(table: dict[str, str], what: str) -> dict[str, str]:
    """The bwrap backend's mount checks, plus the home directory (a mount of its own here) and
    what podman's ``-v SRC:DEST:OPTS`` cannot hold. Mounts under ``/testbed`` (the grader's
    read-only held-out tests) go over the workspace's overlay, as in bwrap."""
    checked = _check_mounts(table, what)
    for dest, host in checked.items():
        if (dest + "/").startswith(HOME + "/") or any(c in host + dest for c in ",:"):
            raise ValueError(f"{what}: {host!r} -> {dest!r}: not under {HOME}, no ',' or ':'")
    return checked
