"""Task spec: round trips and errors that name file, line and field."""

import json

import pytest

from coderl.tasks.spec import Task, TaskFileError, dump_tasks, load_tasks, parse_task_line


def make_task(task_id="repo-1.0/abc", **over):
    fields = dict(
        id=task_id,
        kind="repo",
        env_id="repo-1.0-0123456789ab",
        problem_statement="tests fail",
        FAIL_TO_PASS=["tests/test_a.py::test_x"],
        PASS_TO_PASS=["tests/test_a.py::test_y"],
        gold_patch="diff --git a/a.py b/a.py\n",
        source="pypi:repo==1.0",
        license="MIT",
    )
    fields.update(over)
    return Task(**fields)


@pytest.mark.parametrize("name", ["tasks.jsonl", "tasks.jsonl.gz"])
def test_round_trip_plain_and_gzip(tmp_path, name):
    tasks = [make_task("a/1"), make_task("a/2", kind="function", split="heldout")]
    dump_tasks(tasks, tmp_path / name)
    assert load_tasks(tmp_path / name) == tasks
    # gzip output is reproducible (mtime 0): same tasks -> same bytes
    dump_tasks(tasks, tmp_path / ("again-" + name))
    assert (tmp_path / name).read_bytes() == (tmp_path / ("again-" + name)).read_bytes()


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_invalid_json_names_file_and_line(tmp_path):
    good = make_task().model_dump_json()
    path = write_lines(tmp_path / "t.jsonl", [good, "", "{not json"])
    with pytest.raises(TaskFileError) as err:
        load_tasks(path)
    assert (err.value.path, err.value.line, err.value.field) == (str(path), 3, "<json>")
    assert f"{path}:3:" in str(err.value)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("problem_statement"), "problem_statement"),
        (lambda d: d.update(kind="essay"), "kind"),
        (lambda d: d.update(FAIL_TO_PASS=[]), "FAIL_TO_PASS"),
        (lambda d: d.update(FAIL_TO_PASS="t::x"), "FAIL_TO_PASS"),
        (lambda d: d.update(difficulty={"mutation": 3}), "difficulty.mutation"),
        (lambda d: d.update(unknown_field=1), "unknown_field"),
        (lambda d: d.update(schema_version=2), "schema_version"),
    ],
)
def test_bad_field_is_named(tmp_path, mutate, field):
    raw = json.loads(make_task().model_dump_json())
    mutate(raw)
    path = write_lines(tmp_path / "t.jsonl", [make_task("x/0").model_dump_json(), json.dumps(raw)])
    with pytest.raises(TaskFileError) as err:
        load_tasks(path)
    assert err.value.line == 2
    assert err.value.field == field


def test_duplicate_id_and_non_object(tmp_path):
    line = make_task().model_dump_json()
    path = write_lines(tmp_path / "t.jsonl", [line, line])
    with pytest.raises(TaskFileError, match="duplicate id") as err:
        load_tasks(path)
    assert (err.value.line, err.value.field) == (2, "id")
    with pytest.raises(TaskFileError) as err:
        parse_task_line("[1, 2]", path="p", line=7)
    assert (err.value.line, err.value.field) == (7, "<object>")


def test_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "t.jsonl"
    dump_tasks([make_task()], path)
    before = path.read_bytes()

    class Boom(Task):
        def model_dump_json(self, **kw):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        dump_tasks([Boom(**make_task("b/1").model_dump())], path)
    assert path.read_bytes() == before


def test_cli_humaneval_and_stats(tmp_path, capsys):
    from coderl.cli import main

    out = tmp_path / "heldout.jsonl"
    assert main(["tasks", "humaneval", "--split", "heldout", "--out", str(out)]) == 0
    assert len(load_tasks(out)) == 64
    repo = tmp_path / "repo.jsonl.gz"
    dump_tasks([make_task("r/1", difficulty={"mutation": "wrong_return"}), make_task("r/2")], repo)
    capsys.readouterr()
    assert main(["tasks", "stats", str(out), str(repo)]) == 0
    text = capsys.readouterr().out
    assert "66 tasks" in text and "wrong_return" in text and "pypi:repo==1.0" in text


def test_json_errors_name_the_column(tmp_path):
    from coderl.tasks.swebench import read_instances

    bad = '{"id": "a", "problem_statement": "xx", "kind": "repo", "x": oops}'
    col = bad.index("oops") + 1
    path = write_lines(tmp_path / "t.jsonl", [bad])
    with pytest.raises(TaskFileError, match=f"column {col}\\)"):
        load_tasks(path)
    array = tmp_path / "a.json"
    array.write_text("[\n" + bad + "\n]\n")
    with pytest.raises(TaskFileError, match=f":2: .*column {col}\\)"):
        read_instances(array)
