"""A user's first day (issue 48), the third pass: what the earlier trials found still open.

Through the command line a user types (``coderl.cli.main``) where it can be, so a refusal is
checked together with its one-line message and exit status."""

import signal
from pathlib import Path

import pytest
from test_first_day import _holder, _one_line_error

from coderl.cli import main
from coderl.rundir import RunDirBusy, online_lock, run_lock

ROOT = Path(__file__).parent.parent
TOY = str(ROOT / "configs" / "toy.yaml")
ONLINE = str(ROOT / "configs" / "online-demo.yaml")
FAST = ["progress=false", "tensorboard=false", "eval.before_after=false", "trainer.steps=1"]
FAST += ["rollout.group_size=4", "rollout.max_new_tokens=4"]


# --- 1. a live server holds its run directory: no writer and no second server beside it -------


def _refused(argv: list[str], run_dir: Path, pid: int, capsys) -> str:
    assert main([*argv, f"run_dir={run_dir}"]) == 2, argv
    line = _one_line_error(capsys.readouterr().err)
    assert f"in use by pid {pid}" in line, line
    return line


def test_a_live_server_keeps_writers_and_a_second_server_out(tmp_path, capsys):
    run_dir = tmp_path / "online"
    server = _holder(run_dir, "coderl serve (the live one)", role="serve")
    try:
        for argv in (["train", TOY, *FAST], ["sft", TOY], ["serve", ONLINE, "--port", "0"]):
            assert "the live one" in _refused(argv, run_dir, server.pid, capsys)
        assert not (run_dir / "config.yaml").exists() and not (run_dir / "registry").exists()
        with online_lock(run_dir, "cycle"):  # the cycle shares the directory with the server
            with pytest.raises(RunDirBusy, match="a writer cannot run inside"):
                with run_lock(run_dir):
                    pass
    finally:
        server.send_signal(signal.SIGKILL)  # a crashed or kill -9'd server
        server.wait()
    with run_lock(run_dir):  # the kernel dropped its lock: nothing stuck
        pass
    with online_lock(run_dir, "serve"):
        pass


def test_a_live_writer_keeps_the_server_and_the_online_commands_out(tmp_path, capsys):
    run_dir = tmp_path / "run"
    writer = _holder(run_dir, "coderl train (the live one)")
    try:
        events = tmp_path / "events.jsonl"
        events.write_text("")
        for argv in (
            ["serve", ONLINE, "--port", "0"],
            ["online", "cycle", ONLINE],
            ["online", "import", ONLINE, str(events)],
        ):
            assert "the live one" in _refused(argv, run_dir, writer.pid, capsys)
        assert not (run_dir / "registry").exists() and not (run_dir / "online.db").exists()
    finally:
        writer.kill()
        writer.wait()


# --- 7. coderl eval's JSON holds the per-task rows the docs list ------------------------------


def test_eval_prints_per_task_samples_passes_and_pass_at_k(tmp_path, capsys):
    import json

    run = tmp_path / "run"
    assert main(["train", TOY, *FAST, f"run_dir={run}", "--no-report"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "k=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["per_task"]
    assert rows and len({r["task_id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["n"] == 2 and 0 <= r["correct"] <= 2
        assert r["pass_at"]["1"] == pytest.approx(r["correct"] / 2)
        assert r["pass_at"]["2"] == float(r["correct"] > 0)
    for k in ("1", "2"):
        mean = sum(r["pass_at"][k] for r in rows) / len(rows)
        assert mean == pytest.approx(out["pass_at"][k]["mean"])


# --- 8. train-async ends with coderl train's held-out evaluation and summary -------------------


def test_train_async_ends_with_the_held_out_evaluation_and_summary(tmp_path, capsys):
    from coderl.metrics import read_jsonl

    run = tmp_path / "run"
    argv = ["train-async", TOY, *FAST, "trainer.steps=2", "eval.before_after=true"]
    assert main([*argv, f"run_dir={run}"]) == 0
    out = capsys.readouterr().out
    evals = read_jsonl(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2], evals
    assert evals[0]["phase"] == "start" and "collapse" in evals[1]  # as coderl train writes
    assert "held-out summary" in out and "pass@1" in out, out


# --- 9. Ctrl-C or SIGTERM ends the gateway's agent programs at once -----------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_gateway_rollout_kills_its_agent_programs(tmp_path, signum):
    import os
    import threading
    import time

    from test_gateway import Forced, _config, _program

    from coderl.cli import _signals_as_interrupt
    from coderl.envs import build_environment
    from coderl.policy import load_policy
    from coderl.policy.base import SamplingParams

    pids = tmp_path / "pids"
    pids.mkdir()
    sleeper = _program(  # a stand-in agent program: says it runs, then sleeps past the test
        f"import os, time; open({str(pids)!r} + '/' + str(os.getpid()), 'w').close(); "
        "time.sleep(300)"
    )
    env = build_environment(_config(sleeper, "rollout.concurrency=2", timeout_s=300))
    task = env.tasks("train")[0]
    policy = Forced(load_policy("tiny-random", reference=False), lambda _: "ok")

    def interrupt_once_running() -> None:
        while len(list(pids.iterdir())) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signum)  # what a user's Ctrl-C or a scheduler's kill sends

    _, previous = _signals_as_interrupt()  # as the command line sets them
    try:
        threading.Thread(target=interrupt_once_running, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            env.rollout(policy, [task], SamplingParams(), 2)
    finally:
        for n, handler in previous.items():
            signal.signal(n, handler)
    started = time.monotonic()
    alive = [int(p.name) for p in pids.iterdir()]
    while alive and time.monotonic() - started < 10:
        time.sleep(0.1)
        alive = [pid for pid in alive if _alive(pid)]
    assert not alive, f"agent programs {alive} outlived the interrupt"


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- 2. the toy summary prints no broken-call or KV-reuse rows: nothing was parsed or reused ----


def test_the_toy_summary_has_no_rows_for_what_a_single_reply_task_cannot_measure(tmp_path):
    from coderl.eval.summary import summary_lines
    from coderl.metrics import read_jsonl

    run = tmp_path / "run"
    assert (
        main(["train", TOY, *FAST, "eval.before_after=true", f"run_dir={run}", "--no-report"]) == 0
    )
    evals = read_jsonl(run / "eval.jsonl")
    labels = [label for label, _ in summary_lines(evals)]
    assert any("pass@1" in x for x in labels), labels
    assert not [x for x in labels if "broken calls" in x or "prefill" in x or "summaries" in x]
    # an agent harness's evaluation (its replies parsed, several turns) keeps both rows
    for e in evals:
        e["per_task"] = [t | {"tool_episodes": t["episodes"]} for t in e["per_task"]]
        e["context"] = e["context"] | {"multi_turn": 3.0}
    labels = [label for label, _ in summary_lines(evals)]
    assert "broken calls per episode before -> after RL" in labels, labels
    assert "prefill per episode, last evaluation (tokens)" in labels, labels


# --- 3. approx_kl is logged only where it measures something; no empty KL plot -----------------


def test_approx_kl_is_absent_when_zero_by_construction_and_the_report_draws_no_kl(tmp_path):
    from coderl.eval.report import write_report
    from coderl.metrics import read_jsonl

    one = tmp_path / "one"  # one epoch, old_logp=trainer: ratio exactly 1
    assert main(["train", TOY, *FAST, "trainer.steps=2", f"run_dir={one}", "--no-report"]) == 0
    rows = read_jsonl(one / "metrics.jsonl")
    assert rows and not [r for r in rows if "approx_kl" in r or "kl" in r], rows[0].keys()
    write_report(one)
    assert (one / "report" / "reward.png").exists() and not (one / "report" / "kl.png").exists()
    two = tmp_path / "two"  # a second epoch measures how far the first update moved the policy
    argv = ["train", TOY, *FAST, "trainer.update_epochs=2", "trainer.lr=0.01"]
    assert main([*argv, f"run_dir={two}", "--no-report"]) == 0
    [row] = read_jsonl(two / "metrics.jsonl")
    assert row["approx_kl"] > 0, row


# --- 4. a cycle without traffic says "no traffic", never a share of 0.000 ----------------------


def test_a_cycle_without_traffic_prints_no_traffic(tmp_path, capsys):
    import json

    run = tmp_path / "online"
    assert main(["online", "cycle", ONLINE, f"run_dir={run}"]) == 0
    out = capsys.readouterr().out
    rep = json.loads((run / "cycles.jsonl").read_text().splitlines()[-1])
    assert rep["exploration"]["traffic_share"] is None, rep["exploration"]
    assert "no traffic" in out and "traffic 0.000" not in out, out


# --- 5. the gate never promotes on 0.000 vs 0.000 ---------------------------------------------


def test_the_gate_refuses_to_promote_when_nothing_was_measured():
    from coderl.config.online import GateConfig
    from coderl.online.gate import run_gate

    cfg = GateConfig(margins={"pass@1": 0.15})
    n = 20  # identical weights on a suite neither solves
    rep = run_gate(cfg, {"pass@1": ([0.0] * n, [0.0] * n)}, None, [])
    assert not rep.promote and rep.comparisons[0].passed  # the tie alone would promote
    assert rep.reasons == [
        f"not measured: candidate and champion both score 0.000 on all {n} held-out tasks "
        "(pass@1); nothing shows either is better, not promoted"
    ]
    # one task solved by both is a measurement: a tie at 0.05 vs 0.05 is decided as before
    rep = run_gate(cfg, {"pass@1": ([1.0] + [0.0] * 19, [1.0] + [0.0] * 19)}, None, [])
    assert rep.promote, rep.reasons


# --- 6. three misleading messages, each one line saying what is wrong and what to do ------------


def test_resume_of_a_live_run_a_directory_as_config_and_a_missing_online_run(tmp_path, capsys):
    live = tmp_path / "live"  # a live run before its first checkpoint
    live.mkdir()
    (live / "config.yaml").write_text(Path(TOY).read_text())
    (live / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = _holder(live, "coderl train (the live one)")
    try:
        for command in ("train", "train-async"):
            assert main([command, "--resume", str(live)]) == 2
            line = _one_line_error(capsys.readouterr().err)
            assert f"in use by pid {holder.pid}" in line and "still running" in line, line
            assert "no complete checkpoint" not in line, line
    finally:
        holder.kill()
        holder.wait()
    assert main(["train", f"{live}/"]) == 2  # a directory given as CONFIG
    line = _one_line_error(capsys.readouterr().err)
    assert "is a directory, not a YAML config file" in line and "does not exist" not in line
    assert f"coderl train --resume {live}" in line, line
    nope = tmp_path / "nope"
    assert main(["online", "report", str(nope)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"{nope} does not exist" in line and "online run's directory" in line, line
    assert "config file" not in line, line


# --- the fourth trial (fresh user, 13:14-13:39 UTC): what it found, fixed ----------------------


@pytest.mark.parametrize(
    "made", ["cycles.jsonl", "registry/", "online.db", "export.json"], ids=str.strip
)
def test_train_never_starts_inside_another_commands_output(tmp_path, capsys, made):
    """An online run's directory or an export is not a training run: train is refused there in
    one line (it used to run a whole toy run beside an online run's registry)."""
    run_dir = tmp_path / "other"
    run_dir.mkdir()
    target = run_dir / made.rstrip("/")
    target.mkdir() if made.endswith("/") else target.write_text("{}\n")
    before = sorted(p.name for p in run_dir.iterdir())
    assert main(["train", TOY, *FAST, f"run_dir={run_dir}"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "not a training run" in line and made.rstrip("/") in line, line
    assert sorted(p.name for p in run_dir.iterdir() if p.name != ".lock") == before


def test_a_section_given_whole_keeps_the_presets_other_keys():
    """``trainer={steps: 1}`` overrides one key of the section, as ``trainer.steps=1`` does (it
    replaced the section, so the preset's lr fell back to the default without a word); a
    mapping field is still replaced whole."""
    from coderl.config import load_config

    preset = load_config(TOY)
    whole = load_config(TOY, ["trainer={steps: 1}"])
    assert whole.trainer.steps == 1 and whole.trainer.lr == preset.trainer.lr
    assert load_config(TOY, ["trainer={}"]).trainer == preset.trainer
    nested = load_config(TOY, ["algorithm={kl: {coef: 0.5}}"])
    assert (
        nested.algorithm.kl.coef == 0.5 and nested.algorithm.clip_low == preset.algorithm.clip_low
    )
    terms = load_config(TOY, ["reward.terms={tests: 1.0}"])
    assert terms.reward.terms == {"tests": 1.0}


@pytest.mark.parametrize("command", ["report", "eval"])
def test_a_config_given_as_a_run_says_what_it_is(capsys, command):
    assert main([command, TOY]) != 0
    line = _one_line_error(capsys.readouterr().err)
    assert "is a file, not a run directory" in line and "coderl train" in line, line


def test_a_host_that_is_not_this_machines_blames_the_host():
    from coderl.cli.serve import listening_socket
    from coderl.config import ConfigError

    with pytest.raises(ConfigError, match="check --host"):
        listening_socket("999.1.1.1", 0)


def test_eval_prints_no_fail_to_pass_fraction_for_a_task_without_one(tmp_path, capsys):
    """The toy task has no FAIL_TO_PASS tests: ``f2p`` is absent from its rows, not 0.0 beside
    a ``best`` of 0.5 (the fourth trial read it as a placeholder)."""
    import json

    run_dir = tmp_path / "toy"
    assert main(["train", TOY, *FAST, "trainer.checkpoint_every=1", f"run_dir={run_dir}"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run_dir), "eval.tasks=2", "k=2"]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("{") :])["per_task"]
    assert rows and all("f2p" not in r for r in rows), rows


def test_rl_steps_without_phase_times_are_not_printed_as_zero_seconds():
    """train-async logs no per-phase times: its steps are "not timed", not "0 s", and the rest
    of its wall time is not called model loading (the fourth trial read "RL 3 steps 0 s")."""
    from coderl.eval.summary import _phase_times

    untimed = _phase_times([], [{"step": 1}, {"step": 2}], {"train_s": 40.0})
    assert "RL 2 steps (not timed)" in untimed and "other" not in untimed, untimed
    timed = _phase_times([], [{"time/rollout": 5.0, "time/train": 3.0}], {"train_s": 10.0})
    assert "RL 1 steps 8 s" in timed and "other (model load, checkpoints) 2 s" in timed, timed
