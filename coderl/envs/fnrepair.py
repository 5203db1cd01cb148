"""``fnrepair``: function-scope repair tasks (:mod:`coderl.synth.fnrepair`) in the agent harness.

The tasks are ``function`` tasks, so rollouts and grading are the HumanEval ones of
:class:`coderl.envs.agent.AgentEnvironment` (a sandbox holding ``solution.py``; the hidden check
graded out of the candidate's reach). ``tasks.options.tasks_file`` names the task file (default the
shipped ``data/fnrepair/tasks.jsonl.gz``); ``train`` and ``heldout`` are its splits (held-out
tasks come only from held-out seeds). The ``outside`` split is read from another file,
``tasks.options.outside_file`` (default the shipped kept-back set
``data/fnrepair/outside.jsonl.gz``: libraries the family never uses), and only its ``outside``
tasks: the training split never comes from that file. Tasks that the synthesiser admits during a run
(:mod:`coderl.train.synth`) are served by the same environment: rollout and grading take the
task objects themselves. With ``reward.shaping > 0`` the harness measures each ``run``'s
potential with the task's visible check (:func:`coderl.synth.fnrepair.visible_potential`).
"""

from __future__ import annotations

from coderl.config import Config
from coderl.envs.agent import AgentEnvironment
from coderl.synth.fnrepair import OUTSIDE_FILE, TASKS_FILE, repair_tasks, visible_potential
from coderl.tasks.spec import Task


def fnrepair_environment(cfg: Config) -> AgentEnvironment:
    """Repair tasks from ``tasks.options.tasks_file`` (default the shipped file); the
    ``outside`` split from ``tasks.options.outside_file`` (default the shipped kept-back set)."""
    path = cfg.tasks.options.get("tasks_file") or TASKS_FILE
    outside = cfg.tasks.options.get("outside_file") or OUTSIDE_FILE

    def load(split: str) -> list[Task]:
        return repair_tasks(split, outside if split == "outside" else path)

    return AgentEnvironment(cfg, load, potential=visible_potential)
