"""The optimizer ``compile`` returns: a torch.optim.Optimizer whose step is one fused kernel per arena.

An arena (``buckets.Arena``) holds every bucket of one param group, device and dtype side by
side, so the update launches once per arena, however many buckets the collectives use, and the
step's scalars (loss scale, found_inf, clipping coefficient, the global norm) come from one
more launch that reads the buckets' norms, taken when their reductions completed.

Its param_groups are torch's (LR schedulers work unchanged), and ``state_dict()`` /
``load_state_dict()`` speak torch.optim's format, so a checkpoint loads into plain AdamW/SGD and
back. Internally each state tensor is a view into a flat per-bucket buffer the kernel updates;
``optimizer.state[p]`` holds those views from the step that creates them, as torch's would;
``state_dict()`` also reports the state torch starts from before that step, so that
torch.distributed.checkpoint asks a checkpoint for it.

Sharded (``shard_optimizer_state``), the flat state holds only this rank's share of each bucket,
the kernel updates that share (one launch per bucket: the shares are not contiguous), and the
updated shares are gathered back (``sharding``).
``optimizer.state`` then stays empty; ``state_dict()`` gathers the full state onto every rank
(a collective: every rank calls it) and ``load_state_dict()`` keeps this rank's share of a full one.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.distributed as dist

from ..kernels import adam_step, sgd_step, step_scalars
from ..kernels._launch import arithmetic_dtype
from ..kernels.step_scalars import COUNTS, FOUND_INF, GRAD_NORM, MULTIPLIER
from .buckets import Arena, Bucket
from .reducer import GradReducer
from .sharding import ALL_GATHER, ParameterGathers, Shard, check_every_rank_calls

SUPPORTED = "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD"
# the optimizer state_dict's key for an 8-bit wire's per-rank residuals
WIRE_RESIDUALS = "smddp_wire_residuals"
log = logging.getLogger("smddp_lite")


def optimizer_family(optimizer: torch.optim.Optimizer) -> str:
    """"adamw", "adam" or "sgd", or a ValueError that names what is supported."""
    if isinstance(optimizer, CompiledOptimizer):  # compiled again (after unfreezing parameters)
        return optimizer.family
    kind = type(optimizer)
    family = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}.get(kind)
    if family is None:
        raise ValueError(f"smddp_lite.compile: {kind.__module__}.{kind.__name__} is not supported; supported: {SUPPORTED}")
    check_supported(optimizer.param_groups, kind.__name__)
    if family == "adam":  # torch 2.x's Adam(decoupled_weight_decay=True) is AdamW; one kernel per optimizer
        decoupled = {bool(g.get("decoupled_weight_decay")) for g in optimizer.param_groups}
        if len(decoupled) > 1:
            raise ValueError("smddp_lite.compile: Adam with decoupled_weight_decay=True on some param groups "
                             "and False on others is not supported; set one value for every group")
        family = "adamw" if decoupled == {True} else "adam"
    return family


def check_supported(param_groups, name: str, family: str | None = None, when: str = "") -> None:
    """Refuse param groups that ask for what the fused update does not do. Checked at compile,
    at every step and on load_state_dict: a param_groups edit or a checkpoint of a plain
    Adam(amsgrad=True) run turned it on after compile, and the update silently went without it.
    ``family``: the compiled one, whose weight decay form a group may no longer change."""
    for group in param_groups:
        for flag in ("amsgrad", "maximize", "differentiable"):
            if group.get(flag):
                raise ValueError(f"smddp_lite.compile: {name}({flag}=True) is not supported{when}; "
                                 f"set {flag}=False")
        if family in ("adam", "adamw") and "decoupled_weight_decay" in group \
                and bool(group["decoupled_weight_decay"]) != (family == "adamw"):
            raise ValueError(f"smddp_lite.compile: decoupled_weight_decay={group['decoupled_weight_decay']} "
                             f"differs from the compiled step's ({family == 'adamw'}){when}; the fused update "
                             "was chosen at compile: compile again to change it")


_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}


def torch_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer``'s state as torch.optim keeps it (parameter -> entry). A sharded compiled
    optimizer keeps none in ``state``: its entries are gathered from every rank (a collective)."""
    if isinstance(optimizer, CompiledOptimizer) and optimizer.shard is not None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        gathered = optimizer._gathered_entries("smddp_lite.compile of an optimizer it returned sharded")
        return {params[i]: entry for i, entry in gathered.items()}
    return dict(optimizer.state)


def step_counts(state: dict, family: str) -> dict[int, float]:
    """Each parameter's step count (by ``id``) in torch.optim's ``state``: Adam's "step", and for
    SGD whether its momentum buffer exists (its first step with momentum starts it)."""
    counts = {}
    for p, entry in state.items():
        if family == "sgd":
            counts[id(p)] = 1.0 if entry.get("momentum_buffer") is not None else 0.0
        elif "step" in entry:
            counts[id(p)] = float(entry["step"])
    return counts


_STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


class CompiledOptimizer(torch.optim.Optimizer):
    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale/found_inf instead of unscaling

    def __init__(self, inner: torch.optim.Optimizer, family: str, arenas: list[Arena], reducer: GradReducer,
                 max_grad_norm: float | None, gathers: ParameterGathers | None = None,
                 state: dict | None = None, write_back_grads: bool = False) -> None:
        """``state``: torch-format state to start from (``torch_state(inner)``); default ``inner.state``.
        ``write_back_grads``: leave ``.grad`` unscaled and clipped (``CompileConfig``)."""
        # the wrapped optimizer's own group dicts, not copies: an LR scheduler made before compile
        # (on the optimizer passed in) edits them, and must drive these steps
        super().__init__(inner.param_groups, inner.defaults)
        self._inner = weakref.ref(inner)
        self.family, self.arenas, self.reducer, self.max_grad_norm = family, arenas, reducer, max_grad_norm
        self.buckets = reducer.buckets
        self.gathers, self.write_back_grads = gathers, write_back_grads
        # GradScaler sets self.grad_scale and self.found_inf before step() and deletes them after
        self.last_grad_norm: torch.Tensor | None = None  # unscaled global norm of the last step
        keys = self._state_keys()
        # flat state per arena and key, whose slices are each bucket's (sharded: per bucket,
        # this rank's share of it, and no arena state)
        self.arena_state = [{k: torch.zeros_like(a.param_flat) for k in keys} for a in arenas] \
            if self.shard is None else None
        self.flat_state = [{k: arenas[b.arena].part(v, b) for k, v in self.arena_state[b.arena].items()}
                           if self.shard is None else
                           {k: torch.zeros_like(Shard.part(self.shard, b, b.param_flat)) for k in keys}
                           for b in self.buckets]
        # a step counter per arena (a device tensor), in the update's arithmetic dtype: float32,
        # float64 for float64 parameters
        self.steps = [torch.zeros(1, dtype=arithmetic_dtype(a.dtype), device=a.device) for a in arenas]
        # whether torch would keep state for a bucket's parameters yet, known on the host so that
        # publishing the state never waits on the device: after any Adam step (a skipped one
        # too), after SGD's first step with momentum
        self._has_state = [False] * len(self.buckets)
        # each group's learning rate on each (device, arithmetic dtype), and the value last
        # written there: a fill is a launch, made only when the value changes
        self._lr = {(a.device, arithmetic_dtype(a.dtype)): [
            torch.zeros(1, dtype=arithmetic_dtype(a.dtype), device=a.device) for _ in self.param_groups]
            for a in arenas}
        self._lr_written: dict[tuple, float] = {}
        self._import(inner.state if state is None else state)
        # parameters the optimizer holds that were frozen at compile time: no bucket holds them
        bucketed = {id(p) for b in self.buckets for p in b.params}
        self._frozen = [p for g in self.param_groups for p in g["params"] if id(p) not in bucketed]
        self._compiled = True

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_compiled", False):
            raise ValueError(
                "smddp_lite.compile: add_param_group after compile is not supported: compile plans every "
                "parameter into communication buckets once. Add the group to the optimizer before calling "
                "smddp_lite.compile (or compile again with the new optimizer)")
        super().add_param_group(param_group)

    @property
    def shard(self):
        """This rank's share of every bucket (the reducer's), or None when unsharded."""
        return self.reducer.shard

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (moments or momentum, and step counters)."""
        flats = self.arena_state if self.arena_state is not None else self.flat_state
        return sum(t.numel() * t.element_size() for flat in flats for t in flat.values()) + \
            sum(t.numel() * t.element_size() for t in self.steps)

    def _state_keys(self) -> tuple[str, ...]:
        # SGD gets a momentum buffer even with momentum 0: a scheduler (OneCycleLR) may turn it on
        return _STATE_KEYS[self.family]

    # torch.optim.Optimizer interface -----------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_still_frozen()
        check_supported(self.param_groups, _NAMES[self.family], self.family, " (set after compile)")
        self.reducer.before_step()
        inner = self._inner()
        if inner is not None:  # what a scheduler made on it looks for, to tell step order apart
            inner._opt_called = True
        if self.gathers is not None:  # the last step's gathers still write into the parameters
            self.gathers.wait_all()
        scalars = self._step_scalars()
        # without a loss scale or clipping the multiplier is 1, and writing the gradient back
        # would write what is there (a host-side fact: reading the multiplier would wait)
        unit_scale = getattr(self, "grad_scale", None) is None and self.max_grad_norm is None
        write_grad = self.write_back_grads and not unit_scale
        hyper = []  # per arena: the update's keyword arguments
        for arena, step in zip(self.arenas, self.steps):
            group = self.param_groups[arena.group]
            compute = arithmetic_dtype(arena.dtype)
            mine = scalars if scalars.dtype == compute else scalars.to(compute)
            # a skipped step does not count. SGD counts only steps with momentum: its first such
            # step starts the buffer at the gradient (torch's rule), also when a scheduler turns
            # momentum on mid-run
            if self.family != "sgd" or group["momentum"] != 0:
                step.add_(mine[COUNTS:COUNTS + 1])
                for b in arena.buckets:
                    if not self._has_state[b.index]:
                        self._has_state[b.index] = True
                        self._publish_state(b)
            hyper.append(dict(lr=self._lr_tensor(arena, group["lr"]), step=step, write_grad=write_grad,
                              scale=mine[MULTIPLIER:MULTIPLIER + 1], found_inf=mine[FOUND_INF:FOUND_INF + 1]))
        if self.shard is None:
            for arena, state, common in zip(self.arenas, self.arena_state, hyper):
                self._update(arena.group, arena.param_flat, arena.grad_flat, state, common)
            return loss
        # sharded, the last buckets (the first layers) go first: their gathers are the first the
        # next forward waits for
        for b in reversed(self.buckets):
            self.gathers.before_update(b)
            self._update(b.group, self.shard.of(b, b.param_flat), self.shard.of(b, b.grad_flat),
                         self.flat_state[b.index], hyper[b.arena])
            self.gathers.launch(b)
        return loss

    def _update(self, group_index: int, params: torch.Tensor, grads: torch.Tensor, state: dict,
                common: dict) -> None:
        """One fused launch over flat ``params`` (an arena, or a bucket's share)."""
        group = self.param_groups[group_index]
        if self.family == "sgd":
            sgd_step(params, grads, state.get("momentum_buffer"), momentum=group["momentum"],
                     dampening=group["dampening"], weight_decay=group["weight_decay"],
                     nesterov=group["nesterov"], **common)
        else:
            beta1, beta2 = group["betas"]
            adam_step(params, grads, state["exp_avg"], state["exp_avg_sq"], beta1=beta1,
                      beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                      decoupled=self.family == "adamw", **common)

    def _lr_tensor(self, arena: Arena, lr) -> torch.Tensor:
        """The group's learning rate as a device tensor, written only when it changed."""
        key = (arena.device, arithmetic_dtype(arena.dtype))
        tensor = self._lr[key][arena.group]
        if torch.is_tensor(lr):
            tensor.copy_(lr)
            self._lr_written.pop((key, arena.group), None)
        elif self._lr_written.get((key, arena.group)) != lr:
            tensor.fill_(lr)
            self._lr_written[(key, arena.group)] = lr
        return tensor

    def _check_still_frozen(self) -> None:
        """A parameter frozen at compile time that now has a gradient was unfrozen: torch.optim
        would update it, but no bucket reduces or updates it. Say so instead of skipping it."""
        for p in self._frozen:
            if p.grad is not None:
                raise ValueError(
                    f"smddp_lite.compile: a parameter of shape {tuple(p.shape)} had requires_grad=False when the "
                    "model was compiled and now has a gradient; its gradient is not all-reduced and the compiled "
                    "step does not update it. Call smddp_lite.compile again after changing requires_grad")

    def _step_scalars(self) -> torch.Tensor:
        """(4,) device tensor ``[multiplier, found_inf, global norm, 1 - found_inf]``
        (``kernels.step_scalars``): the multiplier is 1 / loss scale x clipping coefficient, in
        float32, or float64 when some parameters are. One launch; nothing waits on the host."""
        norms = self.reducer.norms
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if self.max_grad_norm is not None:
            # gradients changed in place since backward took their norms: take those buckets'
            # norms again (one more read of each). GradScaler passes found_inf without grad_scale
            # after the user's own scaler.unscale_(optimizer), whose in-place kernel leaves
            # tensors' version counters as they were; other in-place edits (p.grad.div_(n)) are
            # found by theirs.
            self.reducer.remeasure_changed_norms(every_bucket=grad_scale is None and found_inf is not None)
            norms = self.reducer.global_norms()
        # a fresh tensor per step (an allocation, not a launch): last_grad_norm views it
        scalars = step_scalars(norms, grad_scale, found_inf, self.max_grad_norm,
                               torch.empty(4, dtype=norms.dtype, device=norms.device))
        if self.max_grad_norm is not None:
            self.last_grad_norm = scalars[GRAD_NORM:GRAD_NORM + 1]
        return scalars

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buckets in place (one fill per bucket). Gradients stay allocated,
        as views of the buckets, whatever ``set_to_none`` says."""
        for b in self.buckets:
            b.grad_flat.zero_()

    # checkpoints in torch.optim's format --------------------------------------------------------
    def state_dict(self):
        sd = super().state_dict()
        # entries are copied so the checkpoint's CPU step does not replace the live view in
        # self.state; one step tensor per parameter, as torch keeps them
        sd["state"] = {key: dict(entry) for key, entry in sd["state"].items()}
        for entry in sd["state"].values():
            if "step" in entry:
                entry["step"] = entry["step"].detach().to("cpu", torch.float32).clone()
        sd["state"].update(self._unstarted_entries())
        if self.shard is not None:
            sd["state"].update(self._gathered_entries())
        if self.reducer.quantized is not None:
            sd[WIRE_RESIDUALS] = self._wire_residuals()
        return sd

    def _wire_residuals(self) -> dict:
        """This rank's error-feedback residuals (an 8-bit wire_dtype): each rank's are its own, so
        a bitwise resume needs every rank's state_dict (torch.save one file per rank). Plain
        torch.optim ignores the key."""
        return {"rank": dist.get_rank(self.reducer.group), "world_size": self.reducer.world_size,
                "buckets": [wire.state() for wire in self.reducer.quantized]}

    def _load_wire_residuals(self, saved: dict | None) -> None:
        wires = self.reducer.quantized
        if wires is None:
            return
        rank = dist.get_rank(self.reducer.group)
        fits = (saved is not None and saved.get("rank") == rank and saved.get("world_size") == self.reducer.world_size
                and len(saved.get("buckets", ())) == len(wires)
                and all(w.fits(state) for w, state in zip(wires, saved["buckets"])))
        if saved is not None and not fits:
            log.warning("smddp_lite.compile: the checkpoint's 8-bit wire residuals are rank %s's of %s ranks; this "
                        "is rank %d of %d (or the buckets differ), so this rank starts from zero residuals. Save "
                        "every rank's optimizer.state_dict() to resume bitwise", saved.get("rank"),
                        saved.get("world_size"), rank, self.reducer.world_size)
        for i, wire in enumerate(wires):
            wire.load(saved["buckets"][i] if fits else None)

    def wire_residual_bytes(self) -> int:
        """Bytes of error-feedback residuals this rank keeps (an 8-bit wire_dtype), else 0."""
        return sum(w.residual_bytes() for w in self.reducer.quantized or ())

    def _gathered_entries(self, what: str = "optimizer.state_dict()") -> dict[int, dict[str, torch.Tensor]]:
        """torch-format entries of every parameter with state, from every rank's shares: one
        all-gather per bucket and state key, into a bucket-sized buffer the entries are views of
        (so the full state exists on every rank while the state_dict is alive)."""
        check_every_rank_calls(what, self.shard.world, self.shard.rank)
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        entries = {}
        for b, flat in zip(self.buckets, self.flat_state):
            step = self.steps[b.arena]
            if not self._has_state[b.index]:
                continue
            full = {}
            for key, share in flat.items():
                full[key] = torch.empty(b.padded_numel, dtype=share.dtype, device=share.device)
                ALL_GATHER(full[key], share, group=self.reducer.group)
            for i, p in enumerate(b.params):
                views = {k: b.view(v, i) for k, v in full.items()}
                entries[index[id(p)]] = views if self.family == "sgd" else {
                    "step": step.detach().to("cpu", torch.float32).reshape(()).clone(), **views}
        return entries

    def _unstarted_entries(self) -> dict[int, dict[str, torch.Tensor]]:
        """Zero entries for parameters that hold no state yet, where a zero entry is exactly the
        state torch starts from: Adam's (step 0, zero moments) and SGD's zero momentum buffer
        without dampening (torch's first buffer, the gradient, is 0 x momentum + gradient).
        torch.distributed.checkpoint loads only the keys a template asks for, and builds that
        template from this method: without them, a checkpoint's moments were silently left out
        whenever it was loaded before the first step (compiled parameters always have gradients,
        so DCP's warm-up step that would create state does not run)."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        entries = {}
        for b in self.buckets:
            group = self.param_groups[b.group]
            if self._has_state[b.index] or (self.family == "sgd" and (group["momentum"] == 0
                                                                     or group["dampening"] != 0)):
                continue
            for p in b.params:
                zeros = {k: torch.zeros_like(p) for k in self._state_keys()}
                entries[index[id(p)]] = zeros if self.family == "sgd" else {"step": torch.zeros(()), **zeros}
        return entries

    def load_state_dict(self, state_dict) -> None:
        check_supported(state_dict["param_groups"], _NAMES[self.family], self.family, " (in the checkpoint)")
        groups = self.param_groups
        super().load_state_dict(state_dict)
        # torch makes new group dicts: the loaded values go into the ones a scheduler made
        # before compile edits (they are the wrapped optimizer's)
        for kept, loaded in zip(groups, self.param_groups):
            kept.clear()
            kept.update(loaded)
        self.param_groups = groups
        self._import(self.state)
        self._load_wire_residuals(state_dict.get(WIRE_RESIDUALS))

    def _publish_state(self, bucket: Bucket) -> None:
        """Make ``self.state[p]`` torch's entries for the bucket's parameters: views into the flat
        buffers, so they follow every later step without being published again. Sharded, no rank
        holds a parameter's whole state, and ``self.state`` stays empty."""
        if self.shard is not None:
            return
        flat, step = self.flat_state[bucket.index], self.steps[bucket.arena]
        for i, p in enumerate(bucket.params):
            views = {k: bucket.view(v, i) for k, v in flat.items()}
            self.state[p] = views if self.family == "sgd" else {"step": step.reshape(()), **views}

    def _import_one(self, b: Bucket, i: int, buf: torch.Tensor, value: torch.Tensor) -> None:
        """Copy the state ``value`` of ``b``'s ``i``-th parameter into ``buf``: all of it, or the
        part this rank's share holds."""
        if self.shard is None:
            b.view(buf, i).copy_(value)
            return
        part = self.shard.overlap(b, i)
        if part is not None:
            start, at, length = part
            buf[at:at + length].copy_(value.reshape(-1)[start:start + length])

    def _import(self, state) -> None:
        """Copy torch-format state (from the wrapped optimizer or a checkpoint) into the flats."""
        state = dict(state)
        self.state.clear()
        arena_steps: list[dict[float, int]] = [{} for _ in self.arenas]  # step count -> a bucket with it
        for b, flat in zip(self.buckets, self.flat_state):
            steps, present = set(), False
            for i, p in enumerate(b.params):
                entry = state.get(p, {})
                present = present or bool(entry)
                for key, buf in flat.items():
                    if entry.get(key) is not None:
                        if tuple(entry[key].shape) != tuple(p.shape):
                            raise ValueError(
                                f"smddp_lite.compile: the optimizer state's {key!r} for a parameter of shape "
                                f"{tuple(p.shape)} has shape {tuple(entry[key].shape)}; load a checkpoint "
                                "written for this model (its parameters in the same order)")
                        self._import_one(b, i, buf, entry[key])
                if self.family == "sgd":
                    steps.add(1.0 if entry.get("momentum_buffer") is not None else 0.0)
                else:
                    steps.add(float(entry["step"]) if "step" in entry else 0.0)
            if len(steps) > 1:
                raise ValueError(
                    f"smddp_lite.compile: the optimizer state gives the parameters of bucket {b.index} "
                    f"different step counts {sorted(steps)}; the fused update needs one per bucket. "
                    "Load a checkpoint written by a run whose parameters all stepped together."
                )
            arena_steps[b.arena].setdefault(steps.pop() if steps else 0.0, b.index)
            self._has_state[b.index] = present
        for arena, step, counts in zip(self.arenas, self.steps, arena_steps):
            if len(counts) > 1:
                raise ValueError(
                    f"smddp_lite.compile: the optimizer state gives parameters of param group {arena.group} "
                    f"different step counts {sorted(counts)}; the fused update keeps one per group, dtype and "
                    "device, and plans parameters that stepped apart into separate updates at compile. Load "
                    "the checkpoint into the optimizer before smddp_lite.compile, or compile again with the "
                    "optimizer it returned after loading.")
            step.fill_(next(iter(counts)) if counts else 0.0)
        for b in self.buckets:
            if self._has_state[b.index]:
                self._publish_state(b)
