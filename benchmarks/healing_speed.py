"""How fast a replacement receives the job's state, and what the members receive meanwhile.

A job of 2 local ranks trains a ``--params``-parameter MLP (square Linear layers) with AdamW
under ``SurvivingSync``. Once both hold AdamW's moments, rank 1 is killed; the survivor goes on
alone and starts a replacement process (as ``smddp_lite.launch`` would), which joins at a sync
and receives the parameters and the optimizer state from it, peer to peer
(``smddp_lite/surviving_state.py``). The replacement's ``Change`` says how many bytes it
received and how long that took; the survivor's say what it received (nothing: it holds it).
Two processes at a time, on a machine of two cores.

Beside it, in the same job and on the same transport, the strongest baseline there is for that
transfer: one ``dist.send`` of a tensor as large as the whole state from rank 0 to rank 1, and
a copy of it in one process's memory (what shared memory cannot beat). After the join, every
process compares its parameters' and AdamW moments' checksums::

    python -m benchmarks.healing_speed --params 100e6 --out benchmarks/results/healing
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = 2048  # each layer is WIDTH x WIDTH, with a bias


def _model(params: float):
    import torch

    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _checksums(model, optimizer) -> dict:
    state = [optimizer.state[p] for p in model.parameters()]
    return {"params": sum(float(p.detach().double().sum()) for p in model.parameters()),
            "exp_avg": sum(float(s["exp_avg"].double().sum()) for s in state),
            "exp_avg_sq": sum(float(s["exp_avg_sq"].double().sum()) for s in state),
            "steps": sorted({float(s["step"]) for s in state})}


def _train(model, optimizer, sync, steps: int, marks: str, me: str, changes: list) -> None:
    import torch

    for step in range(sync.step, steps):
        x = torch.full((4, WIDTH), 0.01 * (step + 1))
        model(x).square().mean().backward()
        sync()
        optimizer.step()
        optimizer.zero_grad()
        if Path(marks, "joined").exists() or step < 2:
            continue
        time.sleep(0.5)  # keep the job going until the replacement is in
    Path(marks, f"{me}.json").write_text(json.dumps({"checksums": _checksums(model, optimizer),
                                                     "changes": changes, "world": sync.world_size}))


def member(params: float, steps: int, marks: str) -> dict:
    """One of the first ranks: the transport's own figures, then training with SurvivingSync."""
    import torch
    import torch.distributed as dist

    import smddp_lite
    from smddp_lite.surviving import SurvivingSync

    torch.set_num_threads(1)
    smddp_lite.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _model(params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # parameters, 2 moments
    baseline = {}
    whole, copy = torch.ones(state_bytes // 4), torch.zeros(state_bytes // 4)
    for _ in range(2):  # the better of two: the first touches pages the second reuses
        dist.barrier()
        began = time.perf_counter()
        if rank == 0:
            dist.send(whole, 1)
        elif rank == 1:
            dist.recv(whole, 0)
        dist.barrier()
        baseline["send_s"] = min(baseline.get("send_s", 1e9), time.perf_counter() - began)
        began = time.perf_counter()
        copy.copy_(whole)
        baseline["copy_s"] = min(baseline.get("copy_s", 1e9), time.perf_counter() - began)
    del whole, copy
    changes: list = []
    replacements: list = []

    def changed(c) -> None:
        changes.append({"joined": list(c.joined), "state_bytes": c.state_bytes, "state_seconds": c.state_seconds})
        if c.joined:
            Path(marks, "joined").write_text("1")
        if c.lost:
            code = f"from benchmarks.healing_speed import replacement; replacement({params}, {steps}, {marks!r})"
            replacements.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                                                 env=dict(os.environ, SMDDP_REPLACEMENT="1")))

    sync = SurvivingSync(model, optimizer, on_change=changed)
    _train(model, optimizer, sync, 2, marks, f"warm-{rank}", changes)  # AdamW's moments exist from then on
    if rank == 1:  # the rank the replacement replaces
        os.kill(os.getpid(), signal.SIGKILL)
    _train(model, optimizer, sync, steps, marks, f"member-{rank}", changes)
    sync.close()
    dist.destroy_process_group()
    for process in replacements:
        process.wait(timeout=300)
    return {"state_bytes": state_bytes, **baseline}


def replacement(params: float, steps: int, marks: str) -> None:
    """A replacement: a model of its own start (as a fresh process has), then the job's state."""
    import torch

    from smddp_lite.surviving import SurvivingSync

    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = _model(params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    changes: list = []
    sync = SurvivingSync(model, optimizer, on_change=lambda c: changes.append(
        {"joined": list(c.joined), "state_bytes": c.state_bytes, "state_seconds": c.state_seconds}))
    _train(model, optimizer, sync, steps, marks, "replacement", changes)
    sync.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--steps", type=int, default=30, help="syncs in all; the replacement joins within them")
    parser.add_argument("--transport", default="shm", help="SMDDP_TRANSPORT of the job (shm, gloo)")
    parser.add_argument("--out", help="write <out>.json and <out>.txt")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from tests import harness

    marks = Path(os.environ.get("TMPDIR", "/tmp"), f"healing-{os.getpid()}")
    marks.mkdir()
    results = harness.launch("benchmarks.healing_speed:member", 2, env={"SMDDP_TRANSPORT": args.transport},
                             pooled=False, timeout=900, params=args.params, steps=args.steps, marks=str(marks))
    if results[0].value is None:
        raise SystemExit(f"rank 0 failed: {results[0].error}\n{results[0].output[-3000:]}")
    logged = {name: json.loads((marks / f"{name}.json").read_text()) for name in ("member-0", "replacement")}
    (joined,) = [c for c in logged["replacement"]["changes"] if c["joined"]]
    gb = 1e9
    state_gb = joined["state_bytes"] / gb
    send_s, copy_s = results[0].value["send_s"], results[0].value["copy_s"]
    whole_gb = results[0].value["state_bytes"] / gb
    report = {
        "params": args.params, "transport": args.transport,
        "state_gb": state_gb, "state_s": joined["state_seconds"], "state_gb_per_s": state_gb / joined["state_seconds"],
        "send_gb_per_s": whole_gb / send_s, "copy_gb_per_s": whole_gb / copy_s,
        "survivor_received_bytes": [c["state_bytes"] for c in logged["member-0"]["changes"]],
        "one_checksum": len({json.dumps(v["checksums"], sort_keys=True) for v in logged.values()}) == 1,
        "checksums": {n: v["checksums"] for n, v in logged.items()},
        "worlds": {n: v["world"] for n, v in logged.items()},
    }
    report["against_send"] = report["state_gb_per_s"] / report["send_gb_per_s"]
    lines = [f"{args.params / 1e6:.0f}M parameters with AdamW, {args.transport}, a survivor and a replacement",
             (f"replacement received {state_gb:.3f} GB of state in {joined['state_seconds']:.2f} s: "
              f"{report['state_gb_per_s']:.2f} GB/s"),
             (f"one dist.send of {whole_gb:.3f} GB, same job: {report['send_gb_per_s']:.2f} GB/s "
              f"(the state's transfer is {report['against_send']:.2f}x it)"),
             f"a copy of it in one process's memory: {report['copy_gb_per_s']:.2f} GB/s",
             f"the survivor received of the state, at the loss and at the join: {report['survivor_received_bytes']} "
             "bytes",
             f"one checksum of parameters and AdamW moments between the survivor and the replacement: "
             f"{report['one_checksum']}"]
    print("\n".join(lines))
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(report, indent=1))
        Path(args.out + ".txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
