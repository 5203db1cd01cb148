"""``coderl export RUN_DIR [--out DIR] [--merged] [--force]``: a training run's weights as Hugging
Face directories that ``transformers``, ``peft`` and vLLM load without coderl.

What is exported: the run's newest checkpoint (``RUN_DIR`` may also name one checkpoint
directory), on the base model its ``config.yaml`` names. Layout of ``OUT`` (default
``RUN_DIR/export``)::

    full fine-tuning            OUT/ is the model directory
    LoRA                        OUT/base/     the base model the adapter was trained on
                                OUT/adapter/  adapter_config.json, adapter_model.safetensors
                                OUT/merged/   with --merged: base + adapter merged
    both                        OUT/export.json  the source checkpoint and the checks' results

A model directory holds ``config.json``, ``generation_config.json`` (its EOS ids are the ones
coderl stops sampling on), ``model.safetensors``, the tokenizer (``tokenizer.json``,
``tokenizer_config.json``) and ``chat_template.jinja``; the adapter directory holds the tokenizer
files too. The base is always written in full, in Hugging Face layout: a GGUF-loaded base
(the default SmolLM2) or ``tiny-random`` has no hub copy a user could fetch. Load with::

    AutoModelForCausalLM.from_pretrained(OUT)                          # full fine-tuning
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(OUT / "base"), OUT / "adapter")
    AutoModelForCausalLM.from_pretrained(OUT / "merged")               # --merged

The adapter's ``base_model_name_or_path`` is the absolute path of ``OUT/base`` at export time;
after moving the directories, pass the base model explicitly as above.

Checks, run on the written files before they are moved into place (a failed check leaves no
``OUT``): ``AutoTokenizer`` reloads each directory's tokenizer with the same ids as coderl's on
probe strings and a rendered chat-template conversation, and the reloaded model's token logprobs
on that conversation equal the trainer forward's (:func:`coderl.policy.forward.forward`) within
:data:`LOGPROB_ATOL` nats (fp32; a merged model is within rounding of ``W + (alpha / r) B A``).

Limits: weights are written in the trainer's dtype (float32); the PPO value head is not exported
(a serving stack has no use for it). A run of ``coderl sft`` alone exports its SFT weights
(``RUN_DIR/sft``, see :func:`coderl.train.checkpoint.resolve_checkpoint`). An online run's
registry versions (its champion by default) go through :func:`export_weights` from the command
line (``coderl.cli.export``), with the same layout and checks.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from coderl.config import Config, load_config
from coderl.policy.episode import encode, render
from coderl.policy.loading import save_model_dir
from coderl.policy.local import LocalPolicy
from coderl.policy.threads import use_threads
from coderl.policy.vllm_server import write_base_model
from coderl.rundir import enclosing_run, honour_umask
from coderl.train.checkpoint import load_checkpoint, resolve_checkpoint
from coderl.train.run import build_policy

LOGPROB_ATOL = 1e-4
"""Largest |logprob| difference (nats) allowed between the reloaded model and the trainer on the
probe conversation; fp32 forwards of the same weights differ by ~1e-6 (summation order), a
merged LoRA by ~1e-5."""
PROBE_TEXTS = (
    "def add(a, b):\n    return a + b\n",
    'Ünïcode café 12345\t{"name": "run", "arguments": {}}\n\n',
    "<tool_call>\n</tool_call><|im_end|>",
)
PROBE_MESSAGES = (
    {"role": "system", "content": "You are a coding agent. Fix the bug."},
    {"role": "user", "content": "The test failed: AssertionError: expected 3, got 4."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
)


class ExportError(ValueError):
    """An exported directory does not reproduce the run's tokenizer or model."""


def export_run(
    source: str | Path,
    out: str | Path | None = None,
    *,
    merged: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Export ``source`` (a run directory: its newest checkpoint; or a checkpoint directory) to
    ``out`` (default ``RUN_DIR/export``); see the module docstring for the layout and checks.

    Returns:
        The manifest written to ``OUT/export.json``: ``checkpoint``, ``step``, ``version``,
        ``model`` (the base's spec), ``lora``, ``dirs`` (role -> path) and ``checks`` (role ->
        ``max_logprob_gap`` in nats and ``tokenizer_probes``).

    Raises:
        FileNotFoundError: no complete checkpoint or no ``config.yaml``.
        FileExistsError: ``out`` exists and not ``force``, or is not a previous export
            (:func:`ensure_replaceable`).
        ValueError: ``merged`` for a full fine-tuning run.
        ExportError: a check failed (says which directory and by how much).
    """
    run_dir, ckpt = resolve_checkpoint(source)
    cfg = load_config(run_dir / "config.yaml", ["trainer.device=cpu"])

    def load(policy: LocalPolicy) -> dict[str, Any]:
        state = load_checkpoint(ckpt, model=policy.model, restore_rng=False)
        return {"step": int(state["step"]), "version": int(state["version"])}

    return export_weights(cfg, run_dir, ckpt, load, out, merged=merged, force=force)


WeightLoader = Callable[[LocalPolicy], dict[str, Any]]
"""Puts a source's weights into the policy built from its config; returns what the manifest
records about the source (``step`` and ``version`` of a checkpoint; ``registry_version`` of an
online run's version)."""


def export_weights(
    cfg: Config,
    run_dir: Path,
    source: Path,
    load: WeightLoader,
    out: str | Path | None = None,
    *,
    merged: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Export the weights ``load`` puts into ``cfg``'s policy, read from ``source`` (a
    checkpoint, an online run's registry version) of ``run_dir``, to ``out`` (default
    ``RUN_DIR/export``): :func:`export_run` once the source is resolved.

    Raises:
        as :func:`export_run`.
    """
    dest = Path(out) if out is not None else run_dir / "export"
    ensure_replaceable(dest, (run_dir, source), force=force)
    if merged and not cfg.model.lora:
        raise ValueError("--merged: this run fine-tuned every weight; there is no adapter to merge")
    use_threads(cfg.threads)
    policy = build_policy(cfg, reference=False)
    said = load(policy)
    ids = probe_ids(policy.tokenizer)
    expected = {"trained": policy.logprobs([ids])[0]}  # the trainer forward, in fp32
    if policy.is_lora:
        peft_model: Any = policy.model
        with peft_model.disable_adapter():
            expected["base"] = policy.logprobs([ids])[0]
    tmp = dest.parent / f".tmp-{dest.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dirs = _write(policy, tmp, merged=merged, final=dest)
        checks = {
            role: check_dir(policy.tokenizer, path, ids, expected.get(role, expected["trained"]))
            for role, path in dirs.items()
        }
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left behind
        raise
    manifest = {
        "checkpoint": str(source.resolve()),
        **said,
        "model": cfg.model.name,
        "lora": policy.is_lora,
        "dirs": {role: str(_moved(path, tmp, dest)) for role, path in dirs.items()},
        "checks": checks,
        "logprob_atol": LOGPROB_ATOL,
    }
    (tmp / "export.json").write_text(json.dumps(manifest, indent=1))
    honour_umask(tmp)  # safetensors leaves its temporary files' 0600
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return manifest


RUN_MARKERS = ("checkpoints", "config.yaml", "metrics.jsonl", "sft", ".lock")
"""Names whose presence marks a directory as (holding) a training run, never an export's."""


def ensure_replaceable(dest: Path, sources: tuple[Path, ...], *, force: bool) -> None:
    """Refuse to write over ``dest`` unless it is absent, or ``force`` and it is a previous
    export: a directory with ``export.json`` that is none of ``sources`` (the run directory and
    checkpoint exported), holds none of them and holds no run (:data:`RUN_MARKERS`, at any
    depth). ``--force`` replaces an export, never a run or a directory of runs.

    Raises:
        FileExistsError: ``dest`` exists and may not be replaced, or it would go into a run's
            ``checkpoints/`` folder (one line saying why).
    """
    parent = dest.resolve().parent
    if parent.name == "checkpoints" and enclosing_run(parent) is not None:
        raise FileExistsError(
            f"{dest} is in a run's checkpoints/ folder, where it would sit beside (and look like) "
            "a checkpoint: choose another --out"
        )
    if not dest.exists() and not dest.is_symlink():
        return
    if not force:
        raise FileExistsError(f"{dest} exists; not replaced without --force")
    where = dest.resolve()
    for src in sources:
        if src.resolve() == where or where in src.resolve().parents:
            raise FileExistsError(
                f"{dest} holds the run being exported ({src}); --force replaces only a previous "
                "export: choose another --out"
            )
    if dest.is_symlink() or not dest.is_dir() or not (dest / "export.json").is_file():
        raise FileExistsError(
            f"{dest} exists and is not a previous export (no export.json); --force replaces only "
            "an export: choose another --out or move it away"
        )
    runs = [p for p in dest.rglob("*") if p.name in RUN_MARKERS]
    if runs:
        raise FileExistsError(
            f"{dest} holds a training run ({runs[0]}); --force replaces only a previous export: "
            "choose another --out"
        )


def _moved(path: Path, tmp: Path, dest: Path) -> Path:
    return (dest / path.relative_to(tmp)).resolve()


def _write(policy: LocalPolicy, tmp: Path, *, merged: bool, final: Path) -> dict[str, Path]:
    """Write the model directories under ``tmp``; role -> directory ("model" for full
    fine-tuning; "base", "adapter" and, with ``merged``, "merged" for LoRA)."""
    tok, eos = policy.tokenizer, policy.eos_token_ids
    if not policy.is_lora:
        return {"model": save_model_dir(policy.model, tok, tmp, eos_token_ids=eos)}
    adapter, base = tmp / "adapter", write_base_model(policy, tmp / "base")
    peft_model: Any = policy.model
    peft_model.save_pretrained(adapter, safe_serialization=True)  # the adapter only
    tok.save_pretrained(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str((final / "base").resolve())
    (adapter / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    dirs = {"base": base, "adapter": adapter}
    if merged:  # the path a user takes: base directory + adapter directory, merged by peft
        fused = load_exported(adapter).merge_and_unload()
        dirs["merged"] = save_model_dir(fused, tok, tmp / "merged", eos_token_ids=eos)
    return dirs


def probe_ids(tokenizer: Any) -> list[int]:
    """Token ids of the probe conversation (:data:`PROBE_MESSAGES` through the chat template,
    encoded the way :mod:`coderl.policy.episode` encodes a context)."""
    return encode(tokenizer, render(tokenizer, PROBE_MESSAGES, add_generation_prompt=True))


def check_tokenizer(tokenizer: Any, path: Path) -> int:
    """Reload ``path``'s tokenizer with ``AutoTokenizer`` (which picks its class from the
    directory's ``config.json`` too) and compare its ids with ``tokenizer``'s on
    :data:`PROBE_TEXTS` and the probe conversation rendered by the run's chat template.

    Returns:
        The number of strings compared.

    Raises:
        ExportError: different ids on one of them (names the class that was loaded).
    """
    reloaded = AutoTokenizer.from_pretrained(path, local_files_only=True)
    texts = [*PROBE_TEXTS, render(tokenizer, PROBE_MESSAGES, add_generation_prompt=True)]
    for text in texts:
        if encode(reloaded, text) != encode(tokenizer, text):
            raise ExportError(
                f"{path}: AutoTokenizer loads a {type(reloaded).__name__} that tokenizes "
                f"{text[:40]!r} differently from the run's {type(tokenizer).__name__}"
            )
    return len(texts)


def check_dir(
    tokenizer: Any, path: Path, ids: list[int], expected: list[float]
) -> dict[str, float | int]:
    """Reload ``path`` with transformers (and peft for an adapter directory) and compare it with
    the run: the tokenizer (:func:`check_tokenizer`), then token logprobs of ``ids`` against
    ``expected`` (the trainer's; entry 0 has no prefix).

    Returns:
        ``max_logprob_gap`` (nats) and ``tokenizer_probes`` (strings compared).

    Raises:
        ExportError: different ids, or a logprob gap above :data:`LOGPROB_ATOL`.
    """
    probes = check_tokenizer(tokenizer, path)
    model = load_exported(path)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # (T, V)
    got = logits[:-1].log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # (T-1,)
    gap = float((got - torch.tensor(expected[1:])).abs().max())
    if not gap <= LOGPROB_ATOL:
        raise ExportError(f"{path}: logprobs differ from the trainer's by {gap:.3g} nats")
    return {"max_logprob_gap": gap, "tokenizer_probes": probes}


def load_exported(path: str | Path) -> Any:
    """An exported directory as a float32 model in eval mode: a model directory with
    ``AutoModelForCausalLM``, an adapter directory with peft onto its sibling ``base``."""
    path = Path(path)
    if (path / "adapter_config.json").is_file():
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(path.parent / "base", dtype=torch.float32)
        return PeftModel.from_pretrained(base, path).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
