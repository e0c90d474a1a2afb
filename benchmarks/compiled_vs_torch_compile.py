"""The compiled step with and without graph compilation, against torch.compile(DDP(model)).

Variants, each training its own copy of one model (the same initial weights) on the same batches:

  ddp-gloo-compiled     torch.compile(DDP(model)) on a gloo group (nccl on CUDA), AdamW(fused=True)
  ddp-smddp-compiled    torch.compile(DDP(model)) on "smddp", AdamW(fused=True)
  step-eager            smddp_lite.compile(model, AdamW, torch_compile=False)
  step-graph            smddp_lite.compile(model, AdamW, torch_compile=True): each transformer
                        block a torch.compile graph, buckets still overlapping backward

Models are built from transformers configs (nothing is downloaded), without dropout so that the
variants' losses can be compared: ``bert`` (a BERT-style sequence classifier) and ``gpt2`` (a
GPT-2-style causal LM). Each round times ``--steps`` steps of every variant in turn (alternating
rounds in one job, so that noise hits them alike). Reported: samples per second over all ranks
(from the median step), warm-up (the first step: compiling), each rank's peak memory growth
during the variant's first steps (CUDA: the allocator's peak; CPU: not separable in one process,
see --only), and the final losses, which must agree to compile's tolerance.

    torchrun --standalone --nproc-per-node 2 benchmarks/compiled_vs_torch_compile.py --model bert
    torchrun --standalone --nproc-per-node 2 benchmarks/compiled_vs_torch_compile.py --model gpt2
    torchrun --standalone --nproc-per-node 1 benchmarks/compiled_vs_torch_compile.py --model gpt2-small --device cuda
    # peak resident memory of one variant alone (CPU), one job per variant:
    torchrun --standalone --nproc-per-node 2 benchmarks/compiled_vs_torch_compile.py --model bert --only step-graph
    # in the lab: 2 simulated hosts x 2 ranks, 1 Gbit/s links, the compiled steps on a bfloat16 wire (root)
    python -m benchmarks.compiled_vs_torch_compile --lab 2x2 --model bert --wire-dtype bfloat16 \
        --only step-eager --only step-graph
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist

import smddp_lite

# layers, hidden width, heads, sequence, batch per rank
MODELS = {
    "bert": (4, 256, 4, 128, 8),
    "gpt2": (4, 256, 4, 128, 8),
    "gpt2-small": (12, 768, 12, 1024, 8),
}
VARIANTS = ("ddp-gloo-compiled", "ddp-smddp-compiled", "step-eager", "step-graph")


def make_model(name: str, device: torch.device) -> torch.nn.Module:
    import transformers

    layers, width, heads, sequence, _ = MODELS[name]
    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(
            num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads, intermediate_size=4 * width,
            max_position_embeddings=sequence, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertForSequenceClassification(config)
    else:
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=sequence,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    return model.to(device)


def batches_for(name: str, vocab: int, steps: int, rank: int, device: torch.device) -> list[dict]:
    _, _, _, sequence, batch = MODELS[name]
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    out = []
    for _ in range(steps):
        ids = torch.randint(vocab, (batch, sequence), generator=generator)
        labels = torch.randint(2, (batch,), generator=generator) if name == "bert" else ids
        out.append({"input_ids": ids.to(device), "labels": labels.to(device)})
    return out


def build(variant: str, name: str, device: torch.device, gloo_group,
          wire_dtype: str | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    module = make_model(name, device)
    if variant.startswith("ddp-"):
        ddp = torch.nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None,
            process_group=gloo_group if variant == "ddp-gloo-compiled" else None)
        return torch.compile(ddp), torch.optim.AdamW(ddp.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    return smddp_lite.compile(module, torch.optim.AdamW(module.parameters(), lr=3e-4, weight_decay=0.1),
                              torch_compile=variant == "step-graph", wire_dtype=wire_dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="bert")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--only", choices=VARIANTS, action="append", help="run only these variants")
    parser.add_argument("--wire-dtype", help="the compiled steps' wire_dtype (bfloat16, int8, ...)")
    parser.add_argument("--lab", metavar="HOSTSxRANKS",
                        help="run in the lab of simulated hosts (as root), e.g. 2x2; links at --rate")
    parser.add_argument("--rate", default="1gbit", help="the lab's link rate")
    parser.add_argument("--json", help="write the measurements here (rank 0)")
    args = parser.parse_args()
    if args.lab:
        return in_the_lab(args)

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    smddp_lite.init()  # the default group is "smddp"
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")
    names = [v for v in VARIANTS if not args.only or v in args.only]
    if device.type == "cuda":
        names = [v.replace("gloo", "nccl") if v == "ddp-gloo-compiled" else v for v in names]

    def settle() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    variants, warmup_s, peak_mib = {}, {}, {}
    batches = None
    for variant in names:
        settle()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        model, opt = build(variant.replace("nccl", "gloo"), args.model, device, reference, args.wire_dtype)
        if batches is None:
            batches = batches_for(args.model, make_model(args.model, "cpu").config.vocab_size, args.steps, rank, device)
        variants[variant] = (model, opt)
        dist.barrier()
        start = time.perf_counter()
        step_once(model, opt, batches[0])
        settle()
        warmup_s[variant] = time.perf_counter() - start
        step_once(model, opt, batches[1 % len(batches)])  # a second shape-alike step: nothing compiles now
        settle()
        if device.type == "cuda":
            peak_mib[variant] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    times: dict[str, list[float]] = {v: [] for v in variants}
    losses: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant, (model, opt) in variants.items():
            dist.barrier()
            for batch in batches:
                settle()
                start = time.perf_counter()
                loss = step_once(model, opt, batch)
                settle()
                times[variant].append(time.perf_counter() - start)
                losses[variant].append(loss.item())
    _, _, _, sequence, batch = MODELS[args.model]
    rows = []
    for variant, values in times.items():
        t = torch.tensor(values, dtype=torch.float64)
        med, p20, p80 = (float(t.quantile(q)) for q in (0.5, 0.2, 0.8))
        rows.append({"variant": variant, "median_ms": med * 1e3, "p20_ms": p20 * 1e3, "p80_ms": p80 * 1e3,
                     "samples_per_s": batch * world / med, "warmup_s": warmup_s[variant],
                     "peak_mib": peak_mib.get(variant), "final_loss": losses[variant][-1]})
    max_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss = [None] * world
    dist.all_gather_object(rss, max_rss_mib)
    if rank == 0:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        params = sum(p.numel() for p in next(iter(variants.values()))[0].parameters())
        wire = f"compiled steps' wire {args.wire_dtype}" if args.wire_dtype else "float32 wire"
        print(f"# {args.model} ({params / 1e6:.1f}M parameters), {world} rank(s) on {where}, batch {batch} x {sequence} "
              f"per rank, float32, {wire}, AdamW; {args.rounds} rounds of {args.steps} steps per variant; torch {torch.__version__}")
        print(f"# {'variant':<19} {'median ms':>10} {'p20':>9} {'p80':>9} {'samples/s':>10} {'warm-up s':>9} "
              f"{'peak MiB':>9} {'final loss':>10}")
        for r in rows:
            peak = f"{r['peak_mib']:9.0f}" if r["peak_mib"] is not None else f"{'-':>9}"
            print(f"  {r['variant']:<19} {r['median_ms']:10.2f} {r['p20_ms']:9.2f} {r['p80_ms']:9.2f} "
                  f"{r['samples_per_s']:10.2f} {r['warmup_s']:9.1f} {peak} {r['final_loss']:10.5f}")
        by = {r["variant"]: r["median_ms"] for r in rows}
        baselines = [v for v in by if v.startswith("ddp-")] + (["step-eager"] if "step-eager" in by else [])
        if "step-graph" in by and baselines:
            best = min(baselines, key=by.get)
            print(f"# step-graph is {by[best] / by['step-graph']:.3f}x the best baseline ({best}); "
                  + ", ".join(f"{by[v] / by['step-graph']:.3f}x {v}" for v in baselines))
        spread = max(abs(losses[v][-1] - losses[names[0]][-1]) for v in variants)
        print(f"# final losses differ by at most {spread:.2e}; each rank's peak resident memory of the job: "
              + ", ".join(f"{m:.0f} MiB" for m in rss))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "parameters": params, "world_size": world, "device": where,
                           "torch": torch.__version__, "rows": rows, "max_rss_mib": rss}, f, indent=1)
    dist.destroy_process_group()


def in_the_lab(args) -> None:
    """This benchmark on ``args.lab`` simulated hosts (benchmarks/multinode), one torchrun per
    host; prints rank 0's report."""
    import sys

    from benchmarks.scaling import run_job

    hosts, per_host = (int(n) for n in args.lab.split("x"))
    argv = sys.argv[1:]
    for flag in ("--lab", "--rate"):  # the lab's own options go, with their values
        if flag in argv:
            del argv[argv.index(flag):argv.index(flag) + 2]
    argv = [a for a in argv if not a.startswith(("--lab=", "--rate="))]
    outputs = run_job(hosts, per_host, [os.path.basename(__file__), *argv], {}, args.rate, "torchrun", 3000,
                      f"{args.model} on {args.lab}")
    print("\n".join(line for line in outputs[0].splitlines() if line.startswith(("#", "  "))))


def step_once(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict) -> torch.Tensor:
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


if __name__ == "__main__":
    main()
