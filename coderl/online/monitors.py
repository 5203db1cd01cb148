"""Behaviour monitors per policy version and population, and alarms on their shifts.

Metrics over a trailing window of interactions (rates are fractions of interactions unless said):
``n``, ``edit_rate``, ``clarify_rate`` (turns that ask a question instead of editing),
``tool_call_rate``, ``broken_call_rate`` (invalid call seen by the server or a ``tool_error``
event), ``accept_rate`` (accepted / (accepted + rejected) events), ``persistence_rate`` (mean
persisted fraction), ``dissatisfaction_rate`` (dissatisfied / all follow-ups), ``length``
(mean completion tokens), ``latency_ms`` (mean user-reported latency, else server latency),
``reward`` and ``reward/<term>`` (means over scored interactions), ``censored_share`` (censored /
finalised), and, from training, ``kl``; ``suspected_hack_rate`` (:data:`SUSPECTED_HACK_RATE`)
where a hack detector scored the episodes. ``orphaned_share`` is global (orphaned / all events).

An :class:`~coderl.config.AlarmRule` (a config section) fires when a metric moves past a threshold between a reference version and
the version under watch, optionally only while the reward rises (the reward-hacking signature:
the Cursor post's edit rate "decreasing precipitously" while reward improved). Alarms block
promotion. Metrics computed from fewer than ``min_samples`` interactions raise no alarm (they are
reported as such).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coderl.config.online import AlarmRule, default_alarm_rules

if TYPE_CHECKING:
    from coderl.online.store import Store

__all__ = [
    "SUSPECTED_HACK_RATE",
    "Alarm",
    "AlarmRule",
    "behaviour_metrics",
    "check_alarms",
    "default_alarm_rules",
    "monitor_snapshot",
]

SUSPECTED_HACK_RATE = "suspected_hack_rate"
"""Share of a policy's episodes that a hack detector flags (``coderl.rewards`` detectors); the
gate blocks a candidate whose rate rises past ``gate.hack_rate_margin``."""


def behaviour_metrics(
    rows: list[dict[str, Any]],
    events: dict[str, list[dict[str, Any]]],
    rewards: dict[str, dict[str, Any]],
) -> dict[str, float]:
    """Metrics of a set of interaction rows (see module docstring); NaN where undefined."""
    n = len(rows)
    m: dict[str, float] = {"n": float(n)}
    if n == 0:
        return m
    evs = [e for r in rows for e in events.get(r["interaction_id"], [])]
    by_type: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in evs:
        by_type[e["type"]].append(e["payload"])
    broken_ids = {e["interaction_id"] for e in evs if e["type"] == "tool_error"}
    m["edit_rate"] = sum(r["action"] == "edit" for r in rows) / n
    m["clarify_rate"] = sum(r["action"] == "clarify" for r in rows) / n
    m["tool_call_rate"] = sum(r["tool_call_status"] != "none" for r in rows) / n
    m["broken_call_rate"] = (
        sum(r["tool_call_status"] == "invalid" or r["interaction_id"] in broken_ids for r in rows)
        / n
    )
    votes = len(by_type["accepted"]) + len(by_type["rejected"])
    m["accept_rate"] = len(by_type["accepted"]) / votes if votes else math.nan
    fr = [p["fraction"] for p in by_type["edit_persisted"]]
    m["persistence_rate"] = sum(fr) / len(fr) if fr else math.nan
    fu = [p["sentiment"] for p in by_type["follow_up"]]
    m["dissatisfaction_rate"] = fu.count("dissatisfied") / len(fu) if fu else math.nan
    m["length"] = sum(len(r["completion_token_ids"]) for r in rows) / n
    lat = [p["value"] for p in by_type["latency_ms"]]
    server = [r["server_latency_ms"] for r in rows]
    m["latency_ms"] = sum(lat) / len(lat) if lat else sum(server) / n
    rw = [rewards[r["interaction_id"]] for r in rows if r["interaction_id"] in rewards]
    scored = [x for x in rw if x["status"] == "scored"]
    m["censored_share"] = (len(rw) - len(scored)) / len(rw) if rw else math.nan
    m["reward"] = sum(x["reward"] for x in scored) / len(scored) if scored else math.nan
    term_sums: dict[str, float] = defaultdict(float)
    for x in scored:
        for k, v in x["terms"].items():
            if isinstance(v, int | float):
                term_sums[k] += v
    for k, v in term_sums.items():
        m[f"reward/{k}"] = v / len(scored)
    return m


def monitor_snapshot(
    store: Store,
    spec_version: str,
    *,
    window_s: float,
    now: float | None = None,
    orphan_window_s: float = 3600.0,
    kl_by_version: dict[int, float] | None = None,
) -> dict[str, Any]:
    """Metrics per ``(policy_version, population)`` and per version (population ``"*"``) over
    interactions created in ``[now - window_s, now)``.

    Returns:
        ``{"window_s", "orphaned_share", "by_version": {version: {population: metrics}}}``;
        ``orphaned_share`` is None while the store holds no event (nothing to share out).
    """
    now = time.time() if now is None else now
    rows = store.interactions(since=now - window_s, until=now)
    ids = [r["interaction_id"] for r in rows]
    events = store.events_for(ids)
    rewards = store.rewards(spec_version, ids=ids)
    groups: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        groups[r["policy_version"]][r["population"]].append(r)
        groups[r["policy_version"]]["*"].append(r)
    by_version: dict[int, dict[str, dict[str, float]]] = {}
    for v, pops in sorted(groups.items()):
        by_version[v] = {p: behaviour_metrics(rs, events, rewards) for p, rs in pops.items()}
        if kl_by_version and v in kl_by_version:
            for metrics in by_version[v].values():
                metrics["kl"] = kl_by_version[v]
    unjoined = store.unjoined_events()
    orphans = sum(now - e["received_at"] > orphan_window_s for e in unjoined)
    total = store.event_count()
    return {
        "window_s": window_s,
        "orphaned_share": orphans / total if total else None,  # None: no event yet
        "by_version": by_version,
    }


@dataclass(frozen=True)
class Alarm:
    rule: AlarmRule
    population: str
    reference: float
    watched: float

    def reason(self) -> str:
        extra = " while reward rose" if self.rule.only_if_reward_rises else ""
        return (
            f"alarm: {self.rule.metric} {self.rule.direction} {self.reference:.3f} -> "
            f"{self.watched:.3f} (threshold {self.rule.threshold}){extra} "
            f"[population {self.population}]"
        )


def check_alarms(
    reference: dict[str, dict[str, float]],
    watched: dict[str, dict[str, float]],
    rules: list[AlarmRule],
    *,
    min_samples: int = 20,
) -> list[Alarm]:
    """Compare per-population metrics of a watched version against a reference version.

    Args:
        reference, watched: ``{population: metrics}`` as in :func:`monitor_snapshot`.

    Returns:
        the alarms that fired (empty when nothing moved past a threshold). Populations with
        fewer than ``min_samples`` interactions on either side, or NaN metrics, are skipped.
    """
    out: list[Alarm] = []
    for pop in sorted(set(reference) & set(watched)):
        ref, cur = reference[pop], watched[pop]
        if ref.get("n", 0) < min_samples or cur.get("n", 0) < min_samples:
            continue
        reward_rose = cur.get("reward", math.nan) > ref.get("reward", math.nan)
        for rule in rules:
            a, b = ref.get(rule.metric, math.nan), cur.get(rule.metric, math.nan)
            if math.isnan(a) or math.isnan(b):
                continue
            moved = (a - b) if rule.direction == "drop" else (b - a)
            if moved > rule.threshold and (reward_rose or not rule.only_if_reward_rises):
                out.append(Alarm(rule, pop, a, b))
    return out
