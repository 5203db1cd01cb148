"""The SFT warm-start cache (coderl.train.warmstart): a reused entry holds the weights a fresh SFT
of the same inputs gives, byte for byte; any changed input misses; a damaged entry is found and
rebuilt; a store stopped half-way leaves no entry. Tiny random model, two demonstrations."""

import json
import re
from pathlib import Path

import pytest
import torch

from coderl.config import load_config
from coderl.train import warmstart as W
from coderl.train.checkpoint import checkpoint_damage

REPAIR = Path(__file__).parent.parent / "configs" / "repair.yaml"
TINY = ["model.name=tiny-random", "sft.limit=2", "progress=false"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A cache of the test's own (``$CODERL_CACHE``), empty at the start."""
    monkeypatch.setenv("CODERL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "warmstart"


def cfg_of(tmp_path: Path, run: str, *over: str):
    return load_config(REPAIR, [f"run_dir={tmp_path / run}", *TINY, *over])


def weights(tmp_path: Path, run: str) -> bytes:
    return (tmp_path / run / "sft" / "trainable.safetensors").read_bytes()


def test_a_reused_entry_is_the_fresh_sft_byte_for_byte(tmp_path, cache, capsys):
    built = W.warm_start(cfg_of(tmp_path, "built"))
    assert not built.reused and built.key is not None
    assert "warm start: building SFT adapter" in capsys.readouterr().out
    fresh = W.warm_start(cfg_of(tmp_path, "fresh", "sft.cache=false"))  # SFT again, no cache
    assert not fresh.reused and fresh.key is None
    reused = W.warm_start(cfg_of(tmp_path, "reused"))
    out = capsys.readouterr().out
    assert reused.reused and reused.key == built.key
    assert f"warm start: reused cached SFT adapter {built.key} (built " in out
    assert f"from 2 demonstrations; delete {cache / built.key} or set sft.cache=false" in out
    # SFT is deterministic on this CPU for one seed: the two SFT runs and the copy agree exactly
    assert weights(tmp_path, "fresh") == weights(tmp_path, "built") == weights(tmp_path, "reused")
    for run, was_reused in (("built", False), ("reused", True)):
        sft = tmp_path / run / "sft"
        assert checkpoint_damage(sft) is None and (sft / "manifest.json").is_file()
        info = json.loads((sft / "warmstart.json").read_text())
        assert info["reused"] is was_reused and info["key"] == built.key
        assert info["demonstrations"] == 2 and (sft / "metrics.jsonl").is_file()
    assert [p.name for p in cache.iterdir()] == [built.key]  # no temporary folder is left


def test_every_input_changes_the_key_and_rl_only_settings_do_not(tmp_path):
    base = cfg_of(tmp_path, "r")
    tasks = W._demonstrations(base)
    key = W.warmstart_key(W.warmstart_inputs(base, tasks))

    def key_of(*over: str, demos=tasks) -> str:
        return W.warmstart_key(W.warmstart_inputs(cfg_of(tmp_path, "r", *over), demos))

    assert key_of() == key
    for over in ("sft.lr=0.001", "seed=1", "sft.epochs=2", "sft.batch_size=2", "sft.dtype=float32",
                 "model.lora_r=8", "trainer.max_tokens_per_micro_batch=1024",
                 "rollout.max_new_tokens=128"):  # fmt: skip
        assert key_of(over) != key, over
    assert key_of("sft.limit=3", demos=W._demonstrations(cfg_of(tmp_path, "r", "sft.limit=3")))
    edited = tasks[0].model_copy(update={"problem_statement": tasks[0].problem_statement + " "})
    assert key_of(demos=[edited, *tasks[1:]]) != key  # one demonstration's content
    assert key_of(demos=tasks[::-1]) != key  # their order
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # float summation order: other weights
        assert key_of() != key
    finally:
        torch.set_num_threads(threads)
    # what only RL reads leaves the entry valid
    for over in ("trainer.steps=12", "trainer.lr=0.001", "rollout.group_size=4", "sft.cache=false",
                 "eval.samples=8", "tasks.tasks_per_step=2"):  # fmt: skip
        assert key_of(over) == key, over


def test_the_model_files_and_the_code_are_in_the_key(tmp_path, monkeypatch):
    from coderl.policy.loading import MODEL_FILES, MODEL_SOURCES

    assert set(MODEL_FILES) == set(MODEL_SOURCES)  # every named model has its files listed
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"\0" * 64)
    cfg = cfg_of(tmp_path, "r", f"model.name={model}")
    key = W.warmstart_key(W.warmstart_inputs(cfg, []))
    (model / "weights.bin").write_bytes(b"\0" * 63 + b"\1")  # one byte of the weights
    assert W.warmstart_key(W.warmstart_inputs(cfg, [])) != key
    before = W.code_digest()
    monkeypatch.setattr(W, "SFT_CODE", W.SFT_CODE[1:])  # the SFT loop's source left out
    assert W.code_digest() != before


def test_a_damaged_entry_is_found_and_rebuilt(tmp_path, cache, capsys):
    key = W.warm_start(cfg_of(tmp_path, "a")).key
    assert key is not None
    good = (cache / key / "trainable.safetensors").read_bytes()
    damaged = bytearray(good)
    damaged[-1] ^= 1
    (cache / key / "trainable.safetensors").write_bytes(bytes(damaged))
    again = W.warm_start(cfg_of(tmp_path, "b"))
    out = capsys.readouterr().out
    assert not again.reused and again.key == key
    assert "is damaged (trainable.safetensors differs from what was written (SHA-256))" in out
    assert W.entry_damage(cache / key, key) is None  # the rebuilt entry replaced it
    assert (cache / key / "trainable.safetensors").read_bytes() == good == weights(tmp_path, "b")
    (cache / key / "warmstart.json").unlink()  # a file gone: damaged too
    assert W.entry_damage(cache / key, key) == "warmstart.json is missing"


def test_a_store_stopped_half_way_leaves_no_entry(tmp_path, cache, monkeypatch):
    def killed(path):
        raise KeyboardInterrupt  # as Ctrl-C between the copy and the manifest

    monkeypatch.setattr(W, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        W.warm_start(cfg_of(tmp_path, "a"))
    assert [p.name for p in cache.iterdir()] == []
    monkeypatch.undo()
    monkeypatch.setenv("CODERL_CACHE", str(cache.parent))
    # what kill -9 leaves (a temporary folder) is no entry: the next run builds
    key = W.warmstart_key(
        W.warmstart_inputs(cfg_of(tmp_path, "b"), W._demonstrations(cfg_of(tmp_path, "b")))
    )
    (cache / f".tmp-{key}-killed").mkdir()
    assert not W.warm_start(cfg_of(tmp_path, "b")).reused
    assert W.entry_damage(cache / key, key) is None


def test_a_second_builder_keeps_the_first_intact_entry(tmp_path, cache):
    def sft_dir(name: str, content: bytes) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "trainable.safetensors").write_bytes(content)
        return d

    first = W.store(sft_dir("one", b"first"), "k", {"built": "x"})
    W.store(sft_dir("two", b"second"), "k", {"built": "y"})
    assert (first / "trainable.safetensors").read_bytes() == b"first"
    (first / "trainable.safetensors").write_bytes(b"bad")  # damaged: the next store replaces it
    W.store(sft_dir("three", b"third"), "k", {"built": "z"})
    assert (first / "trainable.safetensors").read_bytes() == b"third"
    assert W.entry_damage(first, "k") is None
    assert sorted(p.name for p in cache.iterdir()) == ["k"]


def test_warm_start_command_builds_once_and_force_rebuilds(tmp_path, cache):
    cfg = cfg_of(tmp_path, "unused")
    first = W.build_entry(cfg)
    assert not first.reused and W.entry_damage(cache / str(first.key), str(first.key)) is None
    assert W.build_entry(cfg).reused
    assert not W.build_entry(cfg, force=True).reused
    assert not (tmp_path / "unused").exists()  # built outside any run directory
    assert sorted(p.name for p in cache.iterdir()) == [first.key]


def test_the_summary_says_sft_did_not_run_when_it_was_reused():
    from coderl.eval.summary import _phase_times

    ran = _phase_times([], [], {"sft_s": 300.0, "train_s": 600.0})
    reused = _phase_times([], [], {"sft_s": 1.0, "sft_reused": 1.0, "train_s": 600.0})
    assert ran.startswith("SFT 300 s")
    assert reused.startswith("SFT not run: reused from the warm-start cache (1 s)")


def test_the_demo_reuses_the_built_entry_and_says_so(tmp_path, capsys):
    from coderl.cli.demo import run_demo
    from coderl.metrics import read_jsonl

    small = ["tasks.tasks_per_step=1", "rollout.group_size=2", "trainer.steps=1",
             "rollout.max_new_tokens=32",
             "tasks.synth.enabled=false", "eval.tasks=2", "eval.samples=2", "eval.k=[1,2]",
             "tensorboard=false"]  # fmt: skip
    key = W.build_entry(cfg_of(tmp_path, "unused", *small)).key
    capsys.readouterr()
    assert run_demo(REPAIR, [f"run_dir={tmp_path / 'demo'}", *TINY, *small]) == 0
    out = capsys.readouterr().out
    assert f"warm start: reused cached SFT adapter {key} (built " in out
    flat = " ".join(re.sub("[│┃]", " ", out).split())  # the summary table's cells, unwrapped
    assert "SFT not run: reused from the warm-start cache" in flat  # its phase times
    phases = json.loads((tmp_path / "demo" / "phases.json").read_text())
    assert phases["sft_reused"] == 1.0
    evals = read_jsonl(tmp_path / "demo" / "eval.jsonl")
    assert evals[0]["phase"] == "sft" and evals[0]["time_s"] > 0  # measured in this run


def test_a_source_without_demonstrations_is_refused_before_any_hashing(tmp_path, monkeypatch):
    from coderl.config import ConfigError

    def no_hashing(*a):
        raise AssertionError("inputs were hashed before the source was checked")

    monkeypatch.setattr(W, "warmstart_inputs", no_hashing)
    toy = REPAIR.parent / "toy.yaml"
    cfg = load_config(toy, ["sft.enabled=true", "sft.cache=true", f"run_dir={tmp_path / 'r'}"])
    with pytest.raises(ConfigError, match="has no oracle demonstrations"):
        W.warm_start(cfg)
