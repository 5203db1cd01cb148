"""A reward model from preferences: a scalar head on a causal LM backbone, trained with the
Bradley-Terry loss on (chosen, rejected) pairs.

``r(x) = w . h(x) + b``, where ``h`` pools the backbone's last-layer hidden states: the last
token's (``pool: last``, InstructGPT's choice) or their mean over the sequence's tokens
(``pool: mean``). Training minimises the Bradley-Terry negative log-likelihood (Bradley & Terry 1952,
"Rank Analysis of Incomplete Block Designs", Biometrika 39; as the reward-model loss of Ouyang et
al. 2022, InstructGPT, Sec. 3.5, Eq. 1)::

    loss = -mean_pairs log sigmoid(r(chosen) - r(rejected))

The backbone is trained with LoRA (peft; only the adapter and the head learn), fully, or not at
all (``head_only``: the backbone is frozen, each distinct sequence goes through it once in a no-grad
pass and the head is fitted on those cached features, i.e. logistic regression on feature
differences, since the Bradley-Terry loss of a linear head only sees ``w . (h_c - h_r)``; the
bias cancels). Head-only features are standardised with the training features' mean and
standard deviation while fitting, and the scaling is folded back into ``w`` and ``b``, so the
checkpoint is still one linear head. Held-out
accuracy is the fraction of pairs with ``r(chosen) > r(rejected)`` with Wilson's 95% interval
(:func:`coderl.stats.wilson_interval`); the split keeps every pair of one context on one side.
Checkpoints: ``rm.safetensors`` (the trainable weights and the head) and ``rm.json`` (how to
rebuild the backbone); loading rebuilds the backbone from its spec and loads those weights.

Limits: sequences longer than ``max_len`` keep their first and last ``max_len // 2`` tokens; no
padding-free packing; a full fine-tune checkpoint holds every weight; a head-only model can only
rank by what a frozen backbone's pooled features already separate linearly.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from coderl.graders.judge import EpisodeView
from coderl.graders.pairs import PreferencePair, render_episode
from coderl.progress import PhaseProgress
from coderl.rundir import honour_umask
from coderl.stats import wilson_interval


def bt_loss(r_chosen: Tensor, r_rejected: Tensor) -> Tensor:
    """Bradley-Terry loss ``-mean log sigmoid(r_chosen - r_rejected)`` (module docstring).

    Args:
        r_chosen, r_rejected: (P,) float rewards of the two sides of P pairs.

    Returns:
        () float tensor.
    """
    return -F.logsigmoid(r_chosen - r_rejected).mean()


@dataclass
class RMSpec:
    """How to rebuild a reward model's backbone (stored as ``rm.json``)."""

    backbone: str
    """Model name or path for :func:`coderl.policy.loading.load_policy`."""
    lora_rank: int | None = 16
    """LoRA rank; None: full fine-tune."""
    lora_alpha: float = 32.0
    seed: int = 0
    """Weight seed (``tiny-random``) and head initialisation."""
    max_len: int = 512
    """Tokens per scored sequence."""
    head_only: bool = False
    """Freeze the backbone (no LoRA, ``lora_rank`` ignored) and train only the head, on features
    computed once per sequence (module docstring)."""
    pool: str = "last"
    """Hidden states to features: a name in :data:`POOLS` (``last`` token or ``mean``)."""


def last_token(h: Tensor, mask: Tensor) -> Tensor:
    """h: (B, T, H) float, mask: (B, T) right-padded -> (B, H): the last real token's state."""
    last = mask.sum(-1) - 1  # (B,)
    return h[torch.arange(h.shape[0], device=h.device), last]


def mean_pool(h: Tensor, mask: Tensor) -> Tensor:
    """h: (B, T, H) float, mask: (B, T) -> (B, H): the mean over the real tokens."""
    m = mask.unsqueeze(-1).to(h.dtype)  # (B, T, 1)
    return (h * m).sum(1) / m.sum(1).clamp(min=1.0)


POOLS = {"last": last_token, "mean": mean_pool}
FEATURE_CACHE = 65536
"""Items whose frozen-backbone features a head-only model keeps (then it starts afresh)."""


class RewardModel(nn.Module):
    """Backbone + scalar head; ``forward(ids, mask) -> (B,)`` rewards."""

    def __init__(self, spec: RMSpec) -> None:
        super().__init__()
        from coderl.policy.loading import load_policy
        from coderl.policy.local import LoraSpec

        if spec.pool not in POOLS:
            raise ValueError(f"unknown pool {spec.pool!r}; valid: {sorted(POOLS)}")
        rank = None if spec.head_only else spec.lora_rank
        lora = LoraSpec(rank=rank, alpha=spec.lora_alpha) if rank else None
        policy = load_policy(spec.backbone, lora=lora, reference=False, seed=spec.seed)
        self.spec = spec
        backbone: Any = policy.model
        if spec.head_only:
            backbone.requires_grad_(False)
        self._cache: dict[str | tuple[int, ...], Tensor] = {}
        self.backbone = backbone
        self.tokenizer = policy.tokenizer
        self.pad_id = int(policy.pad_token_id)
        hidden = int(backbone.config.hidden_size)
        gen = torch.Generator().manual_seed(spec.seed)
        self.head = nn.Linear(hidden, 1)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, hidden, generator=gen) / math.sqrt(hidden))
            self.head.bias.zero_()

    def features(self, ids: Tensor, mask: Tensor) -> Tensor:
        """ids, mask: (B, T) long, right-padded; returns (B, H) float pooled hidden states."""
        out = self.backbone(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        return POOLS[self.spec.pool](out.hidden_states[-1], mask)  # (B, T, H) -> (B, H)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        """ids, mask: (B, T) long, right-padded; returns (B,) float rewards."""
        r: Tensor = self.head(self.features(ids, mask)).squeeze(-1)  # (B,)
        return r

    @torch.no_grad()
    def feature_table(self, items: Sequence[str | Sequence[int]], batch_size: int = 8) -> Tensor:
        """(N, H) float features of ``items``, one no-grad pass per item; batches are formed
        in length order so little is padded (row ``i`` is ``items[i]`` whatever the order).
        With a frozen backbone (``head_only``) an item's features never change: they are kept
        (up to :data:`FEATURE_CACHE` items) and not computed again."""
        self.eval()
        if not items:
            return torch.empty(0, int(self.head.in_features))
        keys = [x if isinstance(x, str) else tuple(x) for x in items]
        cache = self._cache if self.spec.head_only else {}
        todo = list(dict.fromkeys(k for k in keys if k not in cache))
        seqs = {k: self.encode(k) for k in todo}
        todo.sort(key=lambda k: len(seqs[k]))
        got: dict[str | tuple[int, ...], Tensor] = {}
        for i in range(0, len(todo), batch_size):
            chunk = todo[i : i + batch_size]
            got.update(
                zip(chunk, self.features(*self.batch([seqs[k] for k in chunk])), strict=True)
            )
        out = torch.stack([got[k] if k in got else cache[k] for k in keys])  # (N, H)
        if self.spec.head_only:
            if len(cache) + len(got) > FEATURE_CACHE:
                cache.clear()
            cache.update(got)
        return out

    def encode(self, item: str | Sequence[int]) -> list[int]:
        """Token ids of a text (or ids as given), cut to ``max_len`` (head and tail kept)."""
        ids = list(item) if not isinstance(item, str) else self.tokenizer(item)["input_ids"]
        n = self.spec.max_len
        if len(ids) > n:
            ids = ids[: n // 2] + ids[len(ids) - (n - n // 2) :]
        return ids or [self.pad_id]

    def batch(self, items: Sequence[str | Sequence[int]]) -> tuple[Tensor, Tensor]:
        """Right-padded (B, T) ids and mask."""
        seqs = [self.encode(x) for x in items]
        t = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), t), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), t), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        return ids, mask

    @torch.no_grad()
    def rewards(self, items: Sequence[str | Sequence[int]], batch_size: int = 8) -> list[float]:
        """Rewards of ``items`` (texts or token ids), in order."""
        if not items:
            return []
        out: list[float] = self.head(self.feature_table(items, batch_size)).squeeze(-1).tolist()
        return out

    def trainable_state(self) -> dict[str, Tensor]:
        return {
            n: p.detach().clone().contiguous()
            for n, p in self.named_parameters()
            if p.requires_grad
        }

    def save(self, out_dir: str | Path) -> Path:
        """Write ``rm.safetensors`` and ``rm.json`` to ``out_dir``; returns it."""
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        save_file(self.trainable_state(), str(d / "rm.safetensors"))
        honour_umask(d / "rm.safetensors")  # safetensors leaves its temporary file's 0600
        (d / "rm.json").write_text(json.dumps(asdict(self.spec), indent=1))
        return d

    @classmethod
    def load(cls, ckpt_dir: str | Path) -> RewardModel:
        """Rebuild from ``rm.json`` and load ``rm.safetensors``.

        Raises:
            FileNotFoundError: a file is missing.
            ValueError: the weights do not match the rebuilt model's trainable parameters.
        """
        d = Path(ckpt_dir)
        for f in ("rm.json", "rm.safetensors"):
            if not (d / f).is_file():
                raise FileNotFoundError(f"{d / f} does not exist (not a `coderl rm train` output)")
        model = cls(RMSpec(**json.loads((d / "rm.json").read_text())))
        state = load_file(str(d / "rm.safetensors"))
        want = set(model.trainable_state())
        if set(state) != want:
            raise ValueError(
                f"{d}: weights do not match the model: missing {sorted(want - set(state))[:5]}, "
                f"unexpected {sorted(set(state) - want)[:5]}"
            )
        model.load_state_dict(state, strict=False)
        return model.eval()


def split_pairs(
    pairs: Sequence[PreferencePair], heldout_fraction: float = 0.2
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out). Pairs that carry a split (mined from graded episodes,
    :mod:`coderl.graders.mine`) go by it: a ``heldout`` pair never trains. The others go by a
    hash of the context id, so a context never straddles the split."""

    def held(p: PreferencePair) -> bool:
        if p.split:
            return p.split == "heldout"
        return zlib.crc32(p.context_id.encode()) % 1000 < heldout_fraction * 1000

    return [p for p in pairs if not held(p)], [p for p in pairs if held(p)]


@dataclass
class PairwiseAccuracy:
    n: int
    correct: int
    """Pairs with r(chosen) > r(rejected) (ties count as wrong)."""
    accuracy: float
    lo: float
    hi: float
    """Wilson 95% interval of the accuracy."""


def pairwise_accuracy(model: RewardModel, pairs: Sequence[PreferencePair]) -> PairwiseAccuracy:
    """Held-out pairwise accuracy with its Wilson interval (NaN fields when no pairs)."""
    if not pairs:
        return PairwiseAccuracy(0, 0, math.nan, math.nan, math.nan)
    rc = model.rewards([p.chosen for p in pairs])
    rr = model.rewards([p.rejected for p in pairs])
    k = sum(a > b for a, b in zip(rc, rr, strict=True))
    lo, hi = wilson_interval(k, len(pairs), 1.959964)
    return PairwiseAccuracy(len(pairs), k, k / len(pairs), max(lo, 0.0), min(hi, 1.0))


def train_rm(
    model: RewardModel,
    pairs: Sequence[PreferencePair],
    *,
    steps: int = 100,
    batch_size: int = 8,
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    seed: int = 0,
    progress: bool = False,
) -> list[float]:
    """AdamW on the Bradley-Terry loss over random minibatches of ``batch_size`` pairs; returns
    the loss per step. A ``head_only`` model is fitted on cached features (:func:`fit_head`).
    ``progress``: a progress line per step with its loss and the ETA (:mod:`coderl.progress`).

    Raises:
        ValueError: no pairs.
    """
    if not pairs:
        raise ValueError("train_rm needs at least one preference pair")
    if model.spec.head_only:
        return fit_head(model, pairs, steps=steps, batch_size=batch_size, lr=lr,
                        weight_decay=weight_decay, seed=seed, progress=progress)  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    rng = random.Random(seed)
    losses = []
    model.train()
    with PhaseProgress("rm train", steps, enabled=progress) as bar:
        for _ in range(steps):
            mb = rng.sample(list(pairs), min(batch_size, len(pairs)))
            r = model(*model.batch([p.chosen for p in mb] + [p.rejected for p in mb]))  # (2P,)
            loss = bt_loss(r[: len(mb)], r[len(mb) :])
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            losses.append(float(loss.detach()))
            bar.advance(status=f"Bradley-Terry loss {losses[-1]:.4f}")
    model.eval()
    return losses


def fit_head(
    model: RewardModel,
    pairs: Sequence[PreferencePair],
    *,
    steps: int = 100,
    batch_size: int = 8,
    lr: float = 1e-2,
    weight_decay: float = 0.0,
    seed: int = 0,
    progress: bool = False,
) -> list[float]:
    """Fit the head of a frozen backbone on the Bradley-Terry loss: the features of every
    distinct sequence are computed once (:meth:`RewardModel.feature_table`), standardised
    (``z = (h - mu) / sd`` over the training sequences), and AdamW fits ``v`` on
    ``-log sigmoid(v . (z_c - z_r))``; then ``w = v / sd``, ``b = -w . mu`` go into the head
    (exactly ``v . z`` on raw features, so the checkpoint is one linear head).
    Returns the loss per step; ``progress``: a line when the features are being computed (the
    long part) and when they are done."""
    items = list(dict.fromkeys(x for p in pairs for x in (p.chosen, p.rejected)))
    row = {x: i for i, x in enumerate(items)}
    t0 = time.perf_counter()
    if progress:
        print(f"rm train: backbone features of {len(items)} sequences...", file=sys.stderr)
    feats = model.feature_table(items)  # (N, H)
    if progress:
        print(f"rm train: features done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    mu, sd = feats.mean(0), feats.std(0, unbiased=False).clamp(min=1e-6)  # (H,)
    z = (feats - mu) / sd  # (N, H)
    ci = torch.tensor([row[p.chosen] for p in pairs])  # (P,)
    ri = torch.tensor([row[p.rejected] for p in pairs])  # (P,)
    gen = torch.Generator().manual_seed(seed)
    v = (torch.randn(z.shape[1], generator=gen) / math.sqrt(z.shape[1])).requires_grad_()
    opt = torch.optim.AdamW([v], lr=lr, weight_decay=weight_decay)
    losses = []
    with PhaseProgress("rm train (head)", steps, enabled=progress) as bar:
        for _ in range(steps):
            mb = torch.randperm(len(pairs), generator=gen)[:batch_size]  # (b,)
            loss = bt_loss(z[ci[mb]] @ v, z[ri[mb]] @ v)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            losses.append(float(loss.detach()))
            bar.advance(status=f"Bradley-Terry loss {losses[-1]:.4f}")
    with torch.no_grad():
        w = v.detach() / sd  # (H,)
        model.head.weight.copy_(w.unsqueeze(0))
        model.head.bias.fill_(-float(w @ mu))
    return losses


@dataclass
class RewardModelGrader:
    """A trained reward model as a grader: ``score(views)`` renders each episode
    (:func:`coderl.graders.pairs.render_episode`) and returns ``sigmoid(r)`` (or ``r``)."""

    model: RewardModel
    squash: bool = True

    @classmethod
    def load(cls, ckpt_dir: str | Path, *, squash: bool = True) -> RewardModelGrader:
        return cls(RewardModel.load(ckpt_dir), squash)

    def score(self, views: Sequence[EpisodeView]) -> list[float]:
        if not views:
            return []
        r = self.model.rewards([render_episode(v) for v in views])
        return [1 / (1 + math.exp(-x)) if self.squash else x for x in r]


def summary(acc: PairwiseAccuracy, losses: Sequence[float]) -> dict[str, Any]:
    """What ``coderl rm train`` / ``eval`` print and store; without pairs (``n`` 0) the
    accuracy and its interval are absent, never NaN (not valid JSON)."""
    out: dict[str, Any] = asdict(acc)
    if not acc.n:
        for key in ("accuracy", "lo", "hi"):
            del out[key]
    if losses:
        out["first_loss"], out["last_loss"] = losses[0], losses[-1]
    return out
