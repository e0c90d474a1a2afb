"""The 8-bit wire's quantize and dequantize_add kernels against a plain copy, side by side.

For each message size, wire dtype and block size this times, on one flat float32 message:
  quantize        the Triton kernel and the torch reference: reads 4 bytes per element, writes 1
                  and a 4-byte scale per block (5 + 4/block bytes per element)
  dequantize_add  the same two: reads the accumulator (4), the value (1) and the scale, writes the
                  accumulator (4): 9 + 4/block bytes per element
  copy            a float32 copy_ of the same message (8 bytes per element), the yardstick
Each round times every variant once, alternating, so noise hits all alike; each sample is
``--calls`` calls back to back, so a launch's host cost hides behind the kernel before it as it
does on a wire. The table gives the median [p20, p80] per call, GB/s by the bytes each must move,
that as a percentage of the copy's GB/s measured in the same rounds, and the kernel's speed over
the reference's. Before timing it checks every kernel against the reference (quantize bit for
bit, dequantize_add within a fused multiply-add's rounding) and exits non-zero on a difference.

    python benchmarks/quantize_kernels.py --numel 6.5M,64M
    TRITON_INTERPRET=1 python benchmarks/quantize_kernels.py --device cpu --numel 4K --rounds 2 --calls 1  # the tool
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optimizer_step import parse_count, timed  # noqa: E402  (the same yardstick)

from smddp_lite.kernels import dequantize_add, quantize  # noqa: E402
from smddp_lite.kernels.quantize import FORMATS, blocks_of  # noqa: E402

DTYPES = {str(d).replace("torch.", ""): d for d in FORMATS}
NAMES = {d: name for name, d in DTYPES.items()}


def check(x: torch.Tensor, dtype: torch.dtype, block: int) -> str | None:
    """What the kernels get wrong against the reference on ``x``, or None."""
    q_kernel, s_kernel = quantize(x, dtype, block, force_triton=True)
    q_ref, s_ref = quantize(x, dtype, block, force_triton=False)
    if not torch.equal(q_kernel.view(torch.uint8), q_ref.view(torch.uint8)) or not torch.equal(s_kernel, s_ref):
        wrong = int((q_kernel.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
        return f"quantize: {wrong} values and {int((s_kernel != s_ref).sum())} scales differ from the reference's"
    acc_kernel = torch.randn(x.numel(), generator=torch.Generator().manual_seed(1)).to(x.device)
    acc_ref = acc_kernel.clone()
    dequantize_add(acc_kernel, q_ref, s_ref, block, force_triton=True)
    dequantize_add(acc_ref, q_ref, s_ref, block, force_triton=False)
    # a GPU fuses q * scale + acc into one rounding where the reference rounds twice: they differ
    # by at most half an ulp of the product and of each sum (tests/test_quantize.py says why)
    product = q_ref.float() * s_ref.repeat_interleave(block)[: x.numel()]
    bound = 2.0 ** -24 * (product.abs() + acc_ref.abs() + acc_kernel.abs()) + 2.0 ** -149
    over = int(((acc_kernel - acc_ref).abs() > bound).sum())
    return f"dequantize_add: {over} sums beyond a fused multiply-add's rounding of the reference's" if over else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", default="6.5M,64M", help="message sizes in float32 elements (K/M/B suffixes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="wire dtypes, comma-separated")
    parser.add_argument("--blocks", default="256,4096", help="block sizes, comma-separated (256 is the default wire's)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10, help="calls per sample, back to back")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args(argv)
    dev = args.device
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("quantize_kernels.py: on the CPU the Triton kernels run only in the interpreter, which "
                         "says nothing of a GPU's bandwidth; run it with --device cuda on a GPU, or set "
                         "TRITON_INTERPRET=1 (tiny sizes) to check the tool itself")
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]
    device_name = torch.cuda.get_device_name() if dev == "cuda" else "Triton interpreter"
    print(f"# quantize and dequantize_add against a float32 copy_; device {dev} ({device_name}); "
          f"torch {torch.__version__}")
    print(f"# {args.rounds} alternating rounds of {args.calls} calls; times in us per call, median [p20, p80]")
    print(f"# {'numel':>10} {'variant':<50} {'B/elem':>6} {'median':>9} {'p20':>9} {'p80':>9} {'GB/s':>8} "
          f"{'% copy':>7} {'vs ref':>6}")
    rows, wrong = [], []
    for n in map(parse_count, args.numel.split(",")):
        x = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 3.0).to(dev)
        src, dst, acc = x.clone(), torch.empty_like(x), torch.zeros_like(x)
        variants = {"copy float32": (8.0, lambda: dst.copy_(src))}
        for dtype in dtypes:
            for block in blocks:
                problem = check(x, dtype, block)  # also compiles each kernel once, outside the rounds
                if problem is not None:
                    wrong.append(f"{n} elements, {NAMES[dtype]}, block {block}: {problem}")
                q = torch.empty(n, dtype=dtype, device=dev)
                scales = torch.empty(blocks_of(n, block), device=dev)
                quantize(x, dtype, block, out=(q, scales))
                for kind, triton in (("kernel", True), ("reference", False)):
                    name = f"{NAMES[dtype]} block {block} {kind}"
                    variants[f"quantize {name}"] = (5 + 4 / block, lambda d=dtype, b=block, t=triton, qs=(q, scales):
                                                    quantize(x, d, b, out=qs, force_triton=t))
                    variants[f"dequantize_add {name}"] = (9 + 4 / block, lambda b=block, t=triton, qs=(q, scales):
                                                          dequantize_add(acc, *qs, b, force_triton=t))
        for _, fn in variants.values():
            fn()  # warm-up: the reference's scratch, the copy's pages
        samples = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (_, fn) in variants.items():
                samples[name].append(timed(lambda f=fn: [f() for _ in range(args.calls)], dev) / args.calls)
        medians = {name: float(torch.tensor(t, dtype=torch.float64).quantile(0.5)) for name, t in samples.items()}
        copy_gbps = n * 8 / medians["copy float32"] / 1e9
        for name, (moved, _) in variants.items():
            t = torch.tensor(samples[name], dtype=torch.float64)
            med, p20, p80 = (float(t.quantile(q)) for q in (0.5, 0.2, 0.8))
            gbs = n * moved / med / 1e9
            reference = name.replace(" kernel", " reference")
            speedup = medians[reference] / med if name.endswith(" kernel") else None
            rows.append(dict(numel=n, variant=name, bytes_per_element=moved, median_us=med * 1e6, p20_us=p20 * 1e6,
                             p80_us=p80 * 1e6, gbps=gbs, pct_copy=100 * gbs / copy_gbps, speedup_vs_reference=speedup))
            print(f"  {n:>10} {name:<50} {moved:6.2f} {med * 1e6:9.1f} {p20 * 1e6:9.1f} {p80 * 1e6:9.1f} {gbs:8.1f} "
                  f"{rows[-1]['pct_copy']:6.1f}% " + (f"{speedup:5.2f}x" if speedup is not None else ""))
    for line in wrong:
        print(f"# WRONG: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "device_name": device_name, "torch": torch.__version__, "rounds": args.rounds,
                       "calls": args.calls, "rows": rows, "wrong": wrong}, f, indent=1)
    if wrong:
        raise SystemExit(f"quantize_kernels.py: {len(wrong)} kernel(s) disagree with the reference (above)")


if __name__ == "__main__":
    main()
