"""The 8-bit wire between hosts (SMDDP_INTER_NODE_WIRE_DTYPE=int8, float8_e4m3fn, float8_e5m2):
the hierarchical all_reduce on 2 x 2 and 3 x 2 simulated hosts against the exact sum, within
the bound two quantizations allow, the same bits on every rank; and bad settings refused."""

from __future__ import annotations

import hashlib
import re

import pytest
import torch

from smddp_lite.config import BackendConfig
from smddp_lite.kernels.quantize import FORMATS

from . import harness, tiers


def _inputs(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s tensor (every rank can make anyone's): normal values whose magnitudes
    span 1e-3 to 1e3 along the tensor, as a gradient's layers do."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    return x * 10.0 ** torch.linspace(-3, 3, numel)


def quantized_all_reduce(numel: int, per_host: int) -> dict:
    """all_reduce of _inputs; returns the largest error against the exact sum, the largest
    magnitude of a host's sum (what the error bound scales with) and a digest of the result."""
    import torch.distributed as dist

    import smddp_lite

    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    got = _inputs(rank, numel)
    dist.all_reduce(got)
    everyone = [_inputs(r, numel).double() for r in range(world)]
    hosts = [sum(everyone[h * per_host : (h + 1) * per_host]) for h in range(world // per_host)]
    exact = sum(everyone)
    report = {"max_error": float((got.double() - exact).abs().max()), "host_sum_max": float(max(h.abs().max() for h in hosts)),
              "digest": hashlib.sha1(got.numpy().tobytes()).hexdigest()}
    dist.destroy_process_group()
    return report


def _bound(wire: torch.dtype, hosts: int, largest: float) -> float:
    """What two quantizations may cost an element: each host's sum quantized once, and their
    float32 sum once more (it is at most ``hosts`` x the largest host sum). A block's scale is
    at most the largest magnitude over the format's largest value (kernels/quantize.py)."""
    qmax, mantissa, min_exp = FORMATS[wire]
    total = hosts * largest
    if mantissa == 0:  # int8: half a step of each block's scale
        return (hosts * largest + total) / qmax / 2
    relative, subnormal = 2.0 ** -(mantissa + 1), 2.0 ** (min_exp - mantissa - 1) / qmax
    return (hosts * largest + total) * (relative + subnormal)


@pytest.mark.parametrize("wire, world", [("int8", 4), ("float8_e4m3fn", 4), ("float8_e5m2", 4), ("int8", 6)])
def test_the_8_bit_all_reduce_between_hosts_is_within_its_bound_and_the_same_on_every_rank(wire, world):
    numel = 100_003  # odd: a short last block and uneven slices between hosts
    env = {"SMDDP_ALGORITHM": "hierarchical", "SMDDP_INTER_NODE_WIRE_DTYPE": wire, "SMDDP_DEBUG": "1"}
    launched = harness.launch(f"{__name__}:quantized_all_reduce", world, env=env, hosts_of=2, numel=numel, per_host=2)
    reports = harness.values(launched)
    hosts = world // 2
    # the debug log says what crossed: a quarter of float32's bytes, and a float32 scale per 256
    said = re.search(rf"sums to {hosts - 1} other hosts as {wire} in blocks of 256, (\d+) bytes per call "
                     r"\(float32: (\d+)\)", launched[0].output)
    assert said, launched[0].output[-2000:]
    sent, float32 = map(int, said.groups())
    # each slice is padded to whole blocks: at most one block more per slice sent
    assert float32 / 4 * (1 + 4 / 256) <= sent <= float32 / 4 * (1 + 4 / 256) + 2 * (hosts - 1) * (256 + 4), \
        (sent, float32)
    bound = _bound(getattr(torch, wire), hosts, reports[0]["host_sum_max"])
    assert len({r["digest"] for r in reports}) == 1, "ranks hold different sums"
    error = reports[0]["max_error"]
    assert error <= bound * (1 + 1e-5), (error, bound)
    # it was quantized (the error is no float32 rounding), and the bound is not empty words
    assert error > bound / 64, (error, bound)


def test_without_the_setting_the_sum_is_float32s():
    reports = harness.values(harness.launch(f"{__name__}:quantized_all_reduce", 4, env={"SMDDP_ALGORITHM": "hierarchical"},
                                            hosts_of=2, numel=100_003, per_host=2))
    assert reports[0]["max_error"] <= 4 * reports[0]["host_sum_max"] * 2.0 ** -22


@pytest.mark.parametrize("settings, says", [
    (dict(inter_node_wire_dtype="int4"), "expected one of bfloat16, float16, int8, float8_e4m3fn, float8_e5m2"),
    (dict(inter_node_wire_dtype="int8", inter_node_wire_block=100), "power of two from 16 to 65536"),
    (dict(inter_node_wire_block=8), "SMDDP_INTER_NODE_WIRE_BLOCK=8"),
])
def test_bad_wire_settings_are_refused_saying_what_is_taken(settings, says):
    with pytest.raises(ValueError, match=says):
        BackendConfig(**settings)


def repeated_calls() -> dict:
    """Hierarchical all_reduces (SUM and 16-bit AVG), reduce_scatters and all_gathers of several
    sizes, one after another, each in many pieces: digests of every result, and what the
    transport keeps afterwards."""
    import torch.distributed as dist

    import smddp_lite

    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    digests = []
    for numel in (100_003, 40_000, 250_001):
        for dtype, op in ((torch.float32, dist.ReduceOp.SUM), (torch.bfloat16, dist.ReduceOp.AVG)):
            x = _inputs(rank, numel).to(dtype)
            dist.all_reduce(x, op=op)
            out = torch.empty(numel // world, dtype=dtype)
            dist.reduce_scatter_tensor(out, _inputs(rank + world, numel // world * world).to(dtype), op=op)
            gathered = torch.empty(numel // world * world, dtype=dtype)
            dist.all_gather_into_tensor(gathered, out)
            digests += [hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest() for t in (x, out, gathered)]
    kept = dist.group.WORLD.transport._scratch.kept_bytes()
    dist.destroy_process_group()
    return {"digests": digests, "kept": kept}


@tiers.FULL_ONLY
@pytest.mark.parametrize("wire", ["int8", "bfloat16"])
def test_kept_working_buffers_give_the_bits_of_fresh_ones_call_after_call(wire):
    """The hierarchical transport keeps each piece's working buffers from call to call
    (SMDDP_SCRATCH_MAX_BYTES, 256 MiB by default; 0 keeps none). Calls of different sizes in
    pieces of 16 KiB, all in flight at once, give the same bits with kept buffers as with fresh
    ones on every call: no piece's buffer is reused while an earlier one still reads or writes it.
    With 3 hosts, a bfloat16 wire takes the all-to-all of 16-bit slices, an int8 one the quantized
    exchange."""
    env = {"SMDDP_ALGORITHM": "hierarchical", "SMDDP_INTER_NODE_WIRE_DTYPE": wire,
           "SMDDP_HIERARCHICAL_CHUNK_BYTES": "16384"}
    kept = harness.values(harness.launch(f"{__name__}:repeated_calls", 6, env=env, hosts_of=2))
    fresh = harness.values(harness.launch(f"{__name__}:repeated_calls", 6, env={**env, "SMDDP_SCRATCH_MAX_BYTES": "0"},
                                          hosts_of=2))
    for rank, (k, f) in enumerate(zip(kept, fresh)):
        assert k["digests"] == f["digests"], f"rank {rank}: kept buffers changed a result"
        assert f["kept"] == 0 and k["kept"] > 0, (k["kept"], f["kept"])
