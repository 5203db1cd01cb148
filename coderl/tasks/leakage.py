"""No held-out code in a training task: the function-repair leakage checks, by provenance and by
content.

- **Provenance** (:func:`provenance_leaks`): a training task says it is ``train``, names a seed
  that is a training seed (:func:`coderl.synth.fnrepair.training_seeds`: HumanEval's training
  split, the training libraries of ``data/repos.txt``), and its ``source`` is that seed's
  source, whose split is ``train`` (HumanEval's fixed split, the library's line of
  ``data/repos.txt``).
- **Content** (:func:`content_leaks`): no held-out function's code is in any text of a training
  task (statement, files, gold file, gold patch, hidden test) or of a training seed, whatever
  the metadata says. Two measures: the *normalised body* (``ast.dump`` of the function's body
  without its docstring: formatting, comments and the function's own name do not count) equal
  to a function's in the text, and *token shingles* (Broder 1997, "On the resemblance and
  containment of documents", section 2: the containment of the held-out function's set of
  ``SHINGLE_TOKENS``-token windows in the text's), at least ``CONTAINMENT``. Shingles catch a
  held-out function shown with a bug injected (a mutant changes one or two tokens, and with
  them at most ``2 * SHINGLE_TOKENS`` of its windows) or inside a markdown statement.

Held-out functions are every top-level function of a held-out seed (HumanEval's held-out
problems, prompt and canonical solution; the seeds of held-out libraries). The kept-back set is
checked the same way: ``heldout_functions(seeds, split="outside")`` fingerprints the seeds of the
kept-back libraries (``data/fnrepair/outside-seeds.jsonl.gz``), and none may be in a training task
or seed either. Limits: a held-out
library without seeds (idna and python-slugify have none) is covered by provenance only, since
its code is not in the checkout; renamed identifiers throughout a copied function defeat both
content measures; held-out *tests* are not fingerprinted (HumanEval's checks share boilerplate
lines across the split).
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from coderl.tasks.fnseeds import Seed
from coderl.tasks.humaneval import SOURCE as HUMANEVAL_SOURCE
from coderl.tasks.humaneval import split_of
from coderl.tasks.repos import RepoPin
from coderl.tasks.spec import Task

SHINGLE_TOKENS = 10
"""Tokens per shingle: long enough that common idioms (``for i in range(len(x)):``) are not
one, short enough that a one-token mutation leaves most windows whole."""
CONTAINMENT = 0.5
"""Share of a held-out function's shingles found in a text that counts as a copy."""
_TOKEN = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class Leak:
    """A training task (or seed) that holds held-out material, and why."""

    task_id: str
    heldout_id: str
    """The held-out seed (``seed_id``) or ``seed_id:function`` found."""
    why: str


def shingles(text: str, width: int = SHINGLE_TOKENS) -> set[bytes]:
    """The set of ``width``-token windows of ``text`` (tokens: words and single punctuation
    marks, whitespace ignored, ``"`` read as ``'``), each as an 8-byte digest."""
    toks = _TOKEN.findall(text.replace('"', "'"))
    return {
        hashlib.blake2b("\0".join(toks[i : i + width]).encode(), digest_size=8).digest()
        for i in range(max(len(toks) - width + 1, 0))
    }


def _functions(code: str) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    return [
        (n.name, n)
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def normalised_body(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``ast.dump`` of a function's body without its docstring: what stays when formatting,
    comments, the docstring and the function's name change."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return "\n".join(ast.dump(stmt) for stmt in body)


@dataclass(frozen=True)
class HeldoutFunction:
    """One top-level function of a held-out seed, fingerprinted."""

    id: str
    """``seed_id:function``."""
    body: str
    """:func:`normalised_body`."""
    shingles: frozenset[bytes]


def heldout_functions(seeds: Iterable[Seed], split: str = "heldout") -> list[HeldoutFunction]:
    """Fingerprints of every top-level function of the seeds of ``split`` (``heldout``, or
    ``outside``: the kept-back libraries) among ``seeds``."""
    out = []
    for seed in seeds:
        if seed.split != split:
            continue
        for name, fn in _functions(seed.code):
            if fn.col_offset == 0:
                source = ast.get_source_segment(seed.code, fn) or ""
                out.append(
                    HeldoutFunction(
                        f"{seed.id}:{name}", normalised_body(fn), frozenset(shingles(source))
                    )
                )
    return out


def task_texts(task: Task) -> list[str]:
    """Every text of a task the policy or its grader sees: statement, workspace files, hidden
    tests, gold patch, and the gold file of a repair task."""
    gold = (task.extra or {}).get("gold_file")
    return [
        task.problem_statement,
        *task.workspace_files.values(),
        *task.hidden_tests.values(),
        task.gold_patch,
        *([gold] if isinstance(gold, str) else []),
    ]


def content_leaks(owner: str, texts: Iterable[str], heldout: list[HeldoutFunction]) -> list[Leak]:
    """The held-out functions found in ``texts`` (of task or seed ``owner``): by normalised
    body, or by shingle containment of at least ``CONTAINMENT`` in one text."""
    leaks = []
    for text in texts:
        bodies = {normalised_body(fn) for _, fn in _functions(text)} - {""}
        grams = shingles(text)
        for h in heldout:
            share = len(h.shingles & grams) / max(len(h.shingles), 1)
            if h.body and h.body in bodies:
                leaks.append(Leak(owner, h.id, "its normalised body is a function of the text"))
            elif share >= CONTAINMENT:
                leaks.append(Leak(owner, h.id, f"{share:.0%} of its token shingles are in a text"))
    return sorted(set(leaks), key=lambda x: (x.task_id, x.heldout_id))


def source_split(source: str, seed_id: str, pins: dict[str, RepoPin]) -> str | None:
    """The split that a seed's provenance puts it in: HumanEval's fixed split for HumanEval
    seeds, the library's line of ``data/repos.txt`` for ``pypi:NAME==VERSION``; None for a
    source that is neither (an unpinned library)."""
    if source == HUMANEVAL_SOURCE:
        return split_of(seed_id)
    pin = pins.get(source.removeprefix("pypi:").split("==")[0])
    return pin.split if pin is not None and source == f"pypi:{pin.spec}" else None


def provenance_leaks(
    tasks: Iterable[Task], training: dict[str, Seed], pins: dict[str, RepoPin]
) -> list[Leak]:
    """The training tasks among ``tasks`` whose provenance is not training-only: the seed they
    name is not in ``training`` (seed id -> training seed), their ``source`` is not that seed's,
    or that source's split is not ``train``."""
    leaks = []
    for task in tasks:
        if task.split != "train":
            continue
        seed_id = str(((task.extra or {}).get("fnrepair") or {}).get("seed", ""))
        seed = training.get(seed_id)
        if seed is None:
            leaks.append(Leak(task.id, seed_id, "its seed is not a training seed"))
        elif task.source != seed.source:
            leaks.append(Leak(task.id, seed_id, f"source {task.source!r} is not its seed's"))
        elif source_split(task.source, seed_id, pins) != "train":
            leaks.append(Leak(task.id, seed_id, f"source {task.source!r} is not a training one"))
    return leaks
