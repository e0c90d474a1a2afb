"""What every rank of test_surviving.py's jobs runs: a small model trained with SurvivingSync,
one of whose ranks fails at a chosen step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import smddp_lite
from smddp_lite.surviving import RankDeclaredLostError, SurvivingSync, TooFewRanksError

FEATURES, BATCH, LR = 8, 16, 0.05


def batch(first_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples a rank (numbered as in the job's first group) trains on at a step."""
    g = torch.Generator().manual_seed(1000 * first_rank + step)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, x.sum(1, keepdim=True) * 0.5 + 1.0


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def wrapped(net: torch.nn.Module, ddp: bool, bucket_view: bool = False, compiled: bool = False,
            wire: torch.dtype = torch.bfloat16) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model as trained, and its optimizer: with ``ddp``, a DistributedDataParallel with a
    bucket per parameter, so that the hooks' order and a redo's must meet over several buckets;
    with ``compiled``, ``smddp_lite.compile`` with a ``wire`` wire and a bucket per parameter."""
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1e-5, gradient_as_bucket_view=bucket_view)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    if compiled:
        return smddp_lite.compile(net, optimizer, wire_dtype=wire, bucket_cap_mb=1e-5,
                                  first_bucket_mb=1e-5)
    return net, optimizer


def train(steps: int, faults: dict, marks: str, group_timeout_s: float = 4.0, min_world_size: int = 1,
          replace: bool = False, step_s: float = 0.0, ddp: bool = False, bucket_view: bool = False,
          late: dict | None = None, starts: dict | None = None, compiled: bool = False) -> dict:
    """Train ``steps`` steps; ``faults`` maps a rank (as a string) to (kind, step): "sigkill" (killed
    while it syncs), "exit" (os._exit before its sync), "sigstop" (stopped before its sync and
    killed at the end), "sigstop_resume" (stopped, and let go on once the others went on without
    it), "heartbeat_dies" (its heartbeat's process killed), "holds_gil" (6 s in a C call that holds
    the GIL, which must not make it lost), "dies_healing" (killed half-way through sending the
    job's state to a replacement; from the start), "sigstop_resume_before_commit" (stopped once
    its average arrived, before the step's commit, and let go on once the others went on). Returns, per completed step, the parameters' checksum and the world size, and each
    change; or the error that ended this rank's training, where SurvivingSync raised one of its own.
    With ``replace``, the new rank 0 starts a replacement process after each loss (as a user's
    launcher would), which writes what ``replacement`` returns into ``marks``. ``step_s``: the
    compute each step stands for (a sleep), so that a replacement has steps left to join. With
    ``ddp`` the model is a DistributedDataParallel (``bucket_view``: gradient_as_bucket_view);
    with ``compiled``, a ``smddp_lite.compile`` model (bfloat16 wire).
    ``late`` maps a rank (as a string) to the seconds it spends before making its SurvivingSync
    (a model or data set slower to load than the others'). ``starts`` maps a step (as a string)
    to what rank 0 starts as that step begins: "replacement", or "ghost" (a replacement that dies
    once it took its ticket and its heartbeat beat)."""
    smddp_lite.init(timeout=timedelta(seconds=group_timeout_s))
    rank = dist.get_rank()
    time.sleep((late or {}).get(str(rank), 0.0))
    net, optimizer = wrapped(model(), ddp, bucket_view, compiled)
    changes, replacements = [], []

    def changed(c) -> None:
        changes.append(_said(c))
        if replace and c.lost and c.rank == 0:
            replacements.append(_start_replacement(steps, marks, len(replacements), step_s, ddp, compiled=compiled))
        stopped = Path(marks, "stopped")
        if c.rank == 0 and any(k.startswith("sigstop_resume") for k, _ in faults.values()) and stopped.exists():
            os.kill(int(stopped.read_text()), signal.SIGCONT)

    def start(step: int) -> None:
        what = (starts or {}).get(str(step))
        if what is not None and rank == 0:
            replacements.append(_start_replacement(steps, marks, len(replacements), step_s, ddp, what == "ghost",
                                                   compiled, odd=what == "odd"))

    sync = SurvivingSync(net, optimizer, min_world_size=min_world_size, on_change=changed)
    kind, fault_step = faults.get(str(rank), (None, -1))
    if kind == "dies_healing":
        _die_while_sending_the_state(marks, rank)
    checksums, worlds = [], []
    try:
        _steps(net, optimizer, sync, rank, steps, kind, fault_step, marks, checksums, worlds, step_s, start)
    except (RankDeclaredLostError, TooFewRanksError) as exc:
        sync.close()
        return {"error": type(exc).__name__, "message": str(exc), "checksums": checksums}
    sync.close()
    stopped = Path(marks, "stopped")
    if stopped.exists() and sync.rank == 0 and "sigstop" in [k for k, _ in faults.values()]:
        os.kill(int(stopped.read_text()), signal.SIGKILL)  # nothing may outlive the job
    dist.destroy_process_group()
    for process in replacements:
        process.wait(timeout=60)
    return {"checksums": checksums, "worlds": worlds, "changes": changes, "first_rank": rank}


def step_done(net, optimizer, sync, checksums: list, worlds: list) -> None:
    """After a step's sync: the optimizer's step, then the parameters' checksum and the world size."""
    optimizer.step()
    optimizer.zero_grad()
    checksums.append(sum(float(p.detach().double().sum()) for p in net.parameters()))
    worlds.append(sync.world_size)


def _said(c) -> dict:
    return {"generation": c.generation, "lost": list(c.lost), "joined": list(c.joined), "members": list(c.members),
            "rank": c.rank, "world_size": c.world_size, "step": c.step, "seconds": c.seconds, "at": time.time()}


def _start_replacement(steps: int, marks: str, n: int, step_s: float, ddp: bool,
                       ghost: bool = False, compiled: bool = False, odd: bool = False) -> subprocess.Popen:
    Path(marks, f"replacement-{n}-started").write_text(repr(time.time()))
    code = (f"from tests.surviving_programs import replacement; "
            f"replacement({steps}, {marks!r}, {n}, {step_s}, {ddp}, {ghost}, {compiled}, {odd})")
    # SMDDP_REPLACEMENT: as smddp_lite.launch marks the replacements it starts
    return subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                            env=dict(os.environ, TEST_RANK=f"replacement-{n}", SMDDP_REPLACEMENT="1"))


def replacement(steps: int, marks: str, n: int, step_s: float = 0.0, ddp: bool = False, ghost: bool = False,
                compiled: bool = False, odd: bool = False) -> None:
    """A replacement process: the same training, joining the running job; writes its checksums and
    changes to ``marks``/replacement-``n``.json. Without DDP it makes no group before SurvivingSync
    does; with DDP (or compiled), ``smddp_lite.init()`` makes it a group of one to make the model on.
    An ``odd`` one compiles with a float16 wire where the job's ranks use bfloat16. A ``ghost`` dies
    (os._exit) a quarter of a second after it took its ticket, while it waits to be admitted."""
    if ghost:
        import smddp_lite.surviving as surviving

        refuse, looks = surviving.SurvivingSync._refuse_a_finished_job, []

        def dies_once_waiting(self, store) -> None:  # looked at once before its ticket, then as it waits
            looks.append(time.time())
            if len(looks) == 2:
                Path(marks, f"replacement-{n}-ticket").write_text(str(self.first_rank))  # its id
                os._exit(7)
            refuse(self, store)

        surviving.SurvivingSync._refuse_a_finished_job = dies_once_waiting
    if ddp or compiled:
        smddp_lite.init()
    net, optimizer = wrapped(model(), ddp, compiled=compiled, wire=torch.float16 if odd else torch.bfloat16)
    changes = []
    try:
        sync = SurvivingSync(net, optimizer, on_change=lambda c: changes.append(_said(c)))
    except ValueError as exc:  # an odd one: told why, once it received the job's state
        written = Path(marks, f"replacement-{n}.json.part")  # renamed once whole, as below
        written.write_text(json.dumps({"error": str(exc)}))
        written.rename(Path(marks, f"replacement-{n}.json"))
        return
    first_step, checksums, worlds, first_sync_at = sync.step, [], [], None
    for step in range(sync.step, steps):
        x, y = batch(sync.first_rank, step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        time.sleep(step_s)
        sync()
        first_sync_at = first_sync_at or time.time()
        step_done(net, optimizer, sync, checksums, worlds)
    sync.close()
    dist.destroy_process_group()
    written = Path(marks, f"replacement-{n}.json.part")  # renamed once whole: a test may be polling for it
    written.write_text(json.dumps(
        {"first_step": first_step, "checksums": checksums, "worlds": worlds, "changes": changes,
         "id": sync.first_rank, "first_sync_at": first_sync_at}))
    written.rename(Path(marks, f"replacement-{n}.json"))


def _steps(net, optimizer, sync, rank, steps, kind, fault_step, marks, checksums, worlds, step_s, start) -> None:
    # DDP and the compiled step average during backward: their rank fails there, the others' with sync()
    ddp = isinstance(net, torch.nn.parallel.DistributedDataParallel) or hasattr(net, "reducer")
    for step in range(steps):
        start(step)
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(net(x), y)
        if ddp and step == fault_step:
            _fail(kind, rank, marks, sync)
        loss.backward()
        time.sleep(step_s)
        if not ddp and step == fault_step:
            _fail(kind, rank, marks, sync)
        sync()
        step_done(net, optimizer, sync, checksums, worlds)


def _fail(kind: str, rank: int, marks: str, sync: SurvivingSync | None = None) -> None:
    Path(marks, f"fault-{rank}").write_text(repr(time.time()))
    if kind == "heartbeat_dies":  # the process that beats its heartbeat is killed
        _kill_the_heartbeat(sync)
    if kind == "holds_gil":  # busy for three times stale_after in a call that never lets another thread run
        _hold_the_gil(6.0)
    if kind == "exit":
        os._exit(3)
    if kind == "sigstop_resume_before_commit":  # its average arrives; it stops before the commit
        commit = sync._commit

        def stops_first() -> None:
            Path(marks, "stopped").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
            commit()

        sync._commit = stops_first
    if kind in ("sigstop", "sigstop_resume"):
        Path(marks, "stopped").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "sigkill":  # while it reduces: its backward (DDP's hooks) or its sync
        threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGKILL), daemon=True).start()


def ddp_beside_ddp(steps: int) -> dict:
    """A model with BatchNorm trained by DDP alone and by DDP with SurvivingSync, side by side on
    the same batches, nothing failing: the largest difference in parameters and in buffers."""
    smddp_lite.init()
    rank = dist.get_rank()

    def made() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 1))

    alone = torch.nn.parallel.DistributedDataParallel(made(), bucket_cap_mb=1e-4)
    kept = torch.nn.parallel.DistributedDataParallel(made(), bucket_cap_mb=1e-4)
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in (alone, kept)]
    sync = SurvivingSync(kept, optimizers[1])
    for step in range(steps):
        x, y = batch(rank, step)
        for m, optimizer in zip((alone, kept), optimizers):
            torch.nn.functional.mse_loss(m(x), y).backward()
            if m is kept:
                sync()
            optimizer.step()
            optimizer.zero_grad()
    sync.close()
    alone.eval()  # DDP alone sends rank 0's buffers at the next forward; SurvivingSync sent them in the sync
    with torch.no_grad():
        alone(batch(rank, steps)[0])

    def apart(tensors: str) -> float:
        pairs = zip(getattr(alone.module, tensors)(), getattr(kept.module, tensors)())
        return max(float((a.double() - b.double()).abs().max()) for a, b in pairs)

    return {"params": apart("parameters"), "buffers": apart("buffers")}


def refusals() -> dict:
    """What SurvivingSync says of the DDP settings and wrappers it cannot keep going."""
    smddp_lite.init()
    DDP = torch.nn.parallel.DistributedDataParallel
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    hooked = DDP(model())
    hooked.register_comm_hook(None, allreduce_hook)
    cases = {
        "unused": lambda: DDP(model(), find_unused_parameters=True),
        "subgroup": lambda: DDP(model(), process_group=dist.new_group(list(range(dist.get_world_size())))),
        "hook": lambda: hooked,
        "sharded": lambda: _compiled(shard_optimizer_state=True),
        "8-bit": lambda: _compiled(wire_dtype="int8"),
        "fsdp": lambda: _fully_sharded(),
    }
    said = {}
    for name, made in cases.items():
        try:
            SurvivingSync(made())
        except (TypeError, ValueError) as exc:
            said[name] = f"{type(exc).__name__}: {exc}"
        else:
            said[name] = "accepted"
    return said


def _compiled(**options) -> torch.nn.Module:
    net = model()
    return smddp_lite.compile(net, torch.optim.SGD(net.parameters(), lr=LR), **options)[0]


def _fully_sharded() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    net = model()
    fully_shard(net)
    return net


def _die_while_sending_the_state(marks: str, rank: int) -> None:
    """Make this rank die (SIGKILL) half-way through sending the job's state to a replacement:
    after the header, as it sends the first chunk of the tensors."""
    import smddp_lite.surviving_state as surviving_state

    send_state, isend = surviving_state.send, dist.isend

    def dies(*args) -> None:
        def killed(*_args, **_named):
            Path(marks, f"fault-{rank}").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        dist.isend = killed
        try:
            send_state(*args)
        finally:
            dist.isend = isend

    surviving_state.send = dies


def _kill_the_heartbeat(sync: SurvivingSync) -> None:
    """SIGKILL the process that beats this rank's heartbeat; returns once the rank noticed."""
    os.kill(sync._heart.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while sync._heart.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)


def _hold_the_gil(seconds: float) -> None:
    """Sleep in a C call that keeps the GIL (ctypes.PyDLL does not release it): no thread of this
    process runs meanwhile, the heartbeat's reading thread included."""
    import ctypes

    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def step_without_sync() -> dict:
    """A compiled model under SurvivingSync whose optimizer steps after backward without sync():
    what it raises, and whether the parameters moved (they must not, on the local gradients)."""
    smddp_lite.init()
    net, optimizer = wrapped(model(), ddp=False, compiled=True)
    sync = SurvivingSync(net, optimizer)
    x, y = batch(dist.get_rank(), 0)
    torch.nn.functional.mse_loss(net(x), y).backward()
    before = [p.detach().clone() for p in net.parameters()]
    try:
        optimizer.step()
    except RuntimeError as exc:
        said = str(exc)
    else:
        said = "no error"
    moved = any(not torch.equal(a, p) for a, p in zip(before, net.parameters()))
    # the way it says: sync(), then the step, which applies the average
    torch.nn.functional.mse_loss(net(x), y).backward()
    sync()
    optimizer.step()
    sync.close()
    dist.destroy_process_group()
    return {"said": said, "moved": moved}


def state_transfer() -> dict:
    """Rank 0 trains a model of three dtypes (float32, float64 and BatchNorm's int64 count) with
    AdamW for three steps and sends its state to rank 1, which starts elsewhere; both then take
    one more step on the same batch. Returns what each holds then, and what rank 1 received."""
    from smddp_lite import surviving_state

    smddp_lite.init()
    rank = dist.get_rank()
    torch.manual_seed(rank)  # rank 1 starts from other parameters, and with no optimizer state
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.BatchNorm1d(16),
                              torch.nn.Linear(16, 1).double())
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)

    def step() -> None:
        x, y = batch(0, 0)
        loss = torch.nn.functional.mse_loss(net[2](net[1](net[0](x)).double()), y.double())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    model = list(net.parameters()) + list(net.buffers())
    extras = None
    # chunks of 1000 bytes: tensors of every dtype span chunks, and chunks span tensors
    surviving_state.CHUNK_BYTES = 1000
    if rank == 0:
        for _ in range(3):
            step()
        surviving_state.send([1], model, optimizer, {"step": 3, "sampler": None})
    else:
        extras = surviving_state.receive(0, model, optimizer).extras
    step()
    state = optimizer.state_dict()["state"]
    held = {"params": [p.detach().double().sum().item() for p in net.parameters()],
            "buffers": [b.double().sum().item() for b in net.buffers()],
            "optimizer": [[float(v.double().sum()) for v in s.values()] for s in state.values()],
            "dtypes": sorted({str(t.dtype) for t in model}), "extras": extras}
    dist.destroy_process_group()
    return held
