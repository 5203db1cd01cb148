"""``coderl rm mine``: preference pairs from graded episodes, with the task split kept.

A pair is two episodes of the same task with different outcomes: the resolved one is chosen,
the unresolved one rejected (:func:`coderl.graders.pairs.pairs_from_outcomes`; ties, i.e. two
resolved or two unresolved episodes, make no pair). Every pair carries its task's split, so
``coderl rm train`` trains on ``train`` pairs only and measures on ``heldout`` pairs
(:func:`coderl.graders.rm.split_pairs`): a pair from a held-out task never reaches training.

The split of a task (:func:`task_split`): the episode row's own ``split`` when it has one;
HumanEval ids (``HumanEval/N``) by :func:`coderl.tasks.humaneval.split_of`; a repository task
(``NAME-VERSION/...`` or ``NAME/...``) by its pin in ``data/repos.txt``; anything else is
``heldout``: a task whose split is unknown never trains the reward model (fail closed).

Sources: each argument is an episodes JSONL file (``coderl eval --episodes-out FILE``) or a run
directory, whose ``episodes*.jsonl`` files are read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from coderl.graders.pairs import PreferencePair, pairs_from_outcomes, read_episodes


def _repo_splits() -> dict[str, str]:
    from coderl.tasks.repos import read_repos

    try:
        pins = read_repos()
    except FileNotFoundError:
        return {}
    out = {}
    for p in pins:
        out[p.name] = out[f"{p.name}-{p.version}"] = p.split
    return out


def task_split(task_id: str, given: str | None = None) -> str:
    """``train`` or ``heldout`` for a task id (module docstring)."""
    if given in ("train", "heldout"):
        return given
    if task_id.startswith("HumanEval/"):
        from coderl.tasks.humaneval import split_of

        return split_of(task_id)
    return _repo_splits().get(task_id.split("/")[0], "heldout")


def episode_files(sources: Sequence[str | Path]) -> list[Path]:
    """The episodes JSONL files of ``sources`` (files as given, run dirs' ``episodes*.jsonl``).

    Raises:
        FileNotFoundError: a source that does not exist, or a run dir without episodes files.
    """
    out: list[Path] = []
    for s in map(Path, sources):
        if s.is_dir():
            found = sorted(s.glob("episodes*.jsonl"))
            if not found:
                raise FileNotFoundError(
                    f"{s}: no episodes*.jsonl (write one with `coderl eval CKPT "
                    f"--episodes-out {s}/episodes.jsonl`)"
                )
            out += found
        elif s.is_file():
            out.append(s)
        else:
            raise FileNotFoundError(f"{s} does not exist")
    return out


def mine_pairs(sources: Sequence[str | Path], *, max_per_task: int = 16) -> list[PreferencePair]:
    """Resolved-over-unresolved pairs of every task in ``sources``, each with its split."""
    views, resolved, given = [], [], {}
    for f in episode_files(sources):
        v, r = read_episodes(f)
        views += v
        resolved += r
        for line in f.read_text().splitlines():
            if line.strip() and "split" in (row := json.loads(line)):
                given[str(row["task_id"])] = str(row["split"])
    pairs = pairs_from_outcomes(views, resolved, max_per_context=max_per_task)
    return [
        PreferencePair(
            p.context_id, p.chosen, p.rejected, task_split(p.context_id, given.get(p.context_id))
        )
        for p in pairs
    ]


def write_pairs(path: str | Path, pairs: Sequence[PreferencePair]) -> None:
    """Pairs as the JSONL :func:`coderl.graders.pairs.pairs_from_jsonl` reads (``split`` kept)."""
    with Path(path).open("w") as f:
        for p in pairs:
            row = {"id": p.context_id, "chosen": p.chosen, "rejected": p.rejected, "split": p.split}
            f.write(json.dumps(row) + "\n")
