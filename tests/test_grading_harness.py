"""SWE-bench's harness grading beside coderl's (``coderl.grading.harness``), in containers.

- the image naming of SWE-bench, SWE-smith and R2E-Gym instances;
- a parse task's gold and empty patch: the harness's report (``swebench``'s log parser and
  ``get_eval_report``) agrees with coderl's verdict, and the run written in the harness's layout
  is read by ``swebench``'s own ``make_run_report``;
- the reason coderl's verdict decides: graded code that prints ``PASSED <id>`` lines after
  pytest's summary and exits 0 fools the log parser (harness: resolved), not coderl.

Needs root, bubblewrap, podman, the Debian base image and the parse environment (built here when
missing, about a minute).
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest

from coderl.grading.harness import instance_image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARSE_TASKS = os.path.join(ROOT, "data", "tasks", "parse.jsonl.gz")
needs_containers = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("podman") is None or shutil.which("bwrap") is None,
    reason="harness grading needs root, bubblewrap and podman (make sysdeps)",
)


def test_instance_images_follow_each_datasets_field_or_swebenchs_scheme():
    assert instance_image({"instance_id": "django__django-11099"}) == (
        "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    )
    assert instance_image({"instance_id": "a__B-1", "image_name": "jyangballin/swesmith.x"}) == (
        "jyangballin/swesmith.x"
    )
    assert instance_image({"instance_id": "x", "docker_image": "namanjain12/r2e:y"}) == (
        "namanjain12/r2e:y"
    )
    assert instance_image({"instance_id": "x", "image": "i:1", "image_name": "n"}) == "i:1"


@pytest.fixture(scope="module")
def container_factory():
    from coderl.envbuild.build import build_env
    from coderl.sandbox import Sandbox
    from coderl.sandbox.images import base_image

    build_env("parse==1.22.4")
    os.environ["CODERL_CONTAINER_IMAGE"] = base_image()
    yield functools.partial(Sandbox.create, backend="container")
    os.environ.pop("CODERL_CONTAINER_IMAGE", None)


@pytest.fixture(scope="module")
def task():
    from coderl.tasks.spec import load_tasks

    return load_tasks(PARSE_TASKS)[0]


@needs_containers
def test_gold_and_empty_agree_and_swebench_reads_the_run(task, container_factory, tmp_path):
    from coderl.grading.harness import cross_check, write_run

    rows = []
    for name, diff in (("gold", task.gold_patch), ("empty", "")):
        result, report = cross_check(task, diff, factory=container_factory)
        assert report["coderl"]["agree"] is True, (name, report["coderl"])
        assert report["patch_successfully_applied"]
        status = report["tests_status"]
        f2p = status["FAIL_TO_PASS"]
        assert (sorted(f2p["success"]) == sorted(task.FAIL_TO_PASS)) == (name == "gold")
        assert len(status["PASS_TO_PASS"]["success"]) == len(task.PASS_TO_PASS)
        rows.append((f"{task.id}-{name}", diff or "\n", report))
    summary = json.loads(write_run(tmp_path, "parity", "coderl/test", rows).read_text())
    assert summary["resolved_ids"] == [f"{task.id}-gold"]
    assert summary["unresolved_ids"] == [f"{task.id}-empty"]
    assert summary["error_ids"] == [] and summary["schema_version"] == 2
    assert (tmp_path / "predictions.jsonl").read_text().count("\n") == 2


FORGE = """
import atexit as _atexit, os as _os, sys as _sys
def _forge():
    _sys.stdout.flush()
    for _t in {ids!r}:
        print("PASSED " + _t)
    _sys.stdout.flush()
    _os._exit(0)
_atexit.register(_forge)
"""


@needs_containers
def test_a_log_forged_by_the_graded_code_fools_the_parser_not_coderl(task, container_factory):
    from coderl.grading.grade import rollout_base
    from coderl.grading.harness import cross_check
    from coderl.tasks.patches import make_diff, paths_in_diff

    rel = paths_in_diff(task.gold_patch)[0]  # the module the fix is in: the tests import it
    old = (rollout_base(task) / rel).read_text()
    diff = make_diff(rel, old, old + FORGE.format(ids=list(task.FAIL_TO_PASS)))
    result, report = cross_check(task, diff, factory=container_factory)
    assert report["coderl"]["harness_resolved"] is True  # the log parser was fooled
    assert not result.resolved and result.failure_kind == "agent"
    assert report["resolved"] is False and report["coderl"]["agree"] is False
