"""Programs of test_p2p.py: send, recv and pipelines.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import smddp_lite

from .rank_helpers import error_of, let_gloo_workers_finish


def point_to_point() -> dict:
    """send/recv as pipelines and ring exchanges use them; returns what went wrong, by case."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    after, before = (rank + 1) % world, (rank - 1) % world
    problems = {}

    def check(case: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or not torch.equal(got, want):
            problems[case] = f"got {got.flatten()[:6].tolist()}, want {want.flatten()[:6].tolist()}"

    # a ring through batch_isend_irecv: every rank posts a send before its peer posts the recv,
    # and each pair's link is made while the others are being made; float8 and int16 travel as bytes
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.int8, torch.float8_e4m3fn, torch.int16):
        sent = (torch.arange(1000) * (rank + 1) % 7).to(dtype)
        got = torch.empty(1000, dtype=dtype)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, after), dist.P2POp(dist.irecv, got, before)])
        for w in works:
            w.wait()
        check(f"ring-{dtype}", got, (torch.arange(1000) * (before + 1) % 7).to(dtype))
    # a pipeline: stage r receives from r-1, adds, sends to r+1; several messages in order
    for step in range(5):
        x = torch.full((300, 7), float(step))
        if rank > 0:
            dist.recv(x, src=rank - 1)
        x += 1
        if rank < world - 1:
            dist.send(x, dst=rank + 1)
        elif rank == world - 1:
            check(f"pipeline-{step}", x, torch.full((300, 7), float(step + world)))
    # tags keep messages apart: posted in one order, received in the other
    if world >= 2 and rank in (0, 1):
        peer = 1 - rank
        if rank == 0:
            a, b = dist.isend(torch.full((5,), 1.0), peer, tag=1), dist.isend(torch.full((5,), 2.0), peer, tag=2)
            a.wait(), b.wait()
        else:
            two, one = torch.empty(5), torch.empty(5)
            w2 = dist.irecv(two, peer, tag=2)
            w1 = dist.irecv(one, peer, tag=1)
            w2.wait(), w1.wait()
            check("tags", torch.cat([one, two]), torch.cat([torch.full((5,), 1.0), torch.full((5,), 2.0)]))
        # into a non-contiguous tensor, and through a future
        if rank == 0:
            dist.send(torch.arange(12.0).view(3, 4), dst=1, tag=3)
        else:
            target = torch.zeros(4, 3).t()
            fut = dist.irecv(target, 0, tag=3).get_future()
            value = fut.wait()[0]
            check("non_contiguous", target, torch.arange(12.0).view(3, 4))
            check("future", value, torch.arange(12.0).view(3, 4))
        # a 1-element column (stride 3, contiguous to torch) of a dtype sent as bytes
        if rank == 0:
            dist.send(torch.tensor([[1, 7, 2]], dtype=torch.int16)[:, 1], dst=1, tag=5)
        else:
            column = torch.zeros(1, 3, dtype=torch.int16)[:, 1]
            dist.recv(column, 0, tag=5)
            check("one_element_column", column, torch.tensor([7], dtype=torch.int16))
    # collectives go on between them, on every transport
    t = torch.ones(3)
    dist.all_reduce(t)
    check("collective_after", t, torch.full((3,), float(world)))
    dist.destroy_process_group()
    return problems


def point_to_point_errors() -> dict:
    """Bad peers and tags raise on the calling rank; a recv whose sender never comes raises at
    the group's timeout (3 s here), naming the peer and tag; collectives go on afterwards."""
    smddp_lite.init(timeout=timedelta(seconds=3))
    rank = dist.get_rank()
    report = {
        "outside": error_of(lambda: dist.send(torch.ones(3), dst=5)),
        "tag": error_of(lambda: dist.recv(torch.ones(3), src=1 - rank, tag=-2)),
        "any_source": error_of(lambda: dist.recv(torch.ones(3))),
        # gloo's tags are 32-bit: this one failed the post and closed the pair's link
        "big_tag": error_of(lambda: dist.send(torch.ones(3), dst=1 - rank, tag=2**40)),
        "recv_expanded": error_of(lambda: dist.recv(torch.zeros(1).expand(4), src=1 - rank, tag=4)),
    }
    # a contiguous lazy negative view (the imaginary part of a conjugate): its memory holds +2
    negative = torch.tensor([1 + 2j]).conj().imag
    received = torch.zeros(1)
    dist.send(negative, dst=1) if rank == 0 else dist.recv(received, src=0)
    report["negative_view_received"] = received.tolist() if rank == 1 else [-2.0]
    started = time.monotonic()
    report["never_sent"] = error_of(lambda: dist.recv(torch.ones(3), src=1 - rank, tag=9))
    report["never_sent"]["seconds"] = time.monotonic() - started
    # gloo closes a pair whose wait timed out: the next call on it says so at once
    report["after_timeout"] = error_of(lambda: dist.recv(torch.ones(3), src=1 - rank, tag=10))
    t = torch.ones(3)
    dist.all_reduce(t)
    report["usable_after"] = t.tolist() == [2.0, 2.0, 2.0]
    dist.destroy_process_group()
    return report


def recv_timed_out_before_the_link() -> dict:
    """Rank 1's first irecv from rank 0 waits 1 s and gives up before rank 0 ever names it; rank
    0 then sends A, and rank 1 receives again. The message must not land in the tensor of the
    recv that already failed (it did, and the retry silently got the next message): as on gloo,
    the pair's link failed with the timeout, and both ranks' next calls on it say so. A
    get_future() asked for before a wait(1 s) must not stretch that wait (to the group's 8 s)."""
    smddp_lite.init(timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    report = {}
    if rank == 1:
        first = torch.zeros(3)
        work = dist.irecv(first, 0)
        work.get_future()
        time.sleep(0.2)  # its watcher thread is waiting in the work by now (for the group's 8 s)
        started = time.monotonic()
        report["wait"] = error_of(lambda: work.wait(timedelta(seconds=1)))
        report["wait_seconds"] = time.monotonic() - started
        store.set("test-recv-gave-up", "1")
        store.wait(["test-send-over"])  # the link exists by now: rank 0 has made it and sent on it
        report["first_after"] = first.tolist()
        report["retry"] = error_of(lambda: dist.recv(torch.zeros(3), 0))
    else:
        store.wait(["test-recv-gave-up"])
        report["send"] = error_of(lambda: dist.send(torch.full((3,), 1.0), 1))
        store.set("test-send-over", "1")
    dist.destroy_process_group()
    return report


def pipeline_parity(microbatches: int = 4) -> dict:
    """torch.distributed.pipelining (one stage per rank, send/recv between them) under the GPipe
    and 1F1B schedules, on "smddp" and on "gloo" side by side in one job: the losses and every
    stage's gradients must be the same."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    smddp_lite.init(timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    target = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    results = {}
    for schedule in (ScheduleGPipe, Schedule1F1B):
        for name, group in (("smddp", dist.group.WORLD), ("gloo", gloo)):
            torch.manual_seed(0)
            layers = [torch.nn.Linear(16, 16) for _ in range(2 * world)]
            stage_layers = torch.nn.Sequential(*layers[2 * rank : 2 * rank + 2])
            stage = PipelineStage(stage_layers, rank, world, torch.device("cpu"), group=group)
            run = schedule(stage, n_microbatches=microbatches, loss_fn=lambda out, y: ((out - y) ** 2).mean())
            losses = []
            if rank == 0:
                run.step(x)
            elif rank == world - 1:
                run.step(target=target, losses=losses)
            else:
                run.step()
            results[(schedule.__name__, name)] = (
                [float(loss) for loss in losses], torch.cat([p.grad.reshape(-1) for p in stage_layers.parameters()]))
    report = {}
    for schedule in ("ScheduleGPipe", "Schedule1F1B"):
        (smddp_losses, smddp_grads), (gloo_losses, gloo_grads) = results[(schedule, "smddp")], results[(schedule, "gloo")]
        report[schedule] = {"losses": smddp_losses, "same_losses": smddp_losses == gloo_losses,
                            "same_grads": bool(torch.equal(smddp_grads, gloo_grads)),
                            "grad_norm": float(smddp_grads.norm())}
    let_gloo_workers_finish()
    dist.destroy_process_group()
    return report
