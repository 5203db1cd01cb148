"""One persistent bash per sandbox: commands, output capture with truncation, wall timeouts.

Protocol. bash reads its script from a pipe. Each command is sent as one line,
``eval $'<command>' </dev/null 3>&-; __coderl_done $?``, so ``cd``, ``export`` and shell variables
persist between commands like in a terminal, while the command itself cannot read the protocol
(stdin is /dev/null) nor forge the end-of-command record (fd 3 is closed for it). After each
command ``__coderl_done`` writes ``status NUL cwd NUL declare -px NUL`` to fd 3, the control pipe.
The exported environment and cwd are kept host side, so that a shell restarted after a timeout
(which kills every process of the sandbox) comes back where the terminal was.

Output is read from the shell's stdout/stderr pipes while the command runs and is always drained
(a flood costs the host only a pipe copy); the first and last ``output_bytes / 2`` of each stream
are kept and the middle replaced by a marker.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coderl.sandbox.base import ExecResult

TIMEOUT_EXIT_CODE = 124
"""``exit_code`` of a command killed by its wall timeout (as coreutils ``timeout`` reports)."""

_CTL_FD = 3
_RECORD_NULS = 3  # status NUL cwd NUL env NUL
_EXIT_OUTPUT_S = 2.0  # after the shell exits, how long its last output may take to arrive


def bash_quote(text: str) -> str:
    """``text`` as a bash ANSI-C quoted word ``$'...'`` (any bytes, newlines included)."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == "'":
            out.append("\\'")
        elif ch == "\n":
            out.append("\\n")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


def init_script(ctl_fd: int, close_fds: list[int], ulimits: str) -> str:
    """bash lines run once at shell start: fd plumbing, limits, the end-of-command function.

    ``ctl_fd`` (the control pipe as the shell inherited it) is moved to fd 3; ``close_fds`` are
    other inherited descriptors that commands must not see.
    """
    moves = "" if ctl_fd == _CTL_FD else f" {_CTL_FD}>&{ctl_fd} {ctl_fd}>&-"
    closes = "".join(f" {fd}>&-" for fd in close_fds)
    return (
        f"exec{moves}{closes}\n"
        f"{ulimits}\n"
        '__coderl_done() { printf \'%s\\0%s\\0\' "$1" "$PWD" >&3; declare -px >&3; '
        "printf '\\0' >&3; }\n"
    )


def restore_script(cwd: str | None, env_decls: str) -> str:
    """bash lines that bring a fresh shell back to a saved cwd and exported environment."""
    lines = []
    if env_decls:
        lines.append(f"eval {bash_quote(env_decls)} 2>/dev/null")
    if cwd:
        lines.append(f"cd -- {bash_quote(cwd)} 2>/dev/null")
    return "".join(line + "\n" for line in lines)


@dataclass
class _Capture:
    """Keeps the head and tail of one output stream, counting what was dropped between them."""

    limit: int
    head: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    dropped: int = 0

    def add(self, data: bytes) -> None:
        room = self.limit // 2 - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        keep = self.limit - self.limit // 2
        self.tail += data
        if len(self.tail) > keep:
            self.dropped += len(self.tail) - keep
            del self.tail[: len(self.tail) - keep]

    def text(self) -> str:
        mid = f"\n[... {self.dropped} bytes truncated ...]\n".encode() if self.dropped else b""
        return bytes(self.head + mid + self.tail).decode("utf-8", errors="replace")


@dataclass
class ShellState:
    """What survives a shell restart: the terminal's cwd and exported environment."""

    cwd: str | None = None
    env_decls: str = ""


class Shell:
    """Drives one running bash (``proc``) whose fd 3 writes to ``ctl_read``.

    ``kill`` must terminate every process of the sandbox (and reap the shell): it is called on
    a timeout. ``run`` raises BrokenPipeError when the shell is already gone.
    """

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        ctl_read: int,
        kill: Callable[[], None],
        streams: tuple[int, int] | None = None,
    ) -> None:
        """``streams``: the read ends of the shell's stdout and stderr when they are not
        ``proc``'s own pipes (a container's shell writes them straight to descriptors passed in,
        so that its output is in them before its end-of-command record; the caller closes them)."""
        self.proc = proc
        self.ctl_read = ctl_read
        self.kill = kill
        self.state = ShellState()
        self.alive = True
        assert proc.stdin and proc.stdout and proc.stderr
        self.streams = streams or (proc.stdout.fileno(), proc.stderr.fileno())
        for fd in (*self.streams, ctl_read):
            os.set_blocking(fd, False)

    def send(self, script: str) -> None:
        """Write raw bash lines to the shell (no output is awaited)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(script.encode())
        self.proc.stdin.flush()

    def run(self, cmd: str, *, timeout: float, output_bytes: int) -> ExecResult:
        """Run ``cmd`` (bash source) to completion or until ``timeout`` seconds have passed.

        Raises ValueError when ``cmd`` contains a NUL byte (bash cannot hold one).
        """
        if "\0" in cmd:
            raise ValueError("a command cannot contain NUL bytes")
        start = time.monotonic()
        if not self.alive:
            raise BrokenPipeError("the sandbox shell has exited")
        try:
            self.send(f"eval {bash_quote(cmd)} </dev/null {_CTL_FD}>&-; __coderl_done $?\n")
        except BrokenPipeError:
            self.alive = False
        out, err = _Capture(output_bytes), _Capture(output_bytes)
        ctl = bytearray()
        timed_out = self._pump(out, err, ctl, start + timeout)
        exit_code = self._finish(ctl, timed_out)
        dropped = out.dropped or err.dropped
        return ExecResult(
            exit_code=exit_code,
            stdout=out.text(),
            stderr=err.text(),
            timed_out=timed_out,
            duration_s=time.monotonic() - start,
            truncated=bool(dropped),
        )

    def _pump(self, out: _Capture, err: _Capture, ctl: bytearray, deadline: float) -> bool:
        """Read all three pipes until the end record, shell exit, or the deadline (-> True)."""
        sel = selectors.DefaultSelector()
        sinks: dict[int, Callable[[bytes], None]] = {
            self.streams[0]: out.add,
            self.streams[1]: err.add,
        }
        for fd in sinks:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(self.ctl_read, selectors.EVENT_READ)
        open_outputs = set(sinks)
        try:
            while self.alive or open_outputs:
                left = deadline - time.monotonic()
                if left <= 0:
                    return self.alive  # past the shell's exit, only its output was awaited
                for key, _ in sel.select(min(left, 1.0)):
                    data = _read(key.fd)
                    if data is None:
                        continue
                    if key.fd == self.ctl_read:
                        if not data:  # the shell exited (exit, exec, crash): read its output
                            self.alive = False  # to the end, since the sandbox is ending
                            sel.unregister(key.fd)
                            deadline = min(deadline, time.monotonic() + _EXIT_OUTPUT_S)
                            continue
                        ctl += data
                        if ctl.count(0) >= _RECORD_NULS:
                            self._drain(sinks)
                            return False
                    elif data:
                        sinks[key.fd](data)
                    else:
                        sel.unregister(key.fd)
                        open_outputs.discard(key.fd)
            return False
        finally:
            sel.close()

    @staticmethod
    def _drain(sinks: dict[int, Callable[[bytes], None]]) -> None:
        """Take what the finished command left in the pipes, without waiting for more."""
        for fd, sink in sinks.items():
            while data := _read(fd):
                sink(data)

    def _finish(self, ctl: bytearray, timed_out: bool) -> int:
        if timed_out:
            self.alive = False
            self.kill()
            return TIMEOUT_EXIT_CODE
        if not self.alive or ctl.count(0) < _RECORD_NULS:  # the shell exited by itself
            self.alive = False
            try:
                rc = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                rc = -9
            self.kill()  # whatever it left behind, and the pipes
            return rc if rc >= 0 else 128 - rc
        status, cwd, env, _ = bytes(ctl).split(b"\0", 3)
        self.state = ShellState(cwd=cwd.decode(errors="replace"), env_decls=env.decode("utf-8"))
        return int(status)


def _read(fd: int) -> bytes | None:
    """Up to 64 KiB from non-blocking ``fd``; b"" at end of file, None when nothing is ready."""
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
