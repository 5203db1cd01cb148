"""Linux mount plumbing for sandbox workspaces: idmapped bind mounts, overlayfs, tmpfs.

Everything here needs root (CAP_SYS_ADMIN in the initial namespaces) and a kernel with the new
mount API (``open_tree``/``mount_setattr``/``move_mount``, Linux >= 5.12) and idmapped overlay
layers (Linux >= 5.19). ``overlay_supported()`` says whether this host qualifies.

Why idmapped mounts: a snapshot usually belongs to root, yet the sandbox must run as an
unprivileged uid (so that RLIMIT_NPROC applies per sandbox) and still own its workspace. An
idmapped view of the base makes the snapshot's owner appear as the sandbox uid without touching
the snapshot; overlayfs on top of that view gives a copy-on-write workspace whose new files land
in a per-sandbox tmpfs. Sources: mount_setattr(2) ("MOUNT_ATTR_IDMAP"), the kernel's
Documentation/filesystems/overlayfs.rst ("Upper and Lower", "whiteouts and opaque directories").
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading

_libc = ctypes.CDLL(None, use_errno=True)

# x86_64 and aarch64 share these numbers (they were added after the syscall tables unified).
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_NOSUID = 0x2
_MOUNT_ATTR_NODEV = 0x4
_MOUNT_ATTR_IDMAP = 0x100000
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MNT_DETACH = 0x2


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def mount(source: str, target: str, fstype: str, options: str, *, flags: int = 0) -> None:
    """mount(2) ``source`` of type ``fstype`` on ``target``. Raises OSError with the errno."""
    rc = _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, options.encode())
    _check(rc, f"mount {fstype} on {target}")


def mount_tmpfs(target: str, size_bytes: int, inodes: int, uid: int, gid: int) -> None:
    """A private tmpfs of at most ``size_bytes`` and ``inodes`` files (tmpfs(5): ``nr_inodes``;
    each costs kernel memory that ``size`` does not count) on ``target``, its root owned by
    ``uid:gid``."""
    opts = f"size={size_bytes},nr_inodes={inodes},mode=0755,uid={uid},gid={gid}"
    mount("tmpfs", target, "tmpfs", opts, flags=_MS_NOSUID | _MS_NODEV)


def mount_overlay(lower: str, upper: str, work: str, target: str) -> None:
    """overlayfs: ``lower`` read-only below, writes into ``upper`` (``work`` on the same fs)."""
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    mount("overlay", target, "overlay", opts, flags=_MS_NOSUID | _MS_NODEV)


CLONE_FS = 0x200
CLONE_NEWNS = 0x20000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18


def unshare(flags: int) -> None:
    """unshare(2) for the calling thread. Raises OSError."""
    _check(_libc.unshare(flags), f"unshare {flags:#x}")


def setns(fd: int, nstype: int) -> None:
    """setns(2): move the calling thread into the namespace ``fd``. Raises OSError."""
    _check(_libc.setns(fd, nstype), f"setns {nstype:#x}")


def make_private(target: str) -> None:
    """Make every mount at and below ``target`` private (no propagation in or out)."""
    mount("none", target, "", "", flags=_MS_REC | _MS_PRIVATE)


def umount(target: str) -> None:
    """Lazily detach the mount at ``target`` (umount2 MNT_DETACH); missing mounts are ignored."""
    rc = _libc.umount2(target.encode(), _MNT_DETACH)
    if rc < 0 and ctypes.get_errno() not in (22, 2):  # EINVAL: not a mount point; ENOENT
        _check(rc, f"umount {target}")


class _UsernsCache:
    """One user namespace per (host uid, host gid, sandbox uid) mapping, kept open for reuse.

    An idmapped mount needs a user namespace whose uid_map says which on-disk owner appears as
    whom; the namespace is made once by a short-lived ``unshare --user`` child and held by fd.
    """

    def __init__(self) -> None:
        self._fds: dict[tuple[int, int, int, int], int] = {}
        self._lock = threading.Lock()

    def fd(self, owner_uid: int, owner_gid: int, uid: int, gid: int) -> int:
        key = (owner_uid, owner_gid, uid, gid)
        with self._lock:
            if key not in self._fds:
                self._fds[key] = _make_userns(owner_uid, owner_gid, uid, gid)
            return self._fds[key]


def _make_userns(owner_uid: int, owner_gid: int, uid: int, gid: int) -> int:
    """A user namespace mapping ``owner_uid``/``owner_gid`` (inside) to ``uid``/``gid`` (host)."""
    with subprocess.Popen(  # its exit closes both pipes (a ResourceWarning each before)
        ["unshare", "--user", "--", "sh", "-c", "echo ready; read _"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as child:
        try:
            assert child.stdout is not None and child.stdin is not None
            if child.stdout.readline() != b"ready\n":
                raise OSError("unshare --user failed to start")
            with open(f"/proc/{child.pid}/uid_map", "w") as f:
                f.write(f"{owner_uid} {uid} 1\n")
            with open(f"/proc/{child.pid}/setgroups", "w") as f:
                f.write("deny\n")
            with open(f"/proc/{child.pid}/gid_map", "w") as f:
                f.write(f"{owner_gid} {gid} 1\n")
            return os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            child.kill()


_USERNS = _UsernsCache()


def idmapped_bind(source: str, target: str, uid: int, gid: int, *, readonly: bool) -> None:
    """Bind ``source`` on ``target`` so that files owned by ``source``'s owner appear as ``uid``.

    Files created through the mount are stored on disk as owned by ``source``'s owner, so the
    host tree keeps its ownership. Other owners appear as the overflow uid (nobody).
    Raises OSError (EINVAL when the filesystem does not support idmapped mounts).
    """
    st = os.stat(source)
    userns = _USERNS.fd(st.st_uid, st.st_gid, uid, gid)
    flags = _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE
    tree = _check(_libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, source.encode(), flags), "open_tree")
    try:
        attr_set = _MOUNT_ATTR_IDMAP | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV
        attr = _MountAttr(attr_set | (_MOUNT_ATTR_RDONLY if readonly else 0), 0, 0, userns)
        _check(
            _libc.syscall(
                _SYS_MOUNT_SETATTR,
                tree,
                b"",
                _AT_EMPTY_PATH | _AT_RECURSIVE,
                ctypes.byref(attr),
                ctypes.sizeof(attr),
            ),
            f"mount_setattr idmap {source}",
        )
        _check(
            _libc.syscall(
                _SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH
            ),
            f"move_mount {source} -> {target}",
        )
    finally:
        os.close(tree)


def overlay_supported() -> bool:
    """True when we are root on Linux, where idmapped overlay workspaces can be built."""
    return os.geteuid() == 0 and os.uname().sysname == "Linux"
