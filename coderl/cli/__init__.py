"""The ``coderl`` command line: one sub-command per module, listed once in ``COMMANDS``.

Only the module of the command being run is imported: ``coderl --help`` and ``--version`` load
no torch (the other commands appear in the help as their one-line descriptions).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import select
import signal
import sys
import threading
import warnings
from typing import Any, NoReturn, TextIO

from coderl import __version__

# sub-command name -> (module that defines ``register(subparsers)``, its one-line help);
# the only dispatch point.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("coderl.cli.demo", "run the main job on the embedded default"),
    "train": ("coderl.cli.train", "RL training: rollouts, grading, rewards, updates"),
    "sft": ("coderl.cli.sft", "supervised warm start on oracle episodes (training split)"),
    "warm-start": ("coderl.cli.warmstart", "build the SFT warm start's cache entry of a config"),
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


_RST_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_RST_LITERAL = re.compile(r"``([^`]+)``")


def plain_help(text: str) -> str:
    """``text`` without the reStructuredText markup that help texts taken from docstrings carry
    (````x```` -> ``x``, ``:func:`x``` -> ``x``): ``--help`` is read in a terminal."""
    return _RST_LITERAL.sub(r"\1", _RST_ROLE.sub(r"\1", text))


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after an option's help line, unless there is no default to show (None,
    False) or the help line already says it; help and descriptions as plain text
    (:func:`plain_help`)."""

    def _expand_help(self, action: argparse.Action) -> str:
        return plain_help(super()._expand_help(action))

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_help(text))

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        if action.option_strings and action.nargs == 0:  # a flag (--no-report): its default
            return text  # is the flag's absence, and "(default: True)" reads as the opposite
        return super()._get_help_string(action)


class HelpfulParser(argparse.ArgumentParser):
    """Every ``coderl`` parser and sub-parser: ``--help`` shows each option's default
    (:class:`DefaultsFormatter`); sub-parsers made from it are of this class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """argparse's error (exit status 2); a missing argument is said as one line naming it
        in capitals with its help text, under a one-line usage of the positional arguments
        (``--help`` has the full one)."""
        missing = message.removeprefix(REQUIRED)
        if missing == message:
            super().error(message)
        optional = {a.dest for a in self._actions if a.nargs == argparse.ZERO_OR_MORE}
        names = [n for n in missing.split(", ") if n not in optional]  # argparse lists a
        said = [  # positional nargs="*" as required when nothing was given; it is optional
            f"{name.upper()}: {plain_help(a.help or '')}"
            for a in self._actions
            if (name := a.metavar if isinstance(a.metavar, str) else a.dest) in names
        ]
        formatter = self._get_formatter()
        words = [
            formatter._format_args(a, a.dest.upper())
            for a in self._actions
            if not a.option_strings and a.help != argparse.SUPPRESS
        ]
        self.exit(
            2,
            f"usage: {self.prog} {' '.join(words)} [options]\n"
            f"{self.prog}: error: missing {'; '.join(said) or missing} (see {self.prog} --help)\n",
        )


REQUIRED = "the following arguments are required: "
"""How argparse begins the error of a missing argument (Python 3.10 to 3.13)."""


def build_parser(command: str | None = "*") -> argparse.ArgumentParser:
    """The parser with ``command``'s real sub-parser (``"*"``: every command's; None: none)
    and a help-only entry for each other command, whose module is not imported."""
    parser = HelpfulParser(
        prog="coderl",
        description="Reinforcement-learning post-training for LLM coding agents.",
    )
    parser.add_argument("--version", action="version", version=f"coderl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=HelpfulParser)
    for name, (module, help_) in COMMANDS.items():
        if command in ("*", name):
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=help_, add_help=False)
    return parser


def threads_option(p: argparse.ArgumentParser) -> None:
    """``--threads N`` on a command that runs torch and reads no config (``rm``, ``agent``,
    ``tasks build-env``): what the config's ``threads`` is to the others. :func:`main` applies
    it (:func:`coderl.policy.threads.use_threads`) before the command runs."""
    p.add_argument(
        "--threads",
        type=_at_least_one,
        metavar="N",
        help="torch's intra-op threads in this process, as the config key `threads` (default: "
        "torch's, one per core or OMP_NUM_THREADS); keep processes x threads <= cores",
    )


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {n})")
    return n


def command_of(argv: list[str]) -> str | None:
    """The sub-command ``argv`` names (its first word that is not an option), or None."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def command_line(args: argparse.Namespace) -> str:
    """``coderl COMMAND [ACTION]`` of a parsed command line, as error lines name it
    (``coderl online report``, not ``coderl online``): every ``*_command`` sub-parser dest."""
    words = [args.command]
    words += [v for k, v in vars(args).items() if k.endswith("_command") and isinstance(v, str)]
    return " ".join(["coderl", *words])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_libraries(command=command_of(argv))  # before a module imports tqdm (reads TQDM_*)
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
    if getattr(args, "threads", None) is not None:  # threads_option: before torch is used
        from coderl.policy.threads import use_threads

        use_threads(args.threads)
    terminated, previous = _signals_as_interrupt()
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away shows here, not as a traceback at exit
        return 143 if terminated and code == 130 else code
    except BrokenPipeError:  # `coderl eval ... | head`: the reader has what it wanted
        if not reader_gone():
            raise  # another pipe (a sandbox's, a server's) broke: a failure, said in full
        return stdout_closed()
    except USER_ERRORS as err:
        if os.environ.get("CODERL_TRACEBACK"):
            raise
        print(f"{command_line(args)}: error: {error_line(err)}", file=sys.stderr)
        print("(set CODERL_TRACEBACK=1 for the full traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the training commands say where they stopped themselves
        print(f"{command_line(args)}: interrupted", file=sys.stderr)
        return 143 if terminated else 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


STDOUT_CLOSED = 141
"""The exit status of a command whose reader closed its standard output: 128 + SIGPIPE, what a
shell reports for a program the signal stopped (``cat big | head``)."""


def reader_gone() -> bool:
    """Whether standard output is a pipe or socket whose reader has closed it (``poll`` reports
    an error or hang-up on it); False where it has no file descriptor."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


def stdout_closed() -> int:
    """What a command ends with when its standard output was closed (a pipe to ``head``): the
    rest of its output goes to ``/dev/null`` (Python's recipe in the ``signal`` module's docs:
    so the flush at exit does not raise again), no traceback; returns :data:`STDOUT_CLOSED`."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return STDOUT_CLOSED


def error_line(err: BaseException) -> str:
    """The one line a user error prints: an ``OSError`` raised by the OS (``[Errno 2] No such
    file or directory: 'x'``) as ``x: does not exist`` / ``x: <its strerror>``; else ``str``."""
    if isinstance(err, OSError) and err.errno is not None and err.filename is not None:
        said = "does not exist" if isinstance(err, FileNotFoundError) else err.strerror.lower()
        return f"{err.filename}: {said}"
    return str(err)


LIBRARY_NOISE: tuple[tuple[type[Warning], str], ...] = (
    # peft's get_peft_model reads transformers' deprecated alias of is_activation_checkpointing
    # (peft 0.21, transformers 5.2x): once per command that builds a LoRA model
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
)
"""(category, message regex) of the library warnings a command keeps out of what it prints:
each one a library raises about its own use of another, which the user cannot act on."""


WEIGHT_IO_COMMANDS = frozenset({"export", "online", "serve"})
"""Commands whose weight loading and writing is a phase of their own output: transformers'
per-file bars ("Loading weights", "Writing model shards") are off on a terminal too."""


def quiet_libraries(stream: TextIO | None = None, command: str | None = None) -> None:
    """Keep library noise out of what a command prints: the warnings of :data:`LIBRARY_NOISE`
    are ignored (unless ``-W`` / ``PYTHONWARNINGS`` says otherwise; every other warning is
    shown as Python shows it), and when ``stream`` (default stderr) is not a terminal, tqdm
    bars (Hugging Face downloads, GGUF conversion, weight loading) are off, so a log file holds
    no carriage-return redraws; for a ``command`` of :data:`WEIGHT_IO_COMMANDS`, transformers'
    weight-loading bars are off on a terminal too; an environment variable already set wins. Call it before the
    libraries are imported (tqdm reads ``TQDM_*`` then). A ``torchrun`` rank other than 0 also
    silences library logging below errors (rank 0 speaks for the run)."""
    if not sys.warnoptions:
        for category, message in LIBRARY_NOISE:
            warnings.filterwarnings("ignore", message=message, category=category)
    if not (stream or sys.stderr).isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
    if command in WEIGHT_IO_COMMANDS:  # transformers reads it at import (utils.logging)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "transformers" in sys.modules:  # imported already (a test, a library caller)
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
    if int(os.environ.get("RANK", "0") or 0) > 0:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        logging.getLogger().setLevel(logging.ERROR)


def _signals_as_interrupt() -> tuple[list[int], dict[int, Any]]:
    """Make SIGINT and SIGTERM (Ctrl-C, ``kill``, a scheduler's preemption, ``timeout``) stop a
    command as Ctrl-C does: a ``KeyboardInterrupt`` in the main thread, so the training
    commands print their last checkpoint and resume command.

    SIGINT is set even where the command inherited it ignored: a shell without job control
    (a script's ``coderl train ... &``, ``make demo &``) starts background commands so, and
    Python then leaves it ignored, so ``kill -INT`` and Ctrl-C did nothing at all.

    Returns a list that holds the signal number once SIGTERM has arrived (empty before), and
    the handlers to put back (none outside the main thread, where nothing is installed)."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        return got, {}

    def interrupt(signum: int, frame: object) -> None:
        got.append(signum)
        raise KeyboardInterrupt

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, interrupt),
    }
    return got, {n: signal.SIG_DFL if h is None else h for n, h in previous.items()}


if __name__ == "__main__":
    sys.exit(main())
