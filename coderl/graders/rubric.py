"""Rubrics and the strict parser of a judge's reply.

A rubric is a YAML file: a ``version`` and ``criteria``, each with a ``name``, a ``weight`` (> 0),
an integer ``scale`` ``[lo, hi]`` and the ``wording`` the judge reads. A judgement is ONE JSON
object with exactly one integer per criterion, inside the scale::

    {"addresses_task": 4, "minimal": 5, "readable": 3, "safe": 5}

A group judgement (RULER-style, several episodes at once) is ONE JSON object mapping episode
labels ``"1"``..``"G"`` to such objects. Anything else is malformed (:class:`MalformedJudgement`):
no object or two objects in the reply (a reply that gives two scores), a key given twice, a
missing or extra criterion, a float, a boolean or a string where an integer belongs, a score
outside the scale. Prose around the one object is ignored. A malformed judgement is never read
as a score (the judge retries once, then masks the sample; see :mod:`coderl.graders.judge`).

The score of a judgement is the weighted mean of the criteria rescaled to [0, 1]:
``score = sum_c w_c (s_c - lo_c) / (hi_c - lo_c) / sum_c w_c`` (ours; a weighted rubric sum as in
Prometheus-style absolute grading, Kim et al. 2024).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class Criterion(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    """Key of the criterion in a judgement (lower snake case)."""
    weight: float = Field(gt=0)
    """Weight in the rubric score."""
    scale: tuple[int, int]
    """Inclusive integer range ``(lo, hi)`` of a score, ``lo < hi``."""
    wording: str = Field(min_length=1)
    """What the judge is asked, scale anchors included."""
    labels: tuple[str, ...] | None = None
    """Verdict words for the ratings ``lo..hi`` in order (e.g. ``[no, yes]`` for a binary
    ``[0, 1]`` criterion), read by the probability judge (:mod:`coderl.graders.probjudge`);
    None: the ratings' digits."""

    @field_validator("scale")
    @classmethod
    def _ordered(cls, v: tuple[int, int]) -> tuple[int, int]:
        if v[0] >= v[1]:
            raise ValueError(f"scale {list(v)}: lo must be below hi")
        return v

    @model_validator(mode="after")
    def _one_label_per_rating(self) -> Criterion:
        n = self.scale[1] - self.scale[0] + 1
        if self.labels is not None and (len(self.labels) != n or len(set(self.labels)) != n):
            raise ValueError(f"labels {list(self.labels)}: need {n} distinct, one per rating")
        return self


class Rubric(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str = Field(min_length=1)
    """Bumped whenever a criterion changes; part of the judgement cache key."""
    criteria: tuple[Criterion, ...] = Field(min_length=1)

    @field_validator("criteria")
    @classmethod
    def _unique(cls, v: tuple[Criterion, ...]) -> tuple[Criterion, ...]:
        names = [c.name for c in v]
        if len(set(names)) != len(names):
            raise ValueError(f"criterion names must be unique, got {names}")
        return v

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.criteria]

    def score(self, scores: dict[str, int]) -> float:
        """Weighted rubric score in [0, 1] of a parsed judgement (see the module docstring)."""
        total = sum(c.weight for c in self.criteria)
        return (
            sum(c.weight * self.normalised(c.name, scores[c.name]) for c in self.criteria) / total
        )

    def normalised(self, name: str, value: int) -> float:
        """``(value - lo) / (hi - lo)`` of criterion ``name``, in [0, 1]."""
        lo, hi = next(c.scale for c in self.criteria if c.name == name)
        return (value - lo) / (hi - lo)

    def instructions(self) -> str:
        """The rubric as the judge reads it, ending with the exact output format."""
        lines = ["Score the episode on each criterion:"]
        for c in self.criteria:
            lines.append(f"- {c.name} (integer {c.scale[0]}-{c.scale[1]}): {c.wording}")
        example = ", ".join(f'"{c.name}": {c.scale[1]}' for c in self.criteria)
        lines.append(
            "Reply with exactly one JSON object holding one integer per criterion and nothing "
            "else, for example: {" + example + "}"
        )
        return "\n".join(lines)


def load_rubric(path: str | Path) -> Rubric:
    """Read and validate a rubric YAML file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not YAML, or not a valid rubric (the message names the field).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"rubric file {str(p)!r} does not exist")
    try:
        return Rubric.model_validate(yaml.safe_load(p.read_text()))
    except (yaml.YAMLError, ValidationError) as err:
        raise ValueError(f"{p}: not a valid rubric: {err}") from None


class MalformedJudgement(ValueError):
    """A judge's reply that does not follow the schema; never read as a score."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise MalformedJudgement(f"key given twice: {dup}")
    return dict(pairs)


def _objects(text: str) -> list[Any]:
    """Every top-level JSON object in ``text`` (objects nested in one are not counted)."""
    dec = json.JSONDecoder(object_pairs_hook=_no_duplicates)
    out, i = [], 0
    while (i := text.find("{", i)) != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        # RecursionError: nested past the decoder's depth (a reply can echo what the agent
        # wrote); not an object, like any text that does not decode, never the caller's crash
        except (json.JSONDecodeError, RecursionError):
            i += 1
            continue
        out.append(obj)
        i = end
    return out


def _one_object(text: str) -> Any:
    objs = _objects(text)
    if len(objs) != 1:
        raise MalformedJudgement(f"expected exactly one JSON object, found {len(objs)}")
    return objs[0]


def _check_scores(obj: Any, rubric: Rubric, where: str = "") -> dict[str, int]:
    if not isinstance(obj, dict):
        raise MalformedJudgement(f"{where}expected an object, got {type(obj).__name__}")
    missing = sorted(set(rubric.names) - set(obj))
    extra = sorted(set(obj) - set(rubric.names))
    if missing or extra:
        raise MalformedJudgement(f"{where}missing criteria {missing}, extra keys {extra}")
    out = {}
    for c in rubric.criteria:
        v = obj[c.name]
        if type(v) is not int:  # bool is an int subclass; 4.0 and "4" are not integers here
            raise MalformedJudgement(f"{where}{c.name}: expected an integer, got {v!r}")
        if not c.scale[0] <= v <= c.scale[1]:
            raise MalformedJudgement(f"{where}{c.name}={v} outside the scale {list(c.scale)}")
        out[c.name] = v
    return out


def parse_judgement(text: str, rubric: Rubric) -> dict[str, int]:
    """The per-criterion integer scores of a pointwise judgement.

    Raises:
        MalformedJudgement: the reply breaks the schema (see the module docstring).
    """
    return _check_scores(_one_object(text), rubric)


def parse_group_judgement(text: str, rubric: Rubric, n: int) -> list[dict[str, int]]:
    """Per-episode scores of a group judgement over ``n`` episodes labelled ``"1"``..``"n"``.

    Raises:
        MalformedJudgement: not one object, labels other than exactly ``"1"``..``"n"``, or any
            episode's scores break the schema.
    """
    obj = _one_object(text)
    labels = [str(i + 1) for i in range(n)]
    if sorted(obj) != sorted(labels):
        raise MalformedJudgement(f"expected episode labels {labels}, got {sorted(obj)}")
    return [_check_scores(obj[k], rubric, f"episode {k}: ") for k in labels]
