"""The audit page: the top-reward and the flagged trajectories of a run, readable in a browser.

The loop appends one JSON line per kept trajectory to ``RUN_DIR/audit.jsonl``
(:func:`write_audit_records`); ``coderl report`` renders ``RUN_DIR/report/audit.html`` from it
(:func:`write_audit_page`). Record fields (every one optional when reading):

- ``step`` (int), ``task_id``, ``episode_id`` (str), ``finish_reason`` (str)
- ``reward`` (float or null when masked), ``breakdown`` ({term: weighted value})
- ``resolved`` (bool), ``fraction_passed`` (float), ``grading_error`` (str or null),
  ``reason`` (why not resolved), ``tests`` ({test id: outcome})
- ``flags`` ([{name, reason, evidence}], from :mod:`coderl.rewards.hacks`)
- ``messages`` ([[{role, content}]]: the messages of each context window)
- ``tool_calls`` ([{turn, name, arguments, status, observation, duration_s}])
- ``diff`` (the final diff)

Trajectory content is attacker-controlled (the policy wrote it), so every string is escaped
(``html.escape`` with quotes), and the page forbids scripts and remote loads with a
Content-Security-Policy as a second wall. Long fields are cut to ``MAX_FIELD_CHARS`` on writing.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from coderl.metrics import AUDIT_FILE

__all__ = [
    "AUDIT_FILE",
    "audit_record",
    "read_audit_records",
    "select_for_audit",
    "write_audit_page",
    "write_audit_records",
]
MAX_FIELD_CHARS = 50_000
"""Longest string kept per field in a record (head and tail around a marker)."""
TOP_K = 20
"""Highest-reward trajectories shown."""
MAX_FLAGGED = 50
"""Most flagged trajectories shown (the latest ones)."""
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'"


def audit_record(
    episode_record: Any,
    grade: Any,
    *,
    step: int,
    reward: float | None,
    breakdown: dict[str, float] | None = None,
    flags: Sequence[Any] = (),
) -> dict[str, Any]:
    """One audit record (module docstring) from an ``EpisodeRecord`` (its ``episode`` field,
    the harness's ``Episode``, gives messages and tool calls), a ``GradeResult`` or
    ``GradeRecord``, the sample's reward and its per-term breakdown, and its hack flags."""
    ep = getattr(episode_record, "episode", None)
    grade = getattr(grade, "result", None) or grade  # a GradeRecord's full GradeResult
    calls = [
        {
            k: getattr(c, k, None)
            for k in ("turn", "name", "arguments", "status", "observation", "duration_s")
        }
        for c in (getattr(ep, "tool_calls", None) or [])
    ]
    diff = getattr(ep, "diff", None)
    if not isinstance(diff, str):
        answer = getattr(episode_record, "answer", None)
        diff = answer if isinstance(answer, str) else ""
    return {
        "step": step,
        "task_id": getattr(episode_record, "task_id", ""),
        "episode_id": getattr(ep, "episode_id", ""),
        "finish_reason": getattr(episode_record, "finish_reason", ""),
        "reward": None if reward is None or not math.isfinite(reward) else float(reward),
        "breakdown": {k: v for k, v in (breakdown or {}).items()},
        "resolved": bool(getattr(grade, "resolved", False)),
        "fraction_passed": float(getattr(grade, "fraction_passed", 0.0) or 0.0),
        "grading_error": getattr(grade, "grading_error", None),
        "reason": getattr(grade, "reason", ""),
        "tests": dict(getattr(grade, "tests", None) or {}),
        "flags": [asdict(f) if is_dataclass(f) else dict(f) for f in flags],
        "messages": list(getattr(ep, "transcripts", None) or []),
        "tool_calls": calls,
        "diff": diff,
    }


def select_for_audit(
    records: Sequence[dict[str, Any]], *, top_k: int = TOP_K, max_flagged: int | None = None
) -> list[dict[str, Any]]:
    """The records worth keeping from one step: the ``top_k`` highest rewards (ties: the
    first) and every flagged one (the first ``max_flagged`` when set), each once, in input
    order."""
    ranked = sorted(
        (i for i, r in enumerate(records) if r.get("reward") is not None),
        key=lambda i: -float(records[i]["reward"]),
    )
    flagged = [i for i, r in enumerate(records) if r.get("flags")]
    keep = set(ranked[:top_k]) | set(flagged if max_flagged is None else flagged[:max_flagged])
    return [r for i, r in enumerate(records) if i in keep]


def write_audit_records(run_dir: str | Path, step: int, records: Iterable[dict[str, Any]]) -> Path:
    """Append ``records`` (from :func:`audit_record`) to ``RUN_DIR/audit.jsonl``, each stamped
    with ``step``, long strings cut, as ASCII JSON (lone surrogates escaped); returns the file."""
    path = Path(run_dir) / AUDIT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="ascii") as f:
        for rec in records:
            row = _cut_strings({**rec, "step": step})
            f.write(json.dumps(row, ensure_ascii=True, default=repr) + "\n")
    return path


def _cut_strings(value: Any) -> Any:
    if isinstance(value, str):
        if len(value) <= MAX_FIELD_CHARS:
            return value
        half = MAX_FIELD_CHARS // 2
        cut = len(value) - 2 * half
        return f"{value[:half]}\n[... {cut} characters cut ...]\n{value[-half:]}"
    if isinstance(value, dict):
        return {str(k): _cut_strings(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cut_strings(v) for v in value]
    return value


def read_audit_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every well-formed record of ``RUN_DIR/audit.jsonl`` (malformed lines are skipped);
    ``[]`` when there is no file."""
    path = Path(run_dir) / AUDIT_FILE
    if not path.is_file():
        return []
    out = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def write_audit_page(run_dir: str | Path, *, top_k: int = TOP_K) -> Path | None:
    """Write ``RUN_DIR/report/audit.html`` from ``audit.jsonl``: the ``top_k`` highest-reward
    trajectories over the run, then the flagged ones (latest ``MAX_FLAGGED``). Returns the page,
    or None when the run has no audit records."""
    records = read_audit_records(run_dir)
    if not records:
        return None
    rewarded = [r for r in records if _number(r.get("reward")) is not None]
    top = sorted(rewarded, key=lambda r: -(_number(r.get("reward")) or 0.0))[:top_k]
    flagged = [r for r in records if r.get("flags")][-MAX_FLAGGED:]
    body = [
        f"<h1>Audit: {_e(Path(run_dir).name)}</h1>",
        f"<p>{len(records)} kept trajectories; {sum(bool(r.get('flags')) for r in records)} "
        "flagged by hack detectors.</p>",
        f'<h2 id="top">Top {len(top)} by reward</h2>',
        *(_trajectory(r, f"top-{i}") for i, r in enumerate(top)),
        f'<h2 id="flagged">Flagged ({len(flagged)})</h2>',
        *(_trajectory(r, f"flagged-{i}") for i, r in enumerate(flagged)),
    ]
    page = f"""<!doctype html>
<html><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<title>coderl audit</title>
<style>body{{font-family:sans-serif;margin:2em}}pre{{background:#f6f6f6;padding:0.5em;
white-space:pre-wrap;word-break:break-all}}.flag{{color:#a00}}td{{padding:0.1em 0.6em;
border-bottom:1px solid #ddd}}.msg{{border-left:3px solid #ccc;padding-left:0.5em;margin:0.3em 0}}
.add{{color:#070}}.del{{color:#900}}</style></head><body>
{"".join(body)}
</body></html>
"""
    out = Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    index = out / "audit.html"
    index.write_bytes(page.encode("utf-8", "backslashreplace"))
    return index


def _e(value: Any) -> str:
    return html.escape(value if isinstance(value, str) else json.dumps(value, default=repr))


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _trajectory(r: dict[str, Any], anchor: str) -> str:
    reward = _number(r.get("reward"))
    head = (
        f"step {_e(r.get('step', '?'))} · {_e(r.get('task_id', ''))} · reward "
        f"{'masked' if reward is None else f'{reward:.3f}'} · "
        f"{'resolved' if r.get('resolved') else 'not resolved'} · {_e(r.get('finish_reason', ''))}"
    )
    parts = [f'<section class="trajectory" id="{_e(anchor)}"><h3>{head}</h3>']
    flags = r.get("flags") if isinstance(r.get("flags"), list) else []
    if flags:
        items = "".join(
            f'<li class="flag"><b>{_e(f.get("name", ""))}</b>: {_e(f.get("reason", ""))} '
            f"<code>{_e(f.get('evidence', ''))}</code></li>"
            for f in flags
            if isinstance(f, dict)
        )
        parts.append(f"<ul>{items}</ul>")
    if r.get("grading_error"):
        parts.append(f"<p>grading error: {_e(r['grading_error'])}</p>")
    if r.get("reason"):
        parts.append(f"<p>grader: {_e(r['reason'])}</p>")
    parts.append(_table("Reward breakdown", r.get("breakdown")))
    parts.append(_table("Per-test outcomes", r.get("tests")))
    parts.append(_messages(r.get("messages")))
    parts.append(_calls(r.get("tool_calls")))
    parts.append("<h4>Final diff</h4>" + _diff(r.get("diff")))
    parts.append("</section>")
    return "\n".join(parts)


def _table(title: str, mapping: Any) -> str:
    if not isinstance(mapping, dict) or not mapping:
        return ""
    rows = "".join(f"<tr><td>{_e(str(k))}</td><td>{_e(v)}</td></tr>" for k, v in mapping.items())
    return f"<h4>{_e(title)}</h4><table>{rows}</table>"


def _messages(windows: Any) -> str:
    if not isinstance(windows, list) or not windows:
        return ""
    out = ["<details><summary>Messages</summary>"]
    for w, window in enumerate(windows):
        out.append(f"<h5>context window {w}</h5>")
        for m in window if isinstance(window, list) else []:
            if isinstance(m, dict):
                out.append(
                    f'<div class="msg"><b>{_e(m.get("role", ""))}</b>'
                    f"<pre>{_e(m.get('content', ''))}</pre></div>"
                )
    out.append("</details>")
    return "".join(out)


def _calls(calls: Any) -> str:
    if not isinstance(calls, list) or not calls:
        return ""
    rows = []
    for c in calls:
        if not isinstance(c, dict):
            continue
        rows.append(
            f'<div class="call"><b>{_e(c.get("name") or "(unparsed)")}</b> '
            f"[{_e(c.get('status', ''))}] turn {_e(c.get('turn', ''))}"
            f"<pre>{_e(c.get('arguments'))}</pre><pre>{_e(c.get('observation', ''))}</pre></div>"
        )
    return "<h4>Tool calls and observations</h4>" + "".join(rows)


def _diff(diff: Any) -> str:
    if not isinstance(diff, str) or not diff:
        return "<p>(empty)</p>"
    lines = []
    for ln in diff.splitlines():
        cls = "add" if ln.startswith("+") else "del" if ln.startswith("-") else ""
        lines.append(f'<span class="{cls}">{_e(ln)}</span>' if cls else _e(ln))
    return '<pre class="diff">' + "\n".join(lines) + "</pre>"
