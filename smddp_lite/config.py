"""Configuration of smddp-lite, read from ``SMDDP_*`` environment variables in one place.

Every component has one frozen dataclass; each field documents itself and has a default.
:func:`read_env` is the only code that looks at ``SMDDP_*`` variables, so the full list of
knobs is the table ``ENV_VARS`` below and a misspelt variable is an error, not a silent no-op.

Example::

    SMDDP_TRANSPORT=gloo SMDDP_DEBUG=1 torchrun --nproc-per-node 2 train.py
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Mapping

TRANSPORTS = ("auto", "shm", "gloo", "mpi")
"""Transports the CPU path can use. "auto" picks mpi when launched by mpiexec, else shm when
every rank of a group shares one host, else gloo."""
ALGORITHMS = ("auto", "flat", "hierarchical")
CUDA_TRANSPORTS = ("auto", "nccl", "staged")
INTER_NODE_ACCUMULATIONS = ("float32", "wire")
# wire dtypes sent blockwise quantized, with a float32 scale per block (kernels/quantize.py)
QUANTIZED_WIRE_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
INTER_NODE_WIRE_DTYPES = ("bfloat16", "float16", *QUANTIZED_WIRE_DTYPES)
WIRE_BLOCKS = (16, 1 << 16)  # the smallest and largest block of an 8-bit wire (a power of two)


def wire_block_problem(block) -> str | None:
    """Why ``block`` cannot be an 8-bit wire's block size, or None."""
    low, high = WIRE_BLOCKS
    if isinstance(block, bool) or not isinstance(block, int) or not low <= block <= high or block & (block - 1):
        return f"expected a power of two from {low} to {high} (elements per float32 scale of an 8-bit wire)"
    return None


@dataclasses.dataclass(frozen=True)
class BackendConfig:
    """How the "smddp" process group moves CPU tensors."""

    transport: str = "auto"
    """One of ``TRANSPORTS``. Env: ``SMDDP_TRANSPORT``."""

    debug: bool = False
    """Log every decision (transport, algorithm) on rank 0 and check that all ranks call the
    same collective with the same size and dtype before running it. Env: ``SMDDP_DEBUG``."""

    check_collectives: bool = True
    """Check op, dtype and size across ranks before each collective. The shared-memory
    transport always checks (it costs nothing there); on gloo, MPI and between hosts the check
    is one extra small all_gather per call, on by default because calls that differ yet pair
    return wrong data with no error (MPI) or abort a process (gloo). Turned off
    (``SMDDP_CHECK_COLLECTIVES=0``), gloo, MPI and the hierarchical transport still find calls
    that differ once ranks have waited a second for each other in them, but not those that
    pair. Env: ``SMDDP_CHECK_COLLECTIVES``."""

    shm_chunk_bytes: int = 1 << 20
    """Bytes each rank stages per step in the shared-memory transport. 1 MiB keeps a step's
    working set (2 ranks x 2 buffers) inside the L2/L3 caches of the machines we measured on.
    Env: ``SMDDP_SHM_CHUNK_BYTES``."""

    scratch_max_bytes: int = 256 << 20
    """The largest working buffer a group keeps between calls, per use and dtype (float32
    copies of 16-bit messages, backend/scratch.py; a group has a few such uses): reusing one saves the page faults of a fresh one (a 64 MiB
    bfloat16 message widened in 6 ms instead of 50), but a group keeps it until destroyed.
    Larger messages get a fresh buffer each call. Env: ``SMDDP_SCRATCH_MAX_BYTES``."""

    algorithm: str = "auto"
    """How all_reduce, all_gather, reduce_scatter, broadcast and barrier cross hosts: "hierarchical" (inside each
    host first, then one balanced share per rank across hosts, the Herring/SMDDP scheme), "flat"
    (one ring over all ranks), or "auto" (hierarchical on several hosts with equal rank counts,
    but for small rounded sums and small broadcasts: see ``hierarchical_min_bytes``). Env: ``SMDDP_ALGORITHM``."""

    hierarchical_min_bytes: int = 256 << 10
    """Under "auto", sums that the hierarchical path would round between hosts (16-bit inputs, or
    float sums with ``inter_node_wire_dtype``) smaller than this take the flat path, summed in
    float32 and rounded once: a loss or a count all-reduced for logging stays exact, and saving
    bandwidth on small messages saves nothing. Smaller broadcasts go flat too: they wait on
    latency, and the hierarchical broadcast's two steps in shared memory cost more than the bytes
    they save (larger ones cross each host link once instead of once per rank: 2x faster on 2 x 2
    and 4 x 2 simulated hosts). Every other call takes the hierarchical path at every size: fewer
    steps cross hosts (measured 1.4-2.2x faster small all_reduces than the flat ring).
    Env: ``SMDDP_HIERARCHICAL_MIN_BYTES``."""

    hierarchical_chunk_bytes: int = 4 << 20
    """A hierarchical all_reduce, reduce_scatter (input bytes) or all_gather (output bytes)
    larger than this runs as a pipeline of pieces of this size: while one piece crosses the
    network, the host reduces the next or gathers the previous one, so the host-local phases
    hide behind the network instead of adding to it. 4 MiB measured best for DDP on 2 simulated
    hosts x 2 ranks at 1 Gbit/s (1, 2, 4, 8 MiB: 1 and 2 MiB pay more in per-piece overhead than
    they hide). A bfloat16 reduce_scatter of 16 MiB on those hosts: 115 ms in one piece, 71 ms in
    four. Env: ``SMDDP_HIERARCHICAL_CHUNK_BYTES``."""

    inter_node_wire_dtype: str | None = None
    """Send float32 sums between hosts as "bfloat16" or "float16" (accumulated in float32 at
    each end), or 8-bit: "int8", "float8_e4m3fn" or "float8_e5m2", blockwise with a float32
    scale per ``inter_node_wire_block`` elements (all_reduce only: each host's sums are
    quantized once, summed in float32 where they land, and come back quantized once; a
    reduce_scatter's cross in float32); None sends them as they are.
    Env: ``SMDDP_INTER_NODE_WIRE_DTYPE``."""

    inter_node_wire_block: int = 256
    """Elements per scale of an 8-bit ``inter_node_wire_dtype`` (a power of two from 16 to
    65536): 256 adds 1.6% to int8's bytes. Env: ``SMDDP_INTER_NODE_WIRE_BLOCK``."""

    inter_node_accumulate: str = "float32"
    """How 16-bit sums add up between more than two hosts. "float32": each host sums one slice
    of every value in float32 and rounds it to the wire dtype once (an all-to-all, then an
    all-gather of the sums). "wire": gloo's ring in the wire dtype, which rounds each partial
    sum on each of its N-1 hops, as NCCL and torch's fp16 compression hook do: the error grows
    with the host count, the speed is the ring's: one flow per link, less CPU work (DDP on 4
    simulated hosts, 1 Gbit/s: 1-7% more samples/s than "float32"). Between two hosts both are
    one addition, rounded once. Env: ``SMDDP_INTER_NODE_ACCUMULATE``."""

    hostname: str | None = None
    """Host identity used to find ranks that share a machine; defaults to the hostname. Set it
    per rank to simulate several hosts on one machine (tests). Env: ``SMDDP_HOSTNAME``."""

    cuda_transport: str = "auto"
    """How CUDA tensors move: "nccl" (through cupy.cuda.nccl), "staged" (through host memory
    and the CPU transport: no cupy needed, and several ranks may share one GPU), or "auto"
    (NCCL when cupy and libnccl load, else staged with a warning). Env: ``SMDDP_CUDA_TRANSPORT``."""

    blocking_wait: bool = False
    """``Work.wait()`` on a CUDA collective also blocks the host until the collective has ended,
    raising after the process group timeout (torch's ``TORCH_NCCL_BLOCKING_WAIT=1`` does the
    same). Off: ``wait()`` only orders the caller's stream. Env: ``SMDDP_BLOCKING_WAIT``."""

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"smddp-lite: SMDDP_ALGORITHM={self.algorithm!r} is not an algorithm; expected one of "
                f"{', '.join(ALGORITHMS)}."
            )
        if self.inter_node_wire_dtype not in (None, *INTER_NODE_WIRE_DTYPES):
            raise ValueError(
                f"smddp-lite: SMDDP_INTER_NODE_WIRE_DTYPE={self.inter_node_wire_dtype!r}; expected one of "
                f"{', '.join(INTER_NODE_WIRE_DTYPES)}, or unset for no compression."
            )
        problem = wire_block_problem(self.inter_node_wire_block)
        if problem is not None:
            raise ValueError(f"smddp-lite: SMDDP_INTER_NODE_WIRE_BLOCK={self.inter_node_wire_block}; {problem}.")
        if self.inter_node_accumulate not in INTER_NODE_ACCUMULATIONS:
            raise ValueError(
                f"smddp-lite: SMDDP_INTER_NODE_ACCUMULATE={self.inter_node_accumulate!r}; expected one of "
                f"{', '.join(INTER_NODE_ACCUMULATIONS)} (float32 rounds each sum once, wire rounds on every "
                "hop and is faster beyond two hosts)."
            )
        if self.hierarchical_chunk_bytes < 4096:
            raise ValueError(
                f"smddp-lite: SMDDP_HIERARCHICAL_CHUNK_BYTES={self.hierarchical_chunk_bytes} is too small; "
                "expected at least 4096 (bytes); the default is 4194304."
            )
        if self.cuda_transport not in CUDA_TRANSPORTS:
            raise ValueError(
                f"smddp-lite: SMDDP_CUDA_TRANSPORT={self.cuda_transport!r} is not a CUDA transport; expected "
                f"one of {', '.join(CUDA_TRANSPORTS)}. Unset it to let the backend choose."
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"smddp-lite: SMDDP_TRANSPORT={self.transport!r} is not a transport; expected one of "
                f"{', '.join(TRANSPORTS)}. Unset it to let the backend choose."
            )
        if self.scratch_max_bytes < 0:
            raise ValueError(
                f"smddp-lite: SMDDP_SCRATCH_MAX_BYTES={self.scratch_max_bytes} must be 0 (keep no working "
                "buffers) or more (bytes); the default is 268435456."
            )
        if self.shm_chunk_bytes < 4096 or self.shm_chunk_bytes % 64:
            raise ValueError(
                f"smddp-lite: SMDDP_SHM_CHUNK_BYTES={self.shm_chunk_bytes} must be a multiple of 64 "
                "and at least 4096 (bytes); the default is 1048576."
            )

    @property
    def checks_collectives(self) -> bool:
        """Whether gloo/MPI groups verify op, dtype and size across ranks before each call."""
        return self.debug or self.check_collectives


WIRE_DTYPES = ("float32", "bfloat16", "float16", *QUANTIZED_WIRE_DTYPES)


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """Options of ``smddp_lite.compile`` (keyword arguments override the environment)."""

    bucket_cap_mb: float = 25.0
    """Gradient bytes per communication bucket (DDP's default); as in DDP, a bucket closes once it
    holds this much or more. Env: ``SMDDP_BUCKET_CAP_MB``."""

    first_bucket_mb: float = 1.0
    """The first bucket (the last layers' gradients, ready first) is small so that
    communication starts early in backward. Env: ``SMDDP_FIRST_BUCKET_MB``."""

    wire_dtype: str | None = None
    """Dtype gradients travel in: "float32", "bfloat16" or "float16" (or the torch dtype);
    None keeps each parameter's dtype. "int8", "float8_e4m3fn" or "float8_e5m2": blockwise
    quantized with a float32 scale per ``wire_block`` elements, summed in float32 where they
    land, each rank keeping what rounding lost for the next step (error feedback: see
    ``smddp_lite.compiler.quantized_wire``). Env: ``SMDDP_WIRE_DTYPE``."""

    wire_block: int = 256
    """Elements per float32 scale of an 8-bit ``wire_dtype`` (a power of two from 16 to 65536).
    Env: ``SMDDP_WIRE_BLOCK``."""

    max_grad_norm: float | None = None
    """Clip the global gradient 2-norm to this value; None disables clipping.
    Env: ``SMDDP_MAX_GRAD_NORM``."""

    write_back_grads: bool = False
    """Leave ``.grad`` unscaled and clipped after ``step()``, as GradScaler.unscale_ and
    clip_grad_norm_ (or torch's fused optimizers given a loss scale) leave it. It costs one more
    write of every gradient in the step: 4 of the 28 bytes an AdamW step moves per float32
    parameter on a GPU. Off, the fused GPU kernels leave ``.grad`` as backward left it (averaged,
    loss-scaled, unclipped), and ``optimizer.last_grad_norm`` holds the norm clipping used, as
    clip_grad_norm_ returns it; on the CPU torch's fused kernels unscale and clip ``.grad`` in the
    same pass either way. Env: ``SMDDP_WRITE_BACK_GRADS``."""

    shard_optimizer_state: bool = False
    """Each rank keeps and updates only its 1/world share of every bucket (optimizer state,
    update and reduced gradient), as ZeRO stage 1 does: gradients are reduce-scattered and the
    updated parameters all-gathered back, the same bytes as an all_reduce. ``optimizer.state``
    stays empty and ``optimizer.state_dict()`` is collective (every rank must call it; each gets
    the full state). Env: ``SMDDP_SHARD_OPTIMIZER_STATE``."""

    broadcast_buffers: bool = True
    """Give every rank rank 0's buffers (BatchNorm's running statistics) before each training
    forward, as DDP's ``broadcast_buffers=True`` (its default) does; off, each rank keeps its
    own. Env: ``SMDDP_BROADCAST_BUFFERS``."""

    torch_compile: bool | None = None
    """Compile forward and backward with torch.compile, one repeated block (transformer layer)
    at a time, so that each bucket's collective still overlaps backward (see
    ``smddp_lite.compiler.graph``). None: on where the parameters are on a GPU; off on the CPU,
    where the first step takes seconds to tens of seconds to compile and the gain depends on the
    model (1.02x to 1.29x the eager step on 2 CPU ranks). Env:
    ``SMDDP_TORCH_COMPILE`` (1, 0, or auto)."""

    debug: bool = False
    """Log the bucket plan on rank 0 and per-step timings; with ``torch_compile``, torch's own
    log of graph breaks and recompiles. Env: ``SMDDP_DEBUG``."""

    def __post_init__(self) -> None:
        wire = self.wire_dtype
        if wire is not None and not isinstance(wire, str):
            object.__setattr__(self, "wire_dtype", str(wire).replace("torch.", ""))
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"smddp-lite: wire_dtype={wire!r} is not supported; expected one of "
                f"{', '.join(WIRE_DTYPES)} (or the torch dtype), or None"
            )
        problem = wire_block_problem(self.wire_block)
        if problem is not None:
            raise ValueError(f"smddp-lite: wire_block={self.wire_block!r}; {problem}")
        for name in ("bucket_cap_mb", "first_bucket_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"smddp-lite: {name}={getattr(self, name)!r} must be a positive number of MiB")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"smddp-lite: max_grad_norm={self.max_grad_norm!r} must be positive, or None for no clipping")


# variable name -> every (component, field) it sets. The one list of every SMDDP_* knob.
ENV_VARS: dict[str, tuple[tuple[str, str], ...]] = {
    "SMDDP_TRANSPORT": (("backend", "transport"),),
    "SMDDP_DEBUG": (("backend", "debug"), ("compile", "debug")),
    "SMDDP_CHECK_COLLECTIVES": (("backend", "check_collectives"),),
    "SMDDP_SHM_CHUNK_BYTES": (("backend", "shm_chunk_bytes"),),
    "SMDDP_SCRATCH_MAX_BYTES": (("backend", "scratch_max_bytes"),),
    "SMDDP_ALGORITHM": (("backend", "algorithm"),),
    "SMDDP_HIERARCHICAL_MIN_BYTES": (("backend", "hierarchical_min_bytes"),),
    "SMDDP_HIERARCHICAL_CHUNK_BYTES": (("backend", "hierarchical_chunk_bytes"),),
    "SMDDP_INTER_NODE_WIRE_DTYPE": (("backend", "inter_node_wire_dtype"),),
    "SMDDP_INTER_NODE_WIRE_BLOCK": (("backend", "inter_node_wire_block"),),
    "SMDDP_INTER_NODE_ACCUMULATE": (("backend", "inter_node_accumulate"),),
    "SMDDP_HOSTNAME": (("backend", "hostname"),),
    "SMDDP_CUDA_TRANSPORT": (("backend", "cuda_transport"),),
    "SMDDP_BLOCKING_WAIT": (("backend", "blocking_wait"),),
    "SMDDP_BUCKET_CAP_MB": (("compile", "bucket_cap_mb"),),
    "SMDDP_FIRST_BUCKET_MB": (("compile", "first_bucket_mb"),),
    "SMDDP_WIRE_DTYPE": (("compile", "wire_dtype"),),
    "SMDDP_WIRE_BLOCK": (("compile", "wire_block"),),
    "SMDDP_MAX_GRAD_NORM": (("compile", "max_grad_norm"),),
    "SMDDP_BROADCAST_BUFFERS": (("compile", "broadcast_buffers"),),
    "SMDDP_WRITE_BACK_GRADS": (("compile", "write_back_grads"),),
    "SMDDP_SHARD_OPTIMIZER_STATE": (("compile", "shard_optimizer_state"),),
    "SMDDP_TORCH_COMPILE": (("compile", "torch_compile"),),
    # no knob: smddp_lite.launch marks the replacements it starts, for smddp_lite.init()
    "SMDDP_REPLACEMENT": (),
    # no knob here: the container's PID 1 (docker/entrypoint.py) reads these, and on SageMaker an
    # estimator's environment= reaches every rank too, where they must not stop the backend
    "SMDDP_STOP_GRACE_S": (),
    "SMDDP_MPI_DONE_WAIT_S": (),
}

# Variables that AWS's SMDDP reads and this library does not need. Scripts brought over from
# SageMaker may still set them, so they earn a warning rather than an error.
_AWS_ONLY_VARS = ("SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES", "SMDDP_AG_SORT_BUFFER_SIZE_BYTES")

_COMPONENTS = {"backend": BackendConfig, "compile": CompileConfig}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse(name: str, raw: str, kind: Any) -> Any:
    if kind == "bool | None" and raw.strip().lower() in ("", "auto", "none"):
        return None
    if kind in (bool, "bool", "bool | None"):
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"smddp-lite: {name}={raw!r} is not a boolean; use 1/0, true/false, on/off.")
    if kind in (int, "int"):
        try:
            return int(raw, 0)
        except ValueError:
            raise ValueError(f"smddp-lite: {name}={raw!r} is not an integer.") from None
    if kind in ("float", "float | None"):
        if kind == "float | None" and raw.strip().lower() in ("", "none"):
            return None
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"smddp-lite: {name}={raw!r} is not a number.") from None
    if name == "SMDDP_HOSTNAME":  # a name, not a choice: keep its case
        return raw.strip() or None
    return raw.strip().lower() or None


def read_env(component: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Return the fields of ``component`` that ``SMDDP_*`` variables set, parsed and checked.

    Raises ValueError naming any ``SMDDP_*`` variable this library does not know, so that a typo
    (``SMDDP_TRANSPRT``) is caught instead of silently ignored.
    """
    environ = os.environ if environ is None else environ
    fields = {f.name: f.type for f in dataclasses.fields(_COMPONENTS[component])}
    values: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith("SMDDP_"):
            continue
        if name in _AWS_ONLY_VARS:
            warnings.warn(f"smddp-lite: {name} is an AWS SMDDP setting and has no effect here", stacklevel=2)
            continue
        if name not in ENV_VARS:
            raise ValueError(
                f"smddp-lite: unknown environment variable {name}; known: {', '.join(sorted(ENV_VARS))}. "
                "Fix the spelling or unset it."
            )
        for owner, field in ENV_VARS[name]:
            if owner == component:
                values[field] = _parse(name, raw, fields[field])
    return values


def backend_config(environ: Mapping[str, str] | None = None) -> BackendConfig:
    """The backend configuration in force: defaults overridden by ``SMDDP_*`` variables."""
    return BackendConfig(**read_env("backend", environ))


def compile_config(options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> CompileConfig:
    """``smddp_lite.compile`` options: defaults, then ``SMDDP_*`` variables, then keyword arguments.
    Unknown keyword arguments are refused by name."""
    known = {f.name for f in dataclasses.fields(CompileConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"smddp_lite.compile: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return CompileConfig(**{**read_env("compile", environ), **options})
