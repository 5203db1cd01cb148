"""Evaluation: pass@k and best-of-n with confidence intervals, and run reports."""

from coderl.eval.passk import Estimate, EvalResult, evaluate, paired_difference, summarize

__all__ = ["EvalResult", "Estimate", "evaluate", "paired_difference", "summarize"]
