"""Fused optimizer-update kernels: one file per optimizer family, each with its Triton kernel,
its launcher and the pure-torch reference that is the CPU path, the test oracle and the
benchmark baseline."""

from .adam import adam_reference, adam_step
from .sgd import sgd_reference, sgd_step

__all__ = ["adam_step", "adam_reference", "sgd_step", "sgd_reference"]
