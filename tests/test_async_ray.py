"""The ``ray`` backend on a local Ray (num_cpus=2): rollout-worker actors, a grader actor and the
trainer as an actor run the async loop within the staleness bound, and closing the backend that
started Ray leaves no Ray process behind. One Ray start (~4 s idle, much more on busy cores), so
the exact max_staleness=0 equivalence is tested on the thread and process backends only."""

from __future__ import annotations

import functools

import psutil
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is installed by `make test`")

from coderl.asyncrl import AsyncConfig, AsyncRunner, cycle_tasks  # noqa: E402
from coderl.asyncrl.ray_backend import RayBackend, RayLearner  # noqa: E402
from coderl.asyncrl.toy import ToyGrader, ToyLearner, ToySampler, toy_tasks  # noqa: E402

K, V = 6, 6
TASKS = cycle_tasks(toy_tasks(K, V))


def start_backend(cfg, sampler):
    """Start Ray through the backend; one more try if the local node timed out starting (Ray
    waits a fixed 30 s for its raylet, which an overloaded shared machine can exceed). A failed
    start shuts down whatever it started, so the retry begins clean."""
    try:
        return RayBackend(cfg, sampler, make_grader=ToyGrader)
    except Exception as err:
        if "timed out during startup" not in str(err):
            raise
    assert not ray.is_initialized()
    return RayBackend(cfg, sampler, make_grader=ToyGrader)


def test_ray_workers_graders_and_trainer_actor_then_clean_shutdown():
    assert not ray.is_initialized()
    cfg = AsyncConfig(
        backend="ray",
        ray_num_cpus=2,
        num_workers=2,
        groups_per_step=2,
        max_staleness=1,
        ray_num_graders=1,
        ray_worker_cpus=0.5,
    )
    sampler = functools.partial(ToySampler, K, V, delay_s=0.002, grade=False)
    with pytest.raises(ValueError, match="grader factory"):
        RayBackend(cfg, sampler)  # checked before Ray starts
    backend = start_backend(cfg, sampler)  # starts Ray, so owns it
    try:
        assert backend.owns_ray
        learner = RayLearner(functools.partial(ToyLearner, K, V, lr=0.2), num_cpus=0.5)
        before = learner.call("expected_reward")
        with AsyncRunner(cfg, learner, sampler, TASKS, backend=backend) as runner:
            summary = runner.run(12)
            after = learner.call("expected_reward")
            procs = [  # raylet, GCS, workers, agents; not Python's lifetime resource tracker
                p
                for p in psutil.Process().children(recursive=True)
                if not any("resource_tracker" in a for a in p.cmdline())
            ]
            assert any("raylet" in p.name() for p in procs)
    finally:
        backend.close()  # idempotent; the runner closed it already unless something failed
    hist = summary["staleness_hist"]
    assert max(hist) <= 1 and sum(hist.values()) == 24
    assert all(h["reward_mean"] == h["reward_mean"] for h in runner.history)  # graded: not NaN
    assert after > before
    assert len(set(runner.trained_tasks)) == 24
    assert not ray.is_initialized()
    _, alive = psutil.wait_procs(procs, timeout=20)
    assert not alive, [(p.pid, p.name(), p.cmdline()) for p in alive]
