"""A SWE-bench-format instance that brings its own image (``coderl.grading.harness``): the episode
runs in a container of the image, and the grade runs the instance's eval script in a fresh
container of it, read by ``swebench``'s log parser and ``get_eval_report``.

The image is built here (no registry; ``tests/instance_image.py``). Needs root and podman (make
sysdeps); PyPI for pytest the first time (then cached by its input hash).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.instance_image import calc_instance

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("podman") is None,
    reason="instance images need root and podman (make sysdeps)",
)


@pytest.fixture(scope="module")
def instance(tmp_path_factory) -> dict:
    return calc_instance(tmp_path_factory.mktemp("ctx"))


def test_an_episode_in_the_instance_image_is_graded_as_the_harness_grades(instance):
    from coderl.grading.harness import grade_instance, instance_sandbox

    with instance_sandbox(instance) as sb:
        assert sb.exec("/venv/bin/python -c 'import pytest'").exit_code == 0  # the image's env
        assert sb.exec("git log --oneline | wc -l").stdout.strip() == "1"
        sb.exec("sed -i '2s/a - b/a + b/' calc.py")
        diff = sb.diff()
    assert "+    return a + b" in diff and ".git" not in diff
    fixed = grade_instance(instance, diff)
    assert fixed["resolved"] and fixed["patch_successfully_applied"]
    assert fixed["tests_status"]["FAIL_TO_PASS"]["success"] == ["tests/test_calc.py::test_add"]
    empty = grade_instance(instance, "")
    assert not empty["resolved"]
    assert empty["tests_status"]["FAIL_TO_PASS"]["failure"] == ["tests/test_calc.py::test_add"]


def test_the_instances_test_files_are_not_the_agents_to_change(instance, monkeypatch):
    """A diff that points the test module at a correct stand-in (``import fakecalc as calc``)
    would resolve the instance; the test file is protected (coderl's test-file patterns and the
    files of the instance's test_patch), so that chunk is stripped and ``test_add`` fails against
    the real ``calc``."""
    import coderl.grading.protected as protected
    import coderl.tasks.patches as patches
    from coderl.grading.harness import grade_instance

    old = "import calc\n\ndef test_sub():\n    assert calc.sub(3, 2) == 1\n"
    forged = patches.make_diff(
        "tests/test_calc.py", old, old.replace("import calc", "import fakecalc as calc")
    )
    forged += (
        "diff --git a/fakecalc.py b/fakecalc.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/fakecalc.py\n@@ -0,0 +1,2 @@\n+add = lambda a, b: a + b\n+sub = lambda a, b: a - b\n"
    )
    assert not grade_instance(instance, forged)["resolved"]
    import coderl.grading.guardproc as guardproc

    # unprotected (and the guard, which denies the new import of `fakecalc`, off): it would
    monkeypatch.setattr(protected, "is_protected", lambda *a, **k: False)
    monkeypatch.setattr(guardproc, "scan_change", lambda *a, **k: [])
    assert grade_instance(instance, forged)["resolved"]


def test_the_image_scheme_names_the_image_when_the_instance_does_not(instance):
    from coderl.grading.harness import instance_image

    assert instance_image(instance) == instance["image"]
    assert Path(instance["image"]).name.startswith("coderl-instance-test:")


def test_an_image_task_grades_as_the_reward_reads_it(instance):
    """The instance as a training task (``image_task``; named by SWE-smith's ``image_name``
    here, so ``make_test_spec``'s ``image`` comes from ``instance_image``): the gold patch
    resolves with every test passed, the empty patch is the agent's failure with the
    FAIL_TO_PASS test failed, a patch that does not apply is the agent's failure too."""
    from coderl.grading.harness import grade_image_task
    from coderl.tasks.swebench import image_task, task_instance

    smith = {k: v for k, v in instance.items() if k != "image"} | {"image_name": instance["image"]}
    task = image_task(smith)
    assert task.env_id == "image:" + instance["image"] and task.held_out_tests == []
    assert task_instance(task)["image_name"] == instance["image"]
    gold = grade_image_task(task, task.gold_patch)
    assert gold.resolved and gold.grading_error is None and gold.fraction_passed == 1.0
    assert gold.tests == {
        "tests/test_calc.py::test_add": "passed",
        "tests/test_calc.py::test_sub": "passed",
    }
    empty = grade_image_task(task, "")
    assert not empty.resolved and empty.failure_kind == "agent" and empty.grading_error is None
    assert empty.tests["tests/test_calc.py::test_add"] == "failed"
    assert empty.fail_to_pass_passed == 0.0 and empty.fraction_passed == 0.5
    assert empty.partial_credit == 0.0  # what reward.tests=fraction pays the starting state
    broken = grade_image_task(task, task.gold_patch.replace("a - b", "a * b"))
    assert not broken.resolved and broken.failure_kind == "agent"
    assert broken.reason == "the patch did not apply"


def test_a_log_the_parser_cannot_read_is_the_agents_failure_not_a_mask(instance, monkeypatch):
    """The instance's log parser reads output the graded code wrote, so what it raises on that
    log is scored as the agent's failure (unresolved, nothing passed), never masked as
    infrastructure: otherwise a policy could turn any grade into "no number" by printing what
    crashes the parser."""
    import swebench.harness.grading as swegrading

    from coderl.grading.harness import grade_image_task
    from coderl.tasks.swebench import image_task

    def crash(*args, **kwargs):
        raise IndexError("list index out of range")  # as a parser meeting a forged line would

    monkeypatch.setattr(swegrading, "get_eval_report", crash)
    task = image_task(instance)
    g = grade_image_task(task, task.gold_patch)
    assert not g.resolved and g.grading_error is None and g.failure_kind == "agent"
    assert "could not read the test log (IndexError" in g.reason
    assert g.fraction_passed == 0.0 and g.partial_credit == 0.0


def _long_path_file(text: str) -> str:
    """A diff adding a file whose path git takes (under 4,096 bytes relative to the tree) but
    whose absolute path on the host is past ``PATH_MAX`` once the grader's own prefix is added."""
    name = "/".join(["d" * 200] * 20) + "/" + "f" * 60 + ".txt"
    return f"diff --git a/{name} b/{name}\nnew file mode 100644\n--- /dev/null\n+++ b/{name}\n@@ -0,0 +1 @@\n+{text}\n"


def test_a_path_the_host_cannot_read_back_is_the_agents_failure_not_a_mask(instance):
    """What the diff wrote decides whether its tree can be read back, so an ``OSError`` there
    (here ``ENAMETOOLONG``: the path is legal relative to the tree and past ``PATH_MAX`` on the
    host) is scored as the agent's failure, for a wrong fix and the gold patch alike; it used to
    be masked as infrastructure, a mask any policy could choose."""
    from coderl.grading.harness import grade_image_task
    from coderl.tasks.swebench import image_task

    task = image_task(instance)
    for patch in (task.gold_patch.replace("a - b", "a * b"), task.gold_patch):
        g = grade_image_task(task, patch + _long_path_file("a byproduct"))
        assert not g.resolved and g.grading_error is None and g.failure_kind == "agent", g


def test_a_full_disk_while_applying_is_the_hosts_fault(instance, monkeypatch):
    """Only the host's own ``OSError`` numbers (``HOST_ERRNOS``: no space, quota, memory) are
    masked as infrastructure while a diff is applied."""
    import errno

    import coderl.grading.harness as harness
    from coderl.tasks.swebench import image_task

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(harness, "apply_to_copy", full)
    task = image_task(instance)
    g = harness.grade_image_task(task, task.gold_patch)
    assert g.grading_error and "No space left" in g.grading_error and g.failure_kind == "infra"
