"""Start the grader's observer and its pytest worker, before any code of the workspace can run.

Usage inside a sandbox (``coderl.grading.runner.pytest_command``)::

    /venv/bin/python -S -P -B /coderl/plugin/coderl_boot.py RUN_JSON SECRET_FIFO PYTEST-ARGS...

``RUN_JSON`` holds the public part of the run (selected ids, site-packages, tracing, allowed
conftests). Before anything else is imported this script makes the process non-dumpable
(``PR_SET_DUMPABLE`` 0: no other process of the sandbox can read its memory, open its descriptors
through ``/proc`` or trace it), points stdin at ``/dev/null``, keeps the sandbox's stdout (the
verdict channel) and points fd 1 at stderr, then forks:

- the **worker** (child) closes the verdict channel, adds only the environment's site-packages
  (``-S``: no ``sitecustomize``/``usercustomize``; ``-P``: the working directory is not on
  ``sys.path``; ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``: no workspace entry point; the virtualenv's
  own plugins by explicit ``-p``) and runs pytest with ``coderl_results``, which reports
  unsigned events on a pipe. It holds no key, no verdict channel and, until collection has
  finished (every test module imported), no canary: those reach it from the observer after its
  ``collected`` event. It leaves with ``os._exit`` (no ``atexit`` handler runs);
- the **observer** (parent) never imports pytest or workspace code. Only after the fork does it
  read ``SECRET_FIFO`` (MAC key, canaries, placement bytes, written by the host once the FIFO is
  opened), so the secret was never in the worker's memory; the worker waits for one byte on a
  pipe that the observer writes once the FIFO is drained, so no workspace code can race it to
  the FIFO (whose path is in the worker's argv). It forwards each event line, MAC-signed
  and numbered, to the verdict channel, answers the ``collected`` event with the canaries, and
  closes the stream with its own ``exit`` record (the worker's exit code or signal, and whether
  an event line was over-long, not a JSON object or without the event token). The host checks
  everything else.
- the **event token**: a random string the observer sends the worker on the go pipe, read and
  the pipe closed before any workspace code runs; the plugin puts it into every event line and
  the observer forwards only lines that carry it (and kills the worker at the first that does
  not). Code under test that opens the event pipe by number (``open(5, "wb")``,
  ``/proc/self/fd/5``) and writes a well-formed stream of its own is therefore a garbled
  verdict; forging past it needs the token from this process's memory (the plugin's globals,
  ``gc``, frames: what ``coderl.grading.diffguard`` denies, or ``/proc/self/mem``: residual).
"""

import ctypes
import hashlib
import hmac
import json
import os
import secrets
import select
import signal
import site
import sys

EVENT_LINE_BYTES = 8 * 1024**2
"""Longest event line forwarded; a longer one ends the forwarding (``garbled``)."""
TOKEN_BYTES = 32
"""Length of the event token (hex characters) the observer hands the worker on the go pipe."""


def _venv_plugins(site_dir: str) -> list[str]:
    """``-p MODULE`` arguments for the pytest11 entry points installed in ``site_dir`` only."""
    from importlib.metadata import distributions

    args: list[str] = []
    for dist in distributions(path=[site_dir]):
        for ep in dist.entry_points:
            if ep.group == "pytest11" and ":" not in ep.value:
                args += ["-p", ep.value]
    return args


def _worker(spec: dict, events: int, control: int, go: int) -> None:
    # nothing runs until the observer has drained the secret FIFO (its path is in our argv):
    # workspace code opening it later finds no writer and blocks until the timeout. The same
    # pipe brings the event token; it is read, and the pipe closed, before any workspace code
    # runs, so the token exists only in this process's memory (no descriptor holds it)
    got = b""
    while len(got) < 1 + TOKEN_BYTES:
        chunk = os.read(go, 1 + TOKEN_BYTES - len(got))
        if not chunk:
            os._exit(3)
        got += chunk
    os.close(go)
    if got[:1] != b"1":
        os._exit(3)
    token = got[1:].decode()
    del got
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    code = 3
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        site.addsitedir(spec["site"])
        import coderl_results

        coderl_results.start(events, control, spec, token)
        del token
        import pytest

        args = _venv_plugins(spec["site"]) + sys.argv[3:]
        code = int(pytest.main(args, plugins=[coderl_results]))
    except BaseException:  # noqa: BLE001 - whatever happened, leave without running atexit
        code = 3
        try:  # say why on stderr (not the verdict channel): a build without pytest, a crash
            import traceback

            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(code)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _observe(pid: int, stream: int, events: int, control: int, go: int) -> int:
    with open(sys.argv[2], "rb") as f:
        secret = json.loads(f.read())
    token = secrets.token_hex(TOKEN_BYTES // 2).encode()
    _write_all(go, b"1" + token)  # the secret is drained: the worker may start
    os.close(go)
    key = bytes.fromhex(secret.pop("key"))
    seq = 0

    def emit(record: dict) -> None:
        nonlocal seq
        record = {"seq": seq, **record}
        seq += 1
        line = json.dumps(record, separators=(",", ":")).encode()
        mac = hmac.new(key, line, hashlib.sha256).hexdigest().encode()
        _write_all(stream, mac + b" " + line + b"\n")

    garbled, answered, pending, status = "", False, b"", None
    while True:
        ready, _, _ = select.select([events], [], [], 0.2)
        chunk = os.read(events, 1 << 16) if ready else b""
        if not chunk:
            if ready or status is not None:
                break  # EOF, or the worker is gone and nothing more is pending
            done, st = os.waitpid(pid, os.WNOHANG)
            status = st if done else None
            continue  # a descendant that kept the pipe open does not hold the verdict back
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > EVENT_LINE_BYTES:
            garbled, pending = garbled or "an over-long event line", b""
        for raw in lines if not garbled else []:
            try:
                event = json.loads(raw) if len(raw) <= EVENT_LINE_BYTES else None
            except (ValueError, RecursionError):
                event = None
            if not isinstance(event, dict):
                garbled = "an event line that is not a JSON object"
                break
            if not hmac.compare_digest(str(event.pop("k", "")).encode(errors="replace"), token):
                garbled = "an event line without the worker's token"
                break
            emit({"w": event})
            if event.get("t") == "collected" and not answered:
                answered = True
                reply = {"canaries": secret["canaries"], "placement": secret["placement"]}
                try:
                    _write_all(control, json.dumps(reply).encode() + b"\n")
                except OSError:
                    pass
        if garbled and status is None:
            os.kill(pid, signal.SIGKILL)  # nothing it says now counts; do not wait for it
            _, status = os.waitpid(pid, 0)
            break
    if pending and not garbled:
        garbled = "an unterminated event line"
    if status is None:
        _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    emit({"t": "exit", "code": code, "garbled": garbled})
    return 0


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    stream = os.dup(1)  # the verdict channel: the observer's only
    os.dup2(2, 1)
    ev_r, ev_w = os.pipe()  # worker -> observer events (close-on-exec: no test subprocess)
    ctl_r, ctl_w = os.pipe()  # observer -> worker: canaries, once collection is done
    go_r, go_w = os.pipe()  # observer -> worker: one byte once the secret is read
    pid = os.fork()
    if pid == 0:
        for fd in (stream, ev_r, ctl_w, go_w):
            os.close(fd)
        _worker(spec, ev_w, ctl_r, go_r)
    for fd in (ev_w, ctl_r, go_r):
        os.close(fd)
    code = 3
    try:
        code = _observe(pid, stream, ev_r, ctl_w, go_w)
    finally:
        os._exit(code)


if __name__ == "__main__":
    main()
