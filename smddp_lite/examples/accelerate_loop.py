"""Hugging Face Accelerate on the "smddp" backend: a training loop written for Accelerate.

Accelerate takes the process group it finds: initialise it first (its own launch options name
only the backends it knows).

    torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.accelerate_loop
    torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.accelerate_loop --compile
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate import Accelerator

import smddp_lite
from smddp_lite.examples import _outcome


def main() -> None:
    args = _outcome.arguments(__doc__)
    smddp_lite.init(backend=args.backend)  # before Accelerator(): it uses this group
    # --compile: Accelerate's own switch (its dynamo plugin), which compiles the DDP model it wraps
    accelerator = Accelerator(cpu=True, dynamo_backend="inductor" if args.compile else "no")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(128, 16, generator=gen)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for step, (inputs, labels) in zip(range(args.steps), loader):
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())  # the mean over ranks
    if accelerator.is_main_process:
        print(f"Accelerate on {args.backend}: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    _outcome.write(args.out, losses, accelerator.unwrap_model(model))
    accelerator.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
