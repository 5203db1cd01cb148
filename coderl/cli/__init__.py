"""The ``coderl`` command line: one sub-command per module, listed once in ``COMMANDS``.

Only the module of the command being run is imported: ``coderl --help`` and ``--version`` load
no torch (the other commands appear in the help as their one-line descriptions).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from coderl import __version__

# sub-command name -> (module that defines ``register(subparsers)``, its one-line help);
# the only dispatch point.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("coderl.cli.demo", "run the main job on the embedded default"),
    "train": ("coderl.cli.train", "RL training: rollouts, grading, rewards, updates"),
    "sft": ("coderl.cli.sft", "supervised warm start on oracle episodes (training split)"),
    "eval": ("coderl.cli.eval", "pass@k and best-of-n of a checkpoint on a task split"),
    "export": ("coderl.cli.export", "a run's weights as Hugging Face / peft directories"),
    "report": ("coderl.cli.report", "PNG plots and an HTML page for a training run"),
    "tasks": ("coderl.cli.tasks", "tasks from real repositories, HumanEval, grading"),
    "serve": ("coderl.cli.serve", "OpenAI-compatible endpoint that records interactions"),
    "online": ("coderl.cli.online", "real-time RL from production interactions"),
    "train-async": (
        "coderl.cli.train_async",
        "train with rollout workers decoupled from the trainer",
    ),
    "agent": ("coderl.cli.agent", "run agent episodes on a directory in sandboxes"),
    "rm": ("coderl.cli.rm", "train / evaluate a reward model from preferences"),
    "graders": ("coderl.cli.graders", "learned graders: gameability probes"),
}


# Bad input from the user (configs, files, run directories, task specs): one line, no traceback.
# ConfigError and TaskFileError are ValueErrors.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError)


def build_parser(command: str | None = "*") -> argparse.ArgumentParser:
    """The parser with ``command``'s real sub-parser (``"*"``: every command's; None: none)
    and a help-only entry for each other command, whose module is not imported."""
    parser = argparse.ArgumentParser(
        prog="coderl",
        description="Reinforcement-learning post-training for LLM coding agents.",
    )
    parser.add_argument("--version", action="version", version=f"coderl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        if command in ("*", name):
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=help_, add_help=False)
    return parser


def command_of(argv: list[str]) -> str | None:
    """The sub-command ``argv`` names (its first word that is not an option), or None."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(command_of(argv))
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
    except KeyboardInterrupt:  # the training commands say where they stopped themselves
        print(f"coderl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
