"""Problem statements written from failing test output, never from the patch, never from a
held-out test.

The statement names the *visible* failing tests (those in the rollout workspace) and quotes, for
each of the first few, the test's own frame (the test code up to the failing line) and the final
error lines (``E ...``). Frames inside the library are left out: they would point at the mutated
line, which is the answer, not the problem.

Held-out failing tests (``coderl.tasks.holdout``) are never named and their code is never quoted.
When no visible failing test has output to show (every FAIL_TO_PASS function is held out, or the
visible ones' output is unknown), the statement describes the failure through the held-out tests'
*symptoms*: their final ``E`` lines (exception type, message, value diff), less pytest's
assertion introspection (``where``/``and`` lines spell out the test's expressions) and less any
line that quotes the held-out test's code. :func:`held_out_mentions` finds what a statement would
reveal; ``coderl tasks synth`` refuses a statement it flags.

Shown on purpose: the values in a held-out test's exception message (``'rg' != 'org'``); they
are the failing behaviour. A fix that special-cases exactly those values is not detected here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from coderl.tasks.holdout import function_of

_FRAME_SEP = re.compile(r"^(_ )+_?\s*$")
_INTROSPECTION = re.compile(r"^E\s+(\+\s+(where|and)\b|where\b)")
_BLOCK = re.compile(r"^Output of (?P<id>[^\n]+):\n```\n(?P<body>.*?)\n```$", re.M | re.S)
_SYMPTOMS = re.compile(
    r"^The failing tests report:\n(?P<blocks>(?:```\n.*?\n```\n?)+)", re.M | re.S
)
STATEMENT_HEADER = re.compile(
    r"^A change introduced a bug into (?P<repo>.+?): tests that used to pass"
)
"""The first line :func:`write_statement` writes (``repo`` is the repository's name and version)."""
MIN_BODY_LINE = 12
"""Stripped held-out source lines shorter than this (``)``, ``else:``, ``assert x``) are too
common to count as quoting the test."""


def abridge(longrepr: str, *, max_lines: int = 25) -> str:
    """The test's frame and the last frame's ``E`` lines from a pytest long report."""
    lines = longrepr.splitlines()
    frames: list[list[str]] = [[]]
    for line in lines:
        if _FRAME_SEP.match(line):
            frames.append([])
        else:
            frames[-1].append(line)
    first = [ln for ln in frames[0] if ln.strip()]
    if len(frames) > 1:
        errors = [ln for ln in frames[-1] if ln.startswith("E ")]
        first = [ln for ln in first if not ln.startswith("E ")] + errors
    if len(first) > max_lines + 1:  # (an abridged report abridges to itself)
        first = first[: max_lines // 2] + ["    ..."] + first[-(max_lines - max_lines // 2) :]
    return "\n".join(first)


def _names(held_out: Iterable[str]) -> set[str]:
    """Every way a statement could name a held-out test: the id, ``path::[Class::]name`` and
    the bare function name."""
    out: set[str] = set()
    for node_id in held_out:
        out.add(node_id)
        key = function_of(node_id)
        if key is not None:
            out |= {key, key.split("::", 1)[1], key.rsplit("::", 1)[-1]}
    return out


def _distinctive(source_lines: Iterable[str]) -> set[str]:
    return {s for s in (ln.strip() for ln in source_lines) if len(s) >= MIN_BODY_LINE}


def held_out_mentions(
    statement: str, held_out: Iterable[str], source_lines: Iterable[str] = ()
) -> list[str]:
    """What ``statement`` reveals of the held-out tests: each held-out id, test key or function
    name it contains as a whole word, and each distinctive line of ``source_lines`` (the
    held-out test functions' code: :func:`coderl.tasks.holdout.held_out_source`) it contains.
    Empty when it reveals nothing."""
    names = sorted(n for n in _names(held_out) if n in statement)  # substring first: fast
    found = [n for n in names if re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", statement)]
    return found + sorted(s for s in _distinctive(source_lines) if s in statement)


def _name_pattern(held_out: Iterable[str]) -> re.Pattern[str] | None:
    names = sorted(_names(held_out), key=len, reverse=True)
    if not names:
        return None
    return re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")(?![\w])")


def symptoms(
    longrepr: str, source_lines: Iterable[str] = (), held_out: Iterable[str] = ()
) -> list[str]:
    """A held-out test's failure as it may be shown: the last frame's ``E`` lines without the
    ``E`` prefix, less assertion introspection, less lines quoting ``source_lines`` (the
    test's code, plus the code lines of the report's own first frame), with the names of the
    ``held_out`` tests (a local class's qualified name, say) replaced by ``<test>``."""
    names = _name_pattern(held_out)
    frames: list[list[str]] = [[]]
    for line in longrepr.splitlines():
        if _FRAME_SEP.match(line):
            frames.append([])
        else:
            frames[-1].append(line)
    code = [ln for ln in frames[0] if not ln.startswith("E ")]
    secret = _distinctive([*source_lines, *(ln.lstrip("> ") for ln in code)])
    out = []
    for line in frames[-1]:
        if not line.startswith("E ") or _INTROSPECTION.match(line):
            continue
        text = line[1:].strip()
        if text and not any(
            s in text or (len(text) >= MIN_BODY_LINE and text in s) for s in secret
        ):
            out.append(names.sub("<test>", text) if names else text)
    return out


def write_statement(
    repo: str,
    failing: dict[str, str],
    *,
    held_out: dict[str, str] | None = None,
    held_out_source: Iterable[str] = (),
    max_tests: int = 3,
) -> str:
    """A bug report for ``repo`` from visible failing test ids -> pytest long reports (``""``
    when unknown) and held-out failing test ids -> long reports, never naming or quoting the
    latter (their failure shows only through :func:`symptoms` when no visible output exists).

    Raises:
        ValueError: no failing test at all (a task needs at least one FAIL_TO_PASS test).
    """
    held_out = held_out or {}
    if not failing and not held_out:
        raise ValueError("a problem statement needs at least one failing test")
    source = list(held_out_source)
    ids = sorted(failing)
    parts = [f"A change introduced a bug into {repo}: tests that used to pass now fail."]
    if ids:
        parts += [
            "",
            f"Failing tests ({len(ids)}):",
            *(f"- {t}" for t in ids[:20]),
            *([f"- ... and {len(ids) - 20} more"] if len(ids) > 20 else []),
        ]
    if held_out:
        parts += [
            "",
            f"{len(held_out)} more failing test(s) are held out: they are not in your workspace "
            "and run only at grading.",
        ]
    shown = [
        t
        for t in ids
        if failing[t].strip() and not held_out_mentions(abridge(failing[t]), held_out, source)
    ][:max_tests]
    for test_id in shown:
        parts += ["", f"Output of {test_id}:", "```", abridge(failing[test_id]), "```"]
    if not shown:
        blocks = list(
            dict.fromkeys(
                "\n".join(symptoms(r, source, held_out))
                for _, r in [*sorted(failing.items()), *sorted(held_out.items())]
            )
        )
        blocks = [b for b in blocks if b][:max_tests]
        if blocks:
            parts += ["", "The failing tests report:"]
            for block in blocks:
                parts += ["```", block, "```"]
        if not ids:
            parts += [
                "",
                "The tests in your workspace may all pass: reproduce the failure with your own "
                "code before fixing it.",
            ]
    parts += [
        "",
        "Fix the library code so that the failing tests pass again without breaking any other "
        "test. Do not modify the tests or the test configuration.",
    ]
    return "\n".join(parts)


def quoted_outputs(statement: str) -> dict[str, str]:
    """Test id -> the abridged output a :func:`write_statement` statement quotes for it
    (``Output of <id>:`` blocks)."""
    return {m["id"]: m["body"] for m in _BLOCK.finditer(statement)}


def symptom_blocks(statement: str) -> list[str]:
    """The blocks a :func:`write_statement` statement shows under ``The failing tests report:``
    (the symptoms, when no visible test's output is quoted); empty when it shows none."""
    m = _SYMPTOMS.search(statement)
    if m is None:
        return []
    return re.findall(r"```\n(.*?)\n```", m["blocks"], re.S)
