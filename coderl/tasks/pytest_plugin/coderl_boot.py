"""Start pytest for the grader, before any code of the workspace can run.

Usage inside a sandbox (``coderl.tasks.runner.pytest_command``)::

    /venv/bin/python -S -P -B /coderl/plugin/coderl_boot.py RUN_JSON SECRET_FIFO PYTEST-ARGS...

``RUN_JSON`` holds the public part of the run (selected ids, site-packages, tracing, allowed
conftests); ``SECRET_FIFO`` delivers the secret part (MAC key, canaries, placement seed), written
by the host once this script opens it, so the secret is in no environment, file or command line
and in no other process of the sandbox. Before pytest is imported this script

1. reads both, makes the process non-dumpable (``PR_SET_DUMPABLE`` 0: other processes of the
   sandbox, same uid or not, cannot read its memory or open its descriptors through ``/proc``)
   and replaces stdin with ``/dev/null``;
2. keeps a private, non-inheritable duplicate of the original stdout as the verdict stream and
   points fd 1 at stderr, so nothing else the run prints lands on the stream by accident;
3. adds only the environment's site-packages (``-S``: no ``sitecustomize``/``usercustomize``, no
   user site; ``-P``: the working directory is not on ``sys.path``) and sets
   ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` so no ``pytest11`` entry point (a ``*.dist-info`` or
   ``*.egg-info`` in the workspace) is loaded; the plugins installed in the virtualenv itself are
   passed explicitly with ``-p``;
4. runs pytest with ``coderl_results`` and leaves with ``os._exit``, so ``atexit`` handlers
   registered by the code under test never run.
"""

import ctypes
import hashlib
import hmac
import json
import os
import site
import sys


def _venv_plugins(site_dir: str) -> list[str]:
    """``-p MODULE`` arguments for the pytest11 entry points installed in ``site_dir`` only."""
    from importlib.metadata import distributions

    args: list[str] = []
    for dist in distributions(path=[site_dir]):
        for ep in dist.entry_points:
            if ep.group == "pytest11" and ":" not in ep.value:
                args += ["-p", ep.value]
    return args


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    with open(sys.argv[2], "rb") as f:
        spec.update(json.loads(f.read()))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    stream = os.dup(1)  # non-inheritable: subprocesses of the tests do not get it
    os.dup2(2, 1)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    signer = hmac.new(bytes.fromhex(spec.pop("key")), digestmod=hashlib.sha256)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    site.addsitedir(spec["site"])
    import coderl_results

    coderl_results.start(signer, stream, spec)
    del spec, signer
    import pytest

    args = _venv_plugins(coderl_results.SPEC["site"]) + sys.argv[3:]
    try:
        code = int(pytest.main(args, plugins=[coderl_results]))
    except BaseException:  # noqa: BLE001 - whatever happened, leave without running atexit
        code = 3
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
