"""False positives of the second run's strict assertions (``coderl.grading.strictcmp``) over
whole test suites: for each built environment of ``data/tasks/*.jsonl.gz``, its released tree
(the state every gold patch restores) runs its test command in a sandbox twice, as released and
with every test module of its test paths rewritten as a second run rewrites its planted files.
A test that fails only with the rule is a false positive of the rule on released code; the ones
whose message is the checker's ("a value posing as") are listed.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/strict_suites.py [--only NAME]
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from coderl.grading.strictcmp import checker_name, released_methods, rewrite
from coderl.sandbox import Limits, Sandbox
from coderl.tasks.env import find_env
from coderl.tasks.spec import load_tasks

ROOT = Path(__file__).resolve().parent.parent
_TEST_MODULE = re.compile(r"(^test_.*|.*_test)\.py$")


def failed(output: str) -> dict[str, str]:
    """Node id -> the message of each ``FAILED``/``ERROR`` line of pytest's ``-rfE`` summary."""
    out = {}
    for line in output.splitlines():
        m = re.match(r"(FAILED|ERROR) (\S+)(?: - (.*))?$", line)
        if m:
            out[m.group(2)] = m.group(3) or ""
    return out


def run_suite(env, planted: bool) -> tuple[dict[str, str], int, float, int]:
    """``(failures, modules rewritten, seconds, tests passed)`` of the environment's test
    command."""
    snapshot = Path(env.snapshot)
    t0 = time.time()
    limits = Limits(timeout_s=900, cpu_s=1800, memory_bytes=4 * 1024**3)
    with Sandbox.create(snapshot, limits=limits, ro_mounts={"/venv": env.venv}) as sb:
        n = 0
        if planted:
            name = checker_name()
            for root in env.test_paths:
                base = snapshot / root
                files = [base] if base.is_file() else sorted(base.rglob("*.py"))
                for path in files:
                    rel = path.relative_to(snapshot).as_posix()
                    if not _TEST_MODULE.match(path.name):
                        continue
                    lines = path.read_bytes().split(b"\n")
                    released = released_methods(path, rel)
                    new = rewrite(lines, name, f"/testbed/{rel}", released)
                    if new is not lines:
                        sb.write_text(rel, b"\n".join(new).decode("utf-8", "surrogateescape"))
                        n += 1
        cmd = re.sub(r"^python\b", "/venv/bin/python", env.test_command) + " -rfE -q"
        result = sb.exec(f"cd /testbed && {cmd} 2>&1 | tail -n 5000", timeout=900)
    passed = re.findall(r"(\d+) passed", result.stdout)
    return failed(result.stdout), n, time.time() - t0, int(passed[-1]) if passed else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="one library name (data/tasks/NAME.jsonl.gz)")
    args = ap.parse_args()
    for path in sorted((ROOT / "data" / "tasks").glob("*.jsonl.gz")):
        lib = path.name.removesuffix(".jsonl.gz")
        if args.only and lib != args.only:
            continue
        env = find_env(load_tasks(str(path))[0].env_id)
        plain, _, s1, _ = run_suite(env, planted=False)
        strict, n, s2, passed = run_suite(env, planted=True)
        new = {k: v for k, v in strict.items() if k not in plain}
        posing = [k for k, v in new.items() if "Posing" in v or "posing as" in v]
        print(
            f"{lib}: {n} test modules rewritten, {passed} tests passed strict; "
            f"failures {len(plain)} as released, "
            f"{len(strict)} strict; {len(new)} only strict, {len(posing)} by the checker "
            f"({s1:.0f}s + {s2:.0f}s)",
            flush=True,
        )
        for k in sorted(new)[:20]:
            print(f"   {k}: {new[k][:200]}", flush=True)


if __name__ == "__main__":
    main()
