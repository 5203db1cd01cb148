"""The shipped repository tasks stay valid in real sandboxes: the gold patch resolves, the empty
diff does not (``coderl.synth.validate.validate_task``), and the environment rebuilt from
``data/repos.txt`` is the one the task names.

Walking every shipped task means building every pinned repository (sdist and dependencies from
PyPI, about a minute each on 2 cores) and two graded test-suite runs per task, too slow for CI.
CI walks a seeded sample: ``CODERL_SHIPPED_REPOS`` repositories (default 2), one task of each,
chosen by ``CODERL_SHIPPED_SEED`` (default 0: parse and python-slugify, each built by its first
install plan; python-dateutil builds only with its ninth, so a seed that draws it costs far more
time). The full walk is the documented command
``coderl tasks validate data/tasks/*.jsonl.gz`` (docs/tasks-and-grading.md, with its last
measured result); ``CODERL_SHIPPED_REPOS=99`` walks one task of every repository here.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest

from coderl.tasks.repos import load_repo_tasks, read_repos, repo_of

SEED = int(os.environ.get("CODERL_SHIPPED_SEED", "0"))
N_REPOS = int(os.environ.get("CODERL_SHIPPED_REPOS", "2"))

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


def _sample() -> list[tuple[str, str]]:
    """``(spec, task id)`` pairs: seeded repositories, one seeded task of each."""
    tasks = load_repo_tasks("train") + load_repo_tasks("heldout")
    rng = random.Random(SEED)
    pins = [p for p in read_repos() if any(repo_of(t) == p.name for t in tasks)]
    chosen = rng.sample(pins, min(N_REPOS, len(pins)))
    out = []
    for pin in sorted(chosen, key=lambda p: p.name):
        own = [t for t in tasks if repo_of(t) == pin.name]
        out.append((pin.spec, rng.choice(own).id))
    return out


@pytest.mark.parametrize("spec, task_id", _sample())
def test_a_shipped_task_is_valid_in_its_rebuilt_environment(spec, task_id):
    from coderl.envbuild.build import build_env
    from coderl.synth.validate import validate_task

    task = next(t for t in load_repo_tasks("train") + load_repo_tasks("heldout") if t.id == task_id)
    env = build_env(spec)
    assert env.env_id == task.env_id  # the build is reproducible: same snapshot, same plan
    assert validate_task(task) is None
