"""Where the grader's plugin puts the first run's canaries depends only on the observer's
placement bytes, never on a Python-level standard-library method that graded code could patch
(round-5 red team: ``random.Random``'s methods are such methods). The patch is simulated here
in the test process, where the plugin module is loaded as the worker loads it; the graded
version is in ``tests/test_grading_redteam.py``."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

PLUGIN = Path(__file__).parent.parent / "coderl" / "grading" / "pytest_plugin" / "coderl_results.py"


@pytest.fixture()
def plugin(monkeypatch):
    spec = importlib.util.spec_from_file_location("coderl_results_under_test", PLUGIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Item:
    def __init__(self, nodeid: str, module: str) -> None:
        self.nodeid, self.module = nodeid, module

    def getparent(self, cls):
        return self.module


def _place(plugin, monkeypatch, placement: str) -> list[str]:
    """Run the placement the plugin's collection hook runs (``_place_canaries``) over 4 items in
    2 modules with 2 canaries."""
    items = [_Item(f"{m}::t{i}", m) for m in ("a.py", "b.py") for i in range(2)]
    reply = {"canaries": [{"name": "c0"}, {"name": "c1"}], "placement": placement}
    ids = plugin._place_canaries(
        items, reply, lambda module, c: [_Item(f"{module}::{c['name']}", module)]
    )
    assert sorted(ids) == sorted(f"{it.nodeid}" for it in items if "::c" in it.nodeid)
    return [it.nodeid for it in items]


# draws, 16 hex digits each: canary 0 -> module 3 % 2 = 1 (b.py), position 9 % 5 = 4 (the
# end); canary 1 -> module 4 % 2 = 0 (a.py), position 7 % 6 = 1 (after the first item)
PLACEMENT = "".join(f"{d:016x}" for d in (3, 9, 4, 7))
EXPECTED = ["a.py::t0", "a.py::c1", "a.py::t1", "b.py::t0", "b.py::t1", "b.py::c0"]


def test_placement_is_the_observers_draws(plugin, monkeypatch):
    assert _place(plugin, monkeypatch, PLACEMENT) == EXPECTED


@pytest.mark.parametrize(
    "patch",
    [
        lambda self, *a, **k: 0,  # every canary first: a forge could then spare the first ones
        lambda self, *a, **k: 10**6,  # out of range: the hook would crash, the run unresolved
    ],
    ids=["constant", "out_of_range"],
)
def test_a_patched_random_method_does_not_move_a_canary(plugin, monkeypatch, patch):
    for name in ("randrange", "randint", "random", "getrandbits", "_randbelow", "seed"):
        monkeypatch.setattr(random.Random, name, patch)
    assert _place(plugin, monkeypatch, PLACEMENT) == EXPECTED


def test_short_or_malformed_placement_falls_back_to_the_front(plugin, monkeypatch):
    placed = _place(plugin, monkeypatch, "zz")
    assert placed[:2] == ["a.py::c1", "a.py::c0"]
    assert _place(plugin, monkeypatch, 12) == placed  # not a string: no draw
