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
     "coderl.progress",  # progress lines of long phases (rich only)
     "coderl.rundir",  # the run directory's writer lock (stdlib only)
     "coderl.pools",  # thread pools that Ctrl-C does not wait out (stdlib only)
     "coderl.metrics",  # a run's metrics I/O and step alarms, read by eval and written by train
     "coderl.ray_cluster"),  # start or join Ray (ray and psutil only), for train and asyncrl
    ("coderl.policy", "coderl.sandbox"),
    ("coderl.tasks",),  # what a task is and plain loaders
    ("coderl.grading",),  # the verifier: judges tasks in sandboxes
    ("coderl.envbuild",),  # environments from repositories (their tests found by the verifier)
    ("coderl.synth",),  # tasks synthesised and validated by the verifier
    ("coderl.agent",),  # the harness runs tasks in sandboxes
    ("coderl.graders", "coderl.envs",  # learned graders; RL environments over the harness
     "coderl.endpoint"),  # the OpenAI endpoint of coderl serve and of the gateway environment
    ("coderl.rewards",),  # reward terms, the learned ones over coderl.graders
    ("coderl.eval",),  # the evaluator, reports, observers: below the drivers that call them
    ("coderl.train",),
    ("coderl.asyncrl", "coderl.online"),
    ("coderl.cli", "coderl.__main__"),  # entry points: every command-line module
]  # fmt: skip

KNOWN_CIRCLES: set[str] = set()
"""Modules on an import circle today (none: keep it so)."""

KNOWN_UPWARD: set[tuple[str, str]] = set()
"""Upward imports today (none: keep it so)."""


def floor(module: str) -> int:
    """The floor of ``module``: the longest matching prefix in :data:`FLOORS`."""
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


def package_of(module: str) -> str:
    """``coderl.tasks.spec`` -> ``coderl.tasks``; a module directly in coderl is its own package."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other coderl packages its modules import (module or function level)."""
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        if m == "coderl":
            continue
        src = package_of(m)
        out.setdefault(src, set())
        out[src] |= {package_of(d) for d in deps if d != "coderl" and package_of(d) != src}
    return out


def test_no_circle_between_packages():
    packages = package_graph(import_graph())
    circles = {p: cycle_through(p, packages) for p in sorted(packages)}
    circles = {p: c for p, c in circles.items() if c}
    assert not circles, f"packages that import each other (through these packages): {circles}"


def test_every_command_line_module_is_in_coderl_cli():
    """Entry points live on the top floor: no package below builds its own command line."""
    graph = import_graph()
    stray = sorted(
        m
        for m in graph
        if not m.startswith("coderl.cli")
        and (m.rsplit(".", 1)[-1] in ("cli", "__main__") or m.endswith("_cli"))
        and m != "coderl.__main__"
    )
    assert not stray, f"command-line modules outside coderl.cli: {stray}"
    registers = sorted(
        m
        for m, path in __import__("import_graph").modules().items()
        if not m.startswith("coderl.cli") and "\ndef register(sub" in path.read_text()
    )
    assert not registers, f"sub-command parsers outside coderl.cli: {registers}"


def test_floors_catch_a_circle_and_an_upward_import():
    # the checks themselves: a made-up graph with a circle, and a config module importing train
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert cycle_through("a", graph) == ["a", "b", "a"] and cycle_through("c", graph) is None
    assert floor("coderl.config.online") < floor("coderl.train.step")
    assert floor("coderl.cli.rm") == len(FLOORS) - 1
    assert floor("coderl.config.graders") == 0 < floor("coderl.graders.rm")
    assert floor("coderl.tasks.spec") < floor("coderl.grading.grade") < floor("coderl.synth.repo")
    assert floor("coderl.eval.audit") < floor("coderl.train.pipeline")
    # and the package check: two packages that import each other are a circle
    packages = package_graph({"coderl.a.x": {"coderl.b.y"}, "coderl.b.y": {"coderl.a.z"},
                              "coderl.a.z": set()})  # fmt: skip
    assert cycle_through("coderl.a", packages) == ["coderl.a", "coderl.b", "coderl.a"]
