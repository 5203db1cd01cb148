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
