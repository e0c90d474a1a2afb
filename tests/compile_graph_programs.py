"""Programs of test_compile_graph.py: ``smddp_lite.compile(..., torch_compile=True)``, each repeated
block a torch.compile graph, on one and on several ranks.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import copy
import logging
import pickle
import time

import torch
import torch.distributed as dist

import smddp_lite

WIDTH, FEATURES, CLASSES = 32, 12, 3


class Block(torch.nn.Module):
    """A pre-norm residual MLP block: the unit compiled as one graph."""

    def __init__(self, breaks: bool = False) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up, self.down = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)
        self.breaks = breaks

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.breaks:
            print("inside a block: a graph break")
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class Net(torch.nn.Module):
    def __init__(self, blocks: int = 3, breaks: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(FEATURES, WIDTH)
        self.blocks = torch.nn.ModuleList(Block(breaks) for _ in range(blocks))
        self.head = torch.nn.Linear(WIDTH, CLASSES)
        self.marks: list[int] | None = None  # when set: the time each backward reached the blocks' input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.marks is not None and h.requires_grad:
            h.register_hook(lambda grad: self.marks.append(time.time_ns()))
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


def _batches(steps: int, rank: int, sequence: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [(torch.randn(4, sequence, FEATURES, generator=gen), torch.randint(CLASSES, (4,), generator=gen))
            for _ in range(steps)]


def graph_parity(steps: int = 4, shard: bool = False, wire_dtype: str | None = None) -> dict:
    """Two copies of one model, compiled with and without torch_compile, trained on the same
    batches: their weights, how many blocks were compiled, and when the graph copy's collectives
    were issued against when its last backward reached the blocks' input."""
    smddp_lite.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = Net()
    options = {"bucket_cap_mb": WIDTH * 2 * WIDTH * 4 / 2**20, "first_bucket_mb": 1e-4,  # a block per bucket
               "shard_optimizer_state": shard, "wire_dtype": wire_dtype, "max_grad_norm": 1.0}
    copies = {}
    for graph in (False, True):
        module = copy.deepcopy(base)
        copies[graph] = smddp_lite.compile(module, torch.optim.AdamW(module.parameters(), lr=1e-2),
                                           torch_compile=graph, **options)
    graph_model = copies[True][0]
    compiled_blocks = sum(1 for b in graph_model.module.blocks if "forward" in vars(b))
    losses = {False: [], True: []}
    for step, (x, y) in enumerate(_batches(steps, rank)):
        for graph, (model, opt) in copies.items():
            if graph and step == steps - 1:
                model.module.marks = []
                started = time.time_ns()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[graph].append(loss.item())
    for model, _ in copies.values():
        model.wait_for_parameters()
    entries = pickle.loads(smddp_lite.dump_fr_trace())["entries"]  # the flight recorder's
    reduced = [e for e in entries if e["time_created_ns"] >= started and "reduce" in e["profiling_name"]]
    mark = graph_model.module.marks[0]
    a, b = (dict(m.module.named_parameters()) for m, _ in copies.values())
    return {"compiled_blocks": compiled_blocks, "buckets": len(graph_model.reducer.buckets),
            "max_diff": max(float((a[n] - b[n]).abs().max()) for n in a),
            "losses_eager": losses[False], "losses_graph": losses[True],
            "issued_before_input_grad": sum(1 for e in reduced if e["time_created_ns"] < mark),
            "issued_in_step": len(reduced), "names": sorted({e["profiling_name"] for e in reduced})}


def shapes_and_debug(debug: bool) -> dict:
    """One process: forward with one sequence length, then another (the recompile message), with
    blocks that break their graph (what ``debug=True`` reports)."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("smddp_lite").addHandler(Keep())
    torch.manual_seed(0)
    module = Net(blocks=2, breaks=True)
    model, opt = smddp_lite.compile(module, torch.optim.AdamW(module.parameters(), lr=1e-2), torch_compile=True,
                                    debug=debug)
    for sequence in (6, 6, 9, 11):
        x, y = _batches(1, 0, sequence)[0]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"said": said}
