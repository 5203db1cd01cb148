"""torch's intra-op threads for a command's process: the config's top-level ``threads``.

torch starts as many intra-op threads as the machine has cores (``OMP_NUM_THREADS`` where set).
Two processes that each do so on the same cores spin-wait for each other: on a 2-core machine
under load one toy training step took 60 s at 2 threads and 6.4 s at 1 (docs/training.md).
"""

from __future__ import annotations

import torch


def use_threads(threads: int | None) -> None:
    """Set this process's intra-op threads to ``threads`` (the config's ``threads``); None keeps
    torch's default (``OMP_NUM_THREADS`` where set, else one per core). A number given in the
    config wins over ``OMP_NUM_THREADS``: the config is what the run's ``config.yaml`` records."""
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
