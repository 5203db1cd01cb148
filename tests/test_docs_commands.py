"""The commands the README and docs show run as written: every ``coderl ...`` line of their code
blocks parses with the real command line (options, required arguments, ``key=value``
overrides; a preset it names exists and loads with those overrides), every command's ``--help`` has a line, with its default, for every argument, and
the README's ``tasks import`` line runs for real on a SWE-bench instance file."""

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest
from test_tasks_swebench import instance

from coderl.cli import COMMANDS, build_parser, command_of, main

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_commands() -> list[tuple[str, str]]:
    """``(page, line)`` for each line of a fenced code block that runs ``coderl``: starts with
    ``coderl `` or runs ``-m coderl `` (``torchrun ... -m coderl train ...``, given as the
    ``coderl ...`` it runs); a trailing ``# comment`` cut off, a line with an elided part
    (``...the same...``) left out."""
    found = []
    for page in PAGES:
        blocks = re.findall(r"```[^\n]*\n(.*?)```", page.read_text(), flags=re.S)
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():  # continuation lines joined
                line = re.split(r"\s+#\s", line.strip().removeprefix("$ "))[0].strip()
                run = re.match(r"(?:\S+ .*-m )?(coderl .*)", line)
                if run and not re.search(r"\s\.\.\.\S", line):
                    found.append((page.name, run.group(1)))
    return found


COMMAND_LINES = documented_commands()


def test_the_pages_show_commands_of_every_kind():
    shown = {command_of(shlex.split(line)[1:]) for _, line in COMMAND_LINES}
    assert len(COMMAND_LINES) >= 30
    assert {"train", "eval", "export", "report", "tasks", "train-async", "online"} <= shown


@pytest.mark.parametrize("page, line", COMMAND_LINES, ids=[c for _, c in COMMAND_LINES])
def test_every_documented_command_parses_as_written(page, line):
    argv = shlex.split(line)[1:]
    command = command_of(argv)
    assert command in COMMANDS, f"{page}: {line}: no such command"
    parser = build_parser(command)
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as e:  # argparse printed why (a missing --out, an unknown option...)
        pytest.fail(f"{page}: `{line}` does not parse (exit {e.code})")
    assert all("=" in a and not a.startswith("-") for a in extra), (page, line, extra)
    assert hasattr(args, "func"), (page, line)
    config = getattr(args, "config", None)
    if isinstance(config, str) and config.endswith(".yaml"):  # the preset and its overrides
        from coderl.config import load_config, load_online_config

        assert (ROOT / config).is_file(), f"{page}: `{line}`: no {config}"
        load = load_online_config if command in ("online", "serve") else load_config
        load(ROOT / config, [*(getattr(args, "overrides", None) or []), *extra])


def _parsers(parser: argparse.ArgumentParser, path: list[str]):
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, [*path, name])


def test_help_has_a_line_and_the_default_for_every_argument(capsys):
    for path, parser in _parsers(build_parser("*"), ["coderl"]):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            assert action.help, f"{path}: {action.dest} has no help line"
        text = "".join(parser.format_help().split())  # long defaults wrap, even at a hyphen
        for action in parser._actions:
            default = action.default
            flag = action.nargs == 0  # --no-report: its default is the flag's absence
            if (
                action.option_strings
                and not flag
                and default not in (None, False, argparse.SUPPRESS)
            ):
                said = "default" in action.help or f"(default:{default})" in text
                assert said, f"{path} {action.dest}: {parser.format_help()}"
        assert "(default:None)" not in text, parser.format_help()
    with pytest.raises(SystemExit) as done:
        main(["eval", "--help"])
    assert done.value.code == 0 and "--episodes-out" in capsys.readouterr().out


def test_the_readme_tasks_import_line_runs_as_written(tmp_path, monkeypatch, capsys):
    """The line as written, with the environment it names looked up among stand-in builds
    (building toolz is minutes; tests/test_tasks_swebench.py builds a real one)."""
    from test_tasks_swebench import fake_env, make_repo

    import coderl.cli.tasks as tasks_cli

    line = next(c for p, c in COMMAND_LINES if p == "README.md" and " tasks import " in c)
    built = {"toolz==1.0.0": fake_env(make_repo(tmp_path / "repo"))}
    monkeypatch.setattr(tasks_cli, "_find_env", lambda ref: built[ref])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "instances.jsonl").write_text(json.dumps(instance()) + "\n")
    assert main(shlex.split(line)[1:]) == 0, capsys.readouterr().err
    out = tmp_path / shlex.split(line)[shlex.split(line).index("--out") + 1]
    assert json.loads(out.read_text().splitlines()[0])["id"] == "mini__mini-1"


def test_error_lines_name_the_sub_command(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert main(["tasks", "export", "no-such.jsonl", "--format", "sweb", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("coderl tasks export: error:")
