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
