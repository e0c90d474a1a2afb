"""Where 16-bit sums and means are rounded (backend/numerics.py's rules) on each transport, inside
one host and between simulated hosts: 16-bit blocks are summed in float32 and rounded once; between
hosts, each host's sum (or float16 mean) is rounded once on the wire, and an AVG divides before its
last rounding. Each test's references differ from one another somewhere, so a wrong rounding fails."""

from __future__ import annotations

import pytest

from . import harness


@pytest.mark.parametrize("op", ["SUM", "AVG"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_16_bit_reduce_scatter_sums_in_float32_and_rounds_once(transport, dtype, op):
    """The gloo and shm transports take 16-bit reduce_scatters as they are (half the bytes of
    widening them) and must still give what widening gave: the float32 sum, divided for AVG,
    rounded once."""
    results = harness.launch("tests.rounding_programs:reduce_scatter_16_bit_sums", 3,
                             env={"SMDDP_TRANSPORT": transport},
                             dtype=dtype, op=op)
    for report in harness.values(results):
        assert report["references_differ_in"] > 0, report
        assert report["float32_once"] and not report["in_16_bit"], report


@pytest.mark.parametrize("numel", [1 << 10, 1 << 20])  # one-shot below 16 KiB; chunked steps above
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_shm_16_bit_avg_all_reduce_divides_in_float32_and_rounds_once(dtype, numel):
    """The shm transport takes a 16-bit AVG all_reduce as it is (no float32 copy to divide) and
    must give what widening gave: the float32 mean, rounded once. The other reference, the sum
    rounded before the division, differs from it in some elements, so the check can fail."""
    results = harness.launch("tests.rounding_programs:all_reduce_16_bit_avg", 3, env={"SMDDP_TRANSPORT": "shm"},
                             ranks_per_host=3, dtype=dtype, numel=numel)
    for report in harness.values(results):
        assert report["widened"] and report["differ_from_widened_in"]["host_sums_rounded"] > 0, report


@pytest.mark.parametrize("accumulate", ["float32", "wire"])
def test_16_bit_sums_between_three_hosts_round_as_configured(accumulate):
    env = {"SMDDP_ALGORITHM": "hierarchical", "SMDDP_INTER_NODE_WIRE_DTYPE": "bfloat16",
           "SMDDP_INTER_NODE_ACCUMULATE": accumulate}
    results = harness.values(harness.launch("tests.rounding_programs:wire_rounding", 3, env=env, hosts_of=1))
    exact = 1 + 2.0**-7  # 1 + 2**-8 + 2**-8, one bfloat16 step above 1
    for got in results:
        if accumulate == "float32":  # summed in float32 and rounded once: exact on every rank
            assert got == [exact]
        else:  # where gloo's ring adds 2**-8 to 1 first, that partial sum rounds back to 1 on its
            # hop: one step lost there, never more (and the setting visibly takes effect)
            assert set(got) == {1.0, exact}
    assert all(r == results[0] for r in results), "every rank must hold the same sums"


@pytest.mark.parametrize("dtype, wire, want", [
    # 16-bit blocks are summed in float32 where they arrive: 1 + 2**-8 + 2**-8 is exact (a sum in
    # bfloat16 would round 1 + 2**-8 back to 1 at its first addition)
    ("bfloat16", None, 1 + 2.0**-7),
    ("float32", None, 1 + 2.0**-7 + 2.0**-9),
    # each host's float32 sum is rounded to the wire dtype once (1 + 2**-9 to 1), then summed in float32
    ("float32", "bfloat16", 1 + 2.0**-7),
])
def test_reduce_scatter_between_three_hosts_rounds_once_per_host_on_a_16_bit_wire(dtype, wire, want):
    env = {"SMDDP_ALGORITHM": "hierarchical", **({"SMDDP_INTER_NODE_WIRE_DTYPE": wire} if wire else {})}
    results = harness.values(harness.launch("tests.rounding_programs:reduce_scatter_rounding", 3, env=env, hosts_of=1,
                                            dtype=dtype))
    assert results == [[want]] * 3


@pytest.mark.parametrize("dtype, world, hosts_of, algorithm, numel, want", [
    # 2 hosts x 2: each host's sum rounds once on its way between hosts, as in a SUM; the
    # division comes before the last rounding
    ("bfloat16", 4, 2, "hierarchical", 1 << 16, "host_sums_rounded"),
    # float16: each host's mean instead (a float16 host sum can overflow), the hosts' means
    # averaged; on hosts of 3, where a mean is not a sum's exponent shifted, the two differ
    ("float16", 4, 2, "hierarchical", 1 << 16, "host_means_rounded"),
    ("float16", 6, 3, "hierarchical", 100003, "host_means_rounded"),  # shards and pieces of uneven size
    # one rank per host: no host sum to round, so the float32 mean rounded once
    ("bfloat16", 3, 1, "hierarchical", 1 << 16, "widened"),
    ("float16", 3, 1, "hierarchical", 1 << 16, "widened"),
    # under hierarchical_min_bytes: the flat ring in float32, divided, rounded once
    ("bfloat16", 4, 2, "auto", 1 << 10, "widened"),
    ("float16", 4, 2, "auto", 1 << 10, "widened"),
])
def test_16_bit_avg_all_reduce_between_hosts_divides_before_its_last_rounding(dtype, world, hosts_of, algorithm,
                                                                              numel, want):
    # pieces of 4 KiB: each piece's host sums (or means) cross and are summed on their own
    env = {"SMDDP_ALGORITHM": algorithm, "SMDDP_HIERARCHICAL_CHUNK_BYTES": "4096"}
    results = harness.values(harness.launch("tests.rounding_programs:all_reduce_16_bit_avg", world, env=env,
                                            hosts_of=hosts_of,
                                            ranks_per_host=hosts_of, dtype=dtype, numel=numel))
    for report in results:
        assert report[want], report
        if want != "widened":  # the references must differ, or this shows nothing
            assert report["differ_from_widened_in"][want] > 0 and not report["widened"], report
        if hosts_of == 3:  # hosts of 2 halve a sum exactly: the means are the sums' halves, the same bits
            assert report["means_differ_from_sums_in"] > 0 and not report["host_sums_rounded"], report


def test_float16_avg_reduce_scatter_between_hosts_rounds_each_hosts_mean_once():
    """2 hosts x 3, forced hierarchical, blocks of an odd size in pieces of 4 KiB: each host's
    mean of its ranks' blocks, in float32 rounded once to float16, crosses hosts; the two means
    are summed in float32, halved and rounded once (on hosts of 3 a mean is not a sum's exponent
    shifted, so the host sums' reference differs)."""
    env = {"SMDDP_ALGORITHM": "hierarchical", "SMDDP_HIERARCHICAL_CHUNK_BYTES": "4096"}
    results = harness.values(harness.launch("tests.rounding_programs:reduce_scatter_16_bit_sums", 6, env=env,
                                            hosts_of=3,
                                            dtype="float16", op="AVG", ranks_per_host=3, numel_per_rank=10007))
    for report in results:
        assert report["host_means_rounded"] and not report["float32_once"], report
        assert not report["host_sums_rounded"], report
        assert report["differ_from_once_in"]["host_means_rounded"] > 0, report


@pytest.mark.parametrize("algorithm", ["hierarchical", "auto"])
def test_float16_avg_between_hosts_does_not_overflow_where_a_host_sum_would(algorithm):
    """Every pair of these values sums past float16's largest value; their means are exact. 512 KiB
    runs hierarchical under "auto" too (hierarchical_min_bytes is 256 KiB)."""
    results = harness.values(harness.launch("tests.rounding_programs:float16_avg_of_large_values", 4,
                                            env={"SMDDP_ALGORITHM": algorithm}, hosts_of=2))
    assert results == [{"all_reduce": [40096.0], "reduce_scatter": [40096.0]}] * 4, results


def test_float16_avg_between_hosts_with_gloo_inside_hosts():
    """Where shared memory cannot serve a host's ranks (non-x86), gloo reduces inside the host:
    its reduce_scatter takes the float16 AVG, sums in float32 and divides by the host's ranks
    before rounding, as shared memory does, so the results are the same bits."""
    env = {"SMDDP_ALGORITHM": "hierarchical", "SMDDP_HIERARCHICAL_CHUNK_BYTES": "4096", "SMDDP_DEBUG": "1"}
    launched = harness.launch("tests.rounding_programs:without_shared_memory", 6, env=env, hosts_of=3,
                              program="all_reduce_16_bit_avg", ranks_per_host=3, dtype="float16", numel=100003)
    assert "2 hosts x 3 ranks: gloo inside hosts, gloo between" in launched[0].output
    for report in harness.values(launched):
        assert report["host_means_rounded"] and report["means_differ_from_sums_in"] > 0, report
    for report in harness.values(harness.launch("tests.rounding_programs:without_shared_memory", 6, env=env, hosts_of=3,
                                                program="reduce_scatter_16_bit_sums", dtype="float16", op="AVG",
                                                ranks_per_host=3, numel_per_rank=10007)):
        assert report["host_means_rounded"] and not report["host_sums_rounded"], report
    large = harness.values(harness.launch("tests.rounding_programs:without_shared_memory", 4, env=env, hosts_of=2,
                                          program="float16_avg_of_large_values"))
    assert large == [{"all_reduce": [40096.0], "reduce_scatter": [40096.0]}] * 4, large
