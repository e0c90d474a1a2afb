"""The fused Adam kernel's launch shapes, and the gradient-norm pass, timed side by side.

The compiled step spends its time in the update kernel (32 bytes per parameter: the unscaled,
clipped gradient is written back) and in the per-bucket gradient norms. This times, on one flat buffer of ``--params`` float32 parameters:
  update   adam_step for every BLOCK x num_warps asked for (BLOCK=2048, 4 warps is the default),
           with and without the gradient write-back
  norms    the 2-norm of ``--buckets`` equal buckets: a vector_norm and a square per bucket (as
           an earlier reducer took them), a vector_norm per bucket (as the reducer takes them),
           and torch._foreach_norm over all of them in one launch
Each variant runs once per round, alternating, so noise hits all alike; the table gives the
median [p20, p80] and GB/s by the bytes each moves, as a percentage of a plain copy's.

    python benchmarks/adam_kernel_sweep.py --device cuda --params 350M
    TRITON_INTERPRET=1 python benchmarks/adam_kernel_sweep.py --device cpu --params 64K --rounds 2   # the tool itself
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optimizer_step import copy_bandwidth, parse_count, timed  # noqa: E402  (the same yardstick)

from smddp_lite.kernels import adam_step  # noqa: E402


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="350M", help="parameter count (K/M/B suffixes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int_list, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--warps", type=int_list, default=[4, 8])
    parser.add_argument("--buckets", type=int, default=49, help="buckets the norm pass splits the buffer into")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args()
    dev, n = args.device, parse_count(args.params)
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on the CPU the Triton kernel runs only in the interpreter: set TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(0)
    param, grad, exp_avg = (torch.randn(n, generator=gen).to(dev) for _ in range(3))
    exp_avg_sq = torch.rand(n, generator=gen).to(dev)
    scalar = lambda v: torch.tensor([v], dtype=torch.float32, device=dev)  # noqa: E731
    # scale 1: the gradient written back is the one read, so every round sees the same data
    hyper = dict(lr=scalar(1e-4), step=scalar(10.0), scale=scalar(1.0), found_inf=scalar(0.0), beta1=0.9,
                 beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
    variants = {}
    for block in args.blocks:
        for warps in args.warps:
            for write in (True, False):
                name = f"update BLOCK={block} warps={warps}{'' if write else ' no-grad-write'}"
                variants[name] = (32 if write else 28, lambda b=block, w=warps, u=not write: adam_step(
                    param, grad, exp_avg, exp_avg_sq, write_grad=not u, block=b, num_warps=w, force_triton=True, **hyper))
    buckets = list(grad.chunk(args.buckets))
    variants[f"norms vector_norm+square x {len(buckets)}"] = (
        4, lambda: [torch.linalg.vector_norm(b).square() for b in buckets])
    variants[f"norms vector_norm x {len(buckets)}"] = (4, lambda: [torch.linalg.vector_norm(b) for b in buckets])
    variants[f"norms _foreach_norm of {len(buckets)}"] = (4, lambda: torch._foreach_norm(buckets))
    bandwidth = copy_bandwidth(dev, min(n, 64 * 2**20))
    for _, fn in variants.values():
        fn()  # compiles each launch shape once
    samples = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (_, fn) in variants.items():
            samples[name].append(timed(fn, dev))
    device_name = torch.cuda.get_device_name() if dev == "cuda" else "Triton interpreter"
    print(f"# Adam kernel launch shapes and norm passes, {n} float32 parameters; device {dev} ({device_name}); "
          f"torch {torch.__version__}")
    print(f"# copy bandwidth {bandwidth / 1e9:.2f} GB/s; {args.rounds} alternating rounds; times in ms, median [p20, p80]")
    print(f"# {'variant':<44} {'B/param':>7} {'median':>9} {'p20':>9} {'p80':>9} {'GB/s':>8} {'% copy':>7}")
    rows = []
    for name, (moved, _) in variants.items():
        t = torch.tensor(samples[name], dtype=torch.float64)
        med, p20, p80 = (float(t.quantile(q)) for q in (0.5, 0.2, 0.8))
        gbs = n * moved / med / 1e9
        rows.append(dict(variant=name, bytes_per_param=moved, median_ms=med * 1e3, p20_ms=p20 * 1e3,
                         p80_ms=p80 * 1e3, gbps=gbs, pct_copy=100 * gbs * 1e9 / bandwidth))
        print(f"  {name:<44} {moved:>7} {med * 1e3:9.3f} {p20 * 1e3:9.3f} {p80 * 1e3:9.3f} {gbs:8.1f} "
              f"{rows[-1]['pct_copy']:6.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "device_name": device_name, "torch": torch.__version__, "params": n,
                       "copy_bandwidth_gbps": bandwidth / 1e9, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
