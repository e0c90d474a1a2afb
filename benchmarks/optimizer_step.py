"""Time of the optimizer step, from reduced gradients to updated parameters, side by side.

Compares, for AdamW with float32 parameters and state, loss scaling and clipping to norm 1.0:
  eager     GradScaler.unscale_ + clip_grad_norm_(foreach=True) + AdamW(fused=True)
  compile   torch.compile of that same step (compile time reported apart)
  smddp     smddp_lite.compile's step: per-bucket norms + one fused update per bucket
Each round times every variant once, alternating, so noise hits all alike. Reports median
[p20, p80], effective GB/s counted by the 28 bytes per parameter an AdamW step must move (read
grad, param, exp_avg, exp_avg_sq; write the last three), and that as a percentage of this
device's measured copy bandwidth. With a loss scale or clipping, as here, every variant also
writes the unscaled, clipped gradient back into .grad (4 bytes more), as torch.optim scripts
leave it; the floor stays 28.

    python benchmarks/optimizer_step.py --params 1M,8M,32M                # CPU
    python benchmarks/optimizer_step.py --device cuda --params 125M,350M,1B
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import smddp_lite

BYTES_PER_PARAM = 28  # AdamW, float32 state: 4 streams read, 3 written, 4 bytes each


def parse_count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "B": 10**9}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if text[-1].isalpha() else text) * scale)


def make_params(total: int, device: str) -> list[torch.nn.Parameter]:
    """Transformer-like shapes: square matrices of width 1024 and their biases, then a remainder."""
    shapes, left = [], total
    while left >= 1024 * 1024 + 1024:
        shapes += [(1024, 1024), (1024,)]
        left -= 1024 * 1024 + 1024
    if left:
        shapes.append((left,))
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device) * 0.02) for s in shapes]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def copy_bandwidth(device: str, numel: int) -> float:
    """Bytes per second of a plain copy (read + write) of ``numel`` float32, best of 5."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    best = min(timed(lambda: dst.copy_(src), device) for _ in range(5))
    return 2 * numel * 4 / best


class Variant:
    def __init__(self, name: str, params: list[torch.nn.Parameter], device: str) -> None:
        self.name, self.params, self.device = name, params, device
        gen = torch.Generator().manual_seed(1)
        self.grads = [torch.randn(p.shape, generator=gen).to(device) * 1024.0 for p in params]  # loss-scaled
        self.scale = torch.tensor(1024.0, device=device)


def build_eager(params, device, compiled: bool):
    v = Variant("compile" if compiled else "eager", params, device)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    for p, g in zip(params, v.grads):
        p.grad = g.clone()
    inv = v.scale.reciprocal()

    def step():  # GradScaler.unscale_ is a foreach multiply by 1/scale with an inf check
        grads = [p.grad for p in params]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1, device=device), inv)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    v.step = torch.compile(step) if compiled else step
    return v


def build_smddp(params, device):
    v = Variant("smddp", params, device)
    model = torch.nn.ParameterList(params)
    _, opt = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01),
                                max_grad_norm=1.0)
    for p, g in zip(model.parameters(), v.grads):
        p.grad.copy_(g)  # .grad is a view into its bucket: the "reduced gradients in the buckets"
    found_inf = torch.zeros(1, device=device)

    def step():
        for b in opt.buckets:
            opt.reducer.bucket_norm(b)
        opt.grad_scale, opt.found_inf = v.scale, found_inf  # what GradScaler.step hands over
        opt.step()

    v.step = step
    return v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="1M,8M,32M", help="parameter counts (K/M/B suffixes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-torch-compile", action="store_true", help="skip the torch.compile variant")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args()
    dev = args.device
    bandwidth = copy_bandwidth(dev, 64 * 2**20)
    name = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or platform.machine()
    print(f"# optimizer step, AdamW float32, clip 1.0, loss scale 1024; device {dev} ({name}); torch {torch.__version__}")
    print(f"# copy bandwidth {bandwidth / 1e9:.2f} GB/s; {args.rounds} alternating rounds; times in ms, median [p20, p80]")
    print(f"# {'params':>10} {'variant':<8} {'median':>9} {'p20':>9} {'p80':>9} {'GB/s':>7} {'% copy':>7} {'vs eager':>8}")
    rows = []
    for count in map(parse_count, args.params.split(",")):
        variants = [build_eager(make_params(count, dev), dev, False)]
        compile_s = None
        if not args.no_torch_compile:
            v = build_eager(make_params(count, dev), dev, True)
            compile_s = timed(v.step, dev)  # the first call compiles
            variants.append(v)
        variants.append(build_smddp(make_params(count, dev), dev))
        for v in variants:
            v.step()  # warm-up (allocations, lazy state)
        samples = {v.name: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                samples[v.name].append(timed(v.step, dev))
        eager_median = torch.tensor(samples["eager"]).median().item()
        for v in variants:
            t = torch.tensor(samples[v.name], dtype=torch.float64)
            med, p20, p80 = (float(t.quantile(q)) for q in (0.5, 0.2, 0.8))
            gbs = count * BYTES_PER_PARAM / med / 1e9
            row = dict(params=count, variant=v.name, median_ms=med * 1e3, p20_ms=p20 * 1e3, p80_ms=p80 * 1e3,
                       gbps=gbs, pct_copy=100 * gbs * 1e9 / bandwidth, speedup_vs_eager=eager_median / med)
            if v.name == "compile":
                row["compile_s"] = compile_s
            rows.append(row)
            print(f"  {count:>10} {v.name:<8} {row['median_ms']:9.2f} {row['p20_ms']:9.2f} {row['p80_ms']:9.2f} "
                  f"{gbs:7.2f} {row['pct_copy']:6.1f}% {row['speedup_vs_eager']:7.2f}x")
        if compile_s is not None:
            print(f"# torch.compile of the eager step took {compile_s:.1f} s to compile at {count} parameters")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "device_name": name, "torch": torch.__version__,
                       "copy_bandwidth_gbps": bandwidth / 1e9, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
