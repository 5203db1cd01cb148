import subprocess
import sys

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
    assert "coderl tasks: error: unknown format 'sweb'; valid: ['swebench']" in err
    assert not out.exists()
