"""PyTorch Lightning on the "smddp" backend: its DDP strategy, told the backend's name.

    torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.lightning_fit
    torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.lightning_fit --compile
    torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.lightning_fit --compiled-step
"""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

import smddp_lite  # noqa: F401  (registers "smddp"; installing smddp-lite does it too, see the README)
from smddp_lite.examples import _outcome


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
        self.losses: list[float] = []

    def training_step(self, batch, _):
        inputs, labels = batch
        loss = torch.nn.functional.cross_entropy(self.net(inputs), labels)
        self._record(loss.detach())
        return loss

    # logging reads the loss's value and calls Lightning's machinery: under torch.compile (--compile)
    # it runs as plain Python, outside the graph, as logging should
    @torch.compiler.disable
    def _record(self, loss: torch.Tensor) -> None:
        self.losses.append(float(self.trainer.strategy.reduce(loss, reduce_op="mean")))  # over ranks
        self.log("loss", loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    args = _outcome.arguments(__doc__, compiled_step=True, accumulate=True)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(128, 16, generator=gen)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
    model = Classifier()
    if args.compiled_step:  # smddp_lite.compile's buckets and fused AdamW, through Lightning's extension point
        from smddp_lite.lightning_strategy import CompiledStepStrategy

        strategy = CompiledStepStrategy(process_group_backend=args.backend)
    else:
        strategy = DDPStrategy(process_group_backend=args.backend)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy,
                        max_steps=args.steps, accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    # --compile: a compiled LightningModule, which Lightning unwraps, wraps in DDP and compiles again
    trainer.fit(torch.compile(model) if args.compile else model, torch.utils.data.DataLoader(data, batch_size=8))
    if trainer.is_global_zero:
        print(f"Lightning on {args.backend}: {len(model.losses)} steps, "
              f"loss {model.losses[0]:.4f} -> {model.losses[-1]:.4f}")
    _outcome.write(args.out, model.losses, model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
