"""The container sandbox: one OCI container per sandbox, run by ``podman`` (or ``docker``, below),
behind ``Sandbox``.

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

The container CLI (:func:`container_cli`): ``podman`` (the one run here) or ``docker``, whichever
is installed (podman first) or ``$CODERL_CONTAINER_CLI`` (``sandbox.cli``). Docker's CLI has
neither ``--preserve-fds`` nor overlay volumes with an upper directory, so with docker
(:func:`cli_kind`) the workspace is an overlayfs the host mounts in the scratch tmpfs
(``merged``, bind-mounted at ``/testbed``; same upper directory, same ``diff``) and the shell's
control, stdout and stderr channels are FIFOs in a bind-mounted directory that the shell opens
as fds 3-5 and unlinks before the first command runs. Podman-only flags (``--cgroup-manager``,
``--runtime``, ``--read-only-tmpfs``, ``notmpcopyup``, ``rm --time``, ``image exists``) are not
passed to docker. Docker itself was never run here: the docker command lines are checked by
``tests/test_sandbox_container_docker.py`` against a stand-in ``docker`` that refuses what
Docker's CLI does not accept and runs the rest with podman.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
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
CHANNELS = "/run/coderl-channels"
"""Where a docker container sees the FIFOs of its shell's control, stdout and stderr."""
_FIFOS = ("ctl", "out", "err")
_Spawned = tuple["subprocess.Popen[bytes]", tuple[int, int, int], str, "_Held"]
"""A started container client, its control/stdout/stderr read ends, the lines its shell runs
first, and what the host holds open until the shell answers."""
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


CLI_KINDS = ("podman", "docker")
"""The container CLIs the backend builds command lines for."""


def container_cli() -> list[str]:
    """The container command line prefix: ``podman`` with the runtime flags this host needs, or
    ``docker`` as it is (the daemon holds its runtime settings).

    ``$CODERL_CONTAINER_CLI`` names the program (a name on PATH or a path); default: ``podman``
    when installed, else ``docker``. podman uses ``runc`` when ``crun`` is absent and
    ``--cgroup-manager cgroupfs`` when systemd is not process 1.
    Raises SandboxError (neither is installed, or the named program is missing).
    """
    return list(_cli(os.environ.get(CLI_ENV) or "", os.environ.get("PATH", "")))


def cli_kind() -> str:
    """``"docker"`` when the container CLI is Docker's (a program named ``docker``), else
    ``"podman"``: which command lines :class:`ContainerSandbox` and ``coderl.sandbox.images``
    build. Raises SandboxError as :func:`container_cli`."""
    return "docker" if Path(container_cli()[0]).name == "docker" else "podman"


@functools.cache
def _cli(name: str, search: str) -> tuple[str, ...]:
    """The command line prefix of ``name`` (default: the first of ``CLI_KINDS``) on ``search``."""
    found = [shutil.which(n, path=search) for n in ([name] if name else CLI_KINDS)]
    path = next((p for p in found if p), None)
    if path is None:
        what = repr(name) if name else "neither podman nor docker"
        raise SandboxError(f"no container CLI: {what} is not installed (make sysdeps)")
    if Path(path).name == "docker":
        return (path,)
    argv = [path]
    if shutil.which("crun") is None and shutil.which("runc") is not None:
        argv += ["--runtime", "runc"]
    if Path("/proc/1/comm").read_text().strip() != "systemd":
        argv += ["--cgroup-manager", "cgroupfs"]
    return tuple(argv)


def remove_args(*names: str) -> list[str]:
    """``rm`` arguments that kill and remove containers at once (podman's default grace period
    is 10 s; docker's ``rm -f`` kills with SIGKILL and has no ``--time``)."""
    wait = ["--time", "0"] if cli_kind() == "podman" else []
    return ["rm", "-f", *wait, *names]


def run_cli(args: Sequence[str], *, timeout: float = 120.0, check: bool = True) -> str:
    """Run ``<container CLI> ARGS`` and return its stdout. Raises SandboxError when it fails (``check``)."""
    try:
        done = subprocess.run(
            container_cli() + list(args),
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise SandboxError(
            f"{Path(container_cli()[0]).name} {args[0]} timed out after {timeout} s"
        ) from e
    if check and done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise SandboxError(f"{Path(container_cli()[0]).name} {args[0]} failed: {why[0]}")
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
    directories)`` removed. Raises SandboxError when the CLI cannot list containers.
    """
    # Go templates: podman's .Labels is a map, docker's a string with a .Label method
    label = (
        f'index .Labels "{OWNER_LABEL}"' if cli_kind() == "podman" else f'.Label "{OWNER_LABEL}"'
    )
    template = f"{{{{.ID}}}} {{{{{label}}}}}"
    listing = run_cli(["ps", "-a", "--filter", f"label={LABEL}", "--format", template])
    rows = [line.split(" ", 1) + [""] for line in listing.splitlines() if line.strip()]
    dead = [row[0] for row in rows if not _alive(row[1].strip())]
    if dead:
        run_cli(remove_args(*dead), check=False)
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
    """A sandbox in a podman (or docker) container; build it with ``Sandbox.create(..., backend="container")``
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
        self.cli, self.kind = container_cli(), cli_kind()
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
        for name in ("upper", "work", "tmp", "shm", "home", "merged", "chan"):
            os.mkdir(f"{s}/{name}")
        for name in ("tmp", "shm"):
            os.chmod(f"{s}/{name}", 0o1777)
        if self._seed is not None:
            for name in ("upper", "tmp", "home"):
                copy_tree(f"{self._seed.tree}/{name}", f"{s}/{name}", bounded=True)
        if self.kind == "docker":  # no overlay volumes: the host mounts the workspace's overlay
            mounts.mount_overlay(str(self.base), f"{s}/upper", f"{s}/work", f"{s}/merged")

    def _argv(self, name: str) -> list[str]:
        """The ``run`` command line of one shell's container (podman's or docker's flags)."""
        s, lim, podman = str(self.scratch), self.limits, self.kind == "podman"
        argv = self.cli + ["run", "--rm", "-i", "--init", "--name", name]
        argv += ["--preserve-fds", "3"] if podman else ["-v", f"{s}/chan:{CHANNELS}"]
        argv += ["--label", f"{LABEL}=1", "--label", f"{OWNER_LABEL}={self.owner}"]
        argv += ["--network", "host" if self.network else "none", "--hostname", "sandbox"]
        argv += ["--memory", str(lim.memory_bytes), "--memory-swap", str(lim.memory_bytes)]
        argv += ["--pids-limit", str(lim.processes), "--ulimit", "nofile=1024:1024"]
        argv += ["--ulimit", f"nproc={lim.processes}:{lim.processes}", "--log-driver", "none"]
        argv += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only"]
        argv += ["--read-only-tmpfs=false"] if podman else []  # docker's --read-only adds none
        argv += ["--tmpfs", "/run:size=16m"]
        if podman:
            argv += ["-v", f"{self.base}:{WORKDIR}:O,upperdir={s}/upper,workdir={s}/work"]
        else:
            argv += ["-v", f"{s}/merged:{WORKDIR}"]
        argv += ["-v", f"{s}/tmp:/tmp", "-v", f"{s}/shm:/dev/shm", "-v", f"{s}/home:{HOME}"]
        prefix = sys.base_prefix
        argv += ["-v", f"{prefix}:{prefix}:ro"]
        argv += [a for d, h in self.ro_mounts.items() for a in ("-v", f"{h}:{d}:ro")]
        argv += [a for d, h in self.rw_mounts.items() for a in ("-v", f"{h}:{d}")]
        if not self.network:  # the same library trees the bwrap backend hides
            for path in hidden_paths(self.ro_mounts):  # docker's tmpfs never copies up
                argv += ["--tmpfs", f"{path}:ro,size=4k" + (",notmpcopyup" if podman else "")]
        argv += ["-w", WORKDIR]
        argv += [a for k, v in self.env.items() for a in ("-e", f"{k}={v}")]
        return argv + [self.image, "/bin/bash", "--noprofile", "--norc"]

    def _start_shell(self) -> None:
        self._starts += 1
        name = f"coderl-{self.scratch.name}-{self._starts}"
        spawn = self._spawn_podman if self.kind == "podman" else self._spawn_docker
        proc, (ctl_r, out_r, err_r), prelude, held = spawn(self._argv(name))
        kill = functools.partial(self._kill, proc, (ctl_r, out_r, err_r), name)
        shell = Shell(proc, ctl_r, kill=kill, streams=(out_r, err_r))
        old = self._shell or self._seed
        state = None if old is None else old.state
        lim = self.limits
        ulimits = (
            f"ulimit -c 0 -t {lim.cpu_s} -v {lim.memory_bytes // 1024} "
            f"-f {max(1, lim.file_size_bytes // 1024)}"
        )
        script = prelude + "exec 1>&4 2>&5 4>&- 5>&-\n" + init_script(3, [], ulimits)
        if state is not None:
            script += restore_script(state.cwd, state.env_decls)
        shell.send(script)
        started = shell.run(":", timeout=_START_S, output_bytes=4096)
        held.close()  # docker: the shell holds the FIFOs now; its exit is their end of file
        if started.exit_code != 0 or not shell.alive:
            shell.kill()
            why = self._podman_said or f"exit {started.exit_code}"
            raise SandboxError(f"the container did not start: {why}")
        if state is not None:
            shell.state = state
        self._shell = shell

    def _spawn_podman(self, argv: list[str]) -> _Spawned:
        """podman passes its fds 3-5 into the container (``--preserve-fds 3``), where the shell's
        stdout and stderr go straight to 4 and 5: its output is in our pipes before the
        end-of-command record is (podman's attach relay would deliver it later)."""
        ends = [os.pipe2(os.O_CLOEXEC) for _ in range(3)]  # control, stdout, stderr
        reads = (ends[0][0], ends[1][0], ends[2][0])
        writes = tuple(_high(w) for _, w in ends)  # never one of 3-5, which bash assigns
        moves = " ".join(f"{3 + i}>&{fd}" for i, fd in enumerate(writes))
        closes = " ".join(f"{fd}>&-" for fd in writes)
        try:
            proc = _popen(["/bin/bash", "-c", f'exec "$@" {moves} {closes}', "bash", *argv], writes)
        except BaseException:
            for fd in reads:
                os.close(fd)
            raise
        finally:
            for fd in writes:
                os.close(fd)
        return proc, reads, "", _Held([])

    def _spawn_docker(self, argv: list[str]) -> _Spawned:
        """docker passes no descriptors: the three channels are FIFOs in ``<scratch>/chan``
        (bind-mounted at ``CHANNELS``) that the shell opens as fds 3-5 and unlinks before any
        command runs. The host holds a write end of each until the shell has answered (or the
        client exited), so that a read before the shell opens its end is not an end of file."""
        chan = self.scratch / "chan"
        reads: list[int] = []
        held = _Held([])
        try:
            for fifo in _FIFOS:
                (chan / fifo).unlink(missing_ok=True)
                os.mkfifo(chan / fifo, 0o600)
                reads.append(os.open(chan / fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
                held.fds.append(os.open(chan / fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
            proc = _popen(argv, ())
        except BaseException:
            held.close()
            for fd in reads:
                os.close(fd)
            raise
        threading.Thread(target=held.close_after, args=(proc,), daemon=True).start()
        paths = [f"{CHANNELS}/{fifo}" for fifo in _FIFOS]
        opens = " ".join(f"{3 + i}>{path}" for i, path in enumerate(paths))
        prelude = f"exec {opens}\nrm -f {' '.join(paths)}\n"
        return proc, (reads[0], reads[1], reads[2]), prelude, held

    def _kill(self, proc: subprocess.Popen[bytes], fds: tuple[int, ...], name: str) -> None:
        """Kill the container (every process in it), reap the podman client, close the pipes;
        idempotent."""
        if proc.stderr is None or proc.stderr.closed:
            return
        if proc.poll() is None:
            run_cli(remove_args(name), check=False, timeout=60)
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


class _Held:
    """Descriptors the host holds open until :meth:`close` (idempotent, from any thread)."""

    def __init__(self, fds: list[int]) -> None:
        self.fds, self._lock = fds, threading.Lock()

    def close(self) -> None:
        with self._lock:
            fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)

    def close_after(self, proc: subprocess.Popen[bytes]) -> None:
        """:meth:`close` once ``proc`` has exited."""
        proc.wait()
        self.close()


def _popen(argv: list[str], pass_fds: Sequence[int]) -> subprocess.Popen[bytes]:
    """The container client with the shell's script on its stdin, in a session of its own."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=tuple(pass_fds),
        start_new_session=True,
    )


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
    """Unmount the workspace overlay (docker) and the scratch tmpfs (when mounted) and remove
    the scratch directory."""
    if os.path.ismount(scratch / "merged"):
        mounts.umount(str(scratch / "merged"))
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
