"""A probability-scored rubric judge: no reply is generated or parsed, so format cannot mask it.

For each criterion the prompt (the judge's episode block and the criterion's wording, then the
assistant turn opened with ``<criterion>:``) ends exactly where the verdict token goes. One
forward pass gives the next-token distribution; the judge keeps the probabilities of the rating
tokens (the criterion's labels, ``"1"``..``"5"`` by default, or e.g. ``"no"``/``"yes"`` for a
binary criterion), renormalises over them and takes the expected rating (G-Eval, Liu et al.
2023, "G-Eval: NLG Evaluation using GPT-4 with Better Human Alignment", Sec. 2.3, "scoring
function": ``score = sum_i p(s_i) s_i``)::

    p_i = exp(lp_i) / sum_j exp(lp_j)        # lp_i: logprob of label i's token(s)
    rating = lo + sum_i p_i * i              # i = 0 .. hi - lo
    normalised = (rating - lo) / (hi - lo)   # = P(yes) for a binary [0, 1] criterion

and the rubric score is the weighted mean of the normalised criteria
(:meth:`coderl.graders.rubric.Rubric.score`). A label's probability is that of its single
token at the prompt end (``"4"`` after ``": "`` on SmolLM2, where digits are single tokens and
``" 4"`` is a space token plus a digit; ``" yes"`` after ``":"`` where the space is part of the
word's token); :func:`verdict_prompt` picks the prompt end at which every label is one token,
and raises if there is none.

Group mode (RULER-style, as :class:`coderl.graders.judge.Judge`): the G episodes of a task are
shown together, labelled 1..G, and each (episode, criterion) prompt ends with
``Episode i <criterion>:``: the ratings are read with the whole group in view.

Two scorers give the logprobs (:class:`NextTokenScorer`): :class:`LocalScorer` (one forward pass
of an in-process model, right-padded batches) and :class:`VLLMScorer` (``/v1/completions`` with
``max_tokens: 1``, ``logprobs: k``, token ids; a label outside the top k is scored exactly from
``prompt_logprobs`` of the prompt extended by its token, and counted).

Not protected against: prompt injection by the graded text (the probes measure it), position bias
in group mode (fixed order), and a judge model that is simply wrong: a number always comes out,
which is not the same as a good number (see ``docs/graders.md`` for what SmolLM2-135M measures).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from coderl.graders.cache import JudgementCache, input_hash
from coderl.graders.judge import (
    SYSTEM_PROMPT,
    EpisodeView,
    Judgement,
    _cut,
    _episode_block,
    check_judge_mode,
    judge_in_mode,
)
from coderl.graders.rubric import Criterion, Rubric
from coderl.policy.episode import encode


class NextTokenScorer(Protocol):
    """Logprobs (temperature 1, full vocabulary) of candidate tokens right after each prompt."""

    def next_token_logprobs(
        self, prompts: list[list[int]], candidates: Sequence[int]
    ) -> list[list[float]]:
        """(P, C) logprobs: row p, column c is ``log p(candidates[c] | prompts[p])``."""
        ...


def expected_rating(logprobs: Sequence[float], groups: Sequence[Sequence[int]]) -> list[float]:
    """Renormalised label probabilities (module docstring).

    Args:
        logprobs: (C,) logprobs of the candidate tokens.
        groups: (L,) lists of indices into ``logprobs``: the spellings of each label.

    Returns:
        (L,) probabilities summing to 1.
    """
    lp = torch.tensor(list(logprobs), dtype=torch.float64)  # (C,)
    per_label = torch.stack([torch.logsumexp(lp[list(g)], 0) for g in groups])  # (L,)
    return per_label.softmax(0).tolist()


def labels_of(c: Criterion) -> list[str]:
    """The verdict words of a criterion, for ratings ``lo..hi`` in order."""
    return list(c.labels) if c.labels else [str(k) for k in range(c.scale[0], c.scale[1] + 1)]


def verdict_prompt(
    tokenizer: Any, head: str, labels: Sequence[str]
) -> tuple[list[int], list[list[int]]]:
    """The prompt ids ending where a verdict token goes, and each label's token id there.

    Tries, in order: ``head`` with the label read as ``" " + label`` (a word whose token carries
    its leading space, e.g. SmolLM2's ``" yes"``); ``head + " "`` with the bare label after the
    space token (SmolLM2's and the tiny tokenizer's digits); ``head`` with the bare label. The
    first at which every label is exactly one more token wins.

    Raises:
        ValueError: no ending makes every label a single token (names them).
    """
    for end, sep in ((head, " "), (head + " ", ""), (head, "")):
        ids = encode(tokenizer, end)
        spell: list[list[int]] = []
        for lab in labels:
            full = encode(tokenizer, end + sep + lab)
            if full[: len(ids)] != ids or len(full) != len(ids) + 1:
                break
            spell.append([full[-1]])
        else:
            return ids, spell
    raise ValueError(f"no prompt end makes each of the labels {list(labels)} one token")


@dataclass
class LocalScorer:
    """Next-token logprobs from an in-process causal LM (one forward pass per batch)."""

    model: Any
    pad_id: int
    batch_size: int = 4

    @torch.no_grad()
    def next_token_logprobs(
        self, prompts: list[list[int]], candidates: Sequence[int]
    ) -> list[list[float]]:
        out: list[list[float]] = []
        cand = torch.tensor(list(candidates), dtype=torch.long)  # (C,)
        device = next(self.model.parameters()).device
        for i in range(0, len(prompts), self.batch_size):
            chunk = prompts[i : i + self.batch_size]
            t = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), t), self.pad_id, dtype=torch.long)  # (B, T)
            mask = torch.zeros((len(chunk), t), dtype=torch.long)  # (B, T)
            for j, p in enumerate(chunk):
                ids[j, : len(p)] = torch.tensor(p)
                mask[j, : len(p)] = 1
            logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            last = mask.sum(-1) - 1  # (B,)
            lp = logits[torch.arange(len(chunk)), last.to(device)].float().log_softmax(-1)  # (B, V)
            out += lp[:, cand.to(device)].tolist()  # (B, C)
        return out


@dataclass
class VLLMScorer:
    """Next-token logprobs from a vLLM OpenAI-compatible server (module docstring).

    Args:
        post: ``post(path, body) -> response JSON`` (e.g. ``VLLMEngine._request`` bound to POST).
        model: the served model or adapter name.
        top_k: ``logprobs: k`` of the request.
    """

    post: Callable[[str, dict[str, Any]], Any]
    model: str
    top_k: int = 20
    counts: Counter[str] = field(default_factory=Counter)
    """``outside_top_k``: labels scored exactly because the top k did not hold them."""

    def _exact(self, prompt: list[int], token: int) -> float:
        body = {"model": self.model, "prompt": [*prompt, token], "max_tokens": 1,
                "temperature": 1.0, "prompt_logprobs": 0}  # fmt: skip
        row = self.post("/v1/completions", body)["choices"][0]["prompt_logprobs"][-1]
        return float(row[str(token)]["logprob"])

    def next_token_logprobs(
        self, prompts: list[list[int]], candidates: Sequence[int]
    ) -> list[list[float]]:
        out = []
        for p in prompts:
            body = {"model": self.model, "prompt": p, "max_tokens": 1, "temperature": 1.0,
                    "logprobs": self.top_k, "return_tokens_as_token_ids": True}  # fmt: skip
            top = self.post("/v1/completions", body)["choices"][0]["logprobs"]["top_logprobs"][0]
            by_id = {int(k.partition(":")[2]): float(v) for k, v in top.items()}
            row = []
            for c in candidates:
                if c not in by_id:
                    self.counts["outside_top_k"] += 1
                    by_id[c] = self._exact(p, c)
                row.append(by_id[c])
            out.append(row)
        return out


def _criterion_text(c: Criterion) -> str:
    labels = labels_of(c)
    return (
        f"Criterion {c.name}: {c.wording}\nAnswer with one of {', '.join(labels)} after "
        f'"{c.name}:".'
    )


def pointwise_heads(v: EpisodeView, rubric: Rubric, max_chars: int) -> list[list[dict[str, str]]]:
    """One chat per criterion (the assistant turn's opening is added by the judge)."""
    block = _episode_block(v, max_chars)
    return [
        [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{block}\n\n{_criterion_text(c)}"},
        ]  # fmt: skip
        for c in rubric.criteria
    ]


def group_chat(group: Sequence[EpisodeView], c: Criterion, max_chars: int) -> list[dict[str, str]]:
    """The chat of one criterion over a group: the task once, then episodes 1..G."""
    blocks = [f"## Task\n{_cut(group[0].statement, max_chars)}"]
    for i, v in enumerate(group, 1):
        blocks.append(_episode_block(replace(v, statement="(the task above)"), max_chars, f" {i}"))
    user = (
        "\n\n".join(blocks) + f"\n\nCompare the {len(group)} episodes with each other.\n"
        f"{_criterion_text(c)}\nRate each episode as 'Episode N {c.name}: rating'."
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


@dataclass
class ProbJudge:
    """Scores episodes from rating-token probabilities (see the module docstring).

    Args:
        scorer: next-token logprobs (:class:`LocalScorer`, :class:`VLLMScorer`).
        tokenizer: the judge model's tokenizer (chat template).
        rubric: the criteria (``labels`` per criterion for word verdicts).
        model_id: names the judge model in the cache key.
        cache: stores label probabilities per prompt, or None.
        mode: ``pointwise`` or ``group``.
    """

    scorer: NextTokenScorer
    tokenizer: Any
    rubric: Rubric
    model_id: str
    cache: JudgementCache | None = None
    mode: str = "pointwise"
    max_chars: int = 6000
    counts: Counter[str] = field(default_factory=Counter)
    """``judged`` (forward passes: one per episode and criterion), ``cached``; never
    ``malformed``: a probability judge has no format to break."""
    _recent: dict[str, Judgement | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        check_judge_mode(self.mode)

    def _probs(self, items: list[tuple[list[dict[str, str]], str, Criterion]]) -> list[list[float]]:
        """Label probabilities of each (chat, assistant opening, criterion), through the cache."""
        out: list[list[float] | None] = [None] * len(items)
        todo: dict[tuple[int, ...], list[tuple[int, list[int], list[list[int]], str]]] = {}
        for i, (chat, opening, c) in enumerate(items):
            key = input_hash([chat, opening, labels_of(c)])
            hit = self.cache.get(self.rubric.version, self.model_id, key) if self.cache else None
            if hit is not None:
                out[i] = hit
                self.counts["cached"] += 1
                continue
            text = self.tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True
            )
            ids, spell = verdict_prompt(self.tokenizer, text + opening, labels_of(c))
            cand = tuple(sorted({t for s in spell for t in s}))
            todo.setdefault(cand, []).append((i, ids, spell, key))
        for cand, rows in todo.items():
            lps = self.scorer.next_token_logprobs([r[1] for r in rows], cand)
            self.counts["judged"] += len(rows)
            for (i, _, spell, key), lp in zip(rows, lps, strict=True):
                groups = [[cand.index(t) for t in s] for s in spell]
                out[i] = expected_rating(lp, groups)
                if self.cache is not None:
                    self.cache.put(self.rubric.version, self.model_id, key, out[i])
        return [p for p in out if p is not None]

    def _judgement(self, probs: Sequence[Sequence[float]]) -> Judgement:
        ratings = {
            c.name: c.scale[0] + sum(i * p for i, p in enumerate(ps))
            for c, ps in zip(self.rubric.criteria, probs, strict=True)
        }
        norm = {n: self.rubric.normalised(n, r) for n, r in ratings.items()}
        return Judgement(ratings, self.rubric.score(ratings), norm)  # type: ignore[arg-type]

    def judge(self, views: Sequence[EpisodeView]) -> list[Judgement]:
        """Pointwise judgements, in order (never None)."""
        crit = self.rubric.criteria
        items = [
            (chat, f"{c.name}:", c)
            for v in views
            for chat, c in zip(pointwise_heads(v, self.rubric, self.max_chars), crit, strict=True)
        ]
        probs = self._probs(items)
        k = len(crit)
        return [self._judgement(probs[i * k : (i + 1) * k]) for i in range(len(views))]

    def judge_groups(self, groups: Sequence[Sequence[EpisodeView]]) -> list[list[Judgement]]:
        """Group judgements: every (episode, criterion) read with the whole group in view."""
        items, where = [], []
        for gi, g in enumerate(groups):
            for c in self.rubric.criteria:
                chat = group_chat(g, c, self.max_chars)
                for e in range(len(g)):
                    items.append((chat, f"Episode {e + 1} {c.name}:", c))
                    where.append((gi, e))
        probs = self._probs(items)
        per: dict[tuple[int, int], list[list[float]]] = {}
        for w, p in zip(where, probs, strict=True):
            per.setdefault(w, []).append(p)
        return [
            [self._judgement(per[(gi, e)]) for e in range(len(g))] for gi, g in enumerate(groups)
        ]

    def judge_all(self, views: Sequence[EpisodeView]) -> list[Judgement | None]:
        """Judgements in this judge's mode (group mode groups by ``task_id``); a call whose
        episodes the previous call judged returns those again (see ``Judge.judge_all``)."""
        return judge_in_mode(self.mode, views, self.judge, self.judge_groups, self._recent)

    def score(self, views: Sequence[EpisodeView]) -> list[float]:
        """Rubric scores in [0, 1] (the grader interface of the probes)."""
        return [math.nan if j is None else j.score for j in self.judge_all(views)]
