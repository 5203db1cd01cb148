"""The model-driven builder, driven by a scripted policy in real build sandboxes: a failed install
is read and retried, the commands that worked are replayed and validated; a policy that never
succeeds ends in a BuildError that lists its attempts, with nothing left running."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from test_agent_tools import PLAIN_CHATML

from coderl.agent.buildpolicy import ModelBuildPolicy, build_statement, build_with_model
from coderl.agent.episode import EpisodeConfig
from coderl.agent.parsing import CALL_FORMATS
from coderl.agent.scripted import ScriptedPolicy
from coderl.envbuild.build import BuildError, RuleBasedPolicy, build_env
from coderl.envbuild.detect import InstallPlan, detect
from coderl.policy.tiny import tiny_tokenizer
from coderl.sandbox import Sandbox, SandboxError

call = CALL_FORMATS["hermes"].format_call
PIP = "/venv/bin/python -m pip install -q --disable-pip-version-check"
BAD = f"{PIP} coderl-no-such-distribution-4711"
GOOD = f"{PIP} pytest"
MARKER = "98765.4321"  # a background sleep the model leaves behind; close must kill it

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


@pytest.fixture(scope="module")
def tok():
    t = tiny_tokenizer()
    t.chat_template = PLAIN_CHATML
    return t


def make_repo(root: Path) -> Path:
    (root / "ring").mkdir(parents=True)
    (root / "ring" / "__init__.py").write_text("def rotate(xs, k):\n    return xs[k:] + xs[:k]\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_ring.py").write_text(
        "from ring import rotate\n\n\ndef test_rotate():\n    assert rotate([1, 2, 3], 1) == [2, 3, 1]\n"
    )
    return root


class CountingFactory:
    """``Sandbox.create`` that remembers every sandbox it made (to check they are closed)."""

    def __init__(self) -> None:
        self.made: list[Sandbox] = []

    def __call__(self, base, **kwargs):
        sb = Sandbox.create(base, **kwargs)
        self.made.append(sb)
        return sb


def assert_all_closed(factory: CountingFactory) -> None:
    for sb in factory.made:
        with pytest.raises(SandboxError, match="closed"):
            sb.exec("true")


def sleepers() -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, UnicodeDecodeError):
            continue
        if MARKER in cmd and "sleep" in cmd:
            out.append(cmd)
    return out


CFG = EpisodeConfig(max_turns=10, max_tokens=60000, max_tokens_per_turn=4000, context_budget=60000)


def test_failed_install_is_read_and_retried_and_the_replay_validates(tmp_path, tok):
    script = [
        "Let me look around.\n" + call("run", {"command": "ls"}),
        call("read_file", {"path": "tests/test_ring.py"}),
        "The tests need pytest. Trying a package first.\n" + call("run", {"command": BAD}),
        "That distribution does not exist; installing pytest itself.\n"
        + call("run", {"command": GOOD}),
        call("run", {"command": "/venv/bin/python -m pytest -q tests"}),
        call("submit", {}),
    ]
    policy = ScriptedPolicy(tok, script)
    factory = CountingFactory()
    builder = ModelBuildPolicy(policy, episodes=1, cfg=CFG, fallback=None, factory=factory)
    env = build_env(
        str(make_repo(tmp_path / "repo")),
        cache=tmp_path / "cache",
        factory=factory,
        build_policy=builder,
    )
    # the model saw the failure of its first install: the error is in the next prompt
    after_bad = tok.decode(policy.prompts[3])
    assert "exit code 1" in after_bad and "coderl-no-such-distribution-4711" in after_bad
    ran = builder.log[0]["ran"]
    assert builder.log[0]["said"][2].startswith("The tests need pytest")
    assert builder.log[0]["finish"] == "submitted"
    assert [status for cmd, status in ran if cmd in (BAD, GOOD)] == ["exit code 1", "exit code 0"]
    test_status = [s for c, s in ran if "pytest -q tests" in c]
    assert test_status == ["exit code 0"]  # the tests passed in the model's own sandbox
    # only the install that worked is replayed: not ls, not the failure, not the test run
    assert env.install_plan == "model[0]" and env.install_commands == [GOOD]
    assert env.passing == ["tests/test_ring.py::test_rotate"] and env.flaky == []
    assert [a["plan"] for a in env.attempts] == ["model[0]"]
    assert_all_closed(factory)


def test_a_policy_that_never_succeeds_ends_in_a_build_error_listing_its_attempts(tmp_path, tok):
    sleep = f"nohup sleep {MARKER} > /dev/null 2>&1 &"
    with Sandbox.create(make_repo(tmp_path / "probe")) as probe:  # the check below can fail:
        probe.exec(sleep)
        # a live sandbox's background process is seen (nohup's child may need a moment to exec
        # `sleep` on a loaded machine)
        deadline = time.monotonic() + 10
        while not sleepers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleepers()
    script = [call("run", {"command": sleep}), call("run", {"command": BAD}), call("submit", {})]
    script += [call("run", {"command": BAD}), "I give up.\n" + call("submit", {})]
    policy = ScriptedPolicy(tok, script)
    factory = CountingFactory()
    builder = ModelBuildPolicy(policy, episodes=2, cfg=CFG, fallback=None, factory=factory)
    with pytest.raises(BuildError) as err:
        build_env(
            str(make_repo(tmp_path / "repo")),
            cache=tmp_path / "cache",
            factory=factory,
            build_policy=builder,
        )
    e = err.value
    assert [a["plan"] for a in e.attempts] == ["model[0]", "model[1]"]
    assert e.step == "test" and "pytest" in e.error  # no pytest in /venv: nothing was installed
    assert "attempt 1: model[0]" in str(e) and "attempt 2: model[1]" in str(e)
    # the second episode was told what the first tried and how it failed
    second_task = tok.decode(policy.prompts[3])
    assert "Earlier attempt model[0]" in second_task and "stopped at test" in second_task
    assert len(factory.made) >= 4  # 2 episodes, 2 replays (+ their test runs)
    assert_all_closed(factory)
    assert builder.log[0]["ran"][0] == (sleep, "exit code 0")  # it did start one
    assert sleepers() == []  # the background process died with its sandbox
    assert not list((tmp_path / "cache").glob(".build-*"))  # scratch venvs removed
    assert not list((tmp_path / "cache").glob("envs/*"))


def test_the_rules_take_over_after_the_model_attempts(tmp_path):
    info = detect(make_repo(tmp_path / "repo"))
    builder = ModelBuildPolicy(policy=None, episodes=1)  # type: ignore[arg-type]
    builder._episode = lambda info, attempts: ["echo model"]  # type: ignore[method-assign]
    builder.log.append({})  # one model attempt already made
    rules = RuleBasedPolicy()
    attempts = [{"plan": "model[0]", "step": "test", "error": "x"}]
    plans = []
    while (plan := builder.propose(info, attempts)) is not None:
        plans.append(plan)
        attempts.append({"plan": plan.name, "step": "test"})
    expected = []
    while (p := rules.propose(info, [{"plan": q.name} for q in expected])) is not None:
        expected.append(p)
    assert plans == expected and all(isinstance(p, InstallPlan) for p in plans)
    # the statement names the earlier attempts, their commands and their errors
    text = build_statement(info, [{"plan": "model[0]", "commands": ["pip x"], "step": "test"}], [])
    assert "Earlier attempt model[0] ran: pip x" in text and "no test passed" in text


WRITTEN = (
    "from ring import rotate\n\n\n"
    "def test_rotate():\n    assert rotate([1, 2, 3], 1) == [2, 3, 1]\n\n\n"
    "def test_callable():\n    assert callable(rotate)\n\n\n"
    "def test_wrong():\n    assert rotate([1, 2], 1) == [1, 2]\n"
)


def test_written_tests_are_kept_only_if_they_pass_and_catch_a_synthesised_bug(tmp_path, tok):
    repo = make_repo(tmp_path / "repo")
    shutil.rmtree(repo / "tests")  # a repository without tests
    script = [
        call("run", {"command": GOOD}),
        call("write_file", {"path": "tests/test_written.py", "content": WRITTEN}),
        call("run", {"command": "/venv/bin/python -m pytest -q tests"}),
        call("submit", {}),
    ]
    cache = tmp_path / "cache"
    env = build_with_model(str(repo), ScriptedPolicy(tok, script), cache=cache, cfg=CFG)
    written = env.info["written_tests"]
    # passes and fails on a mutant: kept; passes on every mutant: dropped; fails on the original
    assert env.passing == ["tests/test_written.py::test_rotate"]
    assert written["dropped_no_bug_caught"] == ["tests/test_written.py::test_callable"]
    assert written["failing_on_original"] == ["tests/test_written.py::test_wrong"]
    assert written["files"] == ["tests/test_written.py"] and written["mutants_tried"] >= 1
    assert (Path(env.snapshot) / "tests/test_written.py").read_text() == WRITTEN
    assert env.install_plan == "model[0]" and env.install_commands == [GOOD]
    assert not (repo / "tests").exists()  # the source directory is not touched

    useless = [call("run", {"command": GOOD})]
    useless += [
        call("write_file", {"path": "tests/test_w.py", "content": "def test_t():\n    assert 1\n"})
    ]
    useless += [call("submit", {})]
    with pytest.raises(BuildError, match="failed on") as err:
        build_with_model(str(repo), ScriptedPolicy(tok, useless), cache=cache, cfg=CFG)
    assert err.value.step == "write-tests"
