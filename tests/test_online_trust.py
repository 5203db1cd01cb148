"""Online rewards trust nothing the client can fake (issue 47, class 5): what a turn did decides
whether it is an edit, and the gate judges a candidate against the best champion the track has
had as well as the current one, so small losses cannot compound. (Server clocks for the join
windows and episode ids scoped to populations: ``tests/test_online_rewards.py``.)"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from coderl.config.online import SHARED, GateConfig
from coderl.online.cycle import best_earlier, record_means
from coderl.online.gate import run_gate
from coderl.online.heldout import EvalResult
from coderl.online.registry import Registry
from coderl.online.server import classify


def _call(name: str, **args: object) -> dict:
    return {"function": {"name": name, "arguments": json.dumps(args)}}


NOT_EDITS = {
    "an empty fence": ("Done.\n```\n```", [], "none"),
    "a fence with a language tag only": ("Here:\n```python\n```", [], "none"),
    "a blank fence": ("```\n   \n\t\n```\nthat is all", [], "none"),
    "a fence of comments only": ("```python\n# TODO: fix it\n    # later\n```", [], "none"),
    "a fence of C comments only": ("```c\n// nothing\n/* here */\n```", [], "none"),
    "an edit call with empty content": ("", [_call("write_file", path="", content="")], "valid"),
    "an edit call with blank content": ("", [_call("edit", path=" ", content="\n \n")], "valid"),
    "an edit call with no arguments": ("", [_call("apply_patch")], "valid"),
    "an invalid edit call": ("", [_call("write_file", path="a.py", content="x = 1")], "invalid"),
    "a fence of pass": ("Fixed:\n```python\npass\n```", [], "none"),
    "a fence of an ellipsis and a docstring": ('```python\n"""the fix"""\n...\n```', [], "none"),
    "a fence of one word": ("```\nDone\n```", [], "none"),
    "a write of empty content to a path": (
        "",
        [_call("write_file", path="a.py", content="")],
        "valid",
    ),
    "a write of pass": ("", [_call("create_file", file_path="a.py", content="pass\n")], "valid"),
    "a replacement by the same text": (
        "",
        [_call("str_replace", path="a.py", old_str="x = 1", new_str="x = 1")],
        "valid",
    ),
}
EDITS = {
    "a fence with code": ("```python\ndef f():\n    return 1\n```", [], "none"),
    "code after a comment": ("```python\n# fixed\nx = 2\n```", [], "none"),
    "an edit call that writes": (
        "",
        [_call("write_file", path="a.py", content="x = 1\n")],
        "valid",
    ),
    "a patch call": ("", [_call("apply_patch", patch="--- a/x\n+++ b/x\n")], "valid"),
    "a replacement by other code": (
        "",
        [_call("str_replace", path="a.py", old_str="x = 1", new_str="x = 2")],
        "valid",
    ),
    "a fence in another language": ("```js\nconst x = f(1);\n```", [], "none"),
}


@pytest.mark.parametrize("name", sorted(NOT_EDITS))
def test_a_turn_that_changes_nothing_is_not_an_edit(name: str) -> None:
    text, calls, status = NOT_EDITS[name]
    assert classify(text, calls, status) != "edit", name


@pytest.mark.parametrize("name", sorted(EDITS))
def test_a_turn_that_writes_code_is_an_edit(name: str) -> None:
    assert classify(*EDITS[name]) == "edit", name


def test_an_empty_fence_after_a_question_is_still_a_deferral() -> None:
    assert classify("```\n```\nShould I change the loop?", [], "none") == "clarify"


# -- the gate -----------------------------------------------------------------------------------


@pytest.mark.parametrize("worse", [1, 2, 5])
def test_a_candidate_worse_somewhere_and_better_nowhere_is_rejected(worse: int) -> None:
    champ = [1.0] * 60 + [0.0] * 40
    cand = [0.0] * worse + champ[worse:]  # well inside the margin, but no gain anywhere
    rep = run_gate(GateConfig(margins={"pass@1": 0.2}), {"pass@1": (cand, champ)}, None, [])
    assert rep.comparisons[0].passed and not rep.promote
    assert any("better on none" in r for r in rep.reasons)
    fractional = ([0.5] + [0.75] * 9, [0.75] * 10)  # pass rates: one task lower, none higher
    rep = run_gate(GateConfig(margins={"pass@1": 0.5}), {"pass@1": fractional}, None, [])
    assert not rep.promote and any("better on none" in r for r in rep.reasons)


def _step(scores: list[float], rng: random.Random, lose: int, gain: int) -> list[float]:
    """A candidate that drops ``lose`` solved tasks and picks up ``gain`` unsolved ones."""
    out = list(scores)
    ones = [i for i, x in enumerate(out) if x == 1.0]
    zeros = [i for i, x in enumerate(out) if x == 0.0]
    for i in rng.sample(ones, lose):
        out[i] = 0.0
    for i in rng.sample(zeros, gain):
        out[i] = 1.0
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_small_losses_cannot_compound_over_promotions(tmp_path: Path, seed: int) -> None:
    """Each candidate loses 8 tasks and gains 4 of 400 (-0.01, inside a 0.05 margin of its
    parent, and better somewhere). Against the parent alone every one of ten is promoted (-0.1
    in all); against the best earlier champion as well, the served policy never falls more than
    one margin below the best it has been."""
    rng = random.Random(seed)
    cfg = GateConfig(margins={"pass@1": 0.05})
    start = [1.0] * 300 + [0.0] * 100
    scores = start
    promoted_without = 0
    for _ in range(10):  # without the best-champion check: every step passes
        cand = _step(scores, rng, 8, 4)
        if run_gate(cfg, {"pass@1": (cand, scores)}, None, []).promote:
            promoted_without += 1
            scores = cand
    assert promoted_without == 10 and sum(scores) / 400 <= 0.75 - 0.099

    reg = Registry(tmp_path / "reg")
    v0 = reg.new_version(parent=None)
    reg.init_champion(v0)
    held = {v0: start}
    record_means(reg, SHARED, {v0: EvalResult({"pass@1": start}, {}, [])})
    for _ in range(10):
        parent = reg.champion()
        assert parent is not None
        cand_scores = _step(held[parent], rng, 8, 4)
        v = reg.new_version(parent=parent)
        held[v] = cand_scores
        best_v = best_earlier(reg, SHARED, parent, ["pass@1"])
        best = None if best_v is None else {"pass@1": (cand_scores, held[best_v])}
        results = {v: EvalResult({"pass@1": cand_scores}, {}, [])}
        results |= {} if best_v is None else {best_v: EvalResult({"pass@1": held[best_v]}, {}, [])}
        record_means(reg, SHARED, results)
        rep = run_gate(cfg, {"pass@1": (cand_scores, held[parent])}, None, [], best=best)
        if rep.promote:
            reg.promote(v, rep.to_dict())
        else:
            reg.reject(v, rep.to_dict())
    served = held[reg.champion()]  # type: ignore[index]
    assert sum(served) / 400 > 0.75 - 0.05  # within one margin of the best (the first) champion
    assert reg.promoted()[0] == v0 and len(reg.promoted()) < 11  # some were stopped


def test_the_best_earlier_champion_is_found_and_unmeasured_ones_are_not_ruled_out(
    tmp_path: Path,
) -> None:
    reg = Registry(tmp_path / "reg")
    v0 = reg.new_version(parent=None)
    reg.init_champion(v0)
    v1 = reg.new_version(parent=v0)
    reg.promote(v1, {})
    v2 = reg.new_version(parent=v1)
    reg.promote(v2, {})
    assert best_earlier(reg, SHARED, v2, ["pass@1"]) in (v0, v1)  # never measured: not ruled out
    for v, mean in ((v0, 0.9), (v1, 0.7), (v2, 0.8)):
        record_means(reg, SHARED, {v: EvalResult({"pass@1": [mean, mean]}, {}, [])})
    assert best_earlier(reg, SHARED, v2, ["pass@1"]) == v0
    record_means(reg, SHARED, {v2: EvalResult({"pass@1": [0.95, 0.95]}, {}, [])})
    assert best_earlier(reg, SHARED, v2, ["pass@1"]) is None  # the current one is the best
    assert best_earlier(reg, "org-a", v2, ["pass@1"]) in (v0, v1)  # another suite: unmeasured
