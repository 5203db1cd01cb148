"""A user's first day (issue 48), seventh pass: ``coderl train-async`` starts no run nobody asked
for and ends as ``coderl train`` ends (report, "no step updated the policy" warning), a summary
shows what it did not measure as absent, not 0, step numbers are said from 1 everywhere, and
the "nothing was measured" hint follows the masked episodes' causes."""

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import coderl.train.pipeline as pipeline
from coderl.cli import main
from coderl.config import MixSourceConfig, PoolConfig, load_online_config
from coderl.envs.base import GradeRecord
from coderl.envs.toy import ToyEnvironment
from coderl.eval.passk import check_measured
from coderl.metrics import read_jsonl
from coderl.online.simulate import SimStats
from coderl.stats import NothingMeasured
from coderl.train.sampling import MixSampler

ROOT = Path(__file__).parent.parent
TOY = str(ROOT / "configs" / "toy.yaml")
FAST = ["progress=false", "tensorboard=false", "eval.before_after=false", "trainer.steps=1"]
FAST += ["rollout.group_size=4", "rollout.max_new_tokens=4"]

NEVER_CALLED = "not graded: the episode never ran (the program never called the model (exited): -)"
TOO_LONG = (
    "not graded: the episode never ran (ValueError: a fresh context window (900 tokens) plus "
    "one turn (64) exceeds context_budget=512)"
)
NOT_BUILT = (
    'not graded: the episode never ran (sandbox could not start: KeyError: "no built '
    "environment matches 'toolz-1.0.0'; built: []\")"
)
BUILD_HINT = "coderl tasks build-env"


def _one_line_error(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if "CODERL_TRACEBACK" not in x]
    assert len(lines) == 1, err
    return lines[0]


def _grading_errors(reason: str):
    def grade(self, tasks, episodes):
        return [GradeRecord(grading_error=reason) for _ in episodes]

    return grade


# --- 1. train-async: no run without a config, and it ends as coderl train ends ------------------


def test_no_config_no_run_in_train_and_train_async_alike(tmp_path, monkeypatch, capsys):
    import coderl.asyncrl.trainer as trainer
    import coderl.train.loop as loop

    def started(*a, **k):
        raise AssertionError("a run started on the built-in defaults")

    monkeypatch.setattr(trainer, "train_async", started)
    monkeypatch.setattr(loop, "train", started)
    monkeypatch.chdir(tmp_path)  # the defaults' run_dir is relative: nothing may appear here
    for argv in (["train"], ["train-async"], ["train-async", "--resume"], ["train-async", "a=1"]):
        assert main(argv) == 2, argv
        line = _one_line_error(capsys.readouterr().err)
        hint = "give a CONFIG (e.g. configs/default.yaml) or --resume RUN_DIR"
        assert line == f"coderl {argv[0]}: error: {hint}", line
        assert list(tmp_path.iterdir()) == [], argv


def test_train_async_ends_with_the_report_and_the_no_update_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pipeline, "make_batch", lambda *a, **k: None)  # no token to train on
    run = tmp_path / "run"
    assert main(["train-async", TOY, *FAST, "trainer.steps=2", f"run_dir={run}"]) == 0
    out, err = capsys.readouterr()
    assert [r["optimizer_steps"] for r in read_jsonl(run / "metrics.jsonl")] == [0.0, 0.0]
    assert "WARNING: none of steps 1-2 updated the policy" in err, err
    assert f"report: {run / 'report'}" in out and (run / "report" / "index.html").is_file(), out
    # no step computed a sampler/trainer gap: the summary leaves it out instead of printing 0
    assert "logprob_gap" not in out and "mean_staleness: 0" in out, out


# --- 2. the simulated traffic is said as counts, not as a dataclass repr -------------------------


def test_online_run_prints_the_simulated_traffic_as_counts(tmp_path, monkeypatch, capsys):
    import coderl.cli.online as online

    stats = SimStats(requests=12, edits=5, passed=3, broken_calls=1, events_sent=30)
    stats.dropped = 2
    fake_time = SimpleNamespace(time=time.time, perf_counter=time.perf_counter, sleep=lambda s: 0)
    server = SimpleNamespace(
        app=lambda: None,
        policy=SimpleNamespace(tokenizer=None, close=lambda: None),
        reload_routes=lambda: [],
    )
    monkeypatch.setattr(online, "time", fake_time)  # the join windows: no wait
    monkeypatch.setattr(online, "open_run", lambda cfg: (None, SimpleNamespace(champion=lambda: 0)))
    monkeypatch.setattr(online, "build_server", lambda *a: server)
    monkeypatch.setattr(
        online, "BackgroundServer", lambda app, sock=None: SimpleNamespace(base_url="u", stop=str)
    )
    monkeypatch.setattr(
        online, "SimulatedPopulation", lambda *a, **k: SimpleNamespace(run=lambda n: stats)
    )
    monkeypatch.setattr(online, "run_cycle", lambda cfg, log, extra: {"cycle_s": 1.0})
    monkeypatch.setattr(online, "print_report", lambda rep, console: None)
    monkeypatch.setattr(online, "cycle_time_summary", lambda reports: "")
    cfg = load_online_config(
        str(ROOT / "configs" / "online-demo.yaml"),
        ["online.cycles=1", "online.simulate.enabled=true", f"run_dir={tmp_path}"],
    )
    assert online._run_cycles(SimpleNamespace(config="c", overrides=[]), cfg, None) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal's width
    said = (
        "simulated traffic so far: 12 requests, 5 edits (3 passed), 1 tool_error events (calls the clients could not use), 30 "
        "events sent (0 duplicates, 0 malformed), feedback of 2 interactions dropped "
        "(online.simulate.drop_rate)"
    )
    assert said in out, out
    assert "SimStats(" not in out


def test_agent_episode_counts_are_said_only_in_agent_mode():
    assert "agent episodes" not in SimStats(requests=3).line()
    line = SimStats(requests=7, episodes=2, summaries=1, harness_errors=1).line()
    assert line.startswith("2 agent episodes, 1 self-summary turns, 1 could not start, 7 requests")


# --- 3. step numbers are said from 1, as the step lines count ----------------------------------


@pytest.mark.parametrize("command", ["train", "train-async"])
def test_an_all_masked_step_is_named_as_the_step_lines_count_it(
    command, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(ToyEnvironment, "grade", _grading_errors(NEVER_CALLED))
    argv = [command, TOY, *FAST, f"run_dir={tmp_path / 'run'}", "--no-report"]
    assert main(argv) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "step 1: all 8 episodes were masked" in line, line
    assert "tasks.options.program" in line and BUILD_HINT not in line, line  # the hint follows


def test_a_mix_whose_weights_are_all_zero_names_the_step_from_1():
    tasks = [SimpleNamespace(id=f"a/{i}") for i in range(4)]
    zero = [[0, 1.0], [1, 0.0]]  # stage: weight 0 from the second step on
    mix = MixSampler(
        [(MixSourceConfig(source="toy", name="a", weight=zero), tasks)],
        {"a": "uniform"},
        seed=3,
        pool=PoolConfig(),
        block=1,
    )
    mix.step = 1
    with pytest.raises(ValueError, match=r"weight 0 at step 2 \(schedule point 1"):
        mix.take(1)


# --- 4. the "nothing was measured" hint follows the masked causes --------------------------------


def _masked(reasons: list[str], n: int) -> dict:
    return {
        "per_task": [{"n": n}],
        "grading_errors": n,
        "dropped_episodes": 0,
        "grading_error_examples": reasons,
    }


def test_the_eval_hint_names_only_the_causes_the_grading_errors_show():
    cases = {
        NEVER_CALLED: "tasks.options.program",
        TOO_LONG: "raise rollout.max_context_tokens",
        NOT_BUILT: BUILD_HINT,
        "grader raised RuntimeError: boom": None,
    }
    hints = {"tasks.options.program", "rollout.max_context_tokens", BUILD_HINT}
    for reason, hint in cases.items():
        with pytest.raises(NothingMeasured) as e:
            check_measured(_masked([reason], 4))
        said = str(e.value)
        assert reason in said and (hint is None or hint in said), said
        assert not [h for h in hints if h in said and (hint is None or h not in hint)], said
    both = _masked([NOT_BUILT, TOO_LONG], 4)
    both["per_task"].append({"n": 4})  # half masked: the warning, with both hints
    warning = check_measured(both)
    assert warning is not None and BUILD_HINT in warning and "max_context_tokens" in warning


def test_coderl_eval_of_a_program_that_never_called_the_model_does_not_say_build_env(
    tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    assert main(["train", TOY, *FAST, f"run_dir={run}", "--no-report"]) == 0
    monkeypatch.setattr(ToyEnvironment, "grade", _grading_errors(NEVER_CALLED))
    capsys.readouterr()
    assert main(["eval", str(run), "k=2", "eval.tasks=2"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "nothing was measured" in line and "never called the model" in line, line
    assert BUILD_HINT not in line and "tasks.options.program" in line, line


# --- 5. elsewhere: a rate over nothing is absent, not 0 -----------------------------------------


def test_an_online_run_without_events_prints_no_orphaned_share(tmp_path):
    import io

    from rich.console import Console

    from coderl.online.cycle_report import print_report
    from coderl.online.monitors import monitor_snapshot
    from coderl.online.store import Store

    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    try:
        monitors = monitor_snapshot(store, "v1", window_s=60.0)
    finally:
        store.close()
    assert monitors["orphaned_share"] is None, monitors  # no event: no share of them
    rep = {"decision": "waited", "finalize": {}, "rejected_events": {}, "duplicate_events": 0}
    out = io.StringIO()
    window = {0: {"*": {"reward": 0.5}}}  # interactions in the window, no event yet
    print_report({**rep, "monitors": {**monitors, "by_version": window}}, Console(file=out))
    assert "orphaned share of events: n/a" in out.getvalue(), out.getvalue()


def test_a_build_ledger_without_build_time_has_no_rate():
    from coderl.envbuild.ledger import summary

    assert "built_per_hour" not in summary([])  # nothing finished: no rate, not 0 per hour
    rows = [{"status": "built", "time_s": 1800.0, "builder": "rules"}]
    assert summary(rows)["built_per_hour"] == 2.0
