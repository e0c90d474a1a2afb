"""Programs of test_compile_parallel.py: the compiled step on several ranks. test_compiled_8bit_wire.py
measures the 8-bit wire's bytes with ``compiled_wire_bytes`` too.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import smddp_lite

from .rank_helpers import bytes_sent, error_of


def compiled_parity(steps: int = 10, wire_dtype: str | None = None, clip: float | None = None, width: int = 64,
                    bucket_cap_mb: float = 0.01, finish_on_completion: bool = False) -> dict:
    """smddp_lite.compile against DDP + torch.optim.AdamW on the same per-rank batches; a hidden
    layer of ``width`` units, buckets of ``bucket_cap_mb``. ``finish_on_completion``: take each
    bucket's norm from its collective's future, as on CUDA."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    smddp_lite.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(33, width), torch.nn.Tanh(), torch.nn.Linear(width, 5))
    eager_module, compiled_module = copy.deepcopy(base), copy.deepcopy(base)
    eager = DDP(eager_module, bucket_cap_mb=0.01)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3, weight_decay=0.01)
    compiled, opt_c = smddp_lite.compile(compiled_module, torch.optim.AdamW(compiled_module.parameters(), lr=3e-3,
                                                                             weight_decay=0.01),
                                         bucket_cap_mb=bucket_cap_mb, first_bucket_mb=0.001, wire_dtype=wire_dtype,
                                         max_grad_norm=clip)
    compiled.reducer.finish_on_completion = finish_on_completion
    teacher = torch.randn(33, 5, generator=torch.Generator().manual_seed(7))  # a learnable labelling
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    losses = {"eager": [], "compiled": []}
    for _ in range(steps):
        x = torch.randn(16, 33, generator=gen)
        y = (x @ teacher).argmax(1)
        for name, model, opt in (("eager", eager, opt_e), ("compiled", compiled, opt_c)):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if name == "eager" and clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    diff = max(float((a - b).abs().max()) for a, b in zip(eager_module.parameters(), compiled_module.parameters()))
    scale = max(float(p.abs().max()) for p in eager_module.parameters())
    dist.destroy_process_group()
    return {"max_diff": diff, "max_abs": scale, "losses": losses, "buckets": len(opt_c.buckets),
            "arenas": len(opt_c.arenas)}


def compiled_wire_bytes(wire_dtype: str | None, steps: int = 3) -> dict:
    """Bytes one compiled step moves with ``wire_dtype`` on the wire: what the host's loopback
    carried per step (every rank's, on one host: gloo's sockets), and the dtype and bytes of
    every buffer the step handed the transport."""
    smddp_lite.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    compiled, opt = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), bucket_cap_mb=0.25,
                                       wire_dtype=wire_dtype)
    transport = dist.distributed_c10d._get_default_group().transport
    handed: list[tuple[str, str, int]] = []

    def counting(name: str):
        method = getattr(transport, name)

        def counted(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            sent = tensors[1] if name in ("all_to_all", "all_gather") else tensors[0]  # (output, input)
            handed.append((name, str(sent.dtype).replace("torch.", ""), sent.numel() * sent.element_size()))
            return method(*args, **kwargs)

        return counted

    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        compiled(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # connections made, buffers allocated
    dist.barrier()
    before = bytes_sent("lo")
    dist.barrier()
    for name in ("all_reduce", "all_to_all", "all_gather"):  # instance attributes: this group's only
        setattr(transport, name, counting(name))
    for _ in range(steps):
        step()
    for name in ("all_reduce", "all_to_all", "all_gather"):
        delattr(transport, name)
    dist.barrier()
    loopback = bytes_sent("lo") - before
    dist.barrier()
    grads = sum(p.numel() for p in model.parameters())
    dist.destroy_process_group()
    return {"loopback_per_step": loopback / steps, "handed": handed[: len(handed) // steps],
            "gradient_bytes": 4 * grads}


def large_16_bit_sums(numel: int = 5_000_003) -> dict:
    """float16 and bfloat16 SUM and AVG all_reduces of ``numel`` small integers (several rounds
    of 16-bit pieces on gloo and MPI, the last one short and its share padded): which came out
    wrong, compared exactly."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    pattern = torch.arange(numel, dtype=torch.int64).remainder_(5)
    wrong = []
    for dtype in (torch.float16, torch.bfloat16):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            t = (pattern * world + rank).to(dtype)  # a mean that is an integer, exact in 16 bits
            dist.all_reduce(t, op=op)
            want = pattern * world * world + sum(range(world))
            if op == dist.ReduceOp.AVG:
                want = pattern * world + sum(range(world)) / world
            if not bool((t.double() == want.double()).all()):
                wrong.append(f"{dtype} {op}")
    dist.destroy_process_group()
    return {"wrong": wrong}


def compiled_apart(kind: str, steps: int = 2) -> dict:
    """``smddp_lite.compile`` where the last rank's model or options differ from the others'
    (``kind``): compile's error on each rank, or what training then did."""
    smddp_lite.init(timeout=timedelta(seconds=30))
    odd = dist.get_rank() == dist.get_world_size() - 1
    torch.manual_seed(0)
    width = 65 if odd and kind == "model" else 64
    model = torch.nn.Sequential(torch.nn.Linear(33, width), torch.nn.Tanh(), torch.nn.Linear(width, 5))
    if kind in ("buffers", "same"):  # running statistics: broadcast_buffers matters
        model.insert(1, torch.nn.BatchNorm1d(width))
    if kind == "frozen" and odd:
        model[0].bias.requires_grad_(False)
    options = {"bucket_cap_mb": 0.01}
    if odd:
        options.update({"bucket": {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.001}, "wire": {"wire_dtype": "bfloat16"},
                        "clip": {"max_grad_norm": 0.01}, "buffers": {"broadcast_buffers": False},
                        "shard": {"shard_optimizer_state": True}}.get(kind, {}))
    made = {}
    lr = 2e-3 if odd and kind == "lr" else 1e-3
    compiled = error_of(lambda: made.update(zip(("model", "optimizer"), smddp_lite.compile(
        model, torch.optim.AdamW(model.parameters(), lr=lr), **options))))
    if compiled["type"] is not None:
        return {"compile": compiled}
    def train() -> None:
        for _ in range(steps):
            made["model"](torch.randn(8, 33)).square().mean().backward()
            made["optimizer"].step()
            made["optimizer"].zero_grad()
    report = {"compile": compiled, "train": error_of(train)}
    report["params"] = [p.detach().double().sum().item() for p in made["model"].parameters()]
    return report


def compiled_batchnorm_buffers(broadcast_buffers: bool = True) -> dict:
    """A BatchNorm model trained compiled and under DDP (broadcast_buffers, its default) side by
    side, each rank on its own batches: every rank must end with rank 0's running statistics,
    as under DDP, so that evaluation on any rank gives rank 0's answer. Returns this rank's
    buffers and evaluation output for both."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    smddp_lite.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.BatchNorm1d(17), torch.nn.Tanh(),
                               torch.nn.Linear(17, 5))
    eager_module, compiled_module = copy.deepcopy(base), copy.deepcopy(base)
    eager = DDP(eager_module)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    compiled, opt_c = smddp_lite.compile(compiled_module, torch.optim.SGD(compiled_module.parameters(), lr=0.05,
                                                                           momentum=0.9),
                                         broadcast_buffers=broadcast_buffers)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        x, y = torch.randn(16, 13, generator=gen) * (1 + rank), torch.randint(0, 5, (16,), generator=gen)
        for model, opt in ((eager, opt_e), (compiled, opt_c)):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    x_eval = torch.randn(8, 13, generator=torch.Generator().manual_seed(7))  # one batch on every rank
    report = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        model.eval()
        with torch.no_grad():
            out = model(x_eval)
        report[name] = {"buffers": [b.double().tolist() for b in model.module.buffers()], "eval": out.tolist()}
    dist.destroy_process_group()
    return report


def compiled_frozen_start() -> dict:
    """Each rank builds its model from its own seed, the first layer frozen: compile must start
    every rank from rank 0's weights, frozen ones included, as DDP does."""
    smddp_lite.init()
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    model[0].requires_grad_(False)
    smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    weights = {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}
    dist.destroy_process_group()
    return weights
