"""A user's first day (issue 48), the fourth pass: what the last new-user trial found still open.

Through the command line a user types (``coderl.cli.main``) where it can be, so a refusal is
checked together with its one-line message and exit status; where what matters is *when* a
refusal comes (before torch and the model load), in a fresh interpreter."""

import io
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_first_day import _holder, _logged, _one_line_error

from coderl.cli import main
from coderl.config import ConfigError, load_config
from coderl.metrics import read_jsonl
from coderl.progress import PhaseProgress, inner_note, inner_progress
from coderl.rundir import SFT_WEIGHTS, list_checkpoints

ROOT = Path(__file__).parent.parent
TOY = str(ROOT / "configs" / "toy.yaml")
DEFAULT = str(ROOT / "configs" / "default.yaml")
ONLINE = str(ROOT / "configs" / "online-demo.yaml")
FAST = ["progress=false", "tensorboard=false", "eval.before_after=false", "trainer.steps=1"]
FAST += ["rollout.group_size=4", "rollout.max_new_tokens=4"]
SFT = [DEFAULT, "model.name=tiny-random", "sft.limit=2", "sft.epochs=1", "sft.batch_size=1"]


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones too) with a file's bytes (None: a directory)."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


# --- 1. a command that fails before its first result leaves the run directory as found --------

BAD_SETUP = "tasks.options={nope: 1}"  # refused when the environment is built, after the lock


@pytest.mark.parametrize(
    "argv",
    [
        ["train", TOY, *FAST, BAD_SETUP],
        ["train-async", TOY, *FAST, BAD_SETUP],
        ["sft", TOY],  # the toy source has no oracle: refused after config.yaml is written
        ["train", TOY, *FAST, "sft.enabled=true"],  # the same, from the warm start
    ],
    ids=["train", "train-async", "sft", "train+sft"],
)
def test_a_failed_setup_leaves_the_run_directory_as_it_found_it(tmp_path, capsys, argv):
    new = tmp_path / "runs" / "a" / "b"  # every directory of the path is created, then removed
    before = _tree(tmp_path)
    assert main([*argv, f"run_dir={new}"]) == 2
    _one_line_error(capsys.readouterr().err)
    assert _tree(tmp_path) == before  # no runs/, no config.yaml, no .lock
    old = tmp_path / "old"  # a directory that was there: its files kept, its config put back
    old.mkdir()
    (old / "notes.txt").write_text("mine")
    (old / "config.yaml").write_text("# the user's own\n")
    before = _tree(tmp_path)
    assert main([*argv, f"run_dir={old}"]) == 2
    _one_line_error(capsys.readouterr().err)
    assert _tree(tmp_path) == before
    assert main(["train", TOY, *FAST, f"run_dir={new}", "--no-report"]) == 0  # reusable as is
    assert [r["step"] for r in read_jsonl(new / "metrics.jsonl")] == [1]


def test_a_failure_after_the_first_result_keeps_everything(tmp_path, capsys, monkeypatch):
    from coderl.train import loop

    run_dir = tmp_path / "run"

    def fail_in_step_2(run):
        if run.step == 1:
            raise ValueError("step 2 failed")
        return real(run)

    real = loop.training_step
    monkeypatch.setattr(loop, "training_step", fail_in_step_2)
    argv = ["train", TOY, *FAST, "trainer.steps=2", "trainer.checkpoint_every=1"]
    assert main([*argv, f"run_dir={run_dir}", "--no-report"]) == 2
    assert "step 2 failed" in _one_line_error(capsys.readouterr().err)
    assert (run_dir / "config.yaml").is_file() and list_checkpoints(run_dir)
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1]


# --- 2. a missing argument: one line naming it, under a one-line usage ------------------------


@pytest.mark.parametrize(
    "argv, name",
    [
        (["eval"], "CHECKPOINT"),
        (["sft"], "CONFIG"),
        (["export"], "RUN_DIR"),
        (["report"], "RUN_DIR"),
        (["serve"], "CONFIG"),
        (["online", "cycle"], "CONFIG"),
    ],
)
def test_a_missing_argument_is_one_line_naming_it(capsys, argv, name):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    command = "coderl " + " ".join(argv)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"usage: {command} ") and lines[0].endswith("[options]"), lines
    assert lines[1].startswith(f"{command}: error: missing "), lines
    assert f"see {command} --help" in lines[1] and "following arguments" not in lines[1], lines
    if name is not None:
        assert f"missing {name}: " in lines[1], lines


# --- 3. a run_dir that is a file, or under one: one line naming the key and the file ----------


@pytest.mark.parametrize(
    "argv",
    [
        ["train", TOY, *FAST],
        ["train-async", TOY, *FAST],
        ["sft", TOY],
        ["demo", *FAST, "--config", TOY],
        ["serve", ONLINE, "--port", "0"],
        ["online", "cycle", ONLINE],
    ],
    ids=["train", "train-async", "sft", "demo", "serve", "online-cycle"],
)
def test_a_run_dir_that_is_a_file_is_named_in_one_line(tmp_path, capsys, argv):
    readme = tmp_path / "README.md"
    readme.write_text("# not a run\n")
    for run_dir, said in ((readme, "is a file"), (readme / "run", f"lies under the file {readme}")):
        assert main([*argv, f"run_dir={run_dir}"]) == 2
        line = _one_line_error(capsys.readouterr().err)
        assert f"run_dir={run_dir} {said}" in line and "File exists" not in line, line
    assert readme.read_text() == "# not a run\n" and sorted(tmp_path.iterdir()) == [readme]


# --- 4. a refusal comes before any line that announces work -----------------------------------


def test_no_warm_start_line_before_a_refusal(tmp_path, capsys):
    logs = tmp_path / "logs"  # another run's logs: refused
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"step": 1}\n')
    cases = [
        ["train", *SFT, *FAST, f"run_dir={logs}"],
        # a source without demonstrations, with and without the cache: before the line
        ["train", TOY, *FAST, "sft.enabled=true", "sft.cache=false", f"run_dir={tmp_path / 'a'}"],
        ["train", TOY, *FAST, "sft.enabled=true", "sft.cache=true", f"run_dir={tmp_path / 'b'}"],
    ]
    held = tmp_path / "held"
    holder = _holder(held)
    cases += [["train", *SFT, *FAST, f"run_dir={held}"], ["demo", *FAST, f"run_dir={held}"]]
    try:
        for argv in cases:
            assert main(argv) == 2, argv
            out, err = capsys.readouterr()
            _one_line_error(err)
            assert "warm start" not in out and "sft:" not in out, (argv, out)
    finally:
        holder.kill()
        holder.wait()


# --- 5. --resume of a run that holds only SFT output names it and the command that goes on ----


@pytest.fixture(scope="module")
def sft_only(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sft") / "run"
    assert main(["sft", *SFT, "progress=false", f"run_dir={run_dir}"]) == 0
    return run_dir


@pytest.mark.parametrize("command", ["train", "train-async"])
def test_resume_of_an_sft_only_run_says_what_is_there_and_how_to_start_rl(
    sft_only, capsys, command
):
    weights = (sft_only / SFT_WEIGHTS).read_bytes()
    assert main([command, "--resume", str(sft_only)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    start = f"coderl train {sft_only / 'config.yaml'} run_dir={sft_only} sft.enabled=true"
    assert "SFT warm start" in line and "no RL checkpoint" in line and start in line, line
    assert (sft_only / SFT_WEIGHTS).read_bytes() == weights


def test_the_command_the_resume_line_gives_starts_rl_from_the_sft_weights(
    sft_only, tmp_path, capsys
):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(sft_only, run_dir)
    weights = (run_dir / SFT_WEIGHTS).read_bytes()
    assert main(["train", "--resume", str(run_dir)]) == 2
    start = _one_line_error(capsys.readouterr().err).split("start RL from the SFT weights with: ")
    argv = start[1].split()[1:]  # as printed, less "coderl"
    small = ["trainer.steps=1", "tasks.tasks_per_step=1", "rollout.group_size=2"]  # no SFT input
    small += ["eval.before_after=false", "progress=false", "tensorboard=false"]
    small += ["dynamic_sampling.mode=off", "rollout.max_new_tokens=32"]
    assert main([*argv, *small, "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "RL starts from the SFT weights" in out and "building" not in out, out
    assert (run_dir / SFT_WEIGHTS).read_bytes() == weights  # not replaced by another SFT
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1]


def test_sft_weights_of_another_config_are_refused_not_replaced(sft_only, tmp_path, capsys):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(sft_only, run_dir)
    weights = (run_dir / SFT_WEIGHTS).read_bytes()
    argv = ["train", *SFT, "sft.lr=0.5", "sft.enabled=true", *FAST, f"run_dir={run_dir}"]
    assert main(argv) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "SFT weights of another config (sft differ" in line and "run_dir=" in line, line
    assert (run_dir / SFT_WEIGHTS).read_bytes() == weights


# --- 6. lock, run-dir and port refusals come before torch and the model load ------------------

PROBE = """
import sys
from coderl.cli import main
code = main(sys.argv[1:])
print("exit", code, "torch" in sys.modules, "transformers" in sys.modules)
"""


def test_refusals_come_before_torch_and_the_model_load(tmp_path):
    held = tmp_path / "held"
    holder = _holder(held)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "eval.jsonl").write_text('{"step": 0}\n')
    cases = {
        "train, held": ["train", TOY, *FAST, f"run_dir={held}"],
        "train-async, held": ["train-async", TOY, *FAST, f"run_dir={held}"],
        "sft, held": ["sft", TOY, f"run_dir={held}"],
        "demo, held": ["demo", *FAST, f"run_dir={held}"],
        "train, logs": ["train", TOY, *FAST, f"run_dir={logs}"],
        "train-async, logs": ["train-async", TOY, *FAST, f"run_dir={logs}"],
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        for what, argv in cases.items():
            run = subprocess.run(
                [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env
            )
            assert run.stdout.strip().splitlines()[-1] == "exit 2 False False", (what, run)
    finally:
        holder.kill()
        holder.wait()


def test_online_run_refuses_a_port_in_use_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import coderl.cli.online as online

    def loaded(*a, **k):
        raise AssertionError("the model loaded before the port was checked")

    monkeypatch.setattr(online, "open_run", loaded)
    monkeypatch.setattr(online, "build_server", loaded)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        run_dir = tmp_path / "online"
        argv = ["online", "run", ONLINE, "online.serve.host=127.0.0.1", f"online.serve.port={port}"]
        assert main([*argv, f"run_dir={run_dir}"]) == 2
        line = _one_line_error(capsys.readouterr().err)
        assert f"cannot listen on 127.0.0.1:{port}" in line, line
        assert "choose another with online.serve.port=N, or online.serve.port=0" in line, line
        assert not run_dir.exists()
    finally:
        taken.close()


# --- 7. a long stretch inside a phase shows its progress --------------------------------------


class _Log(io.StringIO):
    def isatty(self) -> bool:
        return False


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_inner_progress_shows_inside_a_phase_only_in_its_thread():
    log = _Log()
    with inner_progress("outside", 3) as bar:  # no phase open: nothing
        bar.advance()
    with PhaseProgress("train", 4, completed=1, stream=log):
        with inner_progress("rollout turn", 5) as bar:
            bar.advance(status="episodes done 0/8")
            bar.advance(status="episodes done 8/8")
        inner_note("synth: waiting for the request in flight")

        def worker() -> None:
            with inner_progress("from a worker", 2) as other:
                other.advance()
            inner_note("from a worker")

        t = threading.Thread(target=worker)
        t.start()
        t.join()
    lines = log.getvalue().splitlines()
    assert len(lines) == 3 and all(x.startswith("train 2/4: rollout turn ") for x in lines[:2])
    assert lines[0].startswith("train 2/4: rollout turn 1/5 elapsed") and " eta " in lines[0]
    assert lines[1].endswith("episodes done 8/8"), lines
    assert lines[2] == "train 2/4: synth: waiting for the request in flight", lines
    with PhaseProgress("train", 2, enabled=False, stream=log):  # progress=false: quiet inside
        with inner_progress("rollout turn", 5) as bar:
            bar.advance()
        inner_note("synth: waiting")
    assert log.getvalue().splitlines() == lines


def test_an_inner_phase_on_a_terminal_is_a_row_of_the_outer_bar():
    term = _Terminal()
    with PhaseProgress("train", 2, stream=term) as outer:
        with PhaseProgress("eval", 3, stream=term) as inner:  # rich: one live display
            assert inner.bar is outer.bar
            inner.advance()
            with inner_progress("rollout turn", 4) as turns:
                assert turns.bar is outer.bar
                turns.advance()
        assert len(outer.bar.tasks) == 1  # the inner rows are gone with their phases
        outer.advance()


def test_a_training_step_in_the_harness_shows_rollout_turns_and_grading_in_a_log(tmp_path):
    argv = ["train", *SFT, "sft.enabled=false", "trainer.steps=1", "tasks.tasks_per_step=1"]
    argv += ["rollout.group_size=2", "eval.before_after=false", "tensorboard=false"]
    argv += ["dynamic_sampling.mode=off", "rollout.max_new_tokens=32"]
    log = _logged([*argv, "progress=true", f"run_dir={tmp_path / 'r'}", "--no-report"], tmp_path)
    turns = [x for x in log.splitlines() if x.startswith("train 1/1: rollout turn ")]
    assert turns and all(" eta " in x and "episodes done" in x for x in turns), log[-3000:]
    grading = [x for x in log.splitlines() if x.startswith("train 1/1: grading ")]
    assert grading and grading[-1].startswith("train 1/1: grading 2/2 "), log[-3000:]


# --- 8. config errors in plain words, no pydantic phrasing ------------------------------------


@pytest.mark.parametrize(
    "override, said",
    [
        ("eval.samples=0", "eval.samples: must be at least 1 (got 0)"),
        ("rollout.group_size=two", "rollout.group_size: must be a whole number (got 'two')"),
        ("rollout.group_size=2.5", "rollout.group_size: must be a whole number (got 2.5)"),
        ("trainer.lr=fast", "trainer.lr: must be a number (got 'fast')"),
        ("progress=maybe", "progress: must be true or false (got 'maybe')"),
        ("eval.k=4", "eval.k: must be a list, e.g. [1, 4] (got 4)"),
        ("algorithm.clip_low=1.5", "algorithm.clip_low: must be less than 1 (got 1.5)"),
        ("algorithm.advantage=grpoo", "did you mean 'grpo'?"),
        ("algorithm.old_logp=behavior", "did you mean 'behaviour'?"),
    ],
)
def test_config_errors_are_plain_words_naming_the_key(override, said, capsys):
    with pytest.raises(ConfigError) as err:
        load_config(TOY, [override])
    text = str(err.value)
    assert said in text and "Input should" not in text and "pydantic" not in text, text
    assert main(["train", TOY, override]) == 2
    assert said in _one_line_error(capsys.readouterr().err)


# --- 9. the ratio's metrics only where the ratio can differ from 1 ----------------------------

RATIO = ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean", "ratio_max")


@pytest.mark.parametrize(
    "overrides, measured",
    [
        ([], False),  # one epoch on its own forward (truncated weights): ratio exactly 1
        (["algorithm.importance.mode=off"], False),
        (["algorithm.importance.mode=mask"], False),  # weights correct the sampler, not the ratio
        (["trainer.update_epochs=2"], True),  # the second epoch's ratio moved
        (["algorithm.old_logp=behaviour"], True),  # against the sampler's (stale) logprobs
    ],
    ids=["one-epoch", "no-weights", "masked-weights", "two-epochs", "behaviour"],
)
def test_clip_fractions_are_absent_where_nothing_can_be_clipped(overrides, measured):
    from test_train import _segments

    from coderl.policy.loading import load_policy
    from coderl.train.batch import build_batch
    from coderl.train.step import train_step

    cfg = load_config(TOY, ["progress=false", "trainer.lr=0.05", *overrides])
    policy = load_policy("tiny-random")
    batch = build_batch(_segments(4), [1.0, -1.0, 0.5, -0.5], policy.pad_token_id)
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    m = train_step(
        policy.model, opt, sched, batch, cfg.algorithm, cfg.trainer, temperature=1.0, max_len=8
    )
    assert all((k in m) == measured for k in RATIO), sorted(m)
    if measured:
        assert m["ratio_mean"] != pytest.approx(1.0, abs=1e-6), m["ratio_mean"]
    assert "iw_mean" in m and "loss" in m


def test_a_one_epoch_run_logs_no_clip_fraction(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", TOY, *FAST, "trainer.steps=2", f"run_dir={run_dir}", "--no-report"]) == 0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 2 and not [k for r in rows for k in r if k in RATIO], rows[0].keys()
    json.dumps(rows)  # plain JSON, as the report reads it
