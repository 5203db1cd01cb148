import subprocess
import sys
from pathlib import Path

import pytest

from coderl import __version__
from coderl.cli import main


def test_version_and_help(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert __version__ in capsys.readouterr().out
    assert main([]) == 0
    assert "demo" in capsys.readouterr().out


def test_console_entry_point_runs():
    out = subprocess.run(
        [sys.executable, "-m", "coderl", "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: coderl" in out.stdout


def test_user_errors_are_one_line_not_tracebacks(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not valid YAML" in err and "Traceback" not in err


def test_a_new_run_refuses_a_directory_with_checkpoints(tmp_path):
    import pytest

    from coderl.train.checkpoint import CKPT_PREFIX, ensure_new_run

    ensure_new_run(tmp_path)  # no checkpoints: fine
    ckpt = tmp_path / "checkpoints" / f"{CKPT_PREFIX}000004"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")  # a complete checkpoint has its state.json
    with pytest.raises(FileExistsError, match="--resume"):
        ensure_new_run(tmp_path)


def test_overrides_may_follow_options(monkeypatch):
    # argparse fills `overrides` (nargs="*") before the options after it; the leftover
    # key=value words still reach the command, anything else is still an error
    import argparse

    import pytest

    seen = {}

    def fake_eval(args: argparse.Namespace) -> int:
        seen.update(base=args.base, overrides=list(args.overrides))
        return 0

    from coderl import cli

    parser = cli.build_parser()
    _, extra = parser.parse_known_args(["eval", "runs/x", "--base", "k=4"])
    assert extra == ["k=4"]  # the argparse behaviour this works around
    monkeypatch.setattr(cli, "build_parser", lambda *a: _Fixed(parser, fake_eval))
    assert cli.main(["eval", "runs/x", "k=2", "--base", "k=4"]) == 0
    assert seen == {"base": True, "overrides": ["k=2", "k=4"]}
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "runs/x", "--base", "stray"])
    assert e.value.code == 2


class _Fixed:
    """A parser whose sub-command function is replaced (no model is loaded)."""

    def __init__(self, parser, func):
        self.parser, self.func = parser, func

    def parse_known_args(self, argv):
        args, extra = self.parser.parse_known_args(argv)
        args.func = self.func
        return args, extra

    def error(self, msg):
        self.parser.error(msg)


def test_unknown_task_format_is_a_one_line_user_error(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert (
        main(["tasks", "export", "data/tasks/ci.jsonl", "--format", "sweb", "--out", str(out)]) == 2
    )
    err = capsys.readouterr().err
    assert "coderl tasks export: error: unknown format 'sweb'; valid: ['swebench']" in err
    assert not out.exists()


TOY = Path(__file__).parent.parent / "configs" / "toy.yaml"


def test_help_and_version_import_no_torch():
    code = (
        "import sys\nfrom coderl.cli import main\n"
        "for argv in (['--help'], ['--version']):\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in out.stdout, out.stdout[-500:]


def test_eval_help_and_the_config_import_no_torch():
    """``coderl eval --help`` and a config load (which every command's argument checks do before
    a model loads) stay light: the config's online rewards reach ``coderl.agent.parsing``."""
    code = (
        "import sys\nfrom coderl.cli import main\nfrom coderl.config import load_config\n"
        f"load_config({str(TOY)!r})\n"
        "try:\n    main(['eval', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in out.stdout, out.stdout[-500:]


def _fake_run(tmp_path: Path) -> Path:
    from coderl.config import dump_config, load_config

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-000001"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    (run / "config.yaml").write_text(dump_config(load_config(TOY, [f"run_dir={run}"])))
    return run


@pytest.mark.parametrize(
    "extra, said",
    [
        (["tasks=humaneval:heldot"], "tasks=humaneval:heldot: unknown split 'heldot'"),
        (["k=abc"], "k=abc: k must be a positive integer"),
    ],
)
def test_eval_argument_errors_are_one_line_before_the_model_loads(
    tmp_path, capsys, monkeypatch, extra, said
):
    import coderl.train.run as run_module

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(run_module, "setup_run", no_model)
    assert main(["eval", str(_fake_run(tmp_path)), *extra]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 2


@pytest.mark.parametrize(
    "flag, value, valid", [("--call-format", "json", "hermes"), ("--kind", "nope", "repo")]
)
def test_agent_choices_are_argparse_errors_naming_the_valid_values(capsys, flag, value, valid):
    with pytest.raises(SystemExit) as e:
        main(["agent", "--workspace", ".", "--task", "t", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: invalid choice: '{value}'" in err and valid in err


def test_progress_lines_appear_when_the_output_is_a_pipe(tmp_path):
    argv = ["train", str(TOY), f"run_dir={tmp_path}", "trainer.steps=2", "tensorboard=false"]
    argv += ["eval.before_after=false", "rollout.group_size=2", "--no-report"]
    out = subprocess.run(
        [sys.executable, "-m", "coderl", *argv], capture_output=True, text=True, check=True
    )
    lines = [x for x in out.stderr.splitlines() if x.startswith("train ")]
    assert [x.split()[1] for x in lines] == ["1/2", "2/2"], out.stderr[-2000:]
    assert all("elapsed" in x and "eta" in x and "reward" in x and "resolved" in x for x in lines)


def test_help_texts_describe_actions_and_builders():
    def help_of(*argv):
        r = subprocess.run(
            [sys.executable, "-m", "coderl", *argv, "--help"], capture_output=True, text=True
        )
        return r.stdout

    online = help_of("online")
    for action in ("cycle", "run", "import", "report"):
        # the action's own line (4 spaces in), not a wrapped description that starts with it
        line = next(x for x in online.splitlines() if x.startswith(f"    {action} "))
        assert len(line.split()) > 3, line  # a description, not only the name

    from coderl.agent.buildpolicy import BUILDERS
    from coderl.cli.tasks import BUILDER_HELP

    assert list(BUILDER_HELP) == list(BUILDERS)
    build = " ".join(help_of("tasks", "build-env").split())
    assert all(f"{name}:" in build for name in BUILDERS)
