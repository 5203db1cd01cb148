"""coderl.progress: what long phases print (the masked-failure log of a phase's episodes)."""

import logging

from coderl.progress import warn_masked


def test_a_masked_cause_prints_one_traceback_not_one_per_episode(caplog) -> None:
    """128 episodes masked by one cause (environments not built) give one warning with its
    traceback; later ones of that cause go to debug (traceback kept); another cause, another
    exception text or another message template warns again."""
    log = logging.getLogger("coderl.test_masked")
    caplog.set_level(logging.DEBUG, logger="coderl.test_masked")

    def fail(exc: Exception, msg: str = "task %s: sandbox could not start (masked)") -> None:
        try:
            raise exc
        except Exception:
            warn_masked(log, msg, "t")

    for _ in range(5):
        fail(KeyError("no built environment matches 'six@1.16'"))
    fail(KeyError("no built environment matches 'toolz@0.12'"))
    fail(OSError("no built environment matches 'six@1.16'"))
    fail(KeyError("no built environment matches 'six@1.16'"), "task %s: diff failed (masked)")
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING] + [logging.DEBUG] * 4 + [logging.WARNING] * 3
    assert all(r.exc_info for r in caplog.records)
    assert "same cause" in caplog.records[1].getMessage()
