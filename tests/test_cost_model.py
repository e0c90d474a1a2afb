"""The alpha-beta cost model of benchmarks/cost_model.py: its formulas against hand-computed
times, and its fits recovering known constants from rows generated with them."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import cost_model as cm  # noqa: E402

MIB = 1 << 20
LINKS = {"intra": (10e-6, 1 / 5e9), "inter": (50e-6, 1 / 0.12e9)}


def test_flat_ring_is_two_p_minus_one_steps_of_one_pth():
    # 2 hosts x 2 ranks, a core per rank: 6 steps of 4 MiB / 4 over the host link
    want = 6 * (50e-6 + MIB / 0.12e9)
    assert cm.predict(2, 2, "flat", 4 * MIB, LINKS) == pytest.approx(want)


def test_step_cpu_binds_only_where_ranks_outnumber_cores_and_steps_are_small():
    c = 0.5e-3
    # 8 ranks on 2 cores, 1 MiB: 14 steps of 128 KiB (1.1 ms on the link) but 4 x 0.5 ms of CPU each
    assert cm.predict(4, 2, "flat", MIB, LINKS, cores=2, step_cpu=c) == pytest.approx(14 * 4 * c)
    # 16 MiB: 2 MiB steps take 17 ms on the link, far above the CPU bound
    big = 16 * MIB
    assert cm.predict(4, 2, "flat", big, LINKS, cores=2, step_cpu=c) == pytest.approx(cm.predict(4, 2, "flat", big, LINKS))
    # a core per rank: the CPU term is below the link time of a 128 KiB step and drops out
    assert cm.predict(4, 2, "flat", MIB, LINKS, step_cpu=c) == pytest.approx(cm.predict(4, 2, "flat", MIB, LINKS))


def test_skew_between_a_hosts_groups_is_added_only_where_their_steps_queue_for_cores():
    c = 0.5e-3
    intra = 2 * (10e-6 + 0.5 * MIB / 5e9)  # reduce-scatter + all-gather of 2 ranks: a step of half each
    # 4 x 2 on 2 cores, 1 MiB: 6 inter steps of 256 KiB (2.2 ms on the link) against a 2 ms CPU bound
    linked = cm.predict(4, 2, "hierarchical", MIB, LINKS, cores=2, step_cpu=c)
    assert linked == pytest.approx(cm.ring(4, MIB, *LINKS["inter"]) + 4 * intra)  # inside: 4 ranks per core
    # a faster link makes the steps CPU-bound: 6 bounded steps, then one more for the other group
    fast = {**LINKS, "inter": (50e-6, 1 / 1e9)}
    bound = 4 * c
    assert cm.predict(4, 2, "hierarchical", MIB, fast, cores=2, step_cpu=c) == pytest.approx(
        6 * bound + (2 - 1) * bound + 4 * intra)
    # one rank per host (no other group) or a core per rank (no queue): nothing added
    assert cm.predict(4, 1, "hierarchical", MIB, fast, cores=4, step_cpu=c) == pytest.approx(6 * c)
    assert cm.predict(4, 2, "hierarchical", MIB, fast, step_cpu=c) == pytest.approx(
        cm.ring(4, MIB, 50e-6, 1 / 1e9, c) + intra)


def test_pipelined_hierarchical_overlaps_the_host_phases_with_the_network():
    one_piece = cm.predict(2, 2, "hierarchical", 16 * MIB, LINKS)
    pieces = cm.predict(2, 2, "hierarchical", 16 * MIB, LINKS, piece=4 * MIB)
    network_only = cm.ring(2, 16 * MIB, *LINKS["inter"])
    assert network_only < pieces < one_piece


def test_fit_link_recovers_alpha_and_beta_of_rings_and_pieces():
    alpha, beta = 200e-6, 1 / 0.12e9
    for parties, piece in ((2, None), (4, 4 * MIB)):
        rows = []
        for size in (MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB):
            k = 1 if piece is None else max(1, -(-size // piece))
            rows.append({"bytes": size, "time_s": 2 * (parties - 1) * (k * alpha + size / parties * beta)})
        got_alpha, got_beta = cm.fit_link(rows, parties, piece)
        assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_beta == pytest.approx(beta, rel=1e-6)


def test_fit_step_cpu_recovers_the_cpu_time_that_made_the_rows():
    c = 0.61e-3
    rows = [{"hosts": 4, "per_host": 1, "algorithm": "flat", "wire": "float32", "bytes": size,
             "time_s": cm.predict(4, 1, "flat", size, LINKS, cores=2, step_cpu=c)} for size in (64 << 10, 256 << 10, MIB)]
    assert cm.fit_step_cpu(rows, LINKS, 4 * MIB, 2) == pytest.approx(c, abs=1e-9)


def test_median_rows_takes_each_sizes_median_over_rounds():
    rows = [{"hosts": 2, "per_host": 1, "algorithm": "flat", "wire": "float32", "bytes": MIB, "time_s": t}
            for t in (0.010, 0.030, 0.012)]
    rows.append({**rows[0], "bytes": 2 * MIB, "time_s": 0.02})
    got = {r["bytes"]: r for r in cm.median_rows(rows)}
    assert got[MIB]["time_s"] == 0.012 and got[MIB]["rounds"] == [0.010, 0.030, 0.012]
    assert got[2 * MIB]["time_s"] == 0.02
