"""Preference pairs for the reward model, from three sources, and the episodes JSONL format.

- :func:`pairs_from_jsonl`: labelled pairs, one JSON object a line:
  ``{"context": str, "chosen": str, "rejected": str}`` (``context`` optional, shared prefix;
  optional ``id`` names the context and ``split``, ``train`` or ``heldout``, places the pair).
- :func:`pairs_from_store`: the online store (:class:`coderl.online.store.Store`): for one
  context (identical prompt token ids), an interaction the user kept (``accepted``, or
  ``edit_persisted`` with fraction >= 0.5) over one the user discarded (``rejected``, or
  ``edit_persisted`` with fraction < 0.5, i.e. reverted). An interaction with both kinds of
  events is ambiguous and skipped. Token ids are the stored ones (the policy's tokenizer): the
  reward model must share it.
- :func:`pairs_from_outcomes`: verifiable outcomes: on the same task, a resolved episode over an
  unresolved one (distilling the tests into a grader of partial credit).

Episodes JSONL (what ``coderl rm train --episodes`` and ``coderl graders probe`` read): one
object a line with the fields of :class:`~coderl.graders.judge.EpisodeView` plus ``resolved``.
``coderl eval --episodes-out FILE`` writes it; ``coderl rm mine`` turns it into split-tagged
pairs (:mod:`coderl.graders.mine`). Pairs per context are capped (``max_per_context``) so one busy context cannot dominate.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coderl.graders.cache import input_hash
from coderl.graders.judge import EpisodeView


@dataclass(frozen=True)
class PreferencePair:
    """``chosen`` is preferred over ``rejected`` in the same context."""

    context_id: str
    """Pairs of one context share it; the held-out split never separates them."""
    chosen: str | tuple[int, ...]
    """Text (tokenized by the reward model) or exact token ids (prompt + completion)."""
    rejected: str | tuple[int, ...]
    split: str = ""
    """``train`` or ``heldout`` when the pair's task has a split (:mod:`coderl.graders.mine`);
    empty: :func:`coderl.graders.rm.split_pairs` splits by a hash of the context id."""


def pairs_from_jsonl(path: str | Path) -> list[PreferencePair]:
    """Labelled pairs from a JSONL file (see the module docstring).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not an object with string ``chosen`` and ``rejected``
            (names the line).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"pairs file {str(p)!r} does not exist")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not all(
            isinstance(row.get(k), str) for k in ("chosen", "rejected")
        ):
            raise ValueError(f"{p}:{n}: expected an object with string 'chosen' and 'rejected'")
        ctx = row.get("context", "")
        if not isinstance(ctx, str):
            raise ValueError(f"{p}:{n}: 'context' must be a string")
        cid = str(row.get("id", ctx or n))
        split = row.get("split", "")
        if split not in ("", "train", "heldout"):
            raise ValueError(f"{p}:{n}: split {split!r}; valid: 'train', 'heldout'")
        out.append(PreferencePair(cid, ctx + row["chosen"], ctx + row["rejected"], split))
    return out


def _label(events: list[dict[str, Any]]) -> int:
    """+1 kept, -1 discarded, 0 unknown or ambiguous."""
    pos = neg = False
    for e in events:
        if e["type"] == "accepted":
            pos = True
        elif e["type"] == "rejected":
            neg = True
        elif e["type"] == "edit_persisted":
            if float(e["payload"]["fraction"]) >= 0.5:
                pos = True
            else:
                neg = True
    return 0 if pos == neg else (1 if pos else -1)


def pairs_from_store(store: Any, *, max_per_context: int = 16) -> list[PreferencePair]:
    """Kept-over-discarded pairs of the same context from the online store."""
    rows = store.interactions()
    events = store.events_for([r["interaction_id"] for r in rows])
    by_ctx: dict[str, dict[int, list[tuple[int, ...]]]] = defaultdict(lambda: {1: [], -1: []})
    for r in rows:
        lab = _label(events.get(r["interaction_id"], []))
        if lab:
            ctx = json.dumps(r["prompt_token_ids"])
            seq = tuple(r["prompt_token_ids"]) + tuple(r["completion_token_ids"])
            by_ctx[ctx][lab].append(seq)
    out = []
    for ctx, groups in by_ctx.items():
        cid = f"store:{input_hash(ctx)[:16]}"
        for c, r in itertools.islice(itertools.product(groups[1], groups[-1]), max_per_context):
            out.append(PreferencePair(cid, c, r))
    return out


def render_episode(v: EpisodeView) -> str:
    """The text a reward model scores for an episode: the task, the diff and the tool log.

    Never the tests report (``v.tests_report``): it states the hidden tests' verdict
    ("resolved" / "not resolved"), which is the preference label of a mined pair, so a reward
    model trained on text that holds it learns to read the label instead of the code (and its
    held-out accuracy measures nothing)."""
    parts = [f"Task:\n{v.statement}", f"Diff:\n{v.diff or '(no change)'}"]
    if v.tool_log:
        parts.append(f"Tool calls:\n{v.tool_log}")
    return "\n\n".join(parts)


def pairs_from_outcomes(
    views: Sequence[EpisodeView], resolved: Sequence[bool], *, max_per_context: int = 16
) -> list[PreferencePair]:
    """Resolved-over-unresolved pairs of episodes of the same task.

    Raises:
        ValueError: ``views`` and ``resolved`` differ in length.
    """
    if len(views) != len(resolved):
        raise ValueError(f"{len(views)} episodes but {len(resolved)} outcomes")
    by_task: dict[str, dict[bool, list[str]]] = defaultdict(lambda: {True: [], False: []})
    for v, ok in zip(views, resolved, strict=True):
        by_task[v.task_id][bool(ok)].append(render_episode(v))
    out = []
    for task, g in by_task.items():
        for c, r in itertools.islice(itertools.product(g[True], g[False]), max_per_context):
            out.append(PreferencePair(task, c, r))
    return out


def read_episodes(path: str | Path) -> tuple[list[EpisodeView], list[bool]]:
    """Episodes and their ``resolved`` flags from an episodes JSONL file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line without ``task_id``, ``statement``, ``diff`` (names the line).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"episodes file {str(p)!r} does not exist")
    views, resolved = [], []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        try:
            views.append(
                EpisodeView(
                    str(row["task_id"]),
                    str(row["statement"]),
                    str(row["diff"]),
                    str(row.get("tool_log", "")),
                    str(row.get("tests_report", "")),
                )
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"{p}:{n}: not an episode ({err})") from None
        resolved.append(bool(row.get("resolved", False)))
    return views, resolved


def write_episodes(
    path: str | Path, views: Sequence[EpisodeView], resolved: Sequence[bool]
) -> None:
    """Write an episodes JSONL file (the format :func:`read_episodes` reads)."""
    with Path(path).open("w") as f:
        for v, ok in zip(views, resolved, strict=True):
            f.write(json.dumps({**asdict(v), "resolved": bool(ok)}) + "\n")
