"""Test-wide setup. Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter,
which must be chosen before anything imports triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
