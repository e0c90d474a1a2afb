"""The batch-size / learning-rate rule for data-parallel training."""

from __future__ import annotations

import math


def scale_lr(base_lr: float, batch_growth: float, rule: str = "linear") -> float:
    """Learning rate for a global batch ``batch_growth`` times the one ``base_lr`` was tuned for.

    Data parallelism multiplies the global batch by the number of ranks (k ranks, same per-rank
    batch: ``batch_growth=k``). Scale the learning rate linearly (``rule="linear"``: x k) or by
    the square root (``rule="sqrt"``: x sqrt(k), gentler, common for Adam-type optimizers).

    Example::

        lr = smddp_lite.scale_lr(3e-4, dist.get_world_size())          # linear
        lr = smddp_lite.scale_lr(3e-4, dist.get_world_size(), "sqrt")
    """
    if not batch_growth > 0:
        raise ValueError(f"scale_lr: batch_growth must be positive, found {batch_growth}")
    if rule == "linear":
        return base_lr * batch_growth
    if rule == "sqrt":
        return base_lr * math.sqrt(batch_growth)
    raise ValueError(f"scale_lr: rule must be 'linear' or 'sqrt', found {rule!r}")
