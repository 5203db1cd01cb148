"""A toy RL problem for the async machinery: a contextual bandit with latency.

Task ``k`` has a target token; an episode samples ``turns x tokens_per_turn`` tokens from the
policy's softmax row for ``k`` and is rewarded with the fraction that hit the target. The policy is
one logit table ``[num_tasks, vocab]``, so a step takes milliseconds and the expected reward is
exact (:meth:`ToyLearner.expected_reward`). Each group waits for an environment latency drawn from
a log-normal law with mean ``delay_s`` seconds (``delay_sigma`` sets its tail: some tasks are slow),
standing in for sandboxed test runs; ``train_delay_s`` stands in for a real optimizer step.

The learner is the decoupled PPO objective of AReaL (Fu et al. 2025, Sec. 5.2, Eq. 5) with one
update per batch: the proximal policy is the current one (ratio 1, no clipping active) and the
behaviour policy's staleness is corrected by :func:`coderl.algorithms.importance_weights` on the
stored behaviour logprobs; advantages are GRPO's (:func:`coderl.algorithms.group_advantages`).
"""

from __future__ import annotations

import copy
import math
import random
import time
from typing import Any

import torch

from coderl import algorithms as A
from coderl.asyncrl.metrics import logprob_gap
from coderl.asyncrl.types import BetweenTurns, Episode, Group, Job, Weights
from coderl.trajectory import Segment, Trajectory

BOS, OBS = 0, 1  # scaffolding tokens: never sampled, never trained on


def toy_tasks(num_tasks: int, vocab: int) -> list[tuple[str, dict[str, int]]]:
    """``[(task_id, {"row": k, "target": t})]``; targets avoid the two scaffolding ids."""
    if vocab < 3:
        raise ValueError(f"vocab must be >= 3 (two ids are scaffolding), got {vocab}")
    return [
        (f"toy/{k}", {"row": k, "target": 2 + (3 * k + 1) % (vocab - 2)}) for k in range(num_tasks)
    ]


class ToySampler:
    """Rollout side of the toy: a copy of the logit table plus the delayed environment."""

    def __init__(
        self,
        num_tasks: int = 8,
        vocab: int = 8,
        *,
        group_size: int = 4,
        turns: int = 2,
        tokens_per_turn: int = 4,
        temperature: float = 1.0,
        delay_s: float = 0.0,
        delay_sigma: float = 0.0,
        grade: bool = True,
    ) -> None:
        self.logits = torch.zeros(num_tasks, vocab)
        self.grade = grade
        self.version = -1
        self.group_size, self.turns, self.tokens_per_turn = group_size, turns, tokens_per_turn
        self.temperature, self.delay_s, self.delay_sigma = temperature, delay_s, delay_sigma

    def load_weights(self, version: int, weights: Weights) -> None:
        self.logits = weights["logits"].detach().clone()
        self.version = version

    def _delay(self, rng: random.Random) -> float:
        """Seconds of environment latency of one group: log-normal with mean ``delay_s``
        (``exp(N(-sigma^2/2, sigma^2))`` has mean 1)."""
        if self.delay_s <= 0:
            return 0.0
        s = self.delay_sigma
        return self.delay_s * math.exp(rng.gauss(0.0, s) - s * s / 2)

    def rollout(self, job: Job, between_turns: BetweenTurns) -> list[Episode]:
        """The group's episodes advance turn by turn together (one batched generation per turn,
        then the environment answers all of them): the group waits ``latency / turns`` per turn,
        with one log-normal ``latency`` drawn per group from the job's seed."""
        gen = torch.Generator().manual_seed(job.seed)
        latency = self._delay(random.Random(job.seed))
        row, target = job.task["row"], job.task["target"]
        segs = [
            Segment([BOS], [0], [0.0], [-1], {"task_id": job.task_id})
            for _ in range(self.group_size)
        ]
        hits = [0] * self.group_size
        for turn in range(self.turns):
            version = between_turns() if turn > 0 else self.version
            logp = (self.logits[row] / self.temperature).log_softmax(-1)  # (V,)
            for e, seg in enumerate(segs):
                tokens = torch.multinomial(logp.exp(), self.tokens_per_turn, True, generator=gen)
                seg.token_ids += tokens.tolist()
                seg.loss_mask += [1] * len(tokens)
                seg.behavior_logprobs += logp[tokens].tolist()
                seg.policy_versions += [version] * len(tokens)
                hits[e] += int((tokens == target).sum())
            time.sleep(latency / self.turns)  # the environment answers
            for seg in segs:
                seg.token_ids.append(OBS)
                seg.loss_mask.append(0)
                seg.behavior_logprobs.append(0.0)
                seg.policy_versions.append(-1)
        n = self.turns * self.tokens_per_turn
        return [
            Episode(job.task_id, Trajectory([seg]), h / n if self.grade else math.nan)
            for seg, h in zip(segs, hits, strict=True)
        ]


class ToyGrader:
    """Grades toy groups separately from sampling (the Ray backend's grader actors): reward is
    the fraction of sampled tokens equal to the task's target."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def grade(self, group: Group) -> Group:
        target = group.job.task["target"]
        for ep in group.episodes:
            seg = ep.trajectory.segments[0]
            sampled = [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]
            ep.reward = sum(t == target for t in sampled) / len(sampled)
            time.sleep(self.delay_s)
        return group


class ToyLearner:
    """Trainer side of the toy: GRPO advantages, importance-weighted policy gradient, Adam."""

    def __init__(
        self,
        num_tasks: int = 8,
        vocab: int = 8,
        *,
        lr: float = 0.1,
        temperature: float = 1.0,
        iw_level: str = "token",
        iw_mode: str = "truncate",
        iw_cap: float = 2.0,
        iw_low: float | None = None,
        train_delay_s: float = 0.0,
    ) -> None:
        self.logits = torch.nn.Parameter(torch.zeros(num_tasks, vocab))
        self.optim = torch.optim.Adam([self.logits], lr=lr)
        self.version = 0
        self.steps = 0
        self.targets = torch.tensor([t["target"] for _, t in toy_tasks(num_tasks, vocab)])
        self.temperature = temperature
        self.iw_level, self.iw_mode, self.iw_cap, self.iw_low = iw_level, iw_mode, iw_cap, iw_low
        self.train_delay_s = train_delay_s

    def _batch(self, groups: list[Group]) -> dict[str, torch.Tensor]:
        """Pad every episode's segment to ``[N, T]`` (N episodes in the batch)."""
        segs = [(g, ep.trajectory.segments[0], ep) for g in groups for ep in g.episodes]
        T = max(len(s.token_ids) for _, s, _ in segs)

        def pad(xs: list[Any], fill: Any) -> list[Any]:
            return xs + [fill] * (T - len(xs))

        return {
            "rows": torch.tensor([g.job.task["row"] for g, _, _ in segs]),  # (N,)
            "group_ids": torch.tensor([g.job.index for g, _, _ in segs]),  # (N,)
            "tokens": torch.tensor([pad(s.token_ids, 0) for _, s, _ in segs]),  # (N, T)
            "mask": torch.tensor([pad(s.loss_mask, 0) for _, s, _ in segs]),  # (N, T)
            "behavior": torch.tensor([pad(s.behavior_logprobs, 0.0) for _, s, _ in segs]),
            "rewards": torch.tensor([ep.reward for _, _, ep in segs]),  # (N,)
        }

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        b = self._batch(groups)
        N, T = b["tokens"].shape
        adv = A.group_advantages(b["rewards"], b["group_ids"])  # (N,)
        logits = self.logits[b["rows"]].unsqueeze(1).expand(N, T, -1)  # (N, T, V)
        logp = A.token_logprobs(logits, b["tokens"], temperature=self.temperature)  # (N, T)
        mask = b["mask"].bool()
        iw = A.importance_weights(
            logp.detach(),
            b["behavior"],
            mask,
            level=self.iw_level,
            mode=self.iw_mode,
            cap=self.iw_cap,
            low=self.iw_low,
        )  # (N, T)
        loss, stats = A.policy_loss(logp, logp.detach(), adv, mask, weights=iw)
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        self.version += 1
        self.steps += 1
        time.sleep(self.train_delay_s)
        return {
            "loss": float(loss.detach()),
            "reward_mean": float(b["rewards"].mean()),
            "iw_mean": float(iw[mask].mean()),
            "iw_zero_frac": float((iw[mask] == 0).float().mean()),
            **logprob_gap(logp, b["behavior"], mask),
            "approx_kl": stats["approx_kl"],
        }

    def expected_reward(self) -> float:
        """Exact expected reward of the current policy, averaged over tasks."""
        with torch.no_grad():
            p = (self.logits / self.temperature).softmax(-1)  # (K, V)
            return float(p.gather(1, self.targets.unsqueeze(1)).mean())

    def weights(self) -> Weights:
        return {"logits": self.logits.detach().clone()}

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(
            {
                "logits": self.logits.detach(),
                "optim": self.optim.state_dict(),
                "version": self.version,
                "steps": self.steps,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.logits.copy_(state["logits"])
        self.optim.load_state_dict(copy.deepcopy(state["optim"]))
        self.version, self.steps = int(state["version"]), int(state["steps"])
