"""PyTorch Lightning's way into the compiled step: a strategy (Lightning's extension point for how
a model is wrapped, stepped and synchronised).

``Trainer(strategy=CompiledStepStrategy(max_grad_norm=1.0))`` trains the LightningModule with
``smddp_lite.compile``: gradient buckets all-reduced while backward runs, and the optimizer that
``configure_optimizers`` returns replaced by its fused step. Everything else is Lightning's DDP
strategy (process launch, process group, samplers, ``self.log(sync_dist=True)``, checkpoints,
``accumulate_grad_batches``), so a script moves over by changing its ``strategy=`` alone.
"""

from __future__ import annotations

from contextlib import contextmanager

from lightning.pytorch.strategies import DDPStrategy

from .compiler import CompiledModel, detach
from .compiler import compile as compile_step


class CompiledStepStrategy(DDPStrategy):
    """Lightning's DDP strategy with ``smddp_lite.compile`` in place of DistributedDataParallel.

    Args:
        process_group_backend: the backend of the process group Lightning initialises ("smddp").
        **compile_options: ``smddp_lite.compile``'s options (``max_grad_norm``, ``wire_dtype``,
            ``torch_compile``, ``shard_optimizer_state``, ...). Pass clipping here as
            ``max_grad_norm`` rather than as the Trainer's ``gradient_clip_val``: here it is taken
            inside the fused step; Lightning's clipping also works, as an extra pass over every
            gradient before the step.

    ``configure_optimizers`` must return one optimizer that ``smddp_lite.compile`` supports
    (AdamW, Adam or SGD), with or without LR schedulers.
    """

    strategy_name = "smddp_compiled"

    def __init__(self, process_group_backend: str = "smddp", **compile_options) -> None:
        super().__init__(process_group_backend=process_group_backend)
        self._compile_options = compile_options

    def configure_ddp(self) -> None:
        """Nothing to wrap yet: the compiled step needs the optimizer, which Lightning creates
        next (``setup_optimizers``)."""

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"CompiledStepStrategy: configure_optimizers returned {len(self.optimizers)} optimizers; the compiled "
                "step fuses one. Return one optimizer (param groups may differ in settings), or use DDPStrategy")
        # schedulers stay on the optimizer Lightning made: the compiled one shares its param groups
        self.model, optimizer = compile_step(self.lightning_module, self.optimizers[0], **self._compile_options)
        self.optimizers = [optimizer]

    @contextmanager
    def block_backward_sync(self):
        """Gradient accumulation (``accumulate_grad_batches``): the compiled model's ``no_sync``."""
        if isinstance(self.model, CompiledModel):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def teardown(self) -> None:
        if isinstance(self.model, CompiledModel):  # as DDP's wrapper goes, so do the step's hooks
            detach(self.model.module)
            self.model = self.lightning_module
        super().teardown()
