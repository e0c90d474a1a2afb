"""Time of the optimizer step, from reduced gradients to updated parameters, side by side.

Compares, for AdamW with float32 parameters and state, loss scaling and clipping to norm 1.0:
  eager       GradScaler.unscale_ + clip_grad_norm_(foreach=True) + AdamW(fused=True): 48 bytes per
              parameter (unscale reads and writes the gradient, the norm reads it, the clip
              multiply reads and writes it, then the update's 28)
  folded      the fairest eager step: one foreach norm of the scaled gradients, then fused AdamW
              given the loss scale divided by the clip coefficient as its ``grad_scale`` and the
              inf check as its ``found_inf`` (as GradScaler hands them over): 32 bytes per
              parameter, on torch's per-parameter tensors
  folded-flat the same on flat tensors of 6.5M elements (25 MiB, DDP's bucket size), as our
              buckets lay gradients out
  graphed     folded-flat's whole step (norms, clip coefficient, fused AdamW with capturable=True)
              captured in one CUDA graph and replayed: no launch or host cost left (CUDA only; it
              checks its first replay against folded-flat's first step)
  compile     torch.compile of the eager step (compile time reported apart): the closure around
              opt.step() breaks the graph and leaves the fused kernel opaque to Inductor
  fullgraph   torch.compile(fullgraph=True) of one function holding the norm, clip and AdamW in
              foreach ops, with lr and step as device tensors (no graph break, every op visible
              to Inductor; it does not skip inf steps, so it does a little less than the others);
              ``--compile-modes default,max-autotune-no-cudagraphs`` times both modes
  smddp       smddp_lite.compile's step as it runs by default: the buckets' norms were taken as
              their reductions completed (in backward, not timed here), then one launch for the
              step's scalars and one fused update per param group, which leaves .grad unwritten:
              28 bytes per parameter
  smddp-all   the same step doing all the baselines do: the buckets' norms timed in (one more
              read of every gradient) and write_back_grads=True: 36 bytes per parameter
Each round times every variant once, alternating, so noise hits all alike. Reports median
[p20, p80], effective GB/s counted by the 28 bytes per parameter an AdamW step must move (read
grad, param, exp_avg, exp_avg_sq; write the last three), and that as a percentage of this
device's measured copy bandwidth. With a loss scale or clipping, as here, every variant but
smddp also writes the unscaled, clipped gradient back into .grad (4 bytes more), as torch.optim
scripts leave it (torch's fused kernels cannot leave it out); the floor stays 28.

    python benchmarks/optimizer_step.py --params 1M,8M,32M                # CPU
    python benchmarks/optimizer_step.py --device cuda --params 125M,350M,1B
    python benchmarks/optimizer_step.py --device cuda --params 125M --compile-modes default,max-autotune-no-cudagraphs
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings

import torch

import smddp_lite

BYTES_PER_PARAM = 28  # AdamW, float32 state: 4 streams read, 3 written, 4 bytes each
FLAT_ELEMENTS = 25 * 2**20 // 4  # folded-flat's tensors: DDP's 25 MiB bucket of float32


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


def flat_params(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The same parameters as a few flat tensors of FLAT_ELEMENTS (values as generated, shapes dropped)."""
    flat_all = torch.cat([p.detach().reshape(-1) for p in params])
    return [torch.nn.Parameter(c.clone()) for c in flat_all.split(FLAT_ELEMENTS)]


def build_folded(params, device, flat: bool):
    """Unscale and clipping folded into fused AdamW's grad_scale and found_inf."""
    if flat:
        params = flat_params(params)
    v = Variant("folded-flat" if flat else "folded", params, device)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    for p, g in zip(params, v.grads):
        p.grad = g.clone()
    found_inf = torch.zeros((), device=device)  # shaped as the fused step's step counters, which it adjusts

    def step():
        norms = torch._foreach_norm([p.grad for p in params])
        total = torch.linalg.vector_norm(torch.stack(norms)) / v.scale  # of the unscaled gradients
        clip = torch.clamp(1.0 / (total + 1e-6), max=1.0)
        found_inf.copy_(torch.isfinite(total).logical_not())
        opt.grad_scale, opt.found_inf = v.scale / clip, found_inf
        opt.step()

    v.step, v.opt = step, opt
    return v


def build_graphed(params, device, warm_up: int = 3):
    """folded-flat's step captured in one CUDA graph, as torch documents capturing a fused AdamW
    with a loss scale (its test_graph_scaling_fused_optimizers): capturable=True, the state made
    by eager steps before capture, and grad_scale and found_inf as tensors made before capture
    that the graph refills in place, so every replay reads and writes the same addresses."""
    params = flat_params(params)
    v = Variant("graphed", params, device)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True, capturable=True)
    for p, g in zip(params, v.grads):
        p.grad = g.clone()
    grads = [p.grad for p in params]
    grad_scale = torch.ones((), device=device)
    found_inf = torch.zeros((), device=device)  # shaped as the fused step's step counters, which it adjusts
    opt.grad_scale, opt.found_inf = grad_scale, found_inf

    def step():
        norms = torch._foreach_norm(grads)
        total = torch.linalg.vector_norm(torch.stack(norms)) / v.scale  # of the unscaled gradients
        clip = torch.clamp(1.0 / (total + 1e-6), max=1.0)
        found_inf.copy_(torch.isfinite(total).logical_not())
        grad_scale.copy_(v.scale / clip)
        opt.step()

    # warm-up on a side stream (the documented pattern): makes exp_avg, exp_avg_sq and the step
    # counters, and any lazy workspace, outside the capture
    start = [p.detach().clone() for p in params]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*without CUDA graph capture")  # as intended
        for _ in range(warm_up):
            step()
    torch.cuda.current_stream().wait_stream(side)
    # back to the starting point in place (the graph holds these addresses), so the first replay
    # is step 1 and compares with folded-flat's first step
    with torch.no_grad():
        for p, g, s, p0 in zip(params, v.grads, grads, start):
            p.copy_(p0)
            s.copy_(g)
            state = opt.state[p]
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
            state["step"].zero_()
    del start
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    v.step, v.opt = graph.replay, opt
    return v


def check_graphed(graphed: Variant, folded_flat: Variant) -> None:
    """Exit non-zero unless the graph's first replay left what folded-flat's first eager step
    left: parameters, the unscaled and clipped .grad and exp_avg. The parameters alone would miss
    a wrong grad_scale (Adam's update barely depends on the gradient's scale); .grad and exp_avg
    scale with it. One step, the same kernels on the same inputs: equal to float32 rounding."""
    for i, (g, f) in enumerate(zip(graphed.params, folded_flat.params)):
        pairs = {"parameter": (g, f), ".grad": (g.grad, f.grad),
                 "exp_avg": (graphed.opt.state[g]["exp_avg"], folded_flat.opt.state[f]["exp_avg"])}
        for what, (got, want) in pairs.items():
            if not torch.allclose(got, want, rtol=1e-6, atol=0):
                worst = (got - want).abs().max().item()
                raise SystemExit(f"graphed: after the first replay, {what} of flat tensor {i} differs from "
                                 f"folded-flat's by up to {worst:.3g} (expected equal to rtol 1e-6): the captured "
                                 "step is not the eager one; check the capture (state made before it, grad_scale "
                                 "and found_inf refilled in place)")


def clipped_adamw(params, grads, exp_avg, exp_avg_sq, step_t, lr, scale, max_norm=1.0, beta1=0.9, beta2=0.999,
                  eps=1e-8, weight_decay=0.01):
    """Unscale, clip to ``max_norm`` and AdamW in foreach ops: the fullgraph baseline's step
    (tests/test_compile.py checks it against torch.optim.AdamW with clip_grad_norm_)."""
    norms = torch._foreach_norm(grads)
    total = torch.linalg.vector_norm(torch.stack(norms)) / scale
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0) / scale
    step_t += 1
    g = torch._foreach_mul(grads, coef)
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avg, g, 1 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, g, g, 1 - beta2)
    bias1 = 1 - beta1 ** step_t
    bias2_sqrt = (1 - beta2 ** step_t).sqrt()
    denom = torch._foreach_div(torch._foreach_sqrt(exp_avg_sq), bias2_sqrt)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(exp_avg, denom)
    torch._foreach_mul_(update, lr / bias1)
    torch._foreach_sub_(params, update)


def build_fullgraph(params, device, mode: str):
    """One compiled function: norm, clip and AdamW in foreach ops, lr and step on the device."""
    v = Variant(f"fullgraph-{mode}" if mode != "default" else "fullgraph", params, device)
    grads = v.grads
    exp_avg = [torch.zeros_like(p) for p in params]
    exp_avg_sq = [torch.zeros_like(p) for p in params]
    step_t = torch.zeros((), device=device)
    lr = torch.tensor(1e-4, device=device)
    plain = [p.detach() for p in params]

    compiled = torch.compile(clipped_adamw, fullgraph=True, mode=None if mode == "default" else mode)
    v.step = lambda: compiled(plain, grads, exp_avg, exp_avg_sq, step_t, lr, v.scale)
    return v


def build_smddp(params, device, everything: bool = False):
    """``everything``: time the buckets' norm pass in and write .grad back, as the baselines do."""
    v = Variant("smddp-all" if everything else "smddp", params, device)
    model = torch.nn.ParameterList(params)
    _, opt = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01),
                                max_grad_norm=1.0, write_back_grads=everything)
    for p, g in zip(model.parameters(), v.grads):
        p.grad.copy_(g)  # .grad is a view into its bucket: the "reduced gradients in the buckets"
    # what backward leaves: each bucket's norm, taken as its reduction completed
    opt.reducer.remeasure_changed_norms(every_bucket=True)
    found_inf = torch.zeros(1, device=device)

    def step():
        if everything:
            opt.reducer.remeasure_changed_norms(every_bucket=True)
        opt.grad_scale, opt.found_inf = v.scale, found_inf  # what GradScaler.step hands over
        opt.step()

    v.step = step
    return v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="1M,8M,32M", help="parameter counts (K/M/B suffixes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-torch-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--no-eager-compile", action="store_true",
                        help="skip the compile variant (the eager step compiled as it is), keep fullgraph")
    parser.add_argument("--no-graphed", action="store_true",
                        help="skip the graphed variant (20 more bytes of device memory per parameter: 20 GB at 1B)")
    parser.add_argument("--compile-modes", default="default",
                        help="modes of the fullgraph variant, comma-separated (default, max-autotune-no-cudagraphs)")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args()
    dev = args.device
    bandwidth = copy_bandwidth(dev, 64 * 2**20)
    name = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or platform.machine()
    print(f"# optimizer step, AdamW float32, clip 1.0, loss scale 1024; device {dev} ({name}); torch {torch.__version__}")
    print(f"# copy bandwidth {bandwidth / 1e9:.2f} GB/s; {args.rounds} alternating rounds; times in ms, median [p20, p80]")
    if dev != "cuda":
        print("# graphed: skipped, CUDA graphs need a CUDA device")
    elif args.no_graphed:
        print("# graphed: skipped (--no-graphed)")
    print(f"# {'params':>10} {'variant':<11} {'median':>9} {'p20':>9} {'p80':>9} {'GB/s':>7} {'% copy':>7} {'vs eager':>8}")
    rows = []
    for count in map(parse_count, args.params.split(",")):
        variants = [build_eager(make_params(count, dev), dev, False),
                    build_folded(make_params(count, dev), dev, flat=False),
                    build_folded(make_params(count, dev), dev, flat=True)]
        if dev == "cuda" and not args.no_graphed:
            variants.append(build_graphed(make_params(count, dev), dev))
        compile_s = {}
        if not args.no_torch_compile:
            candidates = [build_eager(make_params(count, dev), dev, True)] if not args.no_eager_compile else []
            candidates += [build_fullgraph(make_params(count, dev), dev, mode) for mode in args.compile_modes.split(",")]
            for v in candidates:
                torch._dynamo.utils.counters.clear()
                compile_s[v.name] = timed(v.step, dev)  # the first call compiles
                breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
                print(f"# {v.name}: compiled in {compile_s[v.name]:.1f} s at {count} parameters, {breaks} graph "
                      f"break(s), {torch._dynamo.utils.counters['stats'].get('unique_graphs', 0)} graph(s)")
                variants.append(v)
        variants += [build_smddp(make_params(count, dev), dev), build_smddp(make_params(count, dev), dev, True)]
        for v in variants:
            v.step()  # warm-up (allocations, lazy state); graphed's first replay
        by_name = {v.name: v for v in variants}
        if "graphed" in by_name:
            check_graphed(by_name["graphed"], by_name["folded-flat"])
        samples = {v.name: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                samples[v.name].append(timed(v.step, dev))
        eager_median = torch.tensor(samples["eager"]).median().item()
        medians = {name: torch.tensor(t).median().item() for name, t in samples.items()}
        best_baseline = min((m, name) for name, m in medians.items() if not name.startswith("smddp"))
        for v in variants:
            t = torch.tensor(samples[v.name], dtype=torch.float64)
            med, p20, p80 = (float(t.quantile(q)) for q in (0.5, 0.2, 0.8))
            gbs = count * BYTES_PER_PARAM / med / 1e9
            row = dict(params=count, variant=v.name, median_ms=med * 1e3, p20_ms=p20 * 1e3, p80_ms=p80 * 1e3,
                       gbps=gbs, pct_copy=100 * gbs * 1e9 / bandwidth, speedup_vs_eager=eager_median / med)
            if v.name in compile_s:
                row["compile_s"] = compile_s[v.name]
            rows.append(row)
            print(f"  {count:>10} {v.name:<11} {row['median_ms']:9.2f} {row['p20_ms']:9.2f} {row['p80_ms']:9.2f} "
                  f"{gbs:7.2f} {row['pct_copy']:6.1f}% {row['speedup_vs_eager']:7.2f}x")
        for mine in ("smddp", "smddp-all"):
            print(f"# {count} parameters: {mine} {best_baseline[0] / medians[mine]:.2f}x the best baseline "
                  f"({best_baseline[1]}), at {100 * count * BYTES_PER_PARAM / medians[mine] / bandwidth:.1f}% "
                  "of copy bandwidth counted by 28 bytes per parameter")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "device_name": name, "torch": torch.__version__,
                       "copy_bandwidth_gbps": bandwidth / 1e9, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
