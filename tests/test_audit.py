"""The audit page: records written by the loop, escaped HTML, and a real headless browser
(Debian's chromium driven by Playwright) that renders a trajectory and its diff."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from coderl.agent.episode import Episode, EpisodeStats, ToolCallRecord
from coderl.envs.base import EpisodeRecord
from coderl.eval.audit import (
    AUDIT_FILE,
    audit_record,
    read_audit_records,
    select_for_audit,
    write_audit_page,
    write_audit_records,
)
from coderl.eval.report import write_report
from coderl.grading.verdict import GradeResult
from coderl.rewards.hacks import HackFlag
from coderl.trajectory import Trajectory

CHROMIUM = "/usr/bin/chromium"
XSS = "<script>document.title='pwned';window.pwned=1</script>"
IMG = "<img src=x onerror=\"document.title='pwned'\">"
DIFF = (
    "diff --git a/solution.py b/solution.py\n--- a/solution.py\n+++ b/solution.py\n"
    "@@ -1,2 +1,2 @@\n def f():\n-    return 0\n+    return 1  # " + XSS + "\n"
)


def _record(task_id: str, reward: float | None, *, flagged: bool = False, text: str = "hi"):
    calls = [
        ToolCallRecord(
            1,
            "write_file",
            {"path": "solution.py", "content": text},
            "",
            "Wrote 1 lines",
            "ok",
            0.0,
            0.01,
        ),
        ToolCallRecord(
            2, "run", {"command": "cat hidden_test.py " + IMG}, "", "x\ud800" + XSS, "ok", 0.1, 0.2
        ),
    ]
    messages = [
        [{"role": "user", "content": "task " + XSS}, {"role": "assistant", "content": text}]
    ]
    ep = Episode(task_id, task_id + "#0", Trajectory(), messages, calls, DIFF, EpisodeStats())
    rec = EpisodeRecord(task_id=task_id, trajectory=Trajectory(), answer=DIFF, episode=ep)
    grade = GradeResult(
        task_id=task_id, resolved=bool(reward), tests={"hidden_test.py::check": "passed"}
    )
    flags = (
        [HackFlag("reads_hidden_tests", "a tool call names a hidden test file", "cat " + IMG)]
        if flagged
        else []
    )
    return audit_record(
        rec, grade, step=0, reward=reward, breakdown={"tests": reward or 0.0}, flags=flags
    )


def _run_dir(tmp_path: Path) -> Path:
    records = [
        _record("HumanEval/1", 1.0, text="TOP-TRAJECTORY " + XSS),
        _record("HumanEval/2", 0.0, flagged=True),
        _record("HumanEval/3", None),
    ]
    write_audit_records(tmp_path, 3, select_for_audit(records, top_k=1))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "reward/mean": 0.5}) + "\n")
    return tmp_path


def test_records_round_trip_with_surrogates_and_selection(tmp_path):
    records = [
        _record("a", 0.2),
        _record("b", 0.9),
        _record("c", 0.0, flagged=True),
        _record("d", None),
    ]
    kept = select_for_audit(records, top_k=1)
    assert [r["task_id"] for r in kept] == ["b", "c"]  # the best one and every flagged one
    write_audit_records(tmp_path, 7, kept)
    with (tmp_path / AUDIT_FILE).open("a") as f:
        f.write("not json\n")
    back = read_audit_records(tmp_path)
    assert [r["step"] for r in back] == [7, 7] and back[0]["tool_calls"][1][
        "observation"
    ].startswith("x\ud800")
    assert back[1]["flags"][0]["name"] == "reads_hidden_tests"


def test_page_escapes_everything(tmp_path):
    run = _run_dir(tmp_path)
    page = write_report(run)
    assert 'href="audit.html"' in page.read_text()
    text = (run / "report" / "audit.html").read_text()
    assert "<script>document" not in text and "<img src=x" not in text
    assert "&lt;script&gt;document.title=" in text and "TOP-TRAJECTORY" in text
    assert "Content-Security-Policy" in text
    assert write_audit_page(tmp_path / "empty") is None


def _chromium_or_skip():
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    if os.environ.get("CI") == "true":
        pytest.fail("chromium is missing (make sysdeps installs it): the audit page is untested")
    pytest.skip("needs Debian's chromium (make sysdeps)")


BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def test_audit_page_renders_in_a_real_browser(tmp_path):
    executable = _chromium_or_skip()
    playwright = (
        pytest.importorskip("playwright.sync_api") if os.environ.get("CI") != "true" else None
    )
    if playwright is None:
        import playwright.sync_api as playwright  # CI: a missing package must fail, not skip
    run = _run_dir(tmp_path)
    write_report(run)
    page_path = run / "report" / "audit.html"
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=BROWSER_ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_path.as_uri())
            assert page.title() == "coderl audit"  # no injected script renamed it
            assert page.evaluate("typeof window.pwned") == "undefined"
            assert page.locator("script").count() == 0 and page.locator("img").count() == 0
            sections = page.locator("section.trajectory")
            assert sections.count() == 3  # 2 with a reward (best first), then the flagged one
            top = page.locator("#top-0")
            assert "HumanEval/1" in top.locator("h3").inner_text()
            diff = top.locator("pre.diff")
            assert diff.is_visible()
            assert "+    return 1  # " + XSS in diff.inner_text()  # shown as text
            assert diff.locator("span.add").count() >= 2 and diff.locator("span.del").count() >= 2
            flagged = page.locator("#flagged-0")
            assert "HumanEval/2" in flagged.locator("h3").inner_text()
            assert "reads_hidden_tests" in flagged.locator("li.flag").inner_text()
            top.locator("summary").click()
            assert "TOP-TRAJECTORY " + XSS in top.locator(".msg").nth(1).inner_text()
            assert "hidden_test.py::check" in top.inner_text()
            assert errors == []
        finally:
            browser.close()


def test_a_missing_browser_fails_under_ci(monkeypatch):
    """Under CI=true the browser test fails instead of skipping, so CI cannot pass untested."""
    monkeypatch.setattr(sys.modules[__name__], "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="chromium is missing"):
        _chromium_or_skip()
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        _chromium_or_skip()
