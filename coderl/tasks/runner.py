"""Run a repository's pytest suite inside a sandbox and collect per-test outcomes.

The verdict never touches a file or a host path the code under test can reach. The run's secret
(an HMAC key and its canaries) reaches ``coderl_boot`` through a FIFO the host writes once the
boot has opened it, before any workspace code runs, so it is in no environment, file, command
line or other process of the sandbox; the boot then makes pytest non-dumpable. The results
plugin streams one MAC-signed line per finished test on a descriptor that no subprocess inherits,
and the host reads the stream from the command's stdout while it runs. Only lines that verify,
numbered ``0, 1, ...`` and closed by the plugin's end record before pytest exits, count; the
sandbox is closed (every process in it killed) before the verdict is used. Runs use a fixed hash
seed, no cache provider, no plugin autoload, no network (``network=False``) and a timeout.

Sandbox layout used by every run::

    /testbed          the copy-on-write workspace over a read-only base directory
    /venv             the environment's virtualenv (read-only for test runs)
    /coderl/plugin    the boot script and results plugin (read-only)
    /coderl/input     run.json (selected ids; public) and the secret FIFO (read-only)

Canaries: must-pass and must-fail tests (plain ``assert`` and a ``unittest`` assertion) whose
names are drawn at random from the words of the real tests' names, placed by the plugin into
real test modules at random positions among the real tests. If the code under test rewires
pytest or unittest so that the must-fail canaries pass, the run is marked tampered.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import random
import re
import secrets
import shlex
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from coderl.sandbox.base import ExecResult, Limits, Sandbox

PLUGIN_DIR = Path(__file__).parent / "pytest_plugin"
SITE = "/venv/lib/python3.11/site-packages"
CANARY_EXPECTED = {"pass": "passed", "fail": "failed", "ufail": "failed"}


class SandboxFactory(Protocol):
    """Creates a sandbox: the signature of ``coderl.sandbox.Sandbox.create``."""

    def __call__(
        self,
        base: str | Path,
        *,
        limits: Limits,
        env: dict[str, str],
        ro_mounts: dict[str, str],
        rw_mounts: dict[str, str],
        network: bool,
    ) -> Sandbox: ...


def default_factory() -> SandboxFactory:
    """``coderl.sandbox.Sandbox.create`` (imported late: the sandbox is its own package)."""
    from coderl.sandbox import Sandbox

    factory: SandboxFactory = Sandbox.create
    return factory


SANDBOX_ENV = {
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    "PIP_NO_INPUT": "1",
}


@dataclass
class TestRun:
    """Outcome of one pytest run in a sandbox."""

    outcomes: dict[str, str] = field(default_factory=dict)
    """Node id -> ``passed``/``failed``/``error``/``skipped``/``xfailed``/``xpassed``; tests that
    never reported are absent (they count as failures)."""
    longreprs: dict[str, str] = field(default_factory=dict)
    """Node id -> failure text (assertion output), for tests that did not pass."""
    trace: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    """Node id -> functions it called, as (workspace-relative file, first line) pairs."""
    canaries: dict[str, str] = field(default_factory=dict)
    """Canary node id -> outcome, for the canaries that reported."""
    canary_expected: dict[str, str] = field(default_factory=dict)
    """Canary node id -> the outcome it must have (``passed`` or ``failed``)."""
    canaries_ok: bool = True
    """Every canary reported, the must-fail ones failed and the must-pass ones passed."""
    tampered: list[str] = field(default_factory=list)
    """The plugin's integrity findings: replaced runner/plugin functions or code objects
    (``module.name``), foreign hooks (``hook NAME: file``), changed test code (``test code:
    node id``)."""
    collect_errors: list[str] = field(default_factory=list)
    """Collection errors (module that failed to import, with the error text)."""
    results_missing: bool = False
    """No complete, verified verdict stream (pytest crashed, was killed, exited at import, or
    the stream was cut or garbled)."""
    exec: ExecResult | None = None
    """The raw command result (exit code, output tails, duration, timeout flag)."""

    def passed(self, node_id: str) -> bool:
        """Explicit pass only: missing, errored, skipped or not collected is not a pass."""
        return self.outcomes.get(node_id) == "passed"


@dataclass(frozen=True)
class Canary:
    """One canary test: ``kind`` is ``pass``, ``fail`` or ``ufail`` (a unittest assertion)."""

    name: str
    kind: str
    source: str

    @property
    def expected(self) -> str:
        return CANARY_EXPECTED[self.kind]


_WORDS = (
    "basic empty list dict value items keys order parse format string bytes round trip "
    "iterator default none large small nested simple merge update copy repr equal compare"
).split()


def make_canaries(rng: random.Random, known_ids: list[str]) -> list[Canary]:
    """Five canaries (2 pass, 2 fail, 1 ufail) named like the real tests in ``known_ids``."""
    words = {w for i in known_ids for w in re.split(r"[^a-z0-9]+", i.rsplit("::", 1)[-1].lower())}
    vocab = sorted((words - {"test", ""}) | set(_WORDS))
    taken = {i.rsplit("::", 1)[-1].split("[")[0] for i in known_ids}
    out: list[Canary] = []
    for kind in rng.sample(["pass", "fail", "pass", "fail", "ufail"], 5):
        while True:
            name = "test_" + "_".join(rng.sample(vocab, 3))
            if name not in taken:
                taken.add(name)
                break
        a, b = rng.randrange(2, 50), rng.randrange(2, 50)
        want = a * b + (0 if kind == "pass" else rng.randrange(1, 9))
        if kind == "ufail":
            cls = "Test" + "".join(w.title() for w in name.split("_")[1:])
            src = (
                f"class {cls}(unittest.TestCase):\n"
                f"    def {name}(self):\n"
                f"        values = [{a}] * {b}\n"
                f"        self.assertEqual(sum(values), {want})\n"
            )
            out.append(Canary(cls, kind, src))
        else:
            src = f"def {name}():\n    values = [{a}] * {b}\n    assert sum(values) == {want}\n"
            out.append(Canary(name, kind, src))
    return out


def tampering(run: TestRun, *, canaries: bool) -> str:
    """Why ``run`` looks tampered with, or ``""``.

    A must-fail canary that passed is tampering. Canaries that did not run are tampering only if
    some real test passed (a collection error or a crash runs nothing at all, canaries included).
    """
    if run.tampered:
        return "replaced: " + ", ".join(run.tampered[:3])
    if not canaries or run.results_missing:
        return ""
    if any(o == "passed" and run.canary_expected[i] != "passed" for i, o in run.canaries.items()):
        return "a must-fail canary passed"
    if not run.canaries_ok and any(o == "passed" for o in run.outcomes.values()):
        return "tests passed but the canaries did not behave"
    return ""


@contextmanager
def run_dirs() -> Iterator[Path]:
    """A host input directory for one run (selected ids), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="coderl-run-") as tmp:
        inp = Path(tmp) / "input"
        inp.mkdir()
        yield inp


def mounts(input_dir: Path, venv: Path | None) -> dict[str, str]:
    """Standard read-only mounts of a test run (there are no read-write ones)."""
    ro = {"/coderl/plugin": str(PLUGIN_DIR), "/coderl/input": str(input_dir)}
    if venv is not None:
        ro["/venv"] = str(venv)
    return ro


def conftests_of(base: Path) -> list[str]:
    """Sandbox paths (``/testbed/...``) of the ``conftest.py`` files in ``base``: the only
    workspace files allowed to register pytest hooks during a run."""
    out: list[str] = []
    stack = [Path(base)]
    while stack:
        here = stack.pop()
        for entry in os.scandir(here):
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
            elif entry.name == "conftest.py" and entry.is_file(follow_symlinks=False):
                out.append("/testbed/" + Path(entry.path).relative_to(base).as_posix())
    return sorted(out)


def pytest_command(paths: list[str], *, inifile: str | None = None) -> str:
    """The shell command that runs pytest in ``/testbed`` through ``coderl_boot``.

    The boot reads ``/coderl/input/run.json`` (public: selection, tracing, allowed conftests)
    and the secret FIFO ``/coderl/input/secret`` (key and canaries, written by the host once
    the boot opens it, before any workspace code runs). ``inifile`` is passed with ``-c``.
    """
    args = " ".join(shlex.quote(p) for p in paths)
    if inifile:
        args = f"-c {shlex.quote('/testbed/' + inifile)} {args}"
    return (
        "cd /testbed && PYTHONHASHSEED=0 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "
        "/venv/bin/python -S -P -B /coderl/plugin/coderl_boot.py /coderl/input/run.json "
        f"/coderl/input/secret -p no:cacheprovider --rootdir=/testbed -q --color=no {args}"
    )


def _feed_secret(fifo: Path, data: bytes, done: threading.Event) -> threading.Thread:
    """Write ``data`` to ``fifo`` once a reader has opened it (never blocks when none does)."""

    def feed() -> None:
        while not done.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                if e.errno != errno.ENXIO:  # ENXIO: no reader yet
                    return
                done.wait(0.005)
                continue
            try:
                os.set_blocking(fd, True)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:
                pass
            finally:
                os.close(fd)
            return

    thread = threading.Thread(target=feed, name="coderl-secret", daemon=True)
    thread.start()
    return thread


STREAM_LINE_BYTES = 8 * 1024**2
"""Longest stream line read back (bytes); longer lines are ignored."""
RUN_OUTPUT_BYTES = 64 * 1024**2
"""``Limits.output_bytes`` for test runs: the verdict stream travels on stdout."""


def run_pytest(
    sandbox: Sandbox,
    input_dir: Path,
    *,
    paths: list[str],
    select: list[str] | None = None,
    trace: bool = False,
    canaries: bool = True,
    timeout: float = 600.0,
    inifile: str | None = None,
    allowed_conftests: list[str] | None = None,
) -> TestRun:
    """Run pytest on ``paths`` (optionally only the ``select`` ids) and read the verdict stream.

    ``allowed_conftests`` are sandbox paths (``/testbed/...``) of the conftest files that may
    register hooks (the base's own). Raises only what the sandbox raises (an infrastructure
    failure); every failure of the code under test (crash, exit at import, timeout, a garbled or
    forged stream) shows up as missing or failed outcomes.
    """
    key = secrets.token_bytes(32)
    rng = random.Random(secrets.randbits(64))
    args = list(paths)
    public: dict[str, object] = {"site": SITE, "allowed_conftests": list(allowed_conftests or [])}
    if select is not None:
        public["select"] = list(select)
        args = sorted({s.split("::")[0] for s in select}) or args
    if trace:
        public["trace_root"] = "/testbed"
    chosen = make_canaries(rng, list(select or [])) if canaries else []
    secret = {
        "key": key.hex(),
        "seed": rng.randrange(2**32),
        "canaries": [{"name": c.name, "kind": c.kind, "source": c.source} for c in chosen],
    }
    (input_dir / "run.json").write_text(json.dumps(public))
    fifo = input_dir / "secret"
    if fifo.exists():
        fifo.unlink()
    os.mkfifo(fifo, 0o644)
    done = threading.Event()
    feeder = _feed_secret(fifo, json.dumps(secret).encode(), done)
    try:
        result = sandbox.exec(pytest_command(args, inifile=inifile), timeout=timeout)
    finally:
        done.set()
        feeder.join(timeout=5)
    run = TestRun(exec=result)
    records = read_stream(result.stdout, key)
    if records is None:
        run.results_missing = True
        run.canaries_ok = not canaries
        return run
    by_name = {c.name: c for c in chosen}
    for rec in records[:-1]:
        node_id, outcome = str(rec["id"]), str(rec["outcome"])
        parts = node_id.split("::")
        canary = by_name.get(parts[1]) if len(parts) > 1 else None
        if canary is not None and (len(parts) == 2 or canary.kind == "ufail"):
            run.canaries[node_id] = outcome
            run.canary_expected[node_id] = canary.expected
            continue
        run.outcomes[node_id] = outcome
        if outcome != "passed":
            run.longreprs[node_id] = str(rec.get("longrepr", ""))
        if rec.get("trace"):
            run.trace[node_id] = [(str(f), int(n)) for f, n in rec["trace"]]
    end = records[-1]
    run.tampered = [str(t) for t in end.get("tampered", [])]
    run.collect_errors = [str(e) for e in end.get("collect_errors", [])]
    if canaries:
        run.canaries_ok = len(run.canaries) == len(chosen) and all(
            run.canaries[i] == run.canary_expected[i] for i in run.canaries
        )
    return run


def read_stream(stdout: str, key: bytes) -> list[dict[str, Any]] | None:
    """The verified records of a verdict stream, the end record last; ``None`` when the stream is
    incomplete (no end record, a gap in the numbering) or malformed.

    Lines whose MAC does not verify are skipped before they are parsed; a verified line is parsed
    with a size limit, and anything unexpected in it makes the whole stream invalid.
    """
    records: list[dict[str, Any]] = []
    for raw in stdout.split("\n"):
        mac, _, body = raw.partition(" ")
        if len(body) > STREAM_LINE_BYTES or len(mac) != 64:
            continue
        data = body.encode("utf-8", "surrogateescape")
        good = hmac.new(key, data, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(good, mac):
            continue
        try:
            rec = json.loads(data)
        except (ValueError, RecursionError):
            return None
        if not isinstance(rec, dict) or rec.get("seq") != len(records):
            return None
        records.append(rec)
        if rec.get("t") == "end":
            return records if rec.get("n") == len(records) - 1 else None
        if rec.get("t") != "test" or not isinstance(rec.get("id"), str):
            return None
    return None
