"""The step observers the drivers register with the training pipeline
(:class:`coderl.train.pipeline.StepObserver`): the audit log, the learned graders' gameability
probes and the judge's per-criterion metrics. They live here, above ``coderl.train``, so the
trainer's pipeline does not reach up into ``eval`` and the graders' probes; ``coderl train``,
``coderl train-async`` and the demo register :func:`default_observers`.

Observers only observe: no reward, mask, sample or random draw depends on them. Each has two
hooks: ``scored`` annotates the per-episode infos of a scored set (plain data: an async worker's
infos cross processes to the learner), ``step`` turns a step's infos into metrics (and writes the
audit records).

- :class:`Audit`: the step's ``reward.audit_top_k`` highest-reward and (up to
  ``reward.audit_max_flagged``) hack-flagged trajectories, appended to ``RUN_DIR/audit.jsonl``
  (``coderl report`` renders it as the audit page).
- :class:`Probes`: the gameability probes of every learned term in ``reward.terms`` every
  ``graders.probe_every`` steps, ``graders/probe/<term>/*`` metrics.
- :class:`JudgeCriteria`: ``graders/criteria/*``, the judge's per-criterion scores
  (:func:`coderl.graders.report.criteria_metrics`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from coderl.config import Config
from coderl.eval.audit import audit_record, select_for_audit, write_audit_records
from coderl.graders.judge import EpisodeView
from coderl.graders.probes import maybe_probe
from coderl.graders.report import criteria_metrics
from coderl.metrics import step_alarm
from coderl.rewards.learned import configured_learned, learned_grader, view_of


def _for_audit(records: list[dict[str, Any]], cfg: Config) -> list[dict[str, Any]]:
    r = cfg.reward
    return select_for_audit(records, top_k=r.audit_top_k, max_flagged=r.audit_max_flagged)


class Audit:
    """``scored``: the episodes of the set that :meth:`step` may keep get their audit record in
    ``info["audit"]`` (so it travels with the info to an async learner); ``step``: the step's
    records appended to ``audit.jsonl``, stamped with the step number."""

    def scored(self, cfg: Config, scored: Any) -> None:
        audits = [
            audit_record(ep, g, step=0, reward=tot, breakdown=b, flags=fl)
            for ep, g, tot, b, fl in zip(
                scored.episodes,
                scored.grades,
                scored.rewards.totals,
                scored.rewards.breakdown,
                scored.flags,
                strict=True,
            )
        ]
        chosen = {id(r) for r in _for_audit(audits, cfg)}
        for info, rec in zip(scored.infos, audits, strict=True):
            if id(rec) in chosen:
                info["audit"] = rec

    def step(self, cfg: Config, step: int, infos: list[dict[str, Any]]) -> dict[str, float]:
        chosen = _for_audit([x["audit"] for x in infos if "audit" in x], cfg)
        if chosen:
            write_audit_records(cfg.run_dir, step, chosen)
        return {}


@dataclass
class Probes:
    """The gameability probes of every configured learned term (``judge``, ``rm``) on the
    step's episodes, every ``graders.probe_every`` steps (:func:`coderl.graders.probes.
    maybe_probe`; ``step`` is the number the metrics are logged under, 1 first). Metrics:
    ``graders/probe/<term>/<probe>/{shift,lo,hi,flagged}`` and ``graders/probe/<term>/flagged``,
    and ``alarm/grader_gameable``: 1, with a warning, when any term has a flagged probe (the run
    is training on a grader a probe reliably raises); empty on other steps, without a learned term, or when no episode has a diff. ``scored`` puts
    each episode's view in its info (only when probes are scheduled), so the async learner
    probes what the workers scored.

    Args:
        graders: term name -> grader (``score(views) -> list[float]``); default: the process's
            grader of each term (:func:`coderl.rewards.learned.learned_grader`, the reward term's
            own object; an async learner builds its own copy on first use).
    """

    graders: dict[str, Any] | None = None

    def scored(self, cfg: Config, scored: Any) -> None:
        if cfg.graders.probe_every > 0 and configured_learned(cfg.reward):
            for info, s in zip(scored.infos, scored.samples, strict=True):
                info["view"] = asdict(view_of(s))

    def step(self, cfg: Config, step: int, infos: list[dict[str, Any]]) -> dict[str, float]:
        names = configured_learned(cfg.reward)
        if cfg.graders.probe_every <= 0 or step % cfg.graders.probe_every or not names:
            return {}
        views = [EpisodeView(**x["view"]) for x in infos if "view" in x]
        m: dict[str, float] = {}
        for name in names:
            grader = (self.graders or {}).get(name) or learned_grader(name, cfg.reward)
            m.update(maybe_probe(step, cfg, grader, views, prefix=f"graders/probe/{name}"))
        if m:
            bad = [n for n in names if m.get(f"graders/probe/{n}/flagged", 0.0) > 0]
            probes = sorted(
                {
                    k.split("/")[3]
                    for k, v in m.items()
                    if k.count("/") == 4 and k.endswith("/flagged") and v > 0
                }
            )
            detail = f"training on a gameable grader: {bad}; probes {probes}"
            step_alarm(m, "grader_gameable", float(len(bad)), "graders.max_shift", 0.0,
                       lambda: detail)  # fmt: skip
        return m


class JudgeCriteria:
    """``graders/criteria/*`` of the step's reward breakdowns (valid episodes only)."""

    def scored(self, cfg: Config, scored: Any) -> None:
        return None

    def step(self, cfg: Config, step: int, infos: list[dict[str, Any]]) -> dict[str, float]:
        return criteria_metrics([x["breakdown"] for x in infos], [x["valid"] for x in infos])


def default_observers(graders: dict[str, Any] | None = None) -> list[Any]:
    """What every training driver registers: the audit log, the probes (``graders``: see
    :class:`Probes`) and the judge's criteria metrics."""
    return [Audit(), Probes(graders), JudgeCriteria()]
