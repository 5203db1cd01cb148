"""The isolated sandbox: bubblewrap namespaces over an idmapped overlayfs workspace.

What one sandbox is (as root, the normal case here and in CI; rootless mode is at the end):
- a private tmpfs of ``Limits.disk_bytes`` and ``Limits.inodes`` files (each file costs host
  kernel memory that the byte size does not count) on a directory under ``/dev/shm/coderl``
  holding the overlay's upper and work directories, ``/tmp``, ``/dev/shm`` (POSIX semaphores:
  multiprocessing) and the home directory; it and every other mount of the sandbox exist only in
  the sandbox's own *stage*, a private mount namespace that its bwrap is started in
  (``coderl.sandbox.spawn``), never in the host's;
- ``/testbed``: overlayfs with an idmapped, read-only view of ``base`` below (the snapshot's owner
  appears as the sandbox uid, so the sandbox owns its workspace without ``base`` changing);
  when the filesystem of ``base`` refuses idmapped mounts, a copy of ``base`` in the tmpfs;
- one ``bwrap`` process in its own process group: new mount, PID, IPC, UTS, cgroup and (unless
  ``network=True``) network namespaces; a new session (``--new-session``: no way back to the
  caller's terminal) when the caller has a controlling terminal (see "Sessions" below);
  ``/usr`` and the Python prefix read-only; a generated ``/etc``; then ``setpriv`` drops to a
  distinct unprivileged uid/gid (one per live sandbox, taken from ``UID_BASE`` upwards, locked
  across processes) with no capabilities, an empty bounding set and no_new_privs, and runs the
  persistent ``bash`` (``coderl.sandbox.shell``) under bwrap's own init process of the PID
  namespace (killing that init ends the namespace).

Isolated: the host filesystem (only ``/usr``, the Python prefix, a few ``/etc`` files and the
given mounts are visible; the host home directory is not), network (an empty network namespace:
only a down loopback), host processes and environment variables, other sandboxes (distinct uids,
private workspaces). Limits: RLIMIT_NPROC counts the sandbox's uid, so a fork bomb stays inside
its budget; RLIMIT_AS/CPU/FSIZE apply per process; a timeout or ``close`` ends the whole PID
namespace (``coderl.sandbox.process``), so no process of the sandbox survives either.

Not isolated: the kernel is shared (a kernel exploit escapes; ``coderl.sandbox.seccomp`` narrows
the surface: no user namespaces, keyrings, eBPF, perf, io_uring or mounts); memory is limited per
process, not per sandbox (cgroup v2 has no memory controller on these machines), so
``processes x memory_bytes`` bounds the total; CPU time is not shared fairly between sandboxes;
world-readable files under the mounted trees are readable; ``network=True`` gives the host's
network. The host runs the sandbox as root; its mounts live in its stage, which ``close`` (or
the death of the host process) releases, and the kernel then unmounts them all; ``close``
returns after every process of the sandbox has exited, the stage was released and its empty
directory under ``/dev/shm/coderl`` was removed (a crashed host process leaves that directory;
the next sandbox of a later process removes it).

Sessions. ``--new-session`` (setsid) exists to cut a sandbox off from the caller's controlling
terminal (bwrap(1): otherwise it could inject input with TIOCSTI). A caller without a
controlling terminal (a trainer, CI, a service) has none to protect, so there the sandbox stays
in the caller's session, in a process group of its own: it can reach no terminal (it holds no
tty descriptor, cannot acquire the session's, and TIOCSTI needs it to be its controlling tty),
and kill(0) reaches only its own group (other groups' ids are not visible in its PID
namespace). This matters for speed because a new session also gets a new scheduler autogroup
(CONFIG_SCHED_AUTOGROUP), whose first wake-up waits behind busy autogroups: measured here on a
loaded 2-core machine, 25.0 ms against 20.6 ms p50 per create + command + close, same CPU.

Rootless mode (the caller is not root): bwrap runs unprivileged in a new user namespace as the
caller's own uid, with user-namespace creation disabled inside and every capability dropped;
``/testbed`` is a copy of ``base`` under ``/dev/shm/coderl-<uid>`` (start-up grows with the
repository; ``disk_bytes`` and ``inodes`` are not enforced); RLIMIT_NPROC is counted per user namespace (Linux
>= 5.14), so a fork bomb is still held to ``Limits.processes``; mounts are plain binds (host
permissions apply). Files the caller can read elsewhere stay hidden unless mounted.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import functools
import glob
import os
import shutil
import sys
import threading
import weakref
from collections.abc import Sequence
from itertools import count
from pathlib import Path

import coderl.sandbox.mounts as mounts
import coderl.sandbox.seccomp as seccomp
from coderl.sandbox.base import DIFF_EXCLUDES, Limits, Sandbox, SandboxError
from coderl.sandbox.files import FileOps
from coderl.sandbox.fork import Seed, copy_tree
from coderl.sandbox.persistent import ShellSandboxMethods
from coderl.sandbox.process import BwrapProcess
from coderl.sandbox.shell import Shell, init_script, restore_script
from coderl.sandbox.spawn import has_controlling_terminal, new_stage, spawn
from coderl.sandbox.workspace import overlay_diff, remove_tree, tree_diff

WORKDIR = "/testbed"
HOME = "/home/sandbox"
UID_BASE = 2_000_000
"""Sandbox uids are ``UID_BASE + slot``; far above any real account."""
UID_SLOTS = 4096


def rootless() -> bool:
    """True when this process is not root: sandboxes then run in a user namespace as the
    caller's own uid, over a copy of the base (no mounts can be made on the host)."""
    return os.geteuid() != 0


SCRATCH_ROOT = Path(
    os.environ.get("CODERL_SANDBOX_DIR")
    or ("/dev/shm/coderl" if not rootless() else f"/dev/shm/coderl-{os.getuid()}")
)
_RESERVED = ("/proc", "/dev", "/tmp", "/etc", "/usr", HOME)
_ETC_FILES = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "ssl")
_ETC_FILES_NET = ("resolv.conf", "ca-certificates", "gai.conf", "nsswitch.conf")
_NO_IDMAP = (errno.EINVAL, errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP)
"""errnos meaning "this filesystem or kernel cannot make idmapped mounts"."""
_counter = count()
_clean_lock = threading.Lock()
_cleaned: list[bool] = []  # non-empty once this process has cleaned up after dead ones
_live: weakref.WeakSet[BwrapSandbox] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Close sandboxes still open at interpreter exit (their mounts would outlive us)."""
    for sb in list(_live):
        sb.close()


class _UidLease:
    """Holds one sandbox uid: an flock on ``SCRATCH_ROOT/uids/<uid>`` so processes never share."""

    def __init__(self) -> None:
        lock_dir = SCRATCH_ROOT / "uids"
        lock_dir.mkdir(parents=True, exist_ok=True)
        for slot in range(UID_SLOTS):
            uid = UID_BASE + slot
            fd = os.open(lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise SandboxError(f"all {UID_SLOTS} sandbox uids are in use")

    def release(self) -> None:
        os.close(self._fd)


def _clean_stale() -> None:
    """Unmount and delete scratch directories left by host processes that died (once).

    Best effort: a directory that cannot be removed (another process got there first) is left.
    """
    with _clean_lock:
        if _cleaned:
            return
        _cleaned.append(True)
        if not SCRATCH_ROOT.is_dir():
            return
        for entry in SCRATCH_ROOT.iterdir():
            owner = entry.name.split("-")[0]
            if not owner.isdigit() or Path(f"/proc/{owner}").exists():
                continue
            try:
                _remove_scratch(entry, mounted=not rootless())
            except (OSError, SandboxError):
                continue


class BwrapSandbox(ShellSandboxMethods, Sandbox):
    """A sandbox isolated by bubblewrap; build it with ``Sandbox.create(..., backend="bwrap")``."""

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
        """``seed``: the parent of a fork (:meth:`fork`), whose workspace, ``/tmp``, home
        directory and shell state the new sandbox starts from; None for a fresh sandbox."""
        if _bwrap_path() is None:
            raise SandboxError("bubblewrap is not installed (make sysdeps)")
        self.base = _check_dir(base, "base")
        self.limits = limits
        self.network = network
        self.ro_mounts = _check_mounts(ro_mounts, "ro_mounts")
        self.rw_mounts = _check_mounts(rw_mounts, "rw_mounts")
        self.env = _default_env() | dict(env)
        self._lock = threading.Lock()
        self._shell: Shell | None = None
        self._closed = False
        self._binds: list[tuple[str, str, str]] = []  # (bwrap flag, host source, sandbox dest)
        self._mounted: list[str] = []  # idmapped views made for the mounts (in the stage)
        self._stage: int | None = None  # the mount namespace holding the workspace (as root)
        self._root: int | None = None  # the scratch tmpfs, opened inside the stage
        self._seed = seed
        _clean_stale()
        self.rootless = rootless()
        self._lease = None if self.rootless else _UidLease()
        self.uid = os.getuid() if self._lease is None else self._lease.uid
        self.scratch = SCRATCH_ROOT / f"{os.getpid()}-{next(_counter)}-{self.uid}"
        try:
            self.workspace_mode = self._build_workspace()
            self._start_shell()
        except BaseException:
            self.close()
            raise
        self.files = FileOps(self._run_internal)
        _live.add(self)

    # --- workspace -------------------------------------------------------------------------

    def _build_workspace(self) -> str:
        """Make the scratch directory and what goes in it; returns the workspace mode."""
        s = str(self.scratch)
        self.scratch.mkdir(parents=True, mode=0o700)
        if self.rootless:
            for name in ("tmp", "home", "shm"):
                os.mkdir(f"{s}/{name}")
            if self._seed is None:
                shutil.copytree(self.base, self.scratch / "merged", symlinks=True)
            else:
                os.mkdir(f"{s}/merged")
                for name in ("merged", "tmp", "home"):
                    copy_tree(f"{self._seed.tree}/{name}", f"{s}/{name}")
            self._binds += [("--ro-bind", host, dest) for dest, host in self.ro_mounts.items()]
            self._binds += [("--bind", host, dest) for dest, host in self.rw_mounts.items()]
            return "copy"
        self._stage, mode = new_stage(self._mount_workspace)
        return mode

    def _mount_workspace(self) -> str:
        """Inside the sandbox's stage (``coderl.sandbox.spawn``): mount the tmpfs on the scratch
        directory, ``merged`` (the future /testbed) and the mounts; returns the mode."""
        s, uid = str(self.scratch), self.uid  # plain strings: this runs for every sandbox
        mounts.mount_tmpfs(s, self.limits.disk_bytes, self.limits.inode_limit, uid, uid)
        self._root = os.open(s, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        for name in ("upper", "work", "lower", "merged", "tmp", "shm", "home", "mnt"):
            os.mkdir(f"{s}/{name}")
        for name in ("upper", "tmp", "shm", "home"):
            os.chown(f"{s}/{name}", uid, uid)
        for name in ("tmp", "shm"):
            os.chmod(f"{s}/{name}", 0o1777)
        seed = self._seed
        if seed is not None:  # the parent's changes, /tmp and home; its work dir stays behind
            for name in ("upper", "tmp", "home"):
                _copy_seed(seed, name, s, uid)
        for dest, host in self.ro_mounts.items():
            self._binds.append(("--ro-bind", self._idmap(host, readonly=True), dest))
        for dest, host in self.rw_mounts.items():
            self._binds.append(("--bind", self._idmap(host, readonly=False), dest))
        try:
            mounts.idmapped_bind(str(self.base), f"{s}/lower", uid, uid, readonly=True)
        except OSError as e:
            if e.errno not in _NO_IDMAP:
                raise
            if seed is not None:
                _copy_seed(seed, "merged", s, uid)
                return _same_mode(seed, "copy")
            shutil.copytree(self.base, self.scratch / "merged", symlinks=True, dirs_exist_ok=True)
            _chown_tree(self.scratch / "merged", uid)
            return "copy"
        mounts.mount_overlay(f"{s}/lower", f"{s}/upper", f"{s}/work", f"{s}/merged")
        return "overlay" if seed is None else _same_mode(seed, "overlay")

    def _idmap(self, host: str, *, readonly: bool) -> str:
        """An idmapped view of directory ``host`` in the scratch dir (the host path itself for
        files and on filesystems without idmapped mounts); returns the path to bind."""
        if not os.path.isdir(host):
            return host
        target = self.scratch / "mnt" / str(len(self._mounted))
        target.mkdir()
        try:
            mounts.idmapped_bind(host, str(target), self.uid, self.uid, readonly=readonly)
        except OSError as e:
            if e.errno not in _NO_IDMAP:
                raise
            return host
        self._mounted.append(str(target))
        return str(target)

    def _argv(self, info_fd: int, seccomp_fd: int | None) -> list[str]:
        """The ``bwrap ... setpriv ... bash`` command line."""
        s, uid = str(self.scratch), str(self.uid)
        argv = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        argv += [] if self.network else ["--unshare-net"]
        argv += ["--unshare-user", "--disable-userns"] if self.rootless else []
        argv += ["--die-with-parent", "--hostname", "sandbox"]
        argv += ["--new-session"] if has_controlling_terminal() else []
        argv += _system_tree() + ["--proc", "/proc", "--dev", "/dev"]
        argv += ["--ro-bind", str(_etc_dir(self.uid, self.network)), "/etc"]
        made: set[str] = set()
        argv += ["--bind", f"{s}/tmp", "/tmp", "--bind", f"{s}/shm", "/dev/shm"]
        argv += _parents(HOME, made) + ["--bind", f"{s}/home", HOME]
        argv += ["--bind", f"{s}/merged", WORKDIR]
        prefix = sys.base_prefix
        argv += _parents(prefix, made) + ["--ro-bind", prefix, prefix]
        for flag, source, dest in self._binds:
            argv += _parents(dest, made) + [flag, source, dest]
        if not self.network:  # environment builds (networked) need pip and its wheels
            for path in hidden_paths(self.ro_mounts):
                argv += ["--tmpfs", path, "--remount-ro", path]
        argv += ["--chdir", WORKDIR, "--clearenv", "--info-fd", str(info_fd)]
        argv += [] if seccomp_fd is None else ["--seccomp", str(seccomp_fd)]
        for key, value in self.env.items():
            argv += ["--setenv", key, value]
        argv.append("--")
        if not self.rootless:  # unprivileged bwrap has already dropped everything
            argv += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
            argv += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        return argv + ["/bin/bash", "--noprofile", "--norc"]

    # --- the shell -------------------------------------------------------------------------

    def _start_shell(self) -> None:
        ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
        info_r, info_w = os.pipe2(os.O_CLOEXEC)
        filter_fd = seccomp.program_fd() if seccomp.supported() else None
        passed = (ctl_w, info_w) + (() if filter_fd is None else (filter_fd,))
        try:
            proc = spawn(self._argv(info_w, filter_fd), pass_fds=passed, stage=self._stage)
        except BaseException:
            os.close(ctl_r)
            os.close(info_r)
            raise
        finally:
            for fd in passed:
                os.close(fd)
        self._process = BwrapProcess(proc, ctl_r, info_r, self.uid, uid_kill=not self.rootless)
        shell = Shell(proc, ctl_r, kill=lambda: self._process.stop())
        old = self._shell or self._seed  # a restarted shell, or a fork's first one
        state = None if old is None else old.state
        script = init_script(ctl_w, list(passed[1:]), self._ulimits())
        if state is not None:
            script += restore_script(state.cwd, state.env_decls)
        shell.send(script)
        if state is not None:
            shell.state = state
        self._shell = shell

    def _ulimits(self) -> str:
        lim = self.limits
        return (
            f"ulimit -c 0 -t {lim.cpu_s} -v {lim.memory_bytes // 1024} "
            f"-u {lim.processes} -f {max(1, lim.file_size_bytes // 1024)}"
        )

    # --- the Sandbox interface (exec and the file methods: ShellSandboxMethods) --------

    def diff(self, *, exclude: Sequence[str] = DIFF_EXCLUDES) -> str:
        # the scratch tmpfs exists only in the stage: reach it through the descriptor
        view = self.scratch if self._root is None else Path(f"/proc/self/fd/{self._root}")
        if self.workspace_mode == "overlay":
            return overlay_diff(self.base, view / "upper", exclude)
        return tree_diff(self.base, view / "merged", exclude)

    def fork(self, *, limits: Limits | None = None) -> BwrapSandbox:
        with self._lock:
            if self._closed:
                raise SandboxError("cannot fork a closed sandbox")
            assert self._shell is not None
            # the parent's tmpfs exists only in its stage: the child's copy, made in the child's
            # stage, reaches it through the descriptor (a magic link valid in any namespace)
            tree = self.scratch if self._root is None else f"/proc/{os.getpid()}/fd/{self._root}"
            seed = Seed(str(tree), self.uid, self.workspace_mode, self._shell.state)
            with self._process.frozen():  # no background job changes the tree under the copy
                return BwrapSandbox(
                    self.base,
                    limits=limits or self.limits,
                    env=self.env,
                    ro_mounts=self.ro_mounts,
                    rw_mounts=self.rw_mounts,
                    network=self.network,
                    seed=seed,
                )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._shell is not None:
                self._process.stop()
            for fd in (self._root, self._stage):  # the last references: the kernel unmounts
                if fd is not None:  # the stage's mounts when the stage goes
                    os.close(fd)
            self._root = self._stage = None
            if self.scratch.exists():
                _remove_scratch(self.scratch, mounted=not self.rootless)
            if self._lease is not None:
                self._lease.release()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()


def _copy_seed(seed: Seed, name: str, scratch: str, uid: int) -> None:
    """Copy the parent's ``name`` into the child's scratch tmpfs (bounded: a full disk there is
    the parent workspace's doing), its files given to the child's uid."""
    src, dst = f"{seed.tree}/{name}", f"{scratch}/{name}"
    copy_tree(src, dst, owner=seed.uid, new_owner=uid, bounded=True)


def _same_mode(seed: Seed, mode: str) -> str:
    if seed.mode != mode:
        raise SandboxError(
            f"cannot fork: the parent's workspace is {seed.mode}, the child's {mode}"
        )
    return mode


def _remove_scratch(scratch: Path, *, mounted: bool) -> None:
    """Detach the scratch tmpfs with every mount below it, then remove the empty directory.

    Nothing is ever deleted recursively while mounts may exist: a mount that failed to detach
    (an rw mount of a host directory) must never be walked into; the workspace's files vanish
    with the tmpfs. Rootless scratch directories hold no mounts and are deleted recursively.
    """
    if not mounted:  # remove_tree makes 000 directories traversable and does not recurse
        remove_tree(scratch)
        return
    mounts.umount(str(scratch))
    try:
        scratch.rmdir()
    except OSError as e:
        raise SandboxError(f"could not remove {scratch}: {e}") from e


@functools.cache
def _bwrap_path() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def _system_tree() -> list[str]:
    """bwrap arguments for ``/usr`` and the top-level links or directories that lead into it."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    return argv


SYSTEM_PACKAGE_GLOBS = (
    "/usr/lib/python3/dist-packages",
    "/usr/lib/python3*/site-packages",
    "/usr/lib/python3*/dist-packages",
    "/usr/lib/python3*/ensurepip/_bundled",
    "/usr/local/lib/python3*/site-packages",
    "/usr/local/lib/python3*/dist-packages",
    "/usr/share/python-wheels",
    "/usr/lib/google-cloud-sdk",  # its lib/third_party vendors dateutil, idna, six, cachetools
    "/usr/lib/*/lib/third_party",
    "/usr/lib/node_modules",
    "{prefix}/lib/python3*/site-packages",
    "{prefix}/lib/python3*/ensurepip/_bundled",
)
"""System trees hidden (an empty read-only tmpfs over each) from every sandbox without network:
installed and vendored copies of PyPI libraries, some at the exact versions tasks are made from
(Debian's toml, the host Python's six and python-dateutil). ``{prefix}``: ``sys.base_prefix``."""
VENDORED_GLOBS = ("lib/python3*/site-packages/*/_vendor", "lib/python3*/site-packages/*/_vendored")
"""Trees hidden inside each read-only mount (an environment's virtualenv): pip, setuptools and
pkg_resources vendor copies of PyPI libraries (six, idna, packaging, more_itertools, tomli, ...)."""


def hidden_paths(ro_mounts: dict[str, str]) -> list[str]:
    """The sandbox paths masked by an empty mount in a sandbox without network whose read-only
    mounts are ``ro_mounts`` (sandbox path -> host path): the ``SYSTEM_PACKAGE_GLOBS`` that
    exist on the host and the ``VENDORED_GLOBS`` under each mounted directory."""
    return list(_system_hidden()) + [
        dest + found[len(host) :]
        for dest, host in ro_mounts.items()
        for pattern in VENDORED_GLOBS
        for found in sorted(glob.glob(f"{glob.escape(host)}/{pattern}"))
    ]


@functools.cache
def _system_hidden() -> tuple[str, ...]:
    globs = [g.format(prefix=glob.escape(sys.base_prefix)) for g in SYSTEM_PACKAGE_GLOBS]
    found = sorted({p for g in globs for p in glob.glob(g) if os.path.isdir(p)})
    # one mask per tree: bwrap cannot make a mount point inside an empty read-only tmpfs
    return tuple(p for p in found if not any(p.startswith(q + "/") for q in found))


def _default_env() -> dict[str, str]:
    return {
        "PATH": f"{sys.base_prefix}/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": HOME,
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "SHELL": "/bin/bash",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "TMPDIR": "/tmp",
    }


@functools.cache
def _etc_dir(uid: int, network: bool) -> Path:
    """The sandbox's ``/etc``: a few host files plus passwd/group/hosts naming ``uid``.

    Built once per (uid, network) under ``SCRATCH_ROOT/etc`` and shared by later sandboxes
    (one bind instead of one per file). The resolver files are only there when ``network``.
    """
    etc = SCRATCH_ROOT / "etc" / f"v1-{uid}{'-net' if network else ''}"
    if etc.is_dir():
        return etc
    tmp = etc.with_name(f"{etc.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.mkdir(parents=True)
    for name in _ETC_FILES + (_ETC_FILES_NET if network else ()):
        host = Path("/etc") / name
        if host.is_dir():
            shutil.copytree(
                host, tmp / name, symlinks=True, ignore=shutil.ignore_patterns("private")
            )
        elif host.exists():
            shutil.copy2(host, tmp / name)
    (tmp / "passwd").write_text(
        f"root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:{uid}:{uid}::{HOME}:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (tmp / "group").write_text(f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n")
    (tmp / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
    tmp.chmod(0o755)
    try:
        tmp.rename(etc)
    except OSError:  # another process built it first
        shutil.rmtree(tmp)
    return etc


def _parents(dest: str, made: set[str]) -> list[str]:
    """``--dir`` arguments making the missing parents of ``dest`` traversable (mode 0755)."""
    args: list[str] = []
    parts = Path(dest).parts[1:-1]
    for i in range(len(parts)):
        parent = "/" + "/".join(parts[: i + 1])
        if parent in made or parent in ("/usr", "/tmp", WORKDIR) or parent.startswith("/usr/"):
            continue
        if parent.startswith(WORKDIR + "/") or parent.startswith("/tmp/"):
            continue
        made.add(parent)
        args += ["--perms", "0755", "--dir", parent]
    return args


def _check_dir(path: Path, what: str) -> Path:
    path = Path(path).resolve()
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{what} {path} is not a directory")
    return path


def _check_mounts(table: dict[str, str], what: str) -> dict[str, str]:
    """Validate sandbox-path -> host-path pairs; returns them with resolved host paths."""
    checked: dict[str, str] = {}
    for dest, host in table.items():
        norm = os.path.normpath(dest)
        if not os.path.isabs(dest) or norm in ("/", WORKDIR):
            raise ValueError(
                f"{what}: {dest!r} must be an absolute path other than / and {WORKDIR}"
            )
        if any(norm == r or norm.startswith(r + "/") for r in _RESERVED):
            raise ValueError(f"{what}: {dest!r} lies in a reserved tree {_RESERVED}")
        source = Path(host).resolve()
        if not source.exists():
            raise FileNotFoundError(f"{what}: host path {host} (for {dest}) does not exist")
        checked[norm] = str(source)
    return checked


def _chown_tree(root: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            os.lchown(name, uid, uid)
