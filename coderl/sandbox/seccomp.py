"""A seccomp filter that narrows the kernel surface a sandbox can reach.

Loaded by bwrap (``--seccomp FD``) just before the sandbox command starts; inherited by every
process of the sandbox and impossible to remove. It answers, instead of running:
- ``unshare``/``clone`` with CLONE_NEWUSER: EPERM. A user namespace would hand the sandbox a
  full capability set over fresh namespaces, the usual first step of kernel exploits.
- ``clone3``: ENOSYS (its flags live in memory a filter cannot read; glibc then uses ``clone``).
- keyrings, eBPF, perf events, userfaultfd, io_uring, module and kexec loading, (u)mount and the
  new mount API, pivot_root, setns, swap and reboot: EPERM. None is needed to build or test
  Python code; several are frequent sources of kernel vulnerabilities.
- System V shared memory, message queues and semaphore sets, ``memfd_create`` and
  ``memfd_secret``: EPERM. Each holds host memory outside the sandbox's tmpfs and its
  per-process address-space limit (a shared memory segment outlives its last process; a memfd
  written with ``write`` is never mapped), so a 8 MiB sandbox pinned 1.3 GB of SysV segments
  and 1 GB of memfds (issue 47, class 7). POSIX shared memory and semaphores (``shm_open``,
  ``sem_open``: files in ``/dev/shm``, the sandbox's tmpfs) still work.
- any other ABI than the native one (i386 or x32 entry points on x86_64): ENOSYS.
Everything else is allowed. The program is classic BPF over ``struct seccomp_data``
(Linux Documentation/userspace-api/seccomp_filter.rst; struct layout from linux/seccomp.h).
"""

from __future__ import annotations

import errno
import functools
import os
import platform
import struct

_LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (arg0: its low 32 bits, LE)
_CLONE_NEWUSER = 0x10000000
_X32_BIT = 0x40000000

# (audit arch, syscall numbers) per machine; names follow the kernel's syscall tables
_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {
            "clone": 56, "unshare": 272, "clone3": 435, "keyctl": 250, "add_key": 248,
            "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
            "io_uring_setup": 425, "kexec_load": 246, "kexec_file_load": 320,
            "init_module": 175, "finit_module": 313, "delete_module": 176, "mount": 165,
            "umount2": 166, "pivot_root": 155, "swapon": 167, "swapoff": 168, "reboot": 169,
            "setns": 308, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsmount": 432,
            "mount_setattr": 442, "shmget": 29, "msgget": 68, "semget": 64,
            "memfd_create": 319, "memfd_secret": 447,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "clone": 220, "unshare": 97, "clone3": 435, "keyctl": 219, "add_key": 217,
            "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
            "io_uring_setup": 425, "kexec_load": 104, "kexec_file_load": 294,
            "init_module": 105, "finit_module": 273, "delete_module": 106, "mount": 40,
            "umount2": 39, "pivot_root": 41, "swapon": 224, "swapoff": 225, "reboot": 142,
            "setns": 268, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsmount": 432,
            "mount_setattr": 442, "shmget": 194, "msgget": 186, "semget": 190,
            "memfd_create": 279, "memfd_secret": 447,
        },
    ),
}  # fmt: skip
DENIED = tuple(n for n in _ARCHES["x86_64"][1] if n not in ("clone", "unshare", "clone3"))
"""Syscalls refused with EPERM whatever their arguments."""


def supported() -> bool:
    """True on machines whose syscall table this module knows (x86_64, aarch64)."""
    return platform.machine() in _ARCHES


@functools.cache
def program() -> bytes:
    """The filter as bytes: an array of ``struct sock_filter {u16 code; u8 jt, jf; u32 k}``.

    Raises RuntimeError on machines without a known syscall table.
    """
    if not supported():
        raise RuntimeError(f"no seccomp syscall table for {platform.machine()}")
    arch, nr = _ARCHES[platform.machine()]
    ins: list[tuple[int, int, int, int]] = [
        (_LD_ABS, 0, 0, _ARCH),
        (_JEQ, 1, 0, arch),
        (_RET, 0, 0, _ERRNO | errno.ENOSYS),
        (_LD_ABS, 0, 0, _NR),
    ]
    if platform.machine() == "x86_64":
        ins += [(_JGE, 0, 1, _X32_BIT), (_RET, 0, 0, _ERRNO | errno.ENOSYS)]
    for name in DENIED:
        ins += [(_JEQ, 0, 1, nr[name]), (_RET, 0, 0, _ERRNO | errno.EPERM)]
    ins += [
        (_JEQ, 0, 1, nr["clone3"]),
        (_RET, 0, 0, _ERRNO | errno.ENOSYS),
        (_JEQ, 1, 0, nr["clone"]),  # clone: check its flags below
        (_JEQ, 0, 3, nr["unshare"]),  # neither clone nor unshare: allow
        (_LD_ABS, 0, 0, _ARG0),
        (_JSET, 0, 1, _CLONE_NEWUSER),
        (_RET, 0, 0, _ERRNO | errno.EPERM),
        (_RET, 0, 0, _ALLOW),
    ]
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


def program_fd() -> int:
    """A pipe's read end holding ``program()``, for ``bwrap --seccomp FD`` (bwrap closes it)."""
    data = program()
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        os.write(w, data)  # a few hundred bytes: fits in the pipe buffer
    finally:
        os.close(w)
    return r
