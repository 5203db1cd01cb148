"""A user's first day (issue 48), the second user's findings: ``--force`` never removes a run,
nothing moves or writes into a run another command holds, a number that was not measured is
never printed as one, and errors are one line that names what to fix.

Each class is tested through the command line a user types (``coderl.cli.main``) on the toy
task where it can be, so a refusal is checked together with its one-line message."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_first_day import _holder

from coderl.cli import main
from coderl.train.checkpoint import list_checkpoints

ROOT = Path(__file__).parent.parent
TOY = str(ROOT / "configs" / "toy.yaml")
FAST = ["progress=false", "tensorboard=false", "eval.before_after=false", "trainer.steps=1"]
FAST += ["rollout.group_size=4", "rollout.max_new_tokens=4"]


def _train(run_dir: Path, *extra: str) -> int:
    return main(["train", TOY, *FAST, f"run_dir={run_dir}", *extra, "--no-report"])


def _one_line_error(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if not x.startswith("(set CODERL_TRACEBACK")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """``runs/`` holding two finished toy runs, ``a`` and ``b``."""
    root = tmp_path_factory.mktemp("first-day") / "runs"
    for name in ("a", "b"):
        assert _train(root / name) == 0
    return root


# --- 1. --force replaces a previous export, never a run -------------------------------------


def test_export_force_never_removes_a_run_or_a_directory_of_runs(runs, tmp_path, capsys):
    before = _tree(runs)
    refusals = {
        str(runs / "a"): "holds the run being exported",  # the run itself
        str(runs): "holds the run being exported",  # a directory holding it
        str(runs / "b"): "not a previous export",  # another run
        str(runs / "a" / "checkpoints"): "holds the run being exported",
    }
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    refusals[str(tmp_path / "mine")] = "not a previous export"  # anything else
    for out, why in refusals.items():
        assert main(["export", str(runs / "a"), "--out", out, "--force"]) == 2, out
        line = _one_line_error(capsys.readouterr().err)
        assert why in line and "--out" in line, line
    assert _tree(runs) == before
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    # an export that a run was later moved into is not an export any more
    out = tmp_path / "export"
    assert main(["export", str(runs / "a"), "--out", str(out)]) == 0
    (out / "checkpoints").mkdir()
    assert main(["export", str(runs / "b"), "--out", str(out), "--force"]) == 2
    assert "holds a training run" in _one_line_error(capsys.readouterr().err)
    (out / "checkpoints").rmdir()
    # a previous export is replaced
    assert main(["export", str(runs / "b"), "--out", str(out), "--force"]) == 0
    capsys.readouterr()
    assert str(runs / "b") in json.loads((out / "export.json").read_text())["checkpoint"]


# --- 2. nothing moves or writes into a run directory a live command holds --------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--config", TOY, "trainer.steps=1", "progress=false", "tensorboard=false"],
        ["sft", TOY],
        ["train", TOY, *FAST],
    ],
    ids=["demo", "sft", "train"],
)
def test_a_live_runs_directory_is_neither_moved_nor_written(tmp_path, capsys, argv):
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # the live run's log so far
    before = {**_tree(run_dir)}
    holder = _holder(run_dir, "coderl train (the live one)")
    try:
        assert main([*argv, f"run_dir={run_dir}"]) == 2
        out, err = capsys.readouterr()
        line = _one_line_error(err)
        assert f"in use by pid {holder.pid}" in line and "the live one" in line, line
        assert "moved" not in out, out
        assert not list(tmp_path.glob("live.prev*"))
        after = _tree(run_dir)
        assert {k: v for k, v in after.items() if k != ".lock"} == {
            k: v for k, v in before.items() if k != ".lock"
        }
    finally:
        holder.kill()
        holder.wait()


# --- 3. coderl sft writes only into a new directory or its own earlier one ---------------------

SFT = [str(ROOT / "configs" / "default.yaml"), "model.name=tiny-random", "sft.limit=1"]
SFT += ["sft.batch_size=1", "sft.epochs=1", "progress=false"]


def test_sft_refuses_a_directory_holding_another_run(runs, tmp_path, capsys):
    before = _tree(runs / "a")
    assert main(["sft", *SFT, f"run_dir={runs / 'a'}"]) == 2  # a finished run's checkpoints
    line = _one_line_error(capsys.readouterr().err)
    assert "holds another run (checkpoints up to step-000001" in line and "run_dir=" in line
    assert _tree(runs / "a") == before
    stopped = tmp_path / "stopped"  # a run stopped before its first checkpoint: its logs
    stopped.mkdir()
    (stopped / "eval.jsonl").write_text('{"step": 0}\n')
    assert main(["sft", *SFT, f"run_dir={stopped}", "--force"]) == 2
    assert "eval.jsonl" in _one_line_error(capsys.readouterr().err)
    own = tmp_path / "own"  # its own earlier sft: replaced with --force, not with another model
    assert main(["sft", *SFT, f"run_dir={own}"]) == 0
    assert main(["sft", *SFT, f"run_dir={own}", "--force"]) == 0
    capsys.readouterr()
    assert main(["sft", *SFT, f"run_dir={own}", "--force", "model.lora=false"]) == 2
    assert "model settings differ" in _one_line_error(capsys.readouterr().err)
    assert not list_checkpoints(own)


# --- 4. SFT on a source without demonstrations: one line, before the model loads ---------------


@pytest.mark.parametrize("command", ["sft", "train"])
def test_sft_on_a_source_without_demonstrations_is_one_line_before_loading(
    tmp_path, capsys, monkeypatch, command
):
    import coderl.train.sft as sft

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the source was checked")

    monkeypatch.setattr(sft, "build_policy", no_model)
    argv = [command, TOY, "sft.enabled=true", f"run_dir={tmp_path / 'r'}"]
    assert main([*argv, *(FAST if command == "train" else [])]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "tasks.source='toy' has no oracle demonstrations" in line, line
    assert "sft.enabled=false" in line


# --- 5. a rise is not printed as a drop ------------------------------------------------------


def _check(change: float, alarm: bool = False) -> dict:
    ci = {"mean": change, "lo": change - 0.1, "hi": change + 0.1}
    return {"alarm": alarm, "drop": -change, "k": 4, "best_step": 0, "change": ci}


def test_the_collapse_line_says_no_drop_when_pass_at_k_rose():
    from coderl.eval.summary import collapse_line

    rose = collapse_line(
        [{"step": 5, "collapse": _check(0.25)}, {"step": 10, "collapse": _check(0.75)}]
    )
    assert "largest drop" not in rose and "-0.750" not in rose, rose
    assert rose.startswith("not raised in 2 checks") and "no drop" in rose, rose
    assert "step 5: pass@4 vs step 0, change +0.250" in rose, rose  # the smallest rise
    fell = collapse_line(
        [{"step": 5, "collapse": _check(0.25)}, {"step": 10, "collapse": _check(-0.5, True)}]
    )
    assert fell.startswith("RAISED at step 10") and "largest drop 0.500 at step 10" in fell, fell
    assert "change -0.500" in fell, fell


# --- 6. an online table prints n/a, never nan or a placeholder 0 -------------------------------


def test_online_tables_print_n_a_for_what_was_not_measured():
    import io

    from rich.console import Console

    from coderl.online.cycle_report import print_report

    nan = float("nan")
    rep = {
        "decision": "promoted",
        "finalize": {"scored": 4},
        "rejected_events": {},
        "duplicate_events": 0,
        "train": {"train_reward_mean": 0.5, "kl": nan},
        "monitors": {
            "orphaned_share": 0.0,
            "by_version": {
                0: {"*": {"reward": 0.25, "dissatisfaction_rate": nan, "persistence_rate": nan}},
                1: {"*": {"reward": 0.5, "kl": 0.0123}},
            },
        },
    }
    out = io.StringIO()
    print_report(rep, Console(file=out, width=200))
    text = out.getvalue()
    assert "nan" not in text.lower(), text
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 2}
    assert "n/a" in rows["kl"] and "0.0123" in rows["kl"], rows["kl"]  # v0: not trained
    assert rows["dissatisfaction_rate"].count("n/a") == 2, rows["dissatisfaction_rate"]
    assert "n/a" in rows["train kl"], rows["train kl"]


# --- 10. an error names what is missing, in words -------------------------------------------


def test_a_missing_path_is_said_to_not_exist_naming_the_flag(tmp_path, capsys):
    nope = str(tmp_path / "nope")
    cases = [
        (["eval", nope, "k=1"], f"{nope} does not exist"),
        (["export", nope], f"{nope} does not exist"),
        (["train", "--resume", nope], f"{nope} does not exist"),
        (["report", nope], f"{nope} does not exist"),
        (["agent", "--workspace", nope, "--task", "x"], f"--workspace {nope} is not a directory"),
        (["tasks", "stats", f"{nope}.jsonl"], f"{nope}.jsonl: does not exist"),
    ]
    for argv, said in cases:
        assert main(argv) == 2, argv
        line = _one_line_error(capsys.readouterr().err)
        assert said in line and "Errno" not in line, line


def test_a_key_given_twice_in_a_preset_is_refused_naming_key_and_lines(tmp_path, capsys):
    preset = tmp_path / "mine.yaml"
    preset.write_text(
        (ROOT / "configs" / "toy.yaml").read_text()
        + "trainer:\n  steps: 2\n  lr: 0.1\n  steps: 3\n"  # a second trainer: too
    )
    assert main(["train", str(preset), f"run_dir={tmp_path / 'r'}"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"{preset}: key " in line and "given twice" in line, line
    inner = tmp_path / "inner.yaml"
    inner.write_text("trainer:\n  steps: 2\n  lr: 0.1\n  steps: 3\n")
    assert main(["train", str(inner), f"run_dir={tmp_path / 'r'}"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "key 'steps' is given twice" in line and "lines 2 and 4" in line, line
    assert not (tmp_path / "r").exists()


# --- 9. export --merged of a full fine-tuning run is refused before anything loads ------------


def test_export_merged_of_a_full_run_is_refused_before_torch_loads(runs, tmp_path):
    code = (
        "import sys\nfrom coderl.cli import main\n"
        f"code = main(['export', {str(runs / 'a')!r}, '--merged', '--out', {str(tmp_path / 'm')!r}])\n"
        "print(code, 'torch' in sys.modules, 'coderl.train.export' in sys.modules)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert run.stdout.split() == ["2", "False", "False"], run.stdout + run.stderr[-2000:]
    assert "no adapter to merge" in _one_line_error(run.stderr)


# --- 8. library noise: weight bars off for the commands that load and write weights -----------


class _Terminal:
    def isatty(self) -> bool:
        return True


def test_weight_io_bars_are_off_on_a_terminal_for_export_online_and_serve(monkeypatch):
    from transformers.utils import logging as hf_logging

    from coderl.cli import build_parser, quiet_libraries

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    hf_logging.enable_progress_bar()
    try:
        quiet_libraries(_Terminal(), command="train")  # a terminal, training: its bars stay
        assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
        assert hf_logging.is_progress_bar_enabled()
        for command in ("export", "online", "serve"):
            monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
            hf_logging.enable_progress_bar()
            quiet_libraries(_Terminal(), command=command)
            assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1", command
            assert not hf_logging.is_progress_bar_enabled(), command
    finally:
        hf_logging.enable_progress_bar()
    parser = build_parser("serve")
    assert parser.parse_args(["serve", "x.yaml"]).access_log is False
    assert parser.parse_args(["serve", "x.yaml", "--access-log"]).access_log is True


# --- 11. --help is plain text that says what the arguments do ----------------------------------


def test_help_texts_carry_no_rst_markup_and_eval_help_says_what_k_sets(capsys):
    from coderl.cli import COMMANDS

    for argv in [[c, "--help"] for c in COMMANDS] + [
        ["online", op, "--help"] for op in ("run", "cycle")
    ]:
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "``" not in out and ":func:`" not in out and ":mod:`" not in out, (argv, out)
    with pytest.raises(SystemExit):
        main(["graders", "probe", "--help"])
    assert "coderl.graders" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "samples per task, overriding eval.samples" in said and "eval.tasks=N" in said, said


# --- the second fresh-user trial ------------------------------------------------------------


def test_no_flag_replaces_a_runs_own_files(tmp_path, capsys):
    # `eval --episodes-out RUN/metrics.jsonl --force` replaced the run's training log (and the
    # report then crashed on it); a new file beside the run's is fine, outside a run --force is
    from coderl.cli.tasks import writable

    run = tmp_path / "run"
    assert _train(run) == 0
    before = _tree(run)
    for own in ("metrics.jsonl", "config.yaml", "checkpoints"):
        with pytest.raises(FileExistsError, match="inside the training run"):
            writable(run / own, True)
    assert main(["eval", str(run), "--episodes-out", str(run / "metrics.jsonl"), "--force"]) != 0
    assert "inside the training run" in _one_line_error(capsys.readouterr().err)
    assert _tree(run) == before
    assert writable(run / "episodes.jsonl", True) == run / "episodes.jsonl"  # new: allowed
    (tmp_path / "old.jsonl").write_text("x\n")
    assert writable(tmp_path / "old.jsonl", True) == tmp_path / "old.jsonl"


@pytest.mark.parametrize("value", ["{a: 1", "[1", "'x", "{a: [1}"])
def test_a_malformed_override_value_is_a_one_line_config_error(value):
    from coderl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(TOY, [f"tasks={value}"])


def test_eval_harness_on_tasks_without_repositories_stops_before_sampling(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(run) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--harness", str(tmp_path / "h")]) != 0
    err = _one_line_error(capsys.readouterr().err)
    assert "--harness" in err and "no repository tasks" in err
    assert not (tmp_path / "h").exists()


@pytest.mark.parametrize("text", ["", "# nothing here\n", "\n\n"])
def test_an_empty_config_file_is_refused_not_run_on_the_defaults(tmp_path, text):
    # `coderl train empty.yaml` started the full default job (SmolLM2 on HumanEval) for 10 minutes
    from coderl.config import ConfigError, load_config

    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    with pytest.raises(ConfigError, match="the config file is empty"):
        load_config(empty)


def test_an_export_never_goes_into_a_runs_checkpoints_folder(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(run) == 0
    before = _tree(run)
    capsys.readouterr()
    for out in (run / "checkpoints" / "step-000099", run / "checkpoints" / "hf"):
        assert main(["export", str(run), "--out", str(out)]) != 0
        assert "checkpoints/ folder" in _one_line_error(capsys.readouterr().err)
    assert _tree(run) == before
