"""NCCL through ``cupy.cuda.nccl``: loading it, its dtype and op codes, and one communicator per
device, created on the first collective that uses the device.

The unique id that joins a communicator is made by the group's rank 0 and passed through the
process group's store (the rendezvous torchrun, mpirun with ``smddp_lite.init`` and explicit
init methods all provide), under a key numbered by how many communicators the group has made,
so ranks that use different device indices (rank r on cuda:r) still meet under one key.
"""

from __future__ import annotations

import platform
import threading

import torch

from ..errors import SMDDPError, where
from ..ops import RedOp

# torch dtype -> name of cupy.cuda.nccl's constant; bool travels as uint8 (see nccl_path)
NCCL_DTYPE_NAMES = {
    torch.float32: "NCCL_FLOAT32",
    torch.float16: "NCCL_FLOAT16",
    torch.bfloat16: "NCCL_BFLOAT16",
    torch.float64: "NCCL_FLOAT64",
    torch.int32: "NCCL_INT32",
    torch.int64: "NCCL_INT64",
    torch.uint8: "NCCL_UINT8",
    torch.int8: "NCCL_INT8",
}
NCCL_OP_NAMES = {RedOp.SUM: "NCCL_SUM", RedOp.PRODUCT: "NCCL_PROD", RedOp.MIN: "NCCL_MIN",
                 RedOp.MAX: "NCCL_MAX", RedOp.AVG: "NCCL_AVG"}
NCCL_AVG_VERSION = 21000  # ncclAvg arrived in NCCL 2.10
NCCL_BF16_VERSION = 21000  # so did ncclBfloat16; cupy defines the constant whatever NCCL it loads


def load_nccl():
    """cupy's NCCL module. Raises ImportError saying what is missing and how to install it."""
    import torch  # noqa: F401  (torch first: it loads the CUDA runtime cupy then shares)

    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ImportError(f"cupy is not installed ({exc}); pip install cupy-cuda12x nvidia-nccl-cu12 (or the "
                          "cuda13 pair, matching your CUDA; smddp-lite's [cuda12] extra: pip install -e "
                          "'.[cuda12]' in its checkout)") from exc
    if not getattr(nccl, "available", False):
        raise ImportError("cupy is installed but cannot load libnccl; pip install nvidia-nccl-cu12 "
                          "(or cu13), or put NCCL's library on LD_LIBRARY_PATH")
    return nccl


def nccl_version_string(code: int) -> str:
    """NCCL's integer version (21903, or 2304 for releases before 2.9) as "2.19.3"."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


# Plain C ``char`` is unsigned on these Linux architectures (their ABIs say so) and signed on
# x86. cupy < 14 hands the unique id over as a tuple of C chars, so its numbers are -128..127 on
# x86 but 0..255 on an Arm host (GH200, Graviton), and NcclCommunicator refuses the other range.
UNSIGNED_CHAR_MACHINES = frozenset({"aarch64", "arm64", "armv7l", "armv8l", "ppc64", "ppc64le", "s390x"})
CHAR_IS_SIGNED = platform.machine().lower() not in UNSIGNED_CHAR_MACHINES


def encode_unique_id(uid) -> bytes:
    """A unique id from ``nccl.get_unique_id()`` as bytes for the store: cupy >= 14 returns
    bytes, older releases a tuple of 128 C chars (signed or not, as the platform's char is)."""
    if isinstance(uid, (bytes, bytearray)):
        return b"B" + bytes(uid)
    return b"T" + bytes(b & 0xFF for b in uid)


def decode_unique_id(data: bytes, char_is_signed: bool = CHAR_IS_SIGNED):
    """The object ``NcclCommunicator`` takes, from ``encode_unique_id``'s bytes: a tuple in the
    range of this platform's C char when the id came as one (cupy < 14)."""
    kind, raw = data[:1], data[1:]
    if kind == b"B":
        return bytes(raw)
    if kind == b"T":
        return tuple(b - 256 if char_is_signed and b > 127 else b for b in raw)
    raise ValueError(f"not an encoded NCCL unique id (starts with {kind!r})")


class Communicators:
    """One NCCL communicator per CUDA device this rank uses in the group."""

    def __init__(self, nccl, store, rank: int, world_size: int) -> None:
        self.nccl = nccl
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.by_device: dict[int, object] = {}
        self.version = nccl.get_version()
        # the watchdog thread checks for asynchronous errors while a failing call may abort: cupy
        # frees a communicator's handle on abort, so the two never overlap (as ProcessGroupNCCL
        # guards ncclCommGetAsyncError and ncclCommAbort with one mutex per communicator)
        self._handles = threading.Lock()

    def get(self, device: torch.device):
        comm = self.by_device.get(device.index)
        if comm is None:
            comm = self._create(device)
            self.by_device[device.index] = comm
        return comm

    def _create(self, device: torch.device):
        serial = len(self.by_device)
        key = f"smddp/nccl/{serial}"
        self.store.set(f"{key}/version/{self.rank}", str(self.version))
        if self.rank == 0:
            self.store.set(f"{key}/uid", encode_unique_id(self.nccl.get_unique_id()))
        versions = {int(self.store.get(f"{key}/version/{r}")) for r in range(self.world_size)}
        if len(versions) > 1:
            found = ", ".join(nccl_version_string(v) for v in sorted(versions))
            raise SMDDPError(f"{where(self.rank, self.world_size, 'nccl init')} ranks load different NCCL "
                             f"versions ({found}); install the same cupy and NCCL on every host")
        uid = decode_unique_id(self.store.get(f"{key}/uid"))
        with torch.cuda.device(device):
            try:
                return self.nccl.NcclCommunicator(self.world_size, uid, self.rank)
            except Exception as exc:  # NcclError carries NCCL's own text
                raise SMDDPError(f"{where(self.rank, self.world_size, 'nccl init')} creating the NCCL "
                                 f"communicator on {device} failed: {exc}") from exc

    def check_async_errors(self) -> None:
        with self._handles:
            for comm in list(self.by_device.values()):
                comm.check_async_error()

    def abort(self) -> None:
        with self._handles:
            comms, self.by_device = list(self.by_device.values()), {}
            for comm in comms:
                comm.abort()

    def destroy(self) -> None:
        with self._handles:
            comms, self.by_device = list(self.by_device.values()), {}
            for comm in comms:
                comm.destroy()
