"""The ``coderl`` command line: one sub-command per module, listed once in ``COMMANDS``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from coderl import __version__

# sub-command name -> module that defines ``register(subparsers)``; the only dispatch point.
COMMANDS: dict[str, str] = {
    "demo": "coderl.demo",
    "train": "coderl.train.cli",
    "sft": "coderl.train.sft",
    "eval": "coderl.eval.cli",
    "report": "coderl.eval.report",
    "tasks": "coderl.tasks.cli",
    "serve": "coderl.online.cli_serve",
    "online": "coderl.online.cli",
    "train-async": "coderl.asyncrl.cli",
    "agent": "coderl.agent.cli",
    "rm": "coderl.graders.rm_cli",
    "graders": "coderl.graders.cli",
}


# Bad input from the user (configs, files, run directories, task specs): one line, no traceback.
# ConfigError and TaskFileError are ValueErrors.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coderl",
        description="Reinforcement-learning post-training for LLM coding agents.",
    )
    parser.add_argument("--version", action="version", version=f"coderl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(COMMANDS[name]).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse fills a `nargs="*"` positional before the options that follow it, so in
        # `coderl eval RUN --base k=4` the `k=4` is left over; key=value overrides may come
        # anywhere on the line, anything else left over is an error as before.
        overrides = getattr(args, "overrides", None)
        if isinstance(overrides, list) and all("=" in a and not a.startswith("-") for a in extra):
            overrides += extra
        else:
            parser.error(
                f"unrecognized arguments: {' '.join(extra)} (see coderl {args.command} --help)"
            )
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as err:
        if os.environ.get("CODERL_TRACEBACK"):
            raise
        print(f"coderl {args.command}: error: {err}", file=sys.stderr)
        print("(set CODERL_TRACEBACK=1 for the full traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
