"""The Hugging Face Trainer's way into the compiled step: a Trainer that builds its optimizer
through ``smddp_lite.compile``.

``create_optimizer`` is the Trainer's documented place to change the optimizer. Overriding it, the
Trainer compiles the model with the optimizer it would have used (``TrainingArguments.optim``,
its weight-decay groups and learning rate) and hands the compiled model to the training loop as
its wrapped model (``model_wrapped``), which the Trainer then leaves unwrapped: it wraps a model
in torch's DDP (through Accelerate) only when nothing has wrapped it yet. Everything else is the
Trainer's own: the LR schedule, gradient accumulation (through the compiled model's
``no_sync``, which Accelerate calls), ``max_grad_norm`` clipping, logging and checkpoints.
"""

from __future__ import annotations

import torch
from transformers import Trainer

from .compiler import CompiledModel, compile as compile_step


class CompiledStepTrainer(Trainer):
    """``transformers.Trainer`` training with ``smddp_lite.compile``: gradient buckets all-reduced
    while backward runs and the optimizer's fused step.

    Args:
        *args, **kwargs: the Trainer's.
        compile_options: ``smddp_lite.compile``'s options (``wire_dtype``, ``torch_compile``,
            ``shard_optimizer_state``, ...).

    Initialise the process group before ``TrainingArguments`` (as for any Trainer on "smddp").
    The optimizer (``TrainingArguments.optim``, or one passed as ``optimizers=``) must be one the
    compiled step supports ("adamw_torch", "adamw_torch_fused", "sgd"); the Trainer's ``max_grad_norm`` clipping works as
    it does under DDP, as one pass over the gradients before the step.
    """

    def __init__(self, *args, compile_options: dict | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._compile_options = dict(compile_options or {})
        self._compiled: CompiledModel | None = None

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self._compiled is not None and self._compiled.module is self.model:  # a second train()
            return self.optimizer
        optimizer = super().create_optimizer(model)  # or the one passed as optimizers=(optimizer, scheduler)
        self._compiled, self.optimizer = compile_step(self.model, optimizer, **self._compile_options)
        # the training loop wraps model_wrapped in DDP only when it is the bare model
        self.model_wrapped = self._compiled
        return self.optimizer
