"""Triton kernels, one file per job, each with its launcher and the pure-torch reference that is
the CPU path, the test oracle and the benchmark baseline: the fused optimizer updates (one file
per optimizer family), the step's scalars, and the 8-bit wire's blockwise quantization."""

from .adam import adam_reference, adam_step
from .quantize import dequantize_add, quantize
from .sgd import sgd_reference, sgd_step
from .step_scalars import step_scalars, step_scalars_reference

__all__ = ["adam_step", "adam_reference", "sgd_step", "sgd_reference", "step_scalars", "step_scalars_reference",
           "quantize", "dequantize_add"]
