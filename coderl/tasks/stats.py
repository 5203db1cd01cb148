"""Task-set statistics: counts per source repository and per mutation kind."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from coderl.tasks.spec import Task


def task_stats(tasks: list[Task]) -> dict[str, Any]:
    """``{"total", "by_source": {source: {tasks, mean_f2p, mean_p2p, license}},
    "by_mutation": {operator: count}, "by_split": {split: count}}``, sorted by count."""
    groups: dict[str, list[Task]] = defaultdict(list)
    for task in tasks:
        groups[task.source].append(task)
    by_source = {}
    for source, group in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        by_source[source] = {
            "tasks": len(group),
            "mean_f2p": sum(len(t.FAIL_TO_PASS) for t in group) / len(group),
            "mean_p2p": sum(len(t.PASS_TO_PASS) for t in group) / len(group),
            "license": group[0].license,
        }
    mutations = Counter(t.difficulty.mutation or f"({t.kind})" for t in tasks)
    return {
        "total": len(tasks),
        "by_source": by_source,
        "by_mutation": dict(mutations.most_common()),
        "by_split": dict(Counter(t.split for t in tasks).most_common()),
    }
