"""Run a repository's pytest suite inside a sandbox and collect per-test outcomes.

Outcomes are written by the ``coderl_results`` pytest plugin to a file in a read-write mount
outside the workspace (``/coderl/results``); the list of test ids to run and the canary tests sit
in a read-only mount (``/coderl/input``). Runs use a fixed hash seed, no cache provider, no
network (the sandbox is created with ``network=False``) and a wall-clock timeout.

Sandbox layout used by every run::

    /testbed          the copy-on-write workspace over a read-only base directory
    /venv             the environment's virtualenv (read-only for test runs)
    /coderl/plugin    the results plugin (read-only)
    /coderl/input     selected test ids and canary tests (read-only)
    /coderl/results   where the plugin writes results (read-write, on the host)

Canaries: two must-fail tests (a plain ``assert`` and a ``unittest`` assertion) and one
must-pass test, named with a per-run nonce and run last. If the code under test rewires pytest or
unittest so that the must-fail canaries pass, the run is marked tampered.
"""

from __future__ import annotations

import json
import secrets
import shlex
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from coderl.sandbox.base import ExecResult, Limits, Sandbox

PLUGIN_DIR = Path(__file__).parent / "pytest_plugin"
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
    """Canary kind (``pass``, ``fail``, ``ufail``) -> outcome, for the canaries that reported."""
    canaries_ok: bool = True
    """The must-fail canaries failed and the must-pass canary passed."""
    tampered: list[str] = field(default_factory=list)
    """pytest/unittest functions that were replaced during the run."""
    collect_errors: list[str] = field(default_factory=list)
    """Collection errors (module that failed to import, with the error text)."""
    results_missing: bool = False
    """The plugin wrote no results (pytest crashed, was killed, or exited at import)."""
    exec: ExecResult | None = None
    """The raw command result (exit code, output tails, duration, timeout flag)."""

    def passed(self, node_id: str) -> bool:
        """Explicit pass only: missing, errored, skipped or not collected is not a pass."""
        return self.outcomes.get(node_id) == "passed"


def canary_source(nonce: str) -> str:
    return (
        "import unittest\n\n\n"
        f"def test_coderl_canary_pass_{nonce}():\n    assert 1 + 1 == 2\n\n\n"
        f"def test_coderl_canary_fail_{nonce}():\n    assert 1 + 1 == 3\n\n\n"
        f"class TestCoderlCanary_{nonce}(unittest.TestCase):\n"
        "    def test_coderl_canary_ufail(self):\n        self.assertEqual(1, 2)\n"
    )


def tampering(run: TestRun, *, canaries: bool) -> str:
    """Why ``run`` looks tampered with, or ``""``.

    A must-fail canary that passed is tampering. Canaries that did not run are tampering only if
    some real test passed (a collection error or a crash runs nothing at all, canaries included;
    a forged results file reports passes without them).
    """
    if run.tampered:
        return "replaced: " + ", ".join(run.tampered[:3])
    if not canaries or run.results_missing:
        return ""
    if any(run.canaries.get(k) == "passed" for k in ("fail", "ufail")):
        return "a must-fail canary passed"
    if run.canaries != CANARY_EXPECTED and any(o == "passed" for o in run.outcomes.values()):
        return "tests passed but the canaries did not behave"
    return ""


def _canary_kind(node_id: str) -> str | None:
    name = node_id.rsplit("::", 1)[-1]
    for kind in ("ufail", "pass", "fail"):
        if f"canary_{kind}" in name:
            return kind
    return None


@contextmanager
def run_dirs() -> Iterator[tuple[Path, Path]]:
    """Host directories for one run: ``(input_dir, results_dir)``, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="coderl-run-") as tmp:
        inp, res = Path(tmp) / "input", Path(tmp) / "results"
        inp.mkdir()
        res.mkdir()
        res.chmod(0o777)
        yield inp, res


def mounts(
    input_dir: Path, results_dir: Path, venv: Path | None
) -> tuple[dict[str, str], dict[str, str]]:
    """Standard ``(ro_mounts, rw_mounts)`` for a test run."""
    ro = {"/coderl/plugin": str(PLUGIN_DIR), "/coderl/input": str(input_dir)}
    if venv is not None:
        ro["/venv"] = str(venv)
    return ro, {"/coderl/results": str(results_dir)}


def pytest_command(
    paths: list[str], *, results: str, select: bool, trace: bool, inifile: str | None = None
) -> str:
    """The shell command that runs pytest in ``/testbed`` with the results plugin.

    ``inifile`` (workspace-relative) is passed with ``-c``: the canary file outside the workspace
    would otherwise move pytest's search for the repository's configuration to ``/``.
    """
    env = {
        "PYTHONHASHSEED": "0",
        "CODERL_RESULTS": results,
        "PYTHONPATH": "/coderl/plugin",
    }
    if select:
        env["CODERL_SELECT"] = "/coderl/input/select.txt"
    if trace:
        env["CODERL_TRACE_ROOT"] = "/testbed"
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    args = " ".join(shlex.quote(p) for p in paths)
    if inifile:
        args = f"-c {shlex.quote('/testbed/' + inifile)} {args}"
    # -P: the working directory is not put first on sys.path, so a file in the workspace cannot
    # shadow pytest or the standard library.
    return (
        f"cd /testbed && {prefix} /venv/bin/python -P -m pytest -p coderl_results "
        f"-p no:cacheprovider --rootdir=/testbed -q --color=no {args}"
    )


def run_pytest(
    sandbox: Sandbox,
    input_dir: Path,
    results_dir: Path,
    *,
    paths: list[str],
    select: list[str] | None = None,
    trace: bool = False,
    canaries: bool = True,
    timeout: float = 600.0,
    inifile: str | None = None,
) -> TestRun:
    """Run pytest on ``paths`` (optionally only the ``select`` ids) and parse the results.

    Raises only what the sandbox raises (an infrastructure failure); every failure of the code
    under test (crash, exit at import, timeout) shows up as missing or failed outcomes.
    """
    nonce = secrets.token_hex(6)
    results_name = f"results-{nonce}.json"
    args = list(paths)
    if select is not None:
        (input_dir / "select.txt").write_text("\n".join(select) + "\n")
        args = sorted({s.split("::")[0] for s in select}) or args
    if canaries:
        canary = input_dir / f"test_coderl_canary_{nonce}.py"
        canary.write_text(canary_source(nonce))
        args.append(f"/coderl/input/{canary.name}")
    cmd = pytest_command(
        args,
        results=f"/coderl/results/{results_name}",
        select=select is not None,
        trace=trace,
        inifile=inifile,
    )
    result = sandbox.exec(cmd, timeout=timeout)
    run = TestRun(exec=result)
    path = results_dir / results_name
    if not path.exists():
        run.results_missing = True
        run.canaries_ok = not canaries
        return run
    data = json.loads(path.read_text())
    seen_canaries: dict[str, str] = {}
    for node_id, entry in data["tests"].items():
        kind = _canary_kind(node_id) if "coderl_canary" in node_id else None
        if kind is not None:
            seen_canaries[kind] = entry["outcome"]
            continue
        run.outcomes[node_id] = entry["outcome"]
        if entry["outcome"] != "passed":
            run.longreprs[node_id] = entry.get("longrepr", "")
    run.trace = {k: [tuple(x) for x in v] for k, v in data.get("trace", {}).items()}
    run.tampered = list(data.get("tampered", []))
    run.collect_errors = list(data.get("collect_errors", []))
    run.canaries = seen_canaries
    if canaries:
        run.canaries_ok = seen_canaries == CANARY_EXPECTED
    return run
