"""The test runner's own defences, below the grader's path stripping (defence in depth).

The grader removes protected paths from an agent's diff; these tests put the attack files straight
into the base a run sees, as if stripping had failed, and check that the runner still ignores
them, and that the same files do take effect under a plain ``python -m pytest`` (so the checks
are not vacuous). Also: grading sandboxes get no read-write mount at all, and failures are
attributed to the infrastructure or to the agent.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from coderl.envbuild.build import build_env
from coderl.grading.grade import grade, rollout_base
from coderl.grading.runner import mounts, read_stream, run_dirs, run_pytest
from coderl.sandbox import Sandbox, SandboxError
from coderl.tasks.spec import load_tasks

CI_SPEC = "six==1.17.0"
CI_TASKS = Path(__file__).parent.parent / "data" / "tasks" / "ci.jsonl"

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)

MARK = "print('CODERL-INJECTED', __name__, flush=True)\n"
INJECTIONS = {
    "evil_plugin.py": MARK,
    "evil-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n",
    "evil-1.0.dist-info/entry_points.txt": "[pytest11]\nevil = evil_plugin\n",
    "eggy.egg-info/PKG-INFO": "Metadata-Version: 2.1\nName: eggy\nVersion: 1.0\n",
    "eggy.egg-info/entry_points.txt": "[pytest11]\neggy = evil_plugin\n",
    "sitecustomize.py": MARK,
    "usercustomize.py": MARK,
    "zz-evil.pth": "import evil_plugin\n",
}


@pytest.fixture(scope="module")
def env():
    return build_env(CI_SPEC)


@pytest.fixture(scope="module")
def task(env):
    return load_tasks(CI_TASKS)[0]


@pytest.fixture
def poisoned(env, task, tmp_path):
    """The task's rollout base with the injections added (hard links + new files)."""
    base = rollout_base(task, env)
    dest = tmp_path / "base"
    shutil.copytree(base, dest, copy_function=os.link)
    for rel, text in INJECTIONS.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text)
    return dest


def test_workspace_plugins_and_startup_hooks_never_load(env, task, poisoned):
    visible = [t for t in task.PASS_TO_PASS if t not in task.held_out_tests][:5]
    with run_dirs() as inp:
        ro = mounts(inp, Path(env.venv))
        with Sandbox.create(poisoned, ro_mounts=ro) as sb:
            run = run_pytest(sb, inp, paths=env.test_paths, select=visible, timeout=120)
            plain = sb.exec(
                f"cd /testbed && PYTHONPATH=/testbed /venv/bin/python -m pytest -q "
                f"-p no:cacheprovider {visible[0]}"
            )
    assert not run.results_missing and run.canaries_ok
    assert all(run.outcomes[t] == "passed" for t in visible)
    assert "CODERL-INJECTED" not in run.exec.stdout + run.exec.stderr
    # the same files are live attacks under a plain pytest (autoloaded entry points, site hooks)
    assert "CODERL-INJECTED" in plain.stdout + plain.stderr


def test_verdict_stream_rejects_forged_and_incomplete_lines():
    import hashlib
    import hmac
    import json

    key = b"k" * 32

    def line(rec, k=key):
        body = json.dumps(rec, separators=(",", ":"))
        return hmac.new(k, body.encode(), hashlib.sha256).hexdigest() + " " + body

    test = {"seq": 0, "w": {"t": "test", "id": "t.py::test_a", "outcome": "passed"}}
    end = {"seq": 1, "t": "exit", "code": 0, "garbled": ""}
    assert read_stream(line(test) + "\n" + line(end) + "\n", key) is not None
    assert read_stream("garbage\n" + line(test) + "\nzz\n" + line(end) + "\n", key) is not None
    assert read_stream(line(test, b"x" * 32) + "\n" + line(end) + "\n", key) is None  # wrong key
    assert read_stream(line(test) + "\n", key) is None  # no exit record
    gap = dict(end, seq=2)
    assert read_stream(line(test) + "\n" + line(gap) + "\n", key) is None
    bomb = "[" * 100_000 + "]" * 100_000
    body = bomb.encode()
    mac = hmac.new(key, body, hashlib.sha256).hexdigest()
    assert read_stream(f"{mac} {bomb}\n", key) is None  # parsed without blowing the stack


def test_grading_sandboxes_get_no_writable_host_mount(env, task):
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return Sandbox.create(*args, **kwargs)

    result = grade(task, task.gold_patch, env=env, factory=recording)
    assert result.resolved and result.failure_kind is None
    assert seen and all(kw["rw_mounts"] == {} and kw["network"] is False for kw in seen)


def test_failure_attribution(env, task):
    def broken(*args, **kwargs):
        raise SandboxError("could not start")

    infra = grade(task, task.gold_patch, env=env, factory=broken)
    assert infra.failure_kind == "infra" and infra.grading_error
    missing = grade(task.model_copy(update={"env_id": "no-such-env"}), task.gold_patch)
    assert missing.failure_kind == "infra" and missing.grading_error.startswith("setup:")
    for diff in (
        "",
        "not a diff at all\n",
        "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n",
    ):
        agent = grade(task, diff, env=env)
        assert agent.failure_kind == "agent" and agent.grading_error is None
    assert grade(task, task.gold_patch, env=env).failure_kind is None


def test_no_set_id_bit_written_through_a_mount_reaches_the_host(tmp_path):
    """A sandbox may set mode bits on files in a read-write mount (an env build's virtualenv);
    ``clear_setid`` (run after every such build) leaves none on the host."""
    from coderl.tasks.snapshot import clear_setid

    out = tmp_path / "rw"
    out.mkdir()
    out.chmod(0o777)
    base = tmp_path / "base"
    base.mkdir()
    with Sandbox.create(base, rw_mounts={"/out": str(out)}) as sb:
        res = sb.exec(
            "cp /bin/true /out/x && chmod 6755 /out/x && mkdir -p /out/d && chmod 3777 /out/d"
        )
        assert res.exit_code == 0, res.stderr
    modes = [os.stat(out / n).st_mode for n in ("x", "d")]
    assert any(m & (stat.S_ISUID | stat.S_ISGID) for m in modes)  # the attack lands...
    assert clear_setid(out) == 2
    for n in ("x", "d"):  # ...and is cleared
        assert not os.stat(out / n).st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX)


def test_canaries_look_like_real_tests_and_run_among_them(env, task, monkeypatch):
    import coderl.grading.runner as runner

    seen: list[list[dict]] = []
    real_read = runner.read_stream

    def spy(stdout, key):
        records = real_read(stdout, key)
        seen.append(records)
        return records

    monkeypatch.setattr(runner, "read_stream", spy)
    select = [t for t in env.passing if t not in task.held_out_tests]
    with run_dirs() as inp:
        ro = mounts(inp, Path(env.venv))
        with Sandbox.create(rollout_base(task, env), ro_mounts=ro) as sb:
            run = run_pytest(sb, inp, paths=env.test_paths, select=select, timeout=120)
    assert run.canaries_ok and len(run.canaries) == 5
    order = [r["w"]["id"] for r in seen[0][:-1] if r["w"]["t"] == "test"]
    positions = [order.index(c) for c in run.canaries]
    # not appended after the real tests: a random placement is the last 5 with p = 1/C(n, 5)
    # (the former check, all in the back half with one in the last 5, failed ~1% of runs)
    assert sorted(positions) != list(range(len(order) - 5, len(order)))
    for node_id in run.canaries:  # in a real test module, named from the real tests' words
        assert node_id.startswith("test_six.py::Test") or node_id.startswith("test_six.py::test_")
        assert "canary" not in node_id and "coderl" not in node_id
    assert set(run.canary_expected.values()) == {"passed", "failed"}
