"""Working buffers a process group reuses from call to call.

Some calls need a temporary as large as their message: a float32 copy of 16-bit values for a
transport that cannot sum 16-bit floats in float32 itself (MPI, gloo), or for an AVG it cannot
divide before rounding (the hierarchical transport's float16 AVG). Allocated fresh on every call,
such a buffer is expensive on CPU: from 32 MiB glibc maps new pages for it each time, and
the first write to each page faults. Converting 64 MiB of bfloat16 to a fresh float32 tensor took
50 ms on the development VM, against 6 ms into a buffer already touched (see
benchmarks/results/2026-11-24-scratch-buffers.md). A group therefore keeps one buffer per use
and dtype, grown to the largest message it has seen, and hands out views of it.

A group runs its collectives one after another (on its communication thread, or inline on the
caller's), so one buffer per use is never handed out twice at once. The buffers live as long as
the group; ``release`` drops them (process group shutdown).

What a group keeps is bounded: a buffer larger than ``max_bytes`` (``SMDDP_SCRATCH_MAX_BYTES``,
256 MiB by default) is handed out fresh and not kept, so one large 16-bit message does not pin
twice its size in float32 for the rest of the job. Such calls pay the page faults again (for
64 MiB of float32: about 40 ms more per call on the development VM).
"""

from __future__ import annotations

import torch


DEFAULT_MAX_BYTES = 256 << 20  # BackendConfig.scratch_max_bytes's default


class Scratch:
    """Grow-only buffers, one per (use, dtype), each at most ``max_bytes``; ``get`` returns a 1-D
    view of ``numel`` elements (a fresh tensor, not kept, beyond that bound)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.max_bytes = max_bytes

    def get(self, use: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buffer = self._buffers.get((use, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype)
            if numel * buffer.element_size() > self.max_bytes:
                return buffer  # too large to keep: this call's alone
            self._buffers[(use, dtype)] = buffer
        return buffer[:numel]

    def kept_bytes(self) -> int:
        """What the buffers kept now hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def widened(self, use: str, tensor: torch.Tensor) -> torch.Tensor:
        """A float32 copy of (1-D) ``tensor`` in the buffer for ``use``."""
        wide = self.get(use, torch.float32, tensor.numel())
        wide.copy_(tensor)
        return wide

    def release(self) -> None:
        self._buffers.clear()
