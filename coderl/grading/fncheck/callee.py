"""Call the candidate's function on recorded inputs; print its outputs (candidate's sandbox).

Usage: ``python3 -I callee.py CALLS_JSON ENTRY_POINT`` in ``/testbed``. ``CALLS_JSON`` holds the
inputs only (``[[args, kwargs], ...]`` in wire format), never a test or an expected value.
Prints one line ``CODERL-OUTPUTS <json>`` to the original stdout; the candidate's own prints go
to ``/dev/null``. Nothing here is trusted: the candidate can rewrite this process at will, and
whatever it prints is just the candidate's answer, judged elsewhere.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wire  # noqa: E402

MARKER = "CODERL-OUTPUTS "


def _describe(e: BaseException) -> list:
    return ["raise", type(e).__name__, repr(e)[:200]]


def main() -> None:
    calls_path, entry = sys.argv[1], sys.argv[2]
    with open(calls_path, encoding="utf-8") as f:
        calls = json.load(f)
    out = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    report: dict = {"import_error": None, "results": []}
    try:
        namespace = {"__name__": "solution"}
        with open("/testbed/solution.py", encoding="utf-8") as f:
            exec(compile(f.read(), "/testbed/solution.py", "exec"), namespace)
        fn = namespace[entry]
    except BaseException as e:  # noqa: BLE001 - the candidate's failure, reported as such
        report["import_error"] = f"{type(e).__name__}: {repr(e)[:300]}"
        calls = []
    for doc in calls:
        try:
            args, kwargs = wire.decode(doc[0]), wire.decode(doc[1])
            value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001
            report["results"].append(_describe(e))
            continue
        try:
            report["results"].append(["ok", wire.dumps(value)])
        except BaseException as e:  # noqa: BLE001 - not plain data (or its encoding blew up)
            report["results"].append(["unplain", f"{type(e).__name__}: {str(e)[:200]}"])
    data = (MARKER + json.dumps(report, ensure_ascii=True) + "\n").encode()
    while data:
        data = data[os.write(out, data) :]
    os._exit(0)


if __name__ == "__main__":
    main()
