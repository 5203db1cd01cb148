"""Run a repository's pytest suite inside a sandbox and collect per-test outcomes.

The verdict is produced outside the process it judges. ``coderl_boot`` forks before any
workspace code runs: the pytest **worker** (the process under test) holds no key, no verdict
channel and, until its test modules are imported, no canary; it reports unsigned events on a
pipe. The **observer** (the parent, which never imports pytest or workspace code and is
non-dumpable) reads the run's secret from a FIFO only after the fork, hands the worker the
canaries once collection is done, MAC-signs and numbers every event line onto the sandbox's
stdout (which only it holds) and closes the stream with the worker's exit status. The host
then checks every record of the stream (:func:`parse_run`): exact keys, types, lengths and
ranges, booleans that are ``bool``, trace entries of arity 2, one outcome per test, every id
among the selected ones or the canaries, the sequence ``collected`` -> ``test``... -> ``end`` ->
``exit``, the end record's count and exit status equal to what was seen. A stream that fails any
check is a garbled verdict: the run counts as having no results (the agent's failure, never a
mask). Runs use a fixed hash seed, no cache provider, no plugin autoload, no network
(``network=False``) and a timeout; the sandbox is closed (every process in it killed) before
the verdict is used.

What this does not stop: code in the worker can write events of its own on the pipe (it is the
same process as the plugin). It does not know the canaries until collection is over, and the
canaries must fail; code that waits for them, tells them apart and forges the rest needs the
process internals that ``coderl.grading.diffguard`` denies reward for. Such a forge still has to
pass ``coderl.grading.rerun``'s second run, whose canaries the worker is never told.

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

from coderl.grading.pytestcfg import EMPTY_CONFIG
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
    garbled: str = ""
    """Why the stream was rejected (a record failed the host's checks, :func:`parse_run`)."""
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


RUN_KINDS = ("pass", "fail", "pass", "fail", "ufail")
"""The canaries of a graded run: 2 must-pass, 2 must-fail, 1 must-fail unittest assertion."""


def make_canaries(
    rng: random.Random,
    known_ids: list[str],
    kinds: tuple[str, ...] = RUN_KINDS,
    taken: frozenset[str] = frozenset(),
) -> list[Canary]:
    """One canary per entry of ``kinds`` (in a random order), named like the real tests in
    ``known_ids``: ``test_`` and 2-4 of their words (as many as a real name of them has), never a
    name of ``known_ids`` or of ``taken`` (other names the module already binds). Kind ``name``
    is a fresh name only (no source): what a second run renames a real test to."""
    names = [i.rsplit("::", 1)[-1].split("[")[0].lower() for i in known_ids]
    split = [[w for w in re.split(r"[^a-z0-9]+", n) if w and w != "test"] for n in names]
    vocab = sorted({w for ws in split for w in ws} | set(_WORDS))
    lengths = [min(max(len(ws), 2), 4) for ws in split] or [3]
    used = set(taken) | {i.rsplit("::", 1)[-1].split("[")[0] for i in known_ids}
    out: list[Canary] = []
    for kind in rng.sample(list(kinds), len(kinds)):
        while True:
            name = "test_" + "_".join(rng.sample(vocab, rng.choice(lengths)))
            cls = "Test" + "".join(w.title() for w in name.split("_")[1:])
            if name not in used and cls not in used:
                used.update((name, cls))
                break
        if kind == "name":
            out.append(Canary(name, kind, ""))
            continue
        a, b = rng.randrange(2, 50), rng.randrange(2, 50)
        want = a * b + (0 if kind == "pass" else rng.randrange(1, 9))
        if kind == "ufail":
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


def pytest_command(
    paths: list[str], *, inifile: str | None = None, outcomes_only: bool = False
) -> str:
    """The shell command that runs pytest in ``/testbed`` through ``coderl_boot``.

    The boot reads ``/coderl/input/run.json`` (public: selection, tracing, allowed conftests)
    and the secret FIFO ``/coderl/input/secret`` (key and canaries, written by the host once
    the boot opens it, before any workspace code runs). ``inifile`` (a ``/testbed``-relative
    path, ``coderl.grading.pytestcfg.run_config``) is passed with ``-c``; without one the run
    reads ``pytestcfg.EMPTY_CONFIG`` with ``--confcutdir=/testbed`` (what pytest does when it
    finds no file), never a configuration file it would discover in the workspace.
    ``outcomes_only`` adds ``--tb=no --assert=plain``: no failure text and no assertion
    rewriting (a failing test costs about what a passing one does, and test modules import
    without being rewritten; outcomes are the same, messages differ).
    """
    args = " ".join(shlex.quote(p) for p in paths)
    if outcomes_only:
        args = f"--tb=no --assert=plain {args}"
    if inifile:
        args = f"-c {shlex.quote('/testbed/' + inifile)} {args}"
    else:
        args = f"-c {EMPTY_CONFIG} --confcutdir=/testbed {args}"
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
    outcomes_only: bool = False,
) -> TestRun:
    """Run pytest on ``paths`` (optionally only the ``select`` ids) and read the verdict stream.

    ``allowed_conftests`` are sandbox paths (``/testbed/...``) of the conftest files that may
    register hooks (the base's own). ``outcomes_only``: no failure texts, no assertion
    rewriting and no comparison of the test functions' code with their files (the plugin's
    costliest tripwire), for a run that can only take passes away (``coderl.grading.rerun``).
    Raises only what the sandbox raises (an infrastructure
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
    if outcomes_only:
        public["check_code"] = False
    chosen = make_canaries(rng, list(select or [])) if canaries else []
    secret = {
        "key": key.hex(),
        # two 64-bit draws per canary (its module, its position): the plugin reads them as
        # integers, so no method that graded code could patch decides where a canary goes
        "placement": secrets.token_hex(16 * len(chosen)),
        "canaries": [{"name": c.name, "kind": c.kind, "source": c.source} for c in chosen],
    }
    (input_dir / "run.json").write_text(json.dumps(public))
    (input_dir / Path(EMPTY_CONFIG).name).write_text("[pytest]\n")
    fifo = input_dir / "secret"
    if fifo.exists():
        fifo.unlink()
    os.mkfifo(fifo, 0o644)
    done = threading.Event()
    feeder = _feed_secret(fifo, json.dumps(secret).encode(), done)
    try:
        result = sandbox.exec(
            pytest_command(args, inifile=inifile, outcomes_only=outcomes_only), timeout=timeout
        )
    finally:
        done.set()
        feeder.join(timeout=5)
    run = TestRun(exec=result)
    records = read_stream(result.stdout, key)
    why = "no complete, verified stream" if records is None else ""
    if records is not None:
        why = parse_run(records, run, chosen, set(select) if select is not None else None)
    if why:
        fresh = TestRun(exec=result, results_missing=True, canaries_ok=not canaries)
        fresh.garbled = why
        return fresh
    if canaries:
        run.canaries_ok = len(run.canaries) == len(chosen) and all(
            run.canaries[i] == run.canary_expected[i] for i in run.canaries
        )
    return run


def read_stream(stdout: str, key: bytes) -> list[dict[str, Any]] | None:
    """The verified records of the observer's stream, its ``exit`` record last; ``None`` when
    the stream is incomplete (no ``exit`` record, a gap in the numbering) or not JSON objects.

    Lines whose MAC does not verify are skipped before they are parsed; a verified line is parsed
    with a size limit. The records' contents are checked by :func:`parse_run`.
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
        if rec.get("t") == "exit":
            return records
    return None


MAX_ID = 4096
"""Longest node id, tampering note or trace file name accepted (characters)."""
MAX_TEXT = 16_384
"""Longest failure text or collection error accepted (characters)."""
MAX_ITEMS = 100_000
"""Most entries of any list in a record (ids, trace entries, notes)."""
OUTCOMES = frozenset({"passed", "failed", "error", "skipped", "xfailed", "xpassed"})
EVENT_KEYS = {
    "collected": {"t", "ids"},
    "test": {"t", "id", "outcome", "longrepr", "trace"},
    "end": {"t", "n", "tampered", "collect_errors", "exitstatus"},
}


def _is_int(x: object, lo: int, hi: int) -> bool:
    return type(x) is int and lo <= x <= hi  # bool is not an int here


def _strs(x: object, longest: int) -> bool:
    return (
        type(x) is list
        and len(x) <= MAX_ITEMS
        and all(type(v) is str and len(v) <= longest for v in x)
    )


def check_event(ev: dict[str, Any]) -> str:
    """Why the worker event ``ev`` is malformed, or ``""`` (exact keys, types, lengths, ranges)."""
    kind = ev.get("t")
    if type(kind) is not str or kind not in EVENT_KEYS or set(ev) != EVENT_KEYS[kind]:
        return f"unexpected event shape: {sorted(ev)[:8]}"
    if kind == "collected":
        return "" if _strs(ev["ids"], MAX_ID) else "collected ids"
    if kind == "end":
        ok = (
            _is_int(ev["n"], 0, 10 * MAX_ITEMS)
            and _strs(ev["tampered"], MAX_ID)
            and _strs(ev["collect_errors"], MAX_TEXT)
            and _is_int(ev["exitstatus"], 0, 5)  # pytest.ExitCode
        )
        return "" if ok else "end record fields"
    trace = ev["trace"]
    ok = (
        type(ev["id"]) is str
        and 0 < len(ev["id"]) <= MAX_ID
        and type(ev["outcome"]) is str
        and ev["outcome"] in OUTCOMES
        and type(ev["longrepr"]) is str
        and len(ev["longrepr"]) <= MAX_TEXT
        and type(trace) is list
        and len(trace) <= MAX_ITEMS
        and all(
            type(e) is list
            and len(e) == 2
            and type(e[0]) is str
            and len(e[0]) <= MAX_ID
            and _is_int(e[1], 0, 10**7)
            for e in trace
        )
    )
    return "" if ok else f"test record fields ({str(ev.get('id'))[:80]})"


def _canary_of(node_id: str, by_name: dict[str, Canary]) -> Canary | None:
    parts = node_id.split("::")
    canary = by_name.get(parts[1]) if len(parts) > 1 else None
    if canary is not None and (len(parts) == 2 or canary.kind == "ufail"):
        return canary
    return None


def parse_run(
    records: list[dict[str, Any]], run: TestRun, chosen: list[Canary], select: set[str] | None
) -> str:
    """Fill ``run`` from the observer's verified ``records``; returns why the stream is a
    garbled verdict (``""`` when every record checks out). Every field of every record is
    checked before it is used (module docstring)."""
    exit_rec = records[-1]
    if set(exit_rec) != {"seq", "t", "code", "garbled"} or not _is_int(exit_rec["code"], -64, 255):
        return "observer exit record"
    if type(exit_rec["garbled"]) is not str or exit_rec["garbled"]:
        return f"observer: {str(exit_rec['garbled'])[:200]}"
    events = []
    for rec in records[:-1]:
        if set(rec) != {"seq", "w"} or type(rec["w"]) is not dict:
            return "observer record shape"
        why = check_event(rec["w"])
        if why:
            return why
        events.append(rec["w"])
    kinds = [e["t"] for e in events]
    if not kinds or kinds[-1] != "end" or kinds.count("end") != 1:
        return "no single end record closing the events"
    if kinds.count("collected") > 1 or ("collected" in kinds and kinds[0] != "collected"):
        return "collected event out of order"
    if "test" in kinds and "collected" not in kinds:
        return "tests reported before any collection"
    end = events[-1]
    if end["n"] != len(events) - 1 or exit_rec["code"] != end["exitstatus"]:
        return "end record count or exit status disagrees with the stream"
    collected = set(events[0]["ids"]) if kinds[0] == "collected" else set()
    if select is not None and not collected <= select:
        return "collected ids outside the selection"
    by_name = {c.name: c for c in chosen}
    for ev in events[1:-1]:
        node_id, outcome = ev["id"], ev["outcome"]
        canary = _canary_of(node_id, by_name)
        if node_id in run.outcomes or node_id in run.canaries:
            return f"two outcomes for one test ({node_id[:80]})"
        if canary is not None and node_id not in collected:
            run.canaries[node_id] = outcome
            run.canary_expected[node_id] = canary.expected
            continue
        if node_id not in collected:
            return f"an outcome for a test that was not collected ({node_id[:80]})"
        run.outcomes[node_id] = outcome
        if outcome != "passed":
            run.longreprs[node_id] = ev["longrepr"]
        if ev["trace"]:
            run.trace[node_id] = [(f, n) for f, n in ev["trace"]]
    failing = any(
        o in ("failed", "error") for o in [*run.outcomes.values(), *run.canaries.values()]
    )
    if failing and end["exitstatus"] not in (1, 2):  # pytest's TESTS_FAILED / INTERRUPTED
        return "exit status says no test failed, but some did (a crashed or forged worker)"
    run.tampered = list(end["tampered"])
    run.collect_errors = list(end["collect_errors"])
    return ""
