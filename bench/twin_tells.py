"""How well a forge that reads the planted file picks each real FAIL_TO_PASS test among its
mutated twins (``coderl.grading.twins``), against chance ``1 / (n + 1)`` for ``n`` twins:
static, nothing runs.

Plants shipped tasks' second runs as ``grade()`` would (``plant_canaries`` over the
environment's snapshot, the rest of its suite as ``others``) and, for each test with at least
two twins, finds its look-alikes in file order and the changed token of each. Forges scored
(the red team's attack8 a3/a4 and its string-centre note): a fixed index (the likeliest of
this run per group size: the printed best is the largest count, so above chance by noise
alone); ``smallest``, the smallest number (a small count's low place in its run shows here);
``a4``, an index with ascending values on each side of it (the likeliest under a
Binomial(n, 1/2) prior; a random look-alike when none is); ``centre``, the look-alike whose
changed token is closest to the others by summed Hamming distance (ties at random). Not
scored: plausibility (an English word, a round number).
Run: ``python bench/twin_tells.py [--plantings 5] [--task ID_SUFFIX] [TASK_FILE ...]``
(default: six; attack8's a4 task: ``--plantings 300 --task f71f3001a8``).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import math
import random
import re
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from coderl.grading.rerun import plant_canaries
from coderl.grading.twincheck import twin_policy
from coderl.tasks.env import find_env
from coderl.tasks.spec import load_tasks

_TOKEN = re.compile(rb"[\w.]")


def groups(text: bytes, real_to_twins: dict[str, list[str]]) -> list[tuple[int, list[bytes]]]:
    """Per real test (its new name -> its twins' names): the real one's index among its
    look-alikes in file order and each look-alike's changed token (bytes)."""
    lines = text.split(b"\n")
    spans = {
        f"{c.name}.{n.name}" if c is not None else n.name: (n.lineno, n.end_lineno or n.lineno)
        for c, n in _defs(ast.parse(text))
    }
    out = []
    for real, twins in real_to_twins.items():
        members = sorted([real, *twins], key=lambda m: spans[m][0])
        bodies = [lines[spans[m][0] : spans[m][1]] for m in members]
        at = next(i for i, rows in enumerate(zip(*bodies, strict=True)) if len(set(rows)) > 1)
        changed = [rows[at] for rows in bodies]
        lo = min(_common(a, changed[0]) for a in changed)
        hi = min(_common(a[::-1], changed[0][::-1]) for a in changed)
        tokens = []
        for line in changed:
            start, end = lo, len(line) - hi
            while start and _TOKEN.match(line[start - 1 : start]):
                start -= 1
            while end < len(line) and _TOKEN.match(line[end : end + 1]):
                end += 1
            tokens.append(line[start:end])
        out.append((members.index(real), tokens))
    return out


def _defs(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield None, node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield node, sub


def _common(a: bytes, b: bytes) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _number(token: bytes) -> float | None:
    try:
        value = ast.literal_eval(token.decode())
    except (ValueError, SyntaxError):
        return None
    return value if type(value) in (int, float) else None


def forges(tokens: list[bytes], rng: random.Random) -> dict[str, int]:
    """Each forge's pick (an index) among the look-alikes' changed ``tokens`` (file order)."""
    picks = {}
    values = [_number(t) for t in tokens]
    if all(v is not None for v in values):
        picks["smallest"] = values.index(min(values))  # type: ignore[type-var]
        ok = [
            i for i in range(len(values)) if _ascending(values[:i]) and _ascending(values[i + 1 :])
        ]
        k = len(values) - 1
        picks["a4"] = max(ok, key=lambda i: math.comb(k, i)) if ok else rng.randrange(len(values))
    if len({len(t) for t in tokens}) == 1:
        spread = [
            sum(sum(a != b for a, b in zip(t, u, strict=True)) for u in tokens) for t in tokens
        ]
        picks["centre"] = rng.choice([i for i, s in enumerate(spread) if s == min(spread)])
    return picks


def _ascending(xs: list) -> bool:
    return all(a < b for a, b in itertools.pairwise(xs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=["data/tasks/six.jsonl.gz"])
    parser.add_argument("--plantings", type=int, default=5, help="second runs planted per task")
    parser.add_argument("--task", default="", help="only the task whose id ends so")
    args = parser.parse_args()
    rng = random.Random(0)
    places: dict[int, Counter[int]] = defaultdict(Counter)
    hits: dict[str, Counter[str]] = defaultdict(Counter)  # kind -> forge -> hits
    seen: Counter[str] = Counter()
    chance: Counter[str] = Counter()
    for path in args.files:
        for task in load_tasks(path):
            if task.kind != "repo" or not task.id.endswith(args.task):
                continue
            env = find_env(task.env_id)
            snap = Path(env.snapshot)
            f2p = list(dict.fromkeys(task.FAIL_TO_PASS))
            sources = {rel: snap / rel for rel in {t.split("::")[0] for t in f2p}}
            held = frozenset(task.held_out_tests)
            roots = [snap / t for t in env.test_paths]
            suite = tuple(p for r in roots for p in ([r] if r.is_file() else r.rglob("*.py")))
            for _ in range(args.plantings):
                with tempfile.TemporaryDirectory() as tmp:
                    policy = twin_policy(task)
                    pl = plant_canaries(sources, f2p, rng, Path(tmp), suite, held, policy)
                    texts = {m: Path(p).read_bytes() for m, p in pl.mounts.items()}
                back = {old: new for new, old in pl.renamed.items()}
                by_file: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
                for twin, real in pl.twins.items():
                    rel, *rest = real.split("[")[0].split("::")
                    new = back.get("::".join([rel, *rest]))
                    if new is None:  # an inherited method's twin: its class's own counts
                        continue
                    key = ".".join(new.split("::")[1:])
                    by_file[rel][key].append(".".join(twin.split("[")[0].split("::")[1:]))
                for rel, reals in by_file.items():
                    reals = {r: sorted(set(t)) for r, t in reals.items() if len(set(t)) >= 2}
                    for place, tokens in groups(texts[f"/testbed/{rel}"], reals):
                        kind = "number" if _number(tokens[0]) is not None else "other"
                        kind = "string" if tokens[0][:1] in b"'\"" or kind == "other" else kind
                        places[len(tokens)][place] += 1
                        seen[kind] += 1
                        chance[kind] += 1_000_000 // len(tokens)
                        for name, pick in forges(tokens, rng).items():
                            hits[kind][name] += pick == place
    for size, counts in sorted(places.items()):
        n = sum(counts.values())
        top = max(counts.values())
        print(
            f"{size} look-alikes: {n} groups; real index counts {dict(sorted(counts.items()))}; "
            f"best fixed index {top / n:.1%} (chance {1 / size:.1%})"
        )
    for kind in sorted(seen):
        rates = ", ".join(f"{f} {h / seen[kind]:.1%}" for f, h in sorted(hits[kind].items()))
        print(f"{kind}: {seen[kind]} groups, chance {chance[kind] / 1e6 / seen[kind]:.1%}: {rates}")


if __name__ == "__main__":
    main()
