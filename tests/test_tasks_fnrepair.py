"""Function-scope repair tasks: cut-out seeds, injected bugs, knobs, validation in sandboxes, the
shipped file's split (no held-out code in any training task) and the environment."""

from __future__ import annotations

import os
import random
import shutil

import pytest

from coderl.config import load_config
from coderl.grading.grade import grade
from coderl.synth.fnrepair import (
    KINDS,
    OUTSIDE_FILE,
    Knobs,
    helpers_of,
    inject,
    knobs_at,
    level_of,
    make_task,
    make_task_at,
    render_symptom,
    repair_tasks,
    statement,
    symptom,
    validate,
)
from coderl.tasks.fnseeds import (
    LIBRARIES,
    OUTSIDE_LIBRARIES,
    OUTSIDE_SEEDS_FILE,
    Seed,
    check_source,
    humaneval_seeds,
    load_seeds,
    outside_pins,
    standalone,
)
from coderl.tasks.patches import make_diff
from coderl.tasks.repos import pinned
from coderl.train.sft import oracle_message, without_docstrings

needs_sandbox = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)

MODULE = """import re
from collections import OrderedDict
import numpy as np

_SEP = "-"
_UNUSED = 3


def _clean(word):
    return re.sub(r"\\s+", _SEP, word.strip())


def slug(word, lower=True):
    out = _clean(word)
    if lower:
        return out.lower()
    return out


def uses_numpy(x):
    return np.asarray(x)
"""

SEED = Seed(
    id="toy:slug",
    split="train",
    source="pypi:toy==1.0",
    license="MIT",
    entry_point="slug",
    code=standalone(MODULE, "slug") or "",
    test=check_source([(("A b",), {}, "a-b"), (("A  b",), {"lower": False}, "A-b")]),
)


def test_standalone_keeps_what_the_function_needs_in_file_order():
    assert SEED.code == (
        'import re\n\n\n_SEP = "-"\n\n\ndef _clean(word):\n'
        '    return re.sub(r"\\s+", _SEP, word.strip())\n\n\n'
        "def slug(word, lower=True):\n    out = _clean(word)\n    if lower:\n"
        "        return out.lower()\n    return out\n"
    )
    assert standalone(MODULE, "uses_numpy") is None  # a non-stdlib import
    assert standalone(MODULE, "_SEP") is None  # not a function


def test_check_source_is_one_assertion_per_call():
    assert SEED.test == (
        "def check(candidate):\n    assert candidate('A b') == 'a-b'\n"
        "    assert candidate('A  b', lower=False) == 'A-b'\n"
    )


def test_knob_levels_count_the_hard_settings():
    assert Knobs().level == 0
    assert Knobs("subtle", 2, 1, False).level == 4
    rng = random.Random(0)
    for level in range(5):
        k = knobs_at(level, rng)
        assert k is not None and k.level == level
    assert knobs_at(4, rng, helpers=False) is None  # distance 1 needs a helper
    assert all(knobs_at(3, rng, helpers=False).distance == 0 for _ in range(10))
    with pytest.raises(ValueError, match="valid 0-4"):
        knobs_at(5, rng)
    with pytest.raises(ValueError, match="unknown 'odd'"):
        Knobs("odd")
    assert sorted(sum(KINDS.values(), ())) == sorted(set(sum(KINDS.values(), ())))


def test_inject_puts_the_bug_where_the_distance_says():
    rng = random.Random(1)
    near = inject(SEED, Knobs("plain", 1, 0), rng)
    far = inject(SEED, Knobs("plain", 1, 1), rng)
    assert near is not None and far is not None
    assert {m.function for m in near[1]} == {"slug"}
    assert {m.function for m in far[1]} == {"_clean"}
    two = inject(SEED, Knobs("plain", 2, 0), rng)
    assert two is not None and len({m.line for m in two[1]}) == 2
    he = {s.id: s for s in humaneval_seeds()}
    assert helpers_of(he["HumanEval/10"]) == ["is_palindrome"]
    assert helpers_of(he["HumanEval/38"]) == []  # its check encodes inputs with the helper


def test_render_symptom_hides_the_assertion_when_asked():
    sym = {
        "error": "AssertionError",
        "line": "    assert candidate('A b') == 'a-b'",
        "got": "'A-b'",
        "in_solution": [],
    }
    shown, hidden = render_symptom(sym, True), render_symptom(sym, False)
    assert "assert candidate('A b') == 'a-b'" in shown and "'A-b'" in shown
    assert "candidate" not in hidden and hidden == "AssertionError"


@needs_sandbox
def test_a_task_records_its_knobs_and_validates_in_sandboxes():
    task = make_task(SEED, Knobs("plain", 1, 0, True), random.Random(3))
    assert task is not None and task.kind == "function" and level_of(task) == 0
    info = task.extra["fnrepair"]
    assert info["seed"] == "toy:slug" and info["operators"][0] in KINDS["plain"]
    assert task.workspace_files["solution.py"] in task.problem_statement
    assert "def check" not in task.problem_statement
    assert "hidden_test.py" not in task.workspace_files
    assert validate(task) is None  # gold resolves, the buggy file does not
    assert not grade(task, "").resolved and grade(task, task.gold_patch).resolved
    broken = task.model_copy(update={"gold_patch": task.gold_patch.replace("+", "+#", 1)})
    assert validate(broken) is not None
    # the SFT oracle writes the original file without docstrings: that repair resolves it
    written = without_docstrings(SEED.code)
    assert written in oracle_message(task, "xml")
    buggy = task.workspace_files["solution.py"]
    assert grade(task, make_diff("solution.py", buggy, written)).resolved


@pytest.fixture(scope="module")
def shipped():
    return repair_tasks("all")


def test_shipped_tasks_split_by_seed_and_cover_every_level(shipped):
    he_split = {s.id: s.split for s in humaneval_seeds()}
    lib_split = {s.id: s.split for s in load_seeds()}
    pins = pinned()
    assert {t.split for t in shipped} == {"train", "heldout"}
    for t in shipped:
        seed = t.extra["fnrepair"]["seed"]
        assert t.split == {**he_split, **lib_split}[seed], t.id
        if t.source.startswith("pypi:"):
            assert pins[seed.split(":")[0]].split == t.split
    assert {level_of(t) for t in shipped} >= {0, 1, 2, 3}
    libs = {t.extra["fnrepair"]["seed"].split(":")[0] for t in shipped if ":" in t.id}
    assert {"toolz", "boltons", "inflection"} <= libs


def test_no_heldout_code_in_any_training_task_or_seed(shipped):
    # provenance: every training task names a training seed of a training source; content: no
    # held-out function (normalised body or >= CONTAINMENT of its token shingles) and no function
    # of the kept-back (outside) libraries in any text of a training task or a training seed
    from coderl.synth.fnrepair import training_seeds
    from coderl.tasks.leakage import content_leaks, heldout_functions, provenance_leaks, task_texts

    seeds = humaneval_seeds() + load_seeds()
    heldout = heldout_functions(seeds)
    assert len(heldout) >= 50  # HumanEval's held-out problems and the held-out library's seeds
    outside = heldout_functions(load_seeds(OUTSIDE_SEEDS_FILE), split="outside")
    assert len(outside) >= 20  # every function of every kept-back seed
    heldout += outside
    training = {s.id: s for s in training_seeds()}
    train = [t for t in shipped if t.split == "train"]
    assert train and not provenance_leaks(train, training, pinned())
    leaks = [x for t in train for x in content_leaks(t.id, task_texts(t), heldout)]
    leaks += [x for s in training.values() for x in content_leaks(s.id, [s.code], heldout)]
    assert not leaks, leaks[:5]


@pytest.mark.parametrize("split", ["heldout", "outside"])
def test_the_leakage_check_finds_a_planted_heldout_function(shipped, split):
    # a copy of a training task that shows a held-out (or kept-back) seed's code (with a bug
    # injected: one token changed) and one that names such a seed are both caught

    from coderl.synth.fnrepair import training_seeds
    from coderl.tasks.leakage import content_leaks, heldout_functions, provenance_leaks, task_texts

    libraries = load_seeds() if split == "heldout" else load_seeds(OUTSIDE_SEEDS_FILE)
    held = next(s for s in libraries if s.split == split)
    heldout = heldout_functions(humaneval_seeds() + libraries, split=split)
    task = next(t for t in shipped if t.split == "train")
    planted = held.code.replace("return ", "return not ", 1)
    files = {**task.workspace_files, "solution.py": planted}
    copy = task.model_copy(update={"workspace_files": files})
    found = content_leaks(copy.id, task_texts(copy), heldout)
    assert any(x.heldout_id.startswith(f"{held.id}:") for x in found), found
    extra = {**task.extra, "fnrepair": {**task.extra["fnrepair"], "seed": held.id}}
    named = task.model_copy(update={"extra": extra})
    training = {s.id: s for s in training_seeds()}
    assert [x.why for x in provenance_leaks([named], training, pinned())] == [
        "its seed is not a training seed"
    ]


@pytest.fixture(scope="module")
def outside():
    return repair_tasks("outside", OUTSIDE_FILE)


def test_the_outside_set_is_kept_back_from_every_training_path(shipped, outside):
    # built the same way (repair tasks of its own seeds, every level the build makes) from
    # libraries that neither data/repos.txt nor HumanEval holds; in its own file, whose tasks the
    # training file, the training seeds and synthesis never see
    from coderl.synth.fnrepair import training_seeds

    seeds = {s.id: s for s in load_seeds(OUTSIDE_SEEDS_FILE)}
    pins = outside_pins()  # raises if data/repos.txt pins one of them
    assert set(pins) == set(OUTSIDE_LIBRARIES) and len(pins) == 2
    assert not set(pins) & set(pinned()) and not set(pins) & set(LIBRARIES)
    assert 60 <= len(outside) <= 120
    assert {t.split for t in outside} == {"outside"} and {s.split for s in seeds.values()} == {
        "outside"
    }
    assert {t.source for t in outside} == {f"pypi:{p.spec}" for p in pins.values()}
    for t in outside:
        seed = seeds[t.extra["fnrepair"]["seed"]]
        assert t.extra["gold_file"] == seed.code and t.hidden_tests["hidden_test.py"] == seed.test
    assert {level_of(t) for t in outside} >= {0, 1, 2}
    assert not {t.id for t in outside} & {t.id for t in shipped}
    assert not set(seeds) & {s.id for s in training_seeds()}
    assert not {s.split(":")[0] for s in seeds} & {s.id.split(":")[0] for s in load_seeds()}
    assert repair_tasks("outside") == []  # the training file holds none


def test_an_outside_library_the_family_uses_is_refused(tmp_path, monkeypatch):
    import coderl.tasks.fnseeds as fnseeds

    listed = tmp_path / "outside.txt"
    listed.write_text("toolz==1.0.0  outside  BSD-3-Clause\n")
    monkeypatch.setattr(fnseeds, "OUTSIDE_PINS", listed)
    with pytest.raises(ValueError, match=r"\['toolz'\] are in data/repos.txt too"):
        fnseeds.outside_pins()


@needs_sandbox
def test_shipped_tasks_validate(shipped, outside):
    rng = random.Random(0)
    sample = rng.sample([t for t in shipped if t.split == "heldout"], 2) + rng.sample(outside, 2)
    every = humaneval_seeds() + load_seeds() + load_seeds(OUTSIDE_SEEDS_FILE)
    for t in sample:
        assert validate(t) is None, t.id
        buggy, entry = t.workspace_files["solution.py"], t.extra["entry_point"]
        sym = symptom(buggy, t.hidden_tests["hidden_test.py"], entry)  # the statement is current
        shown = render_symptom(sym, t.extra["fnrepair"]["show_assertion"])
        assert statement(buggy, entry, shown) == t.problem_statement
        info, seeds = t.extra["fnrepair"], {s.id: s for s in every}
        level, rng = info["level"], random.Random(f"{info['seed']}/{info['level']}")
        again = make_task_at(seeds[info["seed"]], level, rng)  # the build's draw reproduces it
        assert again is not None and again.model_dump() == t.model_dump()


def test_environment_serves_both_splits_and_the_outside_set_apart(outside):
    from coderl.envs import build_environment

    env = build_environment(load_config(None, ["tasks.source=fnrepair"]))
    train, heldout = env.tasks("train"), env.tasks("heldout")
    assert train and heldout and not {t.id for t in train} & {t.id for t in heldout}
    assert [t.id for t in env.tasks("outside")] == [t.id for t in outside]
    assert not {t.id for t in outside} & {t.id for t in train + heldout}
