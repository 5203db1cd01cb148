"""Floors, not circles: over every module of coderl (module- and function-level imports), no
import circle and no import from a lower floor to a higher one.

Both lists of exceptions are empty: any circle or upward import fails the test. Should one
ever have to be tolerated for a while, name it there; a listed one that is gone fails too, so
the lists only shrink.
"""

from __future__ import annotations

from import_graph import cycle_through, import_graph

FLOORS: list[tuple[str, ...]] = [
    # lowest first; a module may import from its own floor and the floors below it
    ("coderl.config", "coderl.stats", "coderl.trajectory", "coderl.algorithms",
     "coderl.graders.settings",  # a config section, beside the graders it configures
     "coderl.progress",  # progress lines of long phases (rich only)
     "coderl.rundir",  # the run directory's writer lock (stdlib only)
     "coderl.ray_cluster"),  # start or join Ray (ray and psutil only), for train and asyncrl
    ("coderl.policy", "coderl.sandbox"),
    ("coderl.tasks",),
    ("coderl.agent",),  # the harness runs tasks in sandboxes
    ("coderl.rewards", "coderl.graders", "coderl.envs",
     "coderl.eval.passk"),  # the one evaluator, below the three drivers that call it
    ("coderl.train",),  # observers (audit, probes, criteria) are registered from above
    ("coderl.eval",),
    ("coderl.asyncrl", "coderl.online"),
    ("coderl.cli", "coderl.__main__", "coderl.demo"),  # entry points (and every *cli module)
]  # fmt: skip

KNOWN_CIRCLES: set[str] = set()
"""Modules on an import circle today (none: keep it so)."""

KNOWN_UPWARD: set[tuple[str, str]] = set()
"""Upward imports today (none: keep it so)."""


def floor(module: str) -> int:
    """The floor of ``module``: the longest matching prefix in :data:`FLOORS`; command-line
    modules (``cli``, ``*_cli``) are entry points, on the top floor."""
    leaf = module.rsplit(".", 1)[-1]
    if leaf == "cli" or leaf.endswith("_cli"):
        return len(FLOORS) - 1
    best, level = -1, None
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    if level is None:
        raise AssertionError(f"{module} is on no floor: place its package in FLOORS")
    return level


def test_no_import_circle_outside_the_named_ones():
    graph = import_graph()
    on_circle = {m for m in graph if cycle_through(m, graph)}
    new = {m: cycle_through(m, graph) for m in sorted(on_circle - KNOWN_CIRCLES)}
    assert not new, f"new import circles: {new}"
    assert not KNOWN_CIRCLES - on_circle, (
        f"no longer on a circle, delete from KNOWN_CIRCLES: {sorted(KNOWN_CIRCLES - on_circle)}"
    )


def test_no_upward_import_outside_the_named_ones():
    graph = import_graph()
    top = {m for m in graph if m == "coderl"}  # the package's own __init__ re-exports
    upward = {
        (m, d)
        for m, deps in graph.items()
        if m not in top
        for d in deps
        if d not in top and floor(d) > floor(m)
    }
    assert not upward - KNOWN_UPWARD, f"upward imports: {sorted(upward - KNOWN_UPWARD)}"
    assert not KNOWN_UPWARD - upward, (
        f"gone, delete from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - upward)}"
    )


def test_floors_catch_a_circle_and_an_upward_import():
    # the checks themselves: a made-up graph with a circle, and a config module importing train
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert cycle_through("a", graph) == ["a", "b", "a"] and cycle_through("c", graph) is None
    assert floor("coderl.config.online") < floor("coderl.train.step")
    assert floor("coderl.graders.rm_cli") == len(FLOORS) - 1
    assert floor("coderl.graders.settings") == 0 < floor("coderl.graders.terms")
    assert floor("coderl.eval.passk") < floor("coderl.train.pipeline") < floor("coderl.eval.audit")
