"""Evaluation estimators: unbiased pass@k and best-of-n."""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code", Sec. 2.1, Eq. 1): ``1 - C(n - c, k) / C(n, k)``.

    The probability that at least one of ``k`` samples drawn without replacement from ``n``
    samples, ``c`` of them correct, is correct. Computed as the stable product
    ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` from the paper's Figure 3. When ``k > n - c``
    every draw of ``k`` contains a correct sample (1.0); with ``c = 0`` it is 0.0 for any ``k``.

    Args:
        n: samples drawn for the task (>= 1).
        c: correct samples among them (0 <= c <= n).
        k: the k of pass@k (>= 1). ``k > n`` is allowed only as the limit above.

    Returns:
        A float in ``[0, 1]``.

    Raises:
        ValueError: ``n < 1``, ``c`` outside ``[0, n]`` or ``k < 1``.
    """
    if n < 1 or not 0 <= c <= n or k < 1:
        raise ValueError(f"need n >= 1, 0 <= c <= n, k >= 1; got n={n}, c={c}, k={k}")
    if c == 0:
        return 0.0
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def best_of_n(scores_per_task: Sequence[Sequence[float]]) -> float:
    """Best-of-n: the mean over tasks of the best score among each task's n samples.

    With 0/1 scores it equals the empirical pass@n of the drawn samples. Tracked through training
    as a collapse check (a policy that keeps its best-of-16 still explores).

    Args:
        scores_per_task: one sequence of sample scores per task.

    Returns:
        The mean of per-task maxima.

    Raises:
        ValueError: no tasks, or a task with no samples.
    """
    if len(scores_per_task) == 0:
        raise ValueError("best_of_n needs at least one task")
    best = []
    for i, scores in enumerate(scores_per_task):
        if len(scores) == 0:
            raise ValueError(f"task {i} has no samples")
        best.append(max(float(s) for s in scores))
    return sum(best) / len(best)
