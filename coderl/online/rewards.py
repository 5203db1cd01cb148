"""Versioned reward spec: outcome events -> one scalar per episode, with a per-term breakdown.

Rewards are derived data: :func:`finalize` recomputes them from the stored events at any time,
and every reward row names the spec version that produced it (a training batch is claimed for a
single version, so it never mixes versions).

Scoring an episode (all turns share it, summaries included), once every join window of every
turn has closed:

1. **Broken tool call** (the server saw an invalid call, or a ``tool_error`` event arrived in its
   window): reward ``broken_tool_call``, the lowest the spec can give. Never discarded: discarding
   such episodes taught a production policy to break calls on tasks it would fail (Cursor,
   "Improving Composer through real-time RL", 2025, section "Real-time RL and reward hacking").
2. **Deferral** (no turn made an edit: a clarifying question, read-only tool use, or nothing):
   reward ``deferral``, which the spec validates to be <= the worst reward an edit can receive.
   Deferring therefore never scores above editing would have (same source: deferring risky edits
   inflated clarifying questions). Deferral is scored even without outcome events.
3. **Edit**: the sum of the terms whose events arrived inside their windows, judged by the
   server's own clocks (:func:`in_window`: the server received the event at most ``window``
   seconds after it recorded the interaction, not before it beyond a clock skew; the client's ``occurred_at`` must
   lie between the two, give or take ``clock_skew_s``, or the event is not counted).
   Each term takes the **most adverse** in-window value of its kind over the whole episode,
   once: ``accept * (-1 if any rejected else +1)``, ``persist * (2 * min(fraction) - 1)``,
   ``follow_up * min(+1 satisfied / 0 neutral / -1 dissatisfied)``,
   ``-latency * min(max(latency_ms) / latency_scale_ms, 1)``. Repeating an event (fresh
   ``event_id``s, any turn of the episode) therefore never raises a term: ten ``accepted`` do
   not outvote one ``rejected`` (a mean of votes did: the eighth attack round). A client that
   repeats an adverse event can only lower the reward, which rewards no behaviour of the
   policy's.
   Without any outcome event (accepted, rejected, edit_persisted, follow_up) the episode is
   **censored**: excluded from training, never scored 0.

Events whose interaction never arrives are held; after ``orphan_window_s`` they count as orphans.

Episodes are scoped to their population: turns of two populations that send the same
``episode_id`` are two episodes, so one population's events or broken call never score another's
turns.

An episode is scored once, when the windows of all the turns it has so far have closed; a turn
that arrives after that (the client kept going past every window) is a **late turn**: censored
(``kind = "late_turn"``) and counted, so no turn is trained on under an outcome that a later
turn could still change, and the rows already scored (and maybe trained on) stay as they are.
``finalize(..., recompute=True)`` rescores whole episodes from the events.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coderl.config.online import RewardSpec

if TYPE_CHECKING:
    from coderl.online.store import Store

OUTCOME_TYPES = ("accepted", "rejected", "edit_persisted", "follow_up")
SENTIMENT = {"dissatisfied": -1.0, "neutral": 0.0, "satisfied": 1.0}


@dataclass
class EpisodeScore:
    """The outcome of one episode under a spec."""

    status: str
    """``pending`` (a window is still open), ``scored`` or ``censored``."""
    reward: float | None = None
    terms: dict[str, float] = field(default_factory=dict)
    kind: str = ""
    """``broken``, ``deferral`` or ``edit``."""
    late_events: int = 0


def in_window(spec: RewardSpec, turn: dict[str, Any], event: dict[str, Any]) -> bool:
    """Whether ``event`` counts for ``turn``: the server received it within its type's window
    after recording the turn (``received_at - created_at <= window``, both on the servers'
    clocks, and not before the turn beyond ``spec.clock_skew_s``: an event may reach one server
    just before another has stored its interaction, never much earlier, as the interaction id is
    the server's random one), and the client's ``occurred_at`` is no earlier than the turn and no
    later than the receipt, each give or take ``spec.clock_skew_s``. A client cannot backdate a
    late event into its window, nor date feedback before the interaction it rates."""
    created, received, occurred = turn["created_at"], event["received_at"], event["occurred_at"]
    skew = spec.clock_skew_s
    if not -skew <= received - created <= spec.windows_s[event["type"]]:
        return False
    return created - skew <= occurred <= received + skew


def score_episode(
    spec: RewardSpec,
    turns: list[dict[str, Any]],
    events: dict[str, list[dict[str, Any]]],
    now: float,
) -> EpisodeScore:
    """Score one episode from its interaction rows and their events (see module docstring).

    Args:
        turns: interaction rows of the episode (``created_at``, ``action``, ``tool_call_status``).
        events: event rows per interaction id (``type``, ``payload``, ``occurred_at``,
            ``received_at``).
        now: current time, Unix seconds.
    """
    closes = max(t["created_at"] for t in turns) + max(spec.windows_s.values())
    if now < closes:
        return EpisodeScore("pending")
    inside: dict[str, list[dict[str, Any]]] = defaultdict(list)
    late = 0
    for t in turns:
        for ev in events.get(t["interaction_id"], []):
            if in_window(spec, t, ev):
                inside[ev["type"]].append(ev["payload"])
            else:
                late += 1
    broken = inside["tool_error"] or any(t["tool_call_status"] == "invalid" for t in turns)
    if broken:
        v = spec.broken_tool_call
        return EpisodeScore("scored", v, {"broken_tool_call": v}, "broken", late)
    if not any(t["action"] == "edit" for t in turns):
        v = spec.deferral_reward
        return EpisodeScore("scored", v, {"deferral": v}, "deferral", late)
    if not any(inside[k] for k in OUTCOME_TYPES):
        return EpisodeScore("censored", None, {}, "edit", late)
    terms: dict[str, float] = {}
    # the most adverse in-window value of each kind counts, once (module docstring, step 3)
    if inside["accepted"] or inside["rejected"]:
        terms["accept"] = spec.accept * (-1.0 if inside["rejected"] else 1.0)
    if inside["edit_persisted"]:
        terms["persist"] = spec.persist * (
            2.0 * min(p["fraction"] for p in inside["edit_persisted"]) - 1.0
        )
    if inside["follow_up"]:
        terms["follow_up"] = spec.follow_up * min(
            SENTIMENT[p["sentiment"]] for p in inside["follow_up"]
        )
    if inside["latency_ms"]:
        worst = max(p["value"] for p in inside["latency_ms"])
        terms["latency"] = -spec.latency * min(worst / spec.latency_scale_ms, 1.0)
    return EpisodeScore("scored", sum(terms.values()), terms, "edit", late)


@dataclass
class FinalizeReport:
    """Counts from one :func:`finalize` pass."""

    scored: int = 0
    censored: int = 0
    pending: int = 0
    late_events: int = 0
    late_turns: int = 0
    """Turns that arrived after their episode was scored (censored, see the module docstring)."""
    held_events: int = 0
    orphaned_events: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


def _row(
    turn: dict[str, Any],
    spec: RewardSpec,
    episode_id: str,
    status: str,
    reward: float | None,
    terms: dict[str, Any],
    now: float,
) -> dict[str, Any]:
    return {
        "interaction_id": turn["interaction_id"],
        "spec_version": spec.version,
        "episode_id": episode_id,
        "status": status,
        "reward": reward,
        "terms": terms,
        "computed_at": now,
    }


def finalize(
    store: Store, spec: RewardSpec, *, now: float | None = None, recompute: bool = False
) -> FinalizeReport:
    """Score every episode whose windows have closed and write per-interaction reward rows.

    Args:
        recompute: also rescore interactions that already have a row for ``spec.version``
            (rewards are a pure function of the stored events).

    Returns:
        counts of interactions scored / censored / still pending, and of held and orphaned
        events.
    """
    now = time.time() if now is None else now
    rep = FinalizeReport()
    done = set() if recompute else set(store.rewards(spec.version))
    todo_eps = {r["episode_id"] for r in store.interactions() if r["interaction_id"] not in done}
    rows = store.interactions(episode_ids=sorted(todo_eps)) if todo_eps else []
    episodes: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:  # an episode id names an episode within its population only
        episodes[r["population"], r["episode_id"]].append(r)
    events = store.events_for([r["interaction_id"] for r in rows])
    kinds: dict[str, int] = defaultdict(int)
    out: list[dict[str, Any]] = []
    for (_, episode_id), turns in episodes.items():
        late = [t for t in turns if t["interaction_id"] not in done]
        if len(late) < len(turns):  # the episode was scored before these turns arrived
            rep.late_turns += len(late)
            rep.censored += len(late)
            kinds["late_turn"] += len(late)
            out += [_row(t, spec, episode_id, "censored", None, {"kind": "late_turn"}, now)
                    for t in late]  # fmt: skip
            continue
        s = score_episode(spec, turns, events, now)
        if s.status == "pending":
            rep.pending += len(turns)
            continue
        rep.late_events += s.late_events
        kinds[s.kind] += len(turns)
        for t in turns:
            if s.status == "scored":
                rep.scored += 1
            else:
                rep.censored += 1
            out.append(
                _row(t, spec, episode_id, s.status, s.reward, {**s.terms, "kind": s.kind}, now)
            )
    store.upsert_rewards(out)
    for ev in store.unjoined_events():
        if now - ev["received_at"] > spec.orphan_window_s:
            rep.orphaned_events += 1
        else:
            rep.held_events += 1
    rep.by_kind = dict(kinds)
    return rep
