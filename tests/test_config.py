from pathlib import Path

import pytest

from coderl.config import Config, ConfigError, dump_config, load_config

# every preset, online-*.yaml included: `coderl online` reads the same tree (its `online` section)
PRESETS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_there_are_presets():
    assert {"default.yaml", "repo-bugfix.yaml", "toy.yaml"} <= {p.name for p in PRESETS}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(cfg))
    assert load_config(again) == cfg


def test_overrides_replace_leaves_with_yaml_types():
    cfg = load_config(None, ["trainer.lr=2e-5", "rollout.group_size=4", "eval.k=[1, 2]"])
    assert cfg.trainer.lr == 2e-5 and cfg.rollout.group_size == 4 and cfg.eval.k == [1, 2]
    assert Config().trainer.lr != 2e-5  # defaults untouched


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.lrr=1", "unknown key 'trainer.lrr'"),
        ("bogus=1", "unknown key 'bogus'"),
        ("trainer.lr=fast", "trainer.lr: must be a number"),
        ("rollout.group_size=2.5", "rollout.group_size"),
        ("algorithm.advantage=ppo2", "algorithm.advantage"),
        ("rollout.group_size=1", "rollout.group_size=1"),
        ("eval.k=[1, 64]", "eval.k"),
        ("reward.terms={tests: 1, nope: 1}", "reward.terms: unknown terms ['nope']"),
        ("trainer.lr", "not of the form key=value"),
        ("algorithm.kl.estimator=k3", "algorithm.kl.estimator: k3 is not a KL loss"),
        ("algorithm.kl.estimator=k1", "algorithm.kl.estimator: k1 is not a KL loss"),
    ],
)
def test_bad_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", "\\[").replace("]", "\\]")):
        load_config(None, [override])


def test_an_unknown_key_lists_its_section_and_the_nearest_key():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.lrr=1"])
    assert "did you mean 'trainer.lr'?" in str(e.value) and "'micro_batch_size'" in str(e.value)
    with pytest.raises(ConfigError, match="did you mean 'algorithm.kl.coef'.*valid: .'coef'"):
        load_config(None, ["algorithm.kl.coeff=1"])
    with pytest.raises(ConfigError, match="did you mean 'async.max_staleness'"):
        load_config(None, ["async.max_stalenes=1"])


@pytest.mark.parametrize(
    "source, override, message",
    [
        (
            "toy",
            "tasks.options.n_trian=3",
            "unknown key 'tasks.options.n_trian'; valid: .'modulus'",
        ),
        ("toy", "tasks.options.episode={call_format: xml}", "'tasks.options.episode'"),
        ("humaneval", "tasks.options.tasks_fil=x", "'tasks.options.tasks_fil'"),
        ("repo", "tasks.options.episode.call_formatt=xml", "'tasks.options.episode.call_formatt'"),
    ],
)
def test_unknown_task_options_are_config_errors(source, override, message):
    # before: the toy raised a TypeError, the harness one mid-rollout, humaneval ignored it
    from coderl.envs.registry import build_environment

    extra = ["tasks.options.tasks_file=t.jsonl"] if source == "repo" else []
    cfg = load_config(None, [f"tasks.source={source}", *extra, override])
    with pytest.raises(ConfigError, match=message):
        build_environment(cfg)


def test_kl_loss_estimator_is_the_one_with_the_right_gradient():
    from coderl.algorithms import KL_LOSS_ESTIMATOR

    assert KL_LOSS_ESTIMATOR == "k2"  # see test_algorithms: its gradient is grad KL(pi || ref)
    assert Config().algorithm.kl.estimator == KL_LOSS_ESTIMATOR
    assert load_config(None, ["algorithm.kl.estimator=k2"]).algorithm.kl.estimator == "k2"


def test_impossible_combinations():
    # a broken call (0.05) would cost less than the length penalty can take (0.1): refused
    with pytest.raises(ConfigError, match="reward.broken_call_penalty"):
        load_config(
            None,
            [
                "reward.terms={tests: 1, broken_calls: 1, length: 1}",
                "reward.broken_call_penalty=0.05",
            ],
        )
    with pytest.raises(ConfigError, match="algorithm.kl.coef"):
        load_config(
            None, ["reward.terms={tests: 1, kl: 1}", "reward.kl_coef=0.1", "algorithm.kl.coef=0.1"]
        )
    # GAE needs no group: group_size 1 is fine for PPO
    assert (
        load_config(None, ["rollout.group_size=1", "algorithm.advantage=gae"]).rollout.group_size
        == 1
    )


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_a_bare_off_is_the_off_mode_not_false():
    # YAML 1.1 reads `off` as False, in a preset and in a key=value override alike
    cfg = load_config(None, ["dynamic_sampling.mode=off", "algorithm.importance.mode=off"])
    assert cfg.dynamic_sampling.mode == "off" and cfg.algorithm.importance.mode == "off"
    with pytest.raises(ConfigError, match="dynamic_sampling.mode"):
        load_config(None, ["dynamic_sampling.mode=on"])  # True is still no mode
