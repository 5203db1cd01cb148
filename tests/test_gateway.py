"""The gateway (``tasks.source: gateway``): an unmodified agent program, its calls recorded
token-exactly, its commands in the episode's sandbox, its rollout graded like a native one.

The end-to-end tests run mini-swe-agent (PyPI, unmodified, in ``.venv-agents``: ``make agents``)
on a shipped function-repair task (``data/fnrepair``, which needs only the sandbox) and on a
shipped repository task (``data/tasks/ci.jsonl``, in six's built environment, the one the
grading tests build), each graded by its own source's grader.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import in_ci
from metrics_compare import assert_same_metrics
from openai import OpenAI

from coderl.agent.parsing import format_hermes
from coderl.agent.tools import TOOLS as HARNESS_TOOLS
from coderl.cli import main
from coderl.config import ConfigError, load_config
from coderl.endpoint.chat import Call, calls_from_rows, trajectory_of
from coderl.endpoint.http import BackgroundServer
from coderl.envbuild.build import build_env
from coderl.envs import build_environment
from coderl.envs.gateway import Gateway, GatewayOptions, _Episode, _record, check_program
from coderl.metrics import read_jsonl
from coderl.online.server import InteractionServer
from coderl.online.store import Store
from coderl.policy import load_policy
from coderl.policy.base import Completion, SamplingParams
from coderl.stats import NothingMeasured
from coderl.train import loop

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).parent.parent
TOY = ROOT / "configs" / "toy.yaml"
CI_TASKS = ROOT / "data" / "tasks" / "ci.jsonl"
MINI_BIN = ROOT / ".venv-agents" / "bin" / "mini"
MINI = (
    load_config(ROOT / "configs" / "gateway-mini.yaml")
    .tasks.options["program"]
    .replace("$CODERL_ROOT", str(ROOT))
)
"""The program line of configs/gateway-mini.yaml (docs/harness-byo.md)."""


def _needs_mini() -> None:
    if not MINI_BIN.exists():
        msg = f"mini-swe-agent is not installed at {MINI_BIN} (make agents)"
        if in_ci():
            pytest.fail(f"CI: {msg}")
        pytest.skip(msg)


@pytest.fixture(scope="module")
def policy():
    return load_policy("tiny-random", reference=False)


class Forced:
    """A policy whose replies are scripted but whose behaviour logprobs are tiny-random's own
    (the trainer's forward on the prompt the call was sampled from): the recorded logprobs then
    equal the trainer's recomputation iff the trajectory puts every sampled token after exactly
    that prompt."""

    def __init__(self, policy, script) -> None:
        self.policy, self.script = policy, script
        self.tokenizer, self.version = policy.tokenizer, 0
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            text = self.script(self.tokenizer.decode(p, skip_special_tokens=False))
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), params.stop_token_ids[0]]
            lps = self.policy.logprobs([p + ids], params.temperature)[0][len(p) :]
            out.append(Completion(ids, lps, "stop", self.version))
        return out


def _config(
    program: str, *extra: str, inner: str = "fnrepair", timeout_s: float = 120, **options: str
):
    opts = {"inner": inner, "program": program, "timeout_s": timeout_s, **options}
    return load_config(
        TOY,
        [
            "tasks.source=gateway",
            f"tasks.options={json.dumps(opts)}",
            "rollout.max_turns=6",
            "rollout.max_new_tokens=1500",
            *extra,
        ],
    )


def _oracle(command: str):
    """mini-swe-agent's oracle, as bash tool calls: run ``command`` (the fix), then submit."""

    def reply(prompt: str) -> str:
        if "<tool_response>" not in prompt:
            return "I fix it.\n" + format_hermes("bash", {"command": command})
        submit = {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}
        return "Done.\n" + format_hermes("bash", submit)

    return reply


def test_mini_swe_agent_resolves_a_task_and_its_logprobs_are_the_trainers(policy) -> None:
    _needs_mini()
    env = build_environment(_config(MINI))
    task = env.tasks("train")[0]
    forced = Forced(policy, _oracle(f"cat > solution.py <<'EOF'\n{task.extra['gold_file']}EOF"))
    params = SamplingParams(temperature=1.0, max_new_tokens=1500, seed=1)
    [rec] = env.rollout(forced, [task], params, 1)
    assert (rec.finish_reason, rec.failure, rec.turns) == ("exited", None, 2)
    assert rec.broken_tool_calls == 0 and "solution.py" in rec.answer
    [grade] = env.grade([task], [rec])
    assert grade.resolved and grade.grading_error is None
    # mini-swe-agent sent back exactly what was sampled: one context window, both turns
    [seg] = rec.trajectory.segments
    seg.validate()
    assert seg.token_ids[: len(forced.prompts[1])] == forced.prompts[1]
    # the task's hidden test never reached the program's prompts
    hidden = next(iter(task.hidden_tests.values()))
    assert all(hidden[:60] not in policy.tokenizer.decode(p) for p in forced.prompts)
    # recomputed trainer logprobs equal the recorded behaviour logprobs (fp32)
    [train] = policy.logprobs([seg.token_ids], 1.0)
    mask = torch.tensor(seg.loss_mask, dtype=torch.bool)
    gap = (torch.tensor(train)[mask] - torch.tensor(seg.behavior_logprobs)[mask]).abs()
    assert int(mask.sum()) > 50 and float(gap.max()) < 1e-3


def test_a_failed_attempt_is_graded_as_the_agents(policy) -> None:
    _needs_mini()
    env = build_environment(_config(MINI))
    task = env.tasks("train")[0]
    submit = "Giving up.\n" + format_hermes(
        "bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}
    )
    [rec] = env.rollout(Forced(policy, lambda _: submit), [task], SamplingParams(), 1)
    [grade] = env.grade([task], [rec])
    assert rec.failure is None and rec.answer == "" and not grade.resolved


CI_SPEC = "six==1.17.0"
"""The library of the shipped repository tasks ``data/tasks/ci.jsonl``, built once per run
(``build_env`` reuses the build that tests/test_grading_runner.py and test_grading_redteam.py
make, from the cache on disk)."""


@pytest.fixture(scope="module")
def repo_env():
    """The gateway over the ``repo`` source on ``data/tasks/ci.jsonl`` (six's environment)."""
    if shutil.which("bwrap") is None or os.geteuid() != 0:
        msg = "needs bubblewrap and root (make sysdeps)"
        if in_ci():
            pytest.fail(f"CI: {msg}")
        pytest.skip(msg)
    _needs_mini()
    build_env(CI_SPEC)
    return build_environment(_config(MINI, inner="repo", tasks_file=str(CI_TASKS)))


def _edit(diff: str) -> str:
    """The bash command that makes a one-hunk ``diff``'s change in the workspace, with Python
    (in every sandbox, where ``patch`` or ``git`` may be missing)."""
    [path] = [line[6:] for line in diff.splitlines() if line.startswith("+++ b/")]
    assert sum(line.startswith("@@ ") for line in diff.splitlines()) == 1, "one hunk only"
    body = diff.split("@@")[-1].splitlines(keepends=True)[1:]
    old = "".join(line[1:] for line in body if line[0] in " -")
    new = "".join(line[1:] for line in body if line[0] in " +")
    return (
        f"python3 - <<'EOF'\nimport pathlib\np = pathlib.Path({path!r})\ns = p.read_text()\n"
        f"assert s.count({old!r}) == 1\np.write_text(s.replace({old!r}, {new!r}))\n"
        "print('edited', p)\nEOF"
    )


def test_mini_swe_agent_resolves_a_repository_task(policy, repo_env) -> None:
    """A shipped repository task (six, a synthesised bug with a held-out failing test): the
    oracle's commands through mini-swe-agent and the gateway fix it in the sandbox, the repo
    grader resolves the diff, and the trajectory's logprobs are the trainer's."""
    task = repo_env.tasks("train")[0]
    assert task.kind == "repo" and task.held_out_tests
    forced = Forced(policy, _oracle(_edit(task.gold_patch)))
    params = SamplingParams(temperature=1.0, max_new_tokens=1500, seed=1)
    [rec] = repo_env.rollout(forced, [task], params, 1)
    assert (rec.finish_reason, rec.failure, rec.turns) == ("exited", None, 2), rec.failure_reason
    assert rec.broken_tool_calls == 0 and task.extra["file"] in rec.answer
    [grade] = repo_env.grade([task], [rec])
    assert grade.grading_error is None and grade.resolved, grade.reason
    # the held-out failing test never reached the program's prompts
    [held] = [t.split("::")[-1] for t in task.FAIL_TO_PASS if t in task.held_out_tests]
    assert all(held not in policy.tokenizer.decode(p) for p in forced.prompts)
    [seg] = rec.trajectory.segments
    seg.validate()
    [train] = policy.logprobs([seg.token_ids], 1.0)
    mask = torch.tensor(seg.loss_mask, dtype=torch.bool)
    gap = (torch.tensor(train)[mask] - torch.tensor(seg.behavior_logprobs)[mask]).abs()
    assert int(mask.sum()) > 50 and float(gap.max()) < 1e-3


def test_a_wrong_repository_fix_is_graded_unresolved(policy, repo_env) -> None:
    """The same episode with a plausible wrong fix (``itervalues`` returning the keys): it
    applies, the episode ends cleanly, and the grader does not resolve it."""
    task = repo_env.tasks("train")[0]
    wrong = task.gold_patch.replace("d.values(", "d.keys(")
    assert wrong != task.gold_patch
    [rec] = repo_env.rollout(Forced(policy, _oracle(_edit(wrong))), [task], SamplingParams(), 1)
    assert (rec.finish_reason, rec.failure) == ("exited", None)
    assert "+        return iter(d.keys(**kw))" in rec.answer
    [grade] = repo_env.grade([task], [rec])
    assert grade.grading_error is None and not grade.resolved


def _program(body: str) -> str:
    """A tiny agent program in this interpreter (stdlib only)."""
    return f"{sys.executable} -c {shlex.quote(body)}"


CALL = """
import json, os, urllib.request
def call(n=1):
    for _ in range(n):
        body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]})
        req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                     body.encode(), {"Content-Type": "application/json"})
        urllib.request.urlopen(req).read()
"""


@pytest.mark.parametrize(
    ("program", "finish", "failure"),
    [
        (_program("import sys; sys.exit(3)"), "program_error", "infra"),
        (_program("import time; time.sleep(60)"), "timeout", "infra"),
        (_program("print('nothing to do')"), "exited", "infra"),
        ('"$CODERL_OUTPUT_DIR/no-such-agent" -t x', "program_error", "infra"),
        (_program(CALL + "call(1); raise SystemExit(1)"), "program_error", "agent"),
        (_program(CALL + "import time; call(1); time.sleep(60)"), "timeout", "agent"),
        (_program(CALL + "call(10)"), "max_turns", None),
        (_program(CALL + "call(1)"), "exited", None),
    ],
    ids=["crash-no-call", "hang-no-call", "exit-0-no-call", "not-installed", "crash-after-call",
         "hang-after-call", "over-the-call-limit", "clean"],
)  # fmt: skip
def test_program_failures_are_scored_and_limits_hold(policy, program, finish, failure):
    """A program that never called the model is infra (masked: nothing the policy sampled
    reached it); one that fails after a call is the agent's, scored."""
    env = build_environment(_config(program, "rollout.max_turns=3", timeout_s=3))
    task = env.tasks("train")[0]
    [rec] = env.rollout(Forced(policy, lambda _: "ok"), [task], SamplingParams(), 1)
    assert (rec.finish_reason, rec.failure) == (finish, failure), rec.failure_reason
    assert rec.turns == {"max_turns": 3}.get(finish, int("call(" in program))
    assert rec.truncated == (finish in ("timeout", "max_turns"))
    if failure == "infra":
        assert rec.failure_reason.startswith(f"the program never called the model ({finish})")
    if "no-such-agent" in program:  # the reason keeps the program's last line
        assert "No such file or directory" in rec.failure_reason


def test_a_program_that_never_calls_the_model_fails_the_step_and_the_eval(tmp_path) -> None:
    """Every episode masked (the program never called the model): the step and the held-out
    evaluation fail with the reason instead of training on nothing or printing 0.000."""
    program = '"$CODERL_OUTPUT_DIR/no-such-agent"'
    opts = {"inner": "fnrepair", "program": program, "timeout_s": 30}
    common = [*RANDOM, "tasks.source=gateway", f"tasks.options={json.dumps(opts)}"]
    step = load_config(TOY, [*common, f"run_dir={tmp_path / 'step'}"])  # no evaluation
    with pytest.raises(NothingMeasured, match=r"step 1: .*never called the model"):
        loop.train(step)
    evals = ["eval.before_after=true", "eval.tasks=1", "eval.samples=1", "eval.k=[1]"]
    before = load_config(TOY, [*common, *evals, f"run_dir={tmp_path / 'eval'}"])
    with pytest.raises(NothingMeasured, match="never called the model"):
        loop.train(before)  # the held-out evaluation before step 1


def test_a_program_path_that_does_not_exist_is_refused_before_the_model(
    tmp_path, monkeypatch
) -> None:
    """The preset names ``$CODERL_ROOT`` and runs from any directory; a program path that does
    not exist is one ConfigError at ``build_environment`` (before the model loads)."""
    _needs_mini()
    monkeypatch.chdir(tmp_path)  # not the checkout
    preset = load_config(ROOT / "configs" / "gateway-mini.yaml")
    check_program(preset.tasks.options["program"])  # resolves against the checkout
    old = preset.tasks.options["program"].replace("$CODERL_ROOT", "$CODERL_LAUNCH_DIR")
    with pytest.raises(ConfigError, match=f"{tmp_path}/.venv-agents/bin/mini does not exist"):
        check_program(old)
    with pytest.raises(ConfigError, match="/no/such/agent does not exist"):
        build_environment(_config("X=1 /no/such/agent --flag"))
    for fine in ("true", f"{sys.executable} -c pass", '"$CODERL_OUTPUT_DIR/later" -x', "a 'b"):
        check_program(fine)  # a bare name, another variable, a line shlex cannot split: the run's


def test_an_engine_failure_is_infra_and_masked(policy) -> None:
    class Broken(Forced):
        def generate(self, prompts, params):
            raise RuntimeError("CUDA error")

    env = build_environment(_config(_program(CALL + "call(1)")))
    task = env.tasks("train")[0]
    [rec] = env.rollout(Broken(policy, None), [task], SamplingParams(), 1)
    assert rec.failure == "infra" and "CUDA error" in rec.failure_reason


def test_endpoints_are_per_episode_secrets(policy) -> None:
    gw = Gateway(Forced(policy, lambda _: "a"), SamplingParams(), GatewayOptions("true"), 99, 9)
    gw.add(_Episode(0, None, None, "s3cret"))
    bg = BackgroundServer(gw.app())
    try:
        root = bg.base_url[:-3]
        ok = OpenAI(base_url=f"{root}/e/s3cret/v1", api_key="s3cret")
        assert ok.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        for bad in ("guess", "s3cre", ""):
            client = OpenAI(base_url=f"{root}/e/{bad}/v1", api_key="x", max_retries=0)
            with pytest.raises(Exception, match="404|Not Found"):
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}]
                )
    finally:
        bg.stop()
        gw.batcher.close()


def test_the_gateway_answers_any_model_name_and_records_it(policy) -> None:
    """One policy is served to agent programs, which send their configured name: any name is
    answered, echoed, and recorded with the call (``coderl serve`` refuses one it does not
    serve)."""
    gw = Gateway(Forced(policy, lambda _: "a"), SamplingParams(), GatewayOptions("true"), 99, 9)
    ep = _Episode(0, type("T", (), {"id": "t"})(), None, "k")
    gw.add(ep)
    bg = BackgroundServer(gw.app())
    try:
        client = OpenAI(base_url=f"{bg.base_url[:-3]}/e/k/v1", api_key="k", max_retries=0)
        for name in ("gpt-4o", "policy"):
            r = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "x"}]
            )
            assert r.model == name
    finally:
        bg.stop()
        gw.batcher.close()
    actions = [
        a for s in _record(ep, "exited", "").trajectory.segments for a in s.provenance["actions"]
    ]
    assert [a["model"] for a in actions] == ["gpt-4o", "policy"]


def test_serve_and_gateway_give_identical_trajectories_for_identical_calls(tmp_path, policy):
    """The same three calls (two turns of one conversation, then a rewritten history) through
    ``coderl serve`` (non-streamed, rows from its database) and through the gateway (streamed):
    the same prompt ids, samples, logprobs and segments."""
    tool = HARNESS_TOOLS["run"].schema
    reply = "Let me look.\n" + format_hermes("run", {"command": "ls"})
    first = [{"role": "system", "content": "Fix it."}, {"role": "user", "content": "the bug"}]
    second = [
        *first,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "run", "arguments": json.dumps({"command": "ls"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "solution.py"},
    ]  # fmt: skip
    third = [first[0], {"role": "user", "content": "summary: ls showed solution.py"}]

    def talk(client, stream: bool) -> None:
        for msgs in (first, second, third):
            kw = {"model": "tiny", "messages": msgs, "tools": [tool], "max_tokens": 200}
            if stream:
                chunks = list(client.chat.completions.create(**kw, stream=True))
                assert chunks[-1].choices[0].finish_reason in ("stop", "tool_calls")
            else:
                client.chat.completions.create(**kw, extra_body={"episode_id": "ep"})

    served_policy = Forced(policy, lambda _: reply)
    store = Store(f"sqlite:///{tmp_path / 'o.db'}")
    srv = InteractionServer(served_policy, store, version=0, model_name="tiny", max_new_tokens=200)
    bg = BackgroundServer(srv.app())
    try:
        talk(OpenAI(base_url=bg.base_url, api_key="x"), stream=False)
    finally:
        bg.stop()
    served, breaks = trajectory_of(calls_from_rows(store.interactions(episode_ids=["ep"])))

    opts = GatewayOptions("true", template_tools=srv.template_tools, call_format=srv.call_format)
    gw = Gateway(Forced(policy, lambda _: reply), SamplingParams(0.8), opts, 10_000, 9)
    ep = _Episode(0, type("T", (), {"id": "t"})(), None, "k")
    gw.add(ep)
    bg = BackgroundServer(gw.app())
    try:
        talk(OpenAI(base_url=f"{bg.base_url[:-3]}/e/k/v1", api_key="k"), stream=True)
    finally:
        bg.stop()
        gw.batcher.close()
    rec = _record(ep, "exited", "")
    assert breaks == 1 and len(served.segments) == 2 == len(rec.trajectory.segments)
    for a, b in zip(served.segments, rec.trajectory.segments, strict=True):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
        assert a.behavior_logprobs == pytest.approx(b.behavior_logprobs, abs=1e-6)
    assert sum(served.segments[0].loss_mask) == 2 * sum(served.segments[1].loss_mask) > 0


RANDOM = [
    "progress=false",
    "tensorboard=false",
    "eval.before_after=false",
    "trainer.steps=2",
    "trainer.checkpoint_every=1",
    "tasks.tasks_per_step=1",
    "rollout.group_size=2",
    "rollout.max_turns=2",
    "rollout.max_new_tokens=12",
    "reward.terms={tests: 1.0}",
]


def test_training_on_mini_swe_agent_rollouts_steps_and_resumes_exactly(tmp_path, monkeypatch):
    """tiny-random samples for real behind the gateway (token soup: mini-swe-agent answers with
    its format-error message until the call limit stops it); two steps train on those
    trajectories, and a run stopped after step 1 and resumed equals the uninterrupted one
    (``seeded`` calls: a deterministic program replays exactly)."""
    _needs_mini()
    opts = {"inner": "fnrepair", "program": MINI, "timeout_s": 120, "seeded": True}
    common = [*RANDOM, "tasks.source=gateway", f"tasks.options={json.dumps(opts)}"]
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    loop.train(load_config(TOY, [*common, f"run_dir={ref_dir}"]))
    ref = read_jsonl(ref_dir / "metrics.jsonl")
    assert [r["step"] for r in ref] == [1, 2]
    assert all(r["masked_rate"] == 0 and r["episode/sampled_tokens"] > 0 for r in ref)
    assert ref[0]["episode/turns"] == 2  # the call limit, not a crash, ended them
    # mini-swe-agent drops a reply it cannot parse from its history (it sends only its format
    # error back): the second call does not extend the first, and starts a second segment
    assert all(r["episode/segments"] == 2 for r in ref)

    real = loop.training_step

    def step(run):
        if run.step == 1:
            raise KeyboardInterrupt
        return real(run)

    monkeypatch.setattr(loop, "training_step", step)
    with pytest.raises(KeyboardInterrupt):
        loop.train(load_config(TOY, [*common, f"run_dir={cut_dir}"]))
    monkeypatch.setattr(loop, "training_step", real)
    assert main(["train", "--resume", str(cut_dir), "--no-report"]) == 0
    assert_same_metrics(ref, read_jsonl(cut_dir / "metrics.jsonl"))


def test_the_preset_evaluates_a_few_tasks_before_and_after() -> None:
    """configs/gateway-mini.yaml's held-out evaluations are small (every held-out task x 16
    samples of mini-swe-agent would run for hours before step 1), and ``eval.every=0`` does
    not skip them: ``eval.before_after=false`` does."""
    cfg = load_config(ROOT / "configs" / "gateway-mini.yaml")
    assert cfg.eval.before_after and cfg.eval.every == 0
    assert cfg.eval.tasks is not None and cfg.eval.tasks * cfg.eval.samples <= 32


def test_gateway_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="tasks.options.program"):
        build_environment(load_config(TOY, ["tasks.source=gateway"]))
    with pytest.raises(ConfigError, match="tasks.options.inner"):
        build_environment(_config("true", inner="toy"))
    with pytest.raises(ConfigError, match="progam"):
        build_environment(_config("true", "tasks.options.progam=x"))


def test_concurrent_programs_share_the_policys_batches(policy) -> None:
    """Three programs of one task's group call at once: while the first call generates, the
    others queue, and the next ``generate`` carries them together."""
    import time

    class Slow(Forced):
        def __init__(self, *a) -> None:
            super().__init__(*a)
            self.sizes: list[int] = []

        def generate(self, prompts, params):
            self.sizes.append(len(prompts))
            time.sleep(3.0 if len(self.sizes) == 1 else 0.0)  # the others arrive meanwhile
            return super().generate(prompts, params)

    env = build_environment(_config(_program(CALL + "call(2)"), "rollout.concurrency=3"))
    task = env.tasks("train")[0]
    slow = Slow(policy, lambda _: "ok")
    records = env.rollout(slow, [task], SamplingParams(), 3)
    assert [r.finish_reason for r in records] == ["exited"] * 3
    assert sum(slow.sizes) == 6 and max(slow.sizes) >= 2, slow.sizes


RESEND = """
import json, os, urllib.request
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
msgs = [{"role": "user", "content": "fix the bug"}]
for i in range(3):
    body = json.dumps({"model": "x", "messages": msgs}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(req).read())["choices"][0]["message"]
    msgs += [{"role": "assistant", "content": reply["content"]},
             {"role": "user", "content": f"result {i}"}]
"""


def test_a_program_that_sends_replies_back_gets_one_token_exact_segment(policy) -> None:
    """tiny-random samples token soup that a text round trip does not give back (invalid
    UTF-8, other merges); a program that resends each reply as returned still gets one
    segment whose sampled tokens are exactly the sampled ids, where re-rendering the text
    would not reproduce them."""
    from coderl.endpoint.calls import render_prompt, renderer_for
    from coderl.policy.episode import encode

    cfg = _config(_program(RESEND), "rollout.max_new_tokens=12", "rollout.max_turns=3")
    env = build_environment(cfg)
    task = env.tasks("train")[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
    [rec] = env.rollout(policy, [task], params, 1)
    assert rec.finish_reason == "exited" and rec.turns == 3
    [seg] = rec.trajectory.segments
    seg.validate()
    [train] = policy.logprobs([seg.token_ids], 1.0)
    mask = torch.tensor(seg.loss_mask, dtype=torch.bool)
    gap = (torch.tensor(train)[mask] - torch.tensor(seg.behavior_logprobs)[mask]).abs()
    assert float(gap.max()) < 1e-3
    # what a re-tokenizing gateway would have sampled the last call from
    tok = policy.tokenizer
    sampled = [seg.token_ids[a:b] for kind, a, b in seg.provenance["spans"] if kind == "action"]
    msgs = [{"role": "user", "content": "fix the bug"}]
    for i, ids in enumerate(sampled[:2]):
        text = tok.decode(ids[:-1] if ids[-1] in tok.all_special_ids else ids)
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"result {i}"}]
    renderer = renderer_for(tok, msgs, {}, call_format="hermes", template_tools=True)
    again = encode(tok, render_prompt(renderer, msgs, call_format="hermes"))
    last_prompt = seg.token_ids[: seg.provenance["spans"][-1][1]]
    assert again != last_prompt  # the round trip would have changed what the model saw


def test_time_waiting_for_the_model_is_not_the_programs(policy) -> None:
    """A call that takes longer than the program's whole timeout does not time it out: the
    program's own time is what ``timeout_s`` bounds (a slow engine is not the agent's fault)."""
    import time

    class Slow(Forced):
        def generate(self, prompts, params):
            time.sleep(5.0)
            return super().generate(prompts, params)

    env = build_environment(_config(_program(CALL + "call(1)"), timeout_s=3))
    task = env.tasks("train")[0]
    [rec] = env.rollout(Slow(policy, lambda _: "ok"), [task], SamplingParams(), 1)
    assert (rec.finish_reason, rec.failure, rec.turns) == ("exited", None, 1)


class _DiffRaises:
    """A sandbox whose diff raises ``error`` (what a workspace the policy made can cause)."""

    def __init__(self, error: BaseException) -> None:
        self.error, self.closed = error, False

    def diff(self) -> str:
        raise self.error

    def close(self) -> None:
        self.closed = True


class _Registry:
    def __init__(self) -> None:
        self.episodes: dict[str, object] = {}

    def add(self, ep) -> None:
        self.episodes[ep.secret] = ep


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (RecursionError("maximum recursion depth exceeded"), "agent"),  # a tree too deep
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "agent"),
        (OSError("the host's disk is full"), "infra"),
    ],
)
def test_a_diff_the_policys_workspace_breaks_is_scored_like_a_native_episode(
    monkeypatch, error, kind
):
    """The gateway attributes a failed diff as the harness does (``diff_failure``): a workspace
    the policy made that the diff cannot walk is the agent's failure, never a mask."""
    from types import SimpleNamespace

    from coderl.envs import gateway as G

    sandbox = _DiffRaises(error)
    monkeypatch.setattr(G, "sandbox_for", lambda task: sandbox)

    def one_call(ep, opts, url, statement):  # the policy answered once, then it exited
        ep.calls.append(Call([1, 2], Completion([3], [-0.5], "stop", 0), {"status": "ok"}))
        return "exited"

    monkeypatch.setattr(G, "run_program", one_call)
    env = SimpleNamespace(opts=None, statement=lambda task: "fix it")
    task = SimpleNamespace(id="t/1", problem_statement="fix it")
    record = G.GatewayEnvironment._one(env, _Registry(), "http://127.0.0.1:1", 0, task)
    assert record.failure == kind and sandbox.closed
    assert record.failure_reason.startswith(
        "the workspace's diff failed" if kind == "agent" else "diff failed"
    )


def test_a_bug_in_the_diff_is_raised_not_masked(monkeypatch):
    """Only what a diff raises (``DIFF_FAULTS``) is attributed; a bug in the diff code is raised
    with its message (the sandbox still closed) instead of masking the episode."""
    from types import SimpleNamespace

    from coderl.envs import gateway as G

    sandbox = _DiffRaises(TypeError("a bug in the diff code"))
    monkeypatch.setattr(G, "sandbox_for", lambda task: sandbox)
    monkeypatch.setattr(G, "run_program", lambda ep, opts, url, statement: "exited")
    env = SimpleNamespace(opts=None, statement=lambda task: "fix it")
    task = SimpleNamespace(id="t/1", problem_statement="fix it")
    with pytest.raises(TypeError, match="a bug in the diff code"):
        G.GatewayEnvironment._one(env, _Registry(), "http://127.0.0.1:1", 0, task)
    assert sandbox.closed


# --- a command the program (or the model through it) got wrong is answered, never a mask -----

BAD_EXEC = [
    {"argv": ["bash", "-c", "echo a\u0000b"]},  # NUL: a JSON "\u0000" in the model's call
    {"argv": ["bash", "-c", "echo \ud800"]},  # a lone surrogate: valid JSON, not UTF-8
    {"argv": ["echo", "x"], "cwd": "/test\u0000bed"},
    {"argv": ["echo", "x"], "env": {"A": "\udfff"}},
    {"argv": ["echo", "x"], "env": {"A": 1}},
    {"argv": ["echo", "x"], "cwd": ["/testbed"]},
    {"argv": ["echo", "x" * (1 << 20)]},
    {"argv": "echo x"},
]


@pytest.mark.filterwarnings("ignore::coderl.sandbox.local.UnisolatedSandboxWarning")
@pytest.mark.parametrize("body", BAD_EXEC, ids=lambda b: repr(b)[:40])
def test_a_bad_exec_request_is_a_400_not_infra(policy, tmp_path: Path, body, caplog) -> None:
    from fastapi import HTTPException

    from coderl.sandbox import Sandbox

    caplog.set_level(logging.DEBUG, logger="coderl.envs.gateway")
    gw = Gateway(Forced(policy, lambda _: "a"), SamplingParams(), GatewayOptions("true"), 99, 9)
    (tmp_path / "f.txt").write_text("x\n")
    with Sandbox.create(tmp_path, backend="local") as sandbox:
        ep = _Episode(0, None, sandbox, "s")
        with pytest.raises(HTTPException) as info:
            gw.execute(ep, body)
        assert info.value.status_code == 400 and ep.infra == ""
        assert gw.execute(ep, {"argv": ["cat", "f.txt"], "cwd": "."})["output"] == "x\n"
    with pytest.raises(HTTPException) as info:  # the sandbox failing on a valid command masks
        gw.execute(ep, {"argv": ["true"]})
    assert info.value.status_code == 503 and ep.infra.startswith("sandbox exec failed")
    # the masked failure's traceback is logged (the record keeps only 'Type: message')
    assert [r for r in caplog.records if r.name == "coderl.envs.gateway" and r.exc_info]
    gw.batcher.close()


def test_a_model_command_with_nul_or_a_surrogate_keeps_the_episode_scored(policy) -> None:
    """End to end: a program that posts the model's command to ``$CODERL_SANDBOX_URL`` itself."""
    program = _program(
        CALL.replace("urllib.request.urlopen(req).read()", "pass")
        + """
import urllib.error
codes = []
for cmd in ("echo a\\u0000b", "echo \\ud800", "echo fine"):
    body = json.dumps({"argv": ["bash", "-c", cmd]}).encode()
    req = urllib.request.Request(os.environ["CODERL_SANDBOX_URL"], body,
                                 {"Content-Type": "application/json"})
    try:
        codes.append(json.loads(urllib.request.urlopen(req).read())["output"])
    except urllib.error.HTTPError as e:
        codes.append(e.code)
body = json.dumps({"model": "x", "messages": [{"role": "user", "content": str(codes)}]})
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                             body.encode(), {"Content-Type": "application/json"})
urllib.request.urlopen(req).read()
"""
    )
    seen: list[str] = []
    env = build_environment(_config(program, "rollout.max_turns=3", timeout_s=60))
    task = env.tasks("train")[0]
    [rec] = env.rollout(
        Forced(policy, lambda p: seen.append(p) or "ok"), [task], SamplingParams(), 1
    )
    assert (rec.finish_reason, rec.failure) == ("exited", None), rec.failure_reason
    assert "[400, 400, 'fine\\n']" in seen[0]


@pytest.mark.parametrize(
    ("call_before", "emoji", "finish", "kind", "attributed"),
    [(True, 1500, "context", None, "agent"), (False, 1500, "context", "infra", "infra"),
     (True, 10, "exited", None, None)],
)  # fmt: skip
def test_a_prompt_past_the_engines_context_is_a_scored_context_ending(
    policy, call_before, emoji, finish, kind, attributed
):
    """The program sends a message past the model's context (4,096 tokens for tiny-random;
    1,500 emoji are 6,000): the call is refused before the engine (which would fail it as
    infra), the program stopped, and the episode ends ``context``: after a call the policy
    answered, scored; as its first call (nothing sampled reached it), infra like a fresh
    native context window that does not fit."""
    from coderl.envs.base import GradeRecord
    from coderl.train.pipeline import attribute

    long = CALL.replace('"content": "hi"', f'"content": chr(0x1F600) * {emoji}') + "call(1)"
    program = _program((CALL + "call(1)\n" if call_before else "") + long)
    env = build_environment(_config(program, "rollout.max_turns=3", timeout_s=60))
    task = env.tasks("train")[0]
    [rec] = env.rollout(Forced(policy, lambda _: "ok"), [task], SamplingParams(), 1)
    assert (rec.finish_reason, rec.failure) == (finish, kind), rec.failure_reason
    assert attribute(rec, GradeRecord())[0] == attributed
