"""Policies: models behind one interface that samples with exact logprobs, recomputes them for
training, carries a reference policy and versions its weights.

Entry points: :func:`load_policy` (``"tiny-random"``, ``"smollm2-135m"``, a GGUF file or a
Hugging Face directory), :class:`EpisodeBuilder` (token-exact multi-turn trajectories) and
:func:`collate` (segments -> padded training tensors).
"""

from coderl.policy.base import Completion, Engine, Policy, SamplingParams
from coderl.policy.batch import TrainBatch, collate
from coderl.policy.engine import TorchEngine
from coderl.policy.episode import EpisodeBuilder, render, supports_tools
from coderl.policy.loading import MODEL_SOURCES, load_policy, smollm2_gguf_path
from coderl.policy.local import LocalPolicy, LoraSpec, TokenOutputs

__all__ = [
    "MODEL_SOURCES",
    "Completion",
    "Engine",
    "EpisodeBuilder",
    "LocalPolicy",
    "LoraSpec",
    "Policy",
    "SamplingParams",
    "TokenOutputs",
    "TorchEngine",
    "TrainBatch",
    "collate",
    "load_policy",
    "render",
    "smollm2_gguf_path",
    "supports_tools",
]
