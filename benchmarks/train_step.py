"""End-to-end training step of a GPT-2-small-sized causal language model, three ways, side by side.

  ddp-torch   DDP on torch's own backend (nccl for CUDA, gloo for CPU) with fused AdamW
  ddp-smddp   DDP on "smddp" with fused AdamW
  compiled    smddp_lite.compile (gradient buckets, fused Triton update)

Every variant trains its own copy of one model (the same initial weights) on the same batches:
bfloat16 autocast, gradients clipped to norm 1.0, AdamW (lr 3e-4, weight decay 0.1). Each round
times ``--steps`` steps of every variant in turn, so that noise hits them alike. Reports tokens
per second over all ranks, the step time as median [p20, p80], the peak memory the device
allocator saw during the variant's steps (CUDA; it includes the other variants' resident
weights and state, the same for all), and the final loss, which must agree between the three.

    torchrun --standalone --nproc-per-node 1 benchmarks/train_step.py --device cuda
    torchrun --standalone --nproc-per-node 2 benchmarks/train_step.py --size tiny       # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import smddp_lite

SIZES = {  # layers, width, heads, vocabulary, sequence, batch per rank
    "gpt2-small": (12, 768, 12, 50257, 1024, 8),
    "tiny": (2, 64, 4, 256, 32, 4),
}


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.fc, self.out = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CausalLM(torch.nn.Module):
    """GPT-2's shape: learned positions, pre-norm blocks, the output layer tied to the embedding."""

    def __init__(self, layers: int, width: int, heads: int, vocab: int, sequence: int) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(sequence, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_model(size: str, device: torch.device) -> torch.nn.Module:
    layers, width, heads, vocab, sequence, _ = SIZES[size]
    torch.manual_seed(0)
    return CausalLM(layers, width, heads, vocab, sequence).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpt2-small")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", help="write the measurements here (rank 0)")
    args = parser.parse_args()

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    smddp_lite.init()  # the default group is "smddp"
    rank, world = dist.get_rank(), dist.get_world_size()
    torch_backend = "nccl" if device.type == "cuda" else "gloo"
    reference = dist.new_group(backend=torch_backend)
    _, _, _, vocab, sequence, batch = SIZES[args.size]

    def fused_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)

    variants = {}
    for name, group in ((f"ddp-{torch_backend}", reference), ("ddp-smddp", None)):
        module = make_model(args.size, device)
        ddp = torch.nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None, process_group=group)
        variants[name] = (ddp, fused_adamw(ddp), True)
    module = make_model(args.size, device)
    compiled_model, compiled_opt = smddp_lite.compile(
        module, torch.optim.AdamW(module.parameters(), lr=3e-4, weight_decay=0.1), max_grad_norm=1.0)
    variants["compiled"] = (compiled_model, compiled_opt, False)

    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    batches = [torch.randint(vocab, (batch, sequence + 1), generator=generator).to(device)
               for _ in range(args.steps)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    losses: dict[str, float] = {}

    def step(name: str, tokens: torch.Tensor) -> torch.Tensor:
        model, opt, clip_by_hand = variants[name]
        with autocast:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        if clip_by_hand:  # the compiled optimizer clips inside its step (max_grad_norm)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def settle() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for name in variants:  # warm-up: allocations, buckets, kernels compiled
        step(name, batches[0])
    settle()
    times: dict[str, list[float]] = {name: [] for name in variants}
    peaks: dict[str, int] = {name: 0 for name in variants}
    for _ in range(args.rounds):
        for name in variants:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            for tokens in batches:
                settle()
                start = time.perf_counter()
                loss = step(name, tokens)
                settle()
                times[name].append(time.perf_counter() - start)
            losses[name] = loss.item()
            if device.type == "cuda":
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device))
    params = sum(p.numel() for p in variants["compiled"][0].parameters())
    tokens_per_step = batch * sequence * world
    rows = []
    for name, values in times.items():
        t = torch.tensor(values, dtype=torch.float64)
        med, p20, p80 = (float(t.quantile(q)) for q in (0.5, 0.2, 0.8))
        rows.append({"variant": name, "median_ms": med * 1e3, "p20_ms": p20 * 1e3, "p80_ms": p80 * 1e3,
                     "tokens_per_s": tokens_per_step / med, "peak_mib": peaks[name] / 2**20 if peaks[name] else None,
                     "final_loss": losses[name]})
    if rank == 0:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"# {args.size} causal LM ({params / 1e6:.1f}M parameters), {world} rank(s) on {where}, batch {batch} x "
              f"{sequence} tokens per rank, bf16 autocast, clip 1.0, AdamW; {args.rounds} rounds of {args.steps} "
              f"steps per variant; torch {torch.__version__}")
        print(f"# {'variant':<11} {'median ms':>10} {'p20':>9} {'p80':>9} {'tokens/s':>11} {'peak MiB':>9} "
              f"{'final loss':>10}")
        for r in rows:
            peak = f"{r['peak_mib']:9.0f}" if r["peak_mib"] else f"{'-':>9}"
            print(f"  {r['variant']:<11} {r['median_ms']:10.2f} {r['p20_ms']:9.2f} {r['p80_ms']:9.2f} "
                  f"{r['tokens_per_s']:11.0f} {peak} {r['final_loss']:10.4f}")
        by_name = {r["variant"]: r["median_ms"] for r in rows}
        base = by_name[f"ddp-{torch_backend}"]
        print(f"# ddp-smddp {base / by_name['ddp-smddp']:.3f}x and compiled {base / by_name['compiled']:.3f}x the "
              f"speed of ddp-{torch_backend}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"size": args.size, "parameters": params, "world_size": world, "device": where,
                           "torch": torch.__version__, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
