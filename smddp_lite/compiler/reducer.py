"""Mechanism: launch each bucket's collective as soon as its last gradient is accumulated.

A post-accumulate-grad hook per parameter counts down its bucket; buckets are launched strictly
in index order (so every rank issues the same collectives in the same order whatever order
autograd happens to finish them in), asynchronously, overlapping the rest of backward. A
callback queued at the end of backward waits for all of them, so ``.grad`` holds the averaged
gradient when ``backward()`` returns, as with DDP.

Each bucket's 2-norm (for gradient clipping) is taken once, of the reduced values the update
will use (after a 16-bit wire's copy back), into one tensor of norms that the step reads
instead of the gradients. On CUDA it is taken as soon as the bucket's collective completes, on a
stream that waits for it (the collective's future, as DDP's comm hooks chain theirs), so it
overlaps the rest of backward; on the CPU at the end of backward, where a callback would run on
the communication thread and delay the next bucket's collective.

Sharded (``shard_optimizer_state``), a bucket is reduce-scattered instead: only the rank's own
share of ``.grad`` holds the averaged gradient (the rest keeps the rank's local gradient), norms
are taken of the shares and summed across ranks, and the ranks agree at the end of backward
whether any gradient is non-finite (see ``_agree_non_finite``).

Under ``SurvivingSync`` (``keep_local_gradients``) a lost rank must not end backward, and the
survivors must be able to average the step again in their new group: every bucket then travels
in a wire buffer of its own (the 16-bit wire, or one of the gradients' dtype), so ``.grad`` keeps
this rank's own gradients until the step commits (``take_averages``, called by ``sync()``); a
failed call is recorded in ``failure``, never raised, and ``reduce_again`` averages the kept
gradients in the new group.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..backend import numerics
from ..kernels._launch import arithmetic_dtype
from .buckets import Bucket
from .quantized_wire import QuantizedWire
from .sharding import REDUCE_SCATTER, ParameterGathers, Shard

log = logging.getLogger("smddp_lite")


class GradReducer:
    def __init__(self, buckets: list[Bucket], group, world_size: int, want_norm: bool,
                 shard: Shard | None = None, gathers: ParameterGathers | None = None,
                 quantized: list[QuantizedWire] | None = None) -> None:
        """``gathers``, sharded: a bucket's wire buffer may still carry the last step's updates,
        and is waited for before its gradients go out. ``quantized``: each bucket's 8-bit wire,
        which averages it instead of an all_reduce."""
        self.buckets, self.group, self.world_size, self.want_norm = buckets, group, world_size, want_norm
        self.shard, self.gathers, self.quantized = shard, gathers, quantized
        self.sync = True  # False inside no_sync(): gradients only accumulate
        # (n_buckets,) each bucket's 2-norm, unsquared (one op per bucket: the global norm is the
        # norm of these), in float64 if any update computes in it (float64 parameters)
        dtype = max((arithmetic_dtype(b.dtype) for b in buckets), key=lambda d: d.itemsize, default=torch.float32)
        self.norms = torch.zeros(len(buckets), dtype=dtype, device=buckets[0].device if buckets else "cpu")
        # finish each bucket (copy back from the wire, take its norm) from its collective's
        # future, overlapping backward; see the module's docstring for why only on CUDA
        self.finish_on_completion = bool(buckets) and buckets[0].device.type == "cuda"
        # each bucket's gradient version counter when its norm was taken: an in-place edit of a
        # gradient after backward (p.grad.div_(n)) moves it, and step() measures that bucket again
        self._measured_at = [-1] * len(buckets)
        self._backward_since_step = False
        self._count_afresh()
        self._in_backward = False
        self._warned_unused = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(b, i))
                       for b in buckets for i, p in enumerate(b.params)]
        self._non_finite_mark = self._mark_slot() if shard is not None else None
        self.survivable = False  # set by keep_local_gradients
        self.failure: BaseException | None = None  # the step's first failed call, when survivable
        self._on_wire: list[bool] = []  # survivable: the buckets whose averages arrived in their wire buffer
        self._awaiting_commit = False  # survivable: a backward reduced the buckets, and no sync() took them yet

    def keep_local_gradients(self, wire_dtype: torch.dtype | None) -> None:
        """Reduce every bucket in a wire buffer of its own (of ``wire_dtype``, or the bucket's
        dtype), so that ``.grad`` holds this rank's gradients until every average arrived, and
        record failed calls instead of raising them: what SurvivingSync needs to redo a step."""
        for b in self.buckets:
            if b.wire_flat is None:
                b.wire_flat = torch.zeros(b.padded_numel, dtype=wire_dtype or b.dtype, device=b.device)
        # every bucket's average is copied into .grad only once the step committed (a copy before
        # would overwrite gradients a redo needs)
        self.finish_on_completion = False
        self.survivable = True
        self._on_wire = [False] * len(self.buckets)

    def regroup(self, group, world_size: int) -> None:
        """Reduce in ``group`` from now on (a survivor's new group, with its own divisor)."""
        self.group, self.world_size = group, world_size

    def reduce_again(self) -> None:
        """Average every bucket's kept gradients in the current group, as backward would have;
        raises the first failed call."""
        self.failure = None
        self._count_afresh()
        for b in self.buckets:
            self._launch(b)
        self._wait_all()
        self._count_afresh()
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def take_averages(self) -> None:
        """The step committed: its averages into ``.grad`` (over this rank's own gradients), and
        their norms, which clipping reads (taken again after a redo)."""
        for b in self.buckets:
            if self._on_wire[b.index]:
                self._finish_bucket(b)  # the wire's average into .grad, and its norm
            elif self.want_norm:
                self.bucket_norm(b)
        self._on_wire = [False] * len(self.buckets)
        self._awaiting_commit = False
        self._measured_now()

    def detach(self) -> None:
        """Stop reducing: the model was compiled again, and the new reducer owns its gradients
        (two would all-reduce every bucket twice, and point ``.grad`` at the old buckets)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _hook(self, bucket: Bucket, i: int):
        view = bucket.view(bucket.grad_flat, i)

        def on_grad_ready(param: torch.nn.Parameter) -> None:
            if param.grad is not view and param.grad.data_ptr() != view.data_ptr():
                # someone set .grad to None (model.zero_grad()) and autograd stored a fresh tensor
                view.copy_(param.grad)
                param.grad = view
            self._backward_since_step = True
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            if self.sync:
                self._pending[bucket.index] -= 1
                self._launch_ready()

        return on_grad_ready

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        if self.world_size == 1:
            return
        if self.gathers is not None:
            self.gathers.wait([b.index])
        if self.survivable and self.failure is not None:
            return  # after a failure the group is broken: the step is redone anyway
        if self.quantized is not None:
            self.quantized[b.index].start()
            self._works[b.index] = self.quantized[b.index]
            # buckets before it go on to cross between hosts while backward goes on (in bucket
            # order, as every rank does); a no-op where they have already
            for earlier in self.quantized[: b.index]:
                earlier.exchange()
            return
        wire = b.wire_flat
        sent, op = b.grad_flat, dist.ReduceOp.AVG
        if wire is not None:
            # divide before the sum: a float16 wire then cannot overflow where float32 would not
            numerics.share_of_mean(b.grad_flat, self.world_size, out=wire)
            sent, op = wire, dist.ReduceOp.SUM
        try:
            if self.shard is None:
                work = dist.all_reduce(sent, op=op, group=self.group, async_op=True)
            else:
                work = REDUCE_SCATTER(self.shard.of(b, sent), sent, op=op, group=self.group, async_op=True)
        except dist.DistError as failure:
            if not self.survivable:
                raise
            self.failure = failure
            return
        self._works[b.index] = work
        if self.finish_on_completion:
            self._finishing[b.index] = work.get_future().then(lambda reduced, b=b: self._finish_bucket(b, reduced))

    def _wait_all(self) -> None:
        """Survivable: wait for every bucket's call, recording a failure; the averages stay in the
        wire buffers until ``take_averages``."""
        for b in self.buckets:
            work = self._works[b.index]
            if work is not None:
                try:
                    work.wait()
                except dist.DistError as failure:
                    self.failure = self.failure or failure
        self._on_wire = [self.failure is None and work is not None for work in self._works]
        self._awaiting_commit = True

    def _finish_bucket(self, b: Bucket, reduced: torch.futures.Future | None = None) -> None:
        """What follows a bucket's reduction: its 16-bit wire's values back into ``.grad``, and
        its norm. ``reduced``: the collective's future, when called as its callback (a failed
        collective raises here, and its wait() says why)."""
        if reduced is not None:
            reduced.value()
        if b.wire_flat is not None:
            Shard.part(self.shard, b, b.grad_flat).copy_(Shard.part(self.shard, b, b.wire_flat))
        if self.want_norm:
            self.bucket_norm(b)

    def _finish_backward(self) -> None:
        self._in_backward = False
        if not self.sync:
            return
        if self._next < len(self.buckets):
            self._warn_unused()
            for i in range(self._next, len(self.buckets)):
                self._zero_missing(self.buckets[i])
                self._pending[i] = 0
            self._launch_ready()
        if self.survivable:
            self._wait_all()
            self._count_afresh()
            return
        if self.quantized is not None:  # every bucket's sums in flight before the first is waited for
            for wire in self.quantized:
                wire.sum_and_gather()
        for b in self.buckets:
            work, finishing = self._works[b.index], self._finishing[b.index]
            if work is not None:
                work.wait()
            if finishing is not None:
                finishing.wait()  # this stream now waits for the bucket's copy back and norm
            elif work is not None or self.want_norm:
                self._finish_bucket(b)
        if self.shard is not None:
            self._agree_non_finite()
        self._measured_now()
        self._count_afresh()

    def _count_afresh(self) -> None:
        """No bucket counted down, launched or in flight: the state before a backward."""
        self._pending = [len(b.params) for b in self.buckets]  # gradients each bucket still waits for
        self._works: list = [None] * len(self.buckets)
        self._finishing: list[torch.futures.Future | None] = [None] * len(self.buckets)
        self._next = 0  # first bucket not launched yet

    def _zero_missing(self, b: Bucket) -> None:
        """Parameters of ``b`` whose ``.grad`` is None got no gradient since the user set it to
        None (``model.zero_grad()``): their bucket slices still hold an older gradient. Zero them
        and give them back their views, so the warning's "taken as zero" holds."""
        for i, p in enumerate(b.params):
            if p.grad is None:
                view = b.view(b.grad_flat, i)
                view.zero_()
                p.grad = view

    def forget_unfinished_backward(self) -> None:
        """Called at each forward: a backward that raised part-way (an out-of-memory error caught
        and retried) never reached ``_finish_backward``, and left buckets counted down and
        collectives in flight. Wait for those and start counting afresh, or every later backward
        would launch buckets early and never take norms."""
        if not self._in_backward:
            return
        for work in self._works + self._finishing:
            if work is not None:
                try:
                    work.wait()
                except dist.DistError as failure:
                    if not self.survivable:
                        raise
                    self.failure = self.failure or failure
        self._count_afresh()
        self._in_backward = False

    def _warn_unused(self) -> None:
        if self._warned_unused:
            return
        self._warned_unused = True
        missing = sum(self._pending[self._next:])
        log.warning("smddp_lite.compile: %d parameter(s) got no gradient in this backward; their gradient "
                    "is taken as what their bucket holds (zero after zero_grad, or after model.zero_grad() "
                    "set it to None) and they are updated like the others. Every rank must leave out the "
                    "same parameters.", missing)

    def bucket_norm(self, b: Bucket) -> None:
        """Record the bucket's 2-norm (one read of its reduced gradients, one launch)."""
        torch.linalg.vector_norm(Shard.part(self.shard, b, b.grad_flat), dtype=self.norms.dtype,
                                 out=self.norms[b.index])

    def _measured_now(self) -> None:
        """Every bucket's norm holds for its gradients as they are now. Recorded once all are
        taken: a bucket's gradients are a view of its arena's, which shares one version
        counter, so each later collective or copy into the arena moves every bucket's."""
        self._measured_at = [b.grad_flat._version for b in self.buckets]

    def remeasure_changed_norms(self, every_bucket: bool = False) -> None:
        """Take again the norms of buckets whose gradients changed since they were measured (an
        in-place edit of a ``.grad`` view moves its arena's version counter), or of every bucket."""
        changed = [b for b in self.buckets if every_bucket or b.grad_flat._version != self._measured_at[b.index]]
        for b in changed:
            self.bucket_norm(b)
        if changed:
            self._measured_now()

    def before_step(self) -> None:
        """Called by step(). With no backward since the last step, ``.grad`` set to None by
        ``model.zero_grad()`` left the buckets' older gradients in place, which the step would
        apply again: take those as zero, as after a backward that gave them no gradient."""
        if self._awaiting_commit:
            self._awaiting_commit = False  # said once: the next backward starts afresh
            raise RuntimeError(
                "smddp_lite.compile: optimizer.step() was called after backward() without SurvivingSync's "
                "sync(), so .grad still holds this rank's own gradients, not their average (under SurvivingSync "
                "the averages reach .grad when sync() commits the step). Call sync() after backward() and "
                "before optimizer.step().")
        if not self._backward_since_step:
            for b in self.buckets:
                self._zero_missing(b)
        self._backward_since_step = False

    def global_norms(self) -> torch.Tensor:
        """Norms whose 2-norm is the global norm of the (averaged, still loss-scaled) gradients:
        every bucket's, or, sharded, the norm of every rank's shares (their squares summed
        across ranks by one small all_reduce of a device tensor: no wait on the host)."""
        if self.shard is None:
            return self.norms
        squares = self.norms.square().sum().reshape(1)
        dist.all_reduce(squares, group=self.group)
        return squares.sqrt()

    def _mark_slot(self) -> torch.Tensor | None:
        """One gradient element outside this rank's shares (its local gradient, which no update
        reads), where ``_agree_non_finite`` marks a non-finite gradient found on any rank."""
        for b in self.buckets:
            lo, hi = self.shard.bounds(b)
            for position in (0, b.numel - 1):
                if not lo <= position < hi:
                    return b.grad_flat[position:position + 1]
        return None  # buckets of one element each: there is nothing outside the shares to mark

    def _agree_non_finite(self) -> None:
        """GradScaler decides to skip a step, and how to change its scale, from a scan of every
        ``.grad`` on each rank. Sharded, those hold local gradients outside the rank's share, so
        ranks could scan differently and their scales drift apart (and a gradient scaled by
        different factors would then be summed). One summed flag makes the scans agree: a
        non-finite local gradient leaves a non-finite reduced one in somebody's share, so when
        any share is non-finite every rank marks one element of its local gradient as inf, and
        when none is, no rank's gradient holds one."""
        # a share's norm, or its sum, is non-finite when the share is (and when it overflows, which
        # only a gradient beyond any use gives; every rank then marks it alike). The sum is one
        # pass: isfinite().all() took 24 ms where it takes 1 ms (4.7M float32 elements, one core)
        if self.want_norm:
            flag = (~torch.isfinite(self.norms)).sum(dtype=torch.float32).reshape(1)
        else:
            bad = [~torch.isfinite(Shard.part(self.shard, b, b.grad_flat).sum(dtype=arithmetic_dtype(b.dtype)))
                   for b in self.buckets]
            flag = torch.stack(bad).sum(dtype=torch.float32).reshape(1)
        dist.all_reduce(flag, group=self.group)
        if self._non_finite_mark is not None:
            mark = self._non_finite_mark
            mark.copy_(torch.where(flag > 0, torch.full_like(mark, float("inf")), mark))
