"""KV reuse across calls: the keys and values of token sequences the sampler already ran, so that
an agent's next turn prefills only what was added since its last one.

An agent episode's next prompt is its last prompt, the sampled completion and the observation
after it. :class:`PrefixCache` keeps, per finished row of a sampling call, the KV cache of the
prompt and the completion (less its last token, which was sampled but never fed to the model).
A later prompt that starts with exactly such a sequence reuses its KV and prefills only the rest;
a prompt that does not (a new context window after a self-summary, a completion the harness cut
to its budget, a template that rewrote history) is prefilled in full.

Why only exact extensions, not any common prefix: a prompt's numbers then depend only on the
episode's own history, never on which other sequences happen to be cached (another worker's, an
earlier step's), so two drivers that sample the same episodes sample bit-identical tokens and
logprobs (``coderl train`` and ``coderl train-async`` at staleness 0 are tested to give the same
checkpoint, bit for bit).

Exact up to floating-point summation order: the reused keys and values were computed by the
decode steps (one token at a time) or by a prefill of another length, so a reused prefill differs
from a full one by rounding only (tests: the same tokens, logprobs within 1e-4 nats, measured
max 1.1e-5, at temperature 0 and at T = 1 with a fixed seed, on a tiny random model with LoRA).

Invalidation: every entry belongs to one state of the weights, :func:`weights_state` (the
policy's weight version, each parameter's identity and in-place version counter, and each LoRA
layer's active and disabled adapters). Any change, an optimizer step, a ``load_state_dict`` of
an adapter, a new adapter set active, ``disable_adapter()``, empties the cache before the next
lookup. A fused optimizer updates parameters without bumping their counters, and writes through
``param.data`` bypass them too; coderl bumps the weight version after every step, which empties
the cache as well.

Memory: the entries' keys and values are bounded by ``max_bytes``; the least recently used are
evicted first, an entry larger than the bound is not kept, and an entry that is a prefix of a
newer one is dropped (the newer covers it). ``forget`` drops the entries of an episode that
ended.

Limits: entries are not shared block-wise (the G episodes of a group each hold a copy of their
common prompt's KV); a lookup compares the prompt with every entry (fine for the tens of entries
a rollout holds).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from peft.tuners.lora import LoraLayer
from torch import Tensor


def weights_state(model: torch.nn.Module, version: int) -> tuple[object, ...]:
    """A value that changes whenever the function ``model`` computes may have changed.

    Made of the weight ``version``, then per parameter its ``id``, storage address and in-place
    version counter (an optimizer step, ``copy_`` and ``load_state_dict`` bump it), then per
    LoRA layer whether adapters are disabled and which are active.
    """
    params = tuple((id(p), p.data_ptr(), p._version) for p in model.parameters())
    lora = tuple(
        (id(m), bool(m.disable_adapters), tuple(m.active_adapters))
        for m in model.modules()
        if isinstance(m, LoraLayer)
    )
    return (version, params, lora)


@dataclass
class CachedPrefix:
    """The KV cache of one token sequence of ``n`` tokens.

    - ``k``, ``v``: ``[L, KV, n, D]`` keys and values per layer and KV head, in the cache's
      dtype and device.
    """

    k: Tensor
    v: Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class PrefixCache:
    """KV caches of token sequences that later prompts extend (see the module docstring).

    Args:
        max_bytes: bound on the bytes of keys and values held (>= 0; 0 keeps nothing).

    Raises:
        ValueError: a negative ``max_bytes``.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()  # LRU first
        self.nbytes = 0
        self.peak_nbytes = 0
        """The most bytes held at once (after a :meth:`put`), for measurements."""
        self.state: tuple[object, ...] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def validate(self, state: tuple[object, ...]) -> None:
        """Empty the cache if the weights' ``state`` (:func:`weights_state`) is not the one its
        entries were computed with."""
        with self._lock:
            if state != self.state:
                self.entries.clear()
                self.nbytes = 0
                self.state = state

    def lookup(self, prompt: Sequence[int]) -> tuple[CachedPrefix | None, int]:
        """The longest entry that ``prompt`` starts with and is longer than, and its length;
        ``(None, 0)`` when there is none. Marks the entry recently used."""
        ids = tuple(prompt)
        best: tuple[int, ...] | None = None
        with self._lock:
            for key in self.entries:
                n = len(key)
                if n < len(ids) and (best is None or n > len(best)) and ids[:n] == key:
                    best = key
            if best is None:
                return None, 0
            self.entries.move_to_end(best)
            return self.entries[best], len(best)

    def fits(self, n_bytes: int) -> bool:
        """Whether an entry of ``n_bytes`` would be kept (callers skip copying one that won't)."""
        return 0 < n_bytes <= self.max_bytes

    def put(self, tokens: Sequence[int], k: Tensor, v: Tensor) -> None:
        """Keep the KV cache ``k``, ``v`` (``[L, KV, n, D]``, owned by the cache from now on) of
        ``tokens`` (``n`` ids); entries it extends are dropped, then the least recently used
        until the bound holds. Not kept when larger than the bound.

        Raises:
            ValueError: ``k`` / ``v`` do not hold ``len(tokens)`` positions.
        """
        if k.shape[2] != len(tokens) or v.shape != k.shape:
            raise ValueError(f"KV of shape {tuple(k.shape)} for {len(tokens)} tokens")
        entry = CachedPrefix(k, v)
        if not self.fits(entry.nbytes):
            return
        key = tuple(tokens)
        with self._lock:
            for old in [o for o in self.entries if len(o) <= len(key) and key[: len(o)] == o]:
                self.nbytes -= self.entries.pop(old).nbytes
            self.entries[key] = entry
            self.nbytes += entry.nbytes
            while self.nbytes > self.max_bytes:
                _, evicted = self.entries.popitem(last=False)
                self.nbytes -= evicted.nbytes
            self.peak_nbytes = max(self.peak_nbytes, self.nbytes)

    def forget(self, sequences: Sequence[Sequence[int]]) -> int:
        """Drop every entry that is a prefix of one of ``sequences`` (the context windows of an
        episode that ended: nothing will extend them); returns how many were dropped."""
        seqs = [tuple(s) for s in sequences]
        with self._lock:
            gone = [k for k in self.entries if any(s[: len(k)] == k for s in seqs)]
            for k in gone:
                self.nbytes -= self.entries.pop(k).nbytes
        return len(gone)
