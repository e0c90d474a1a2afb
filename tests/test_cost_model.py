"""The alpha-beta cost model of benchmarks/cost_model.py: its formulas against hand-computed
times, and its fits recovering known constants from rows generated with them."""

from __future__ import annotations

import json
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


def test_wait_for_a_hosts_other_group_grows_with_the_share_of_a_step_the_cores_are_busy():
    c = 0.5e-3
    bound = 4 * c  # 8 ranks on 2 cores
    intra = 2 * (10e-6 + 0.5 * MIB / 5e9)  # reduce-scatter + all-gather of 2 ranks: a step of half each
    # 4 x 2 on 2 cores, 1 MiB: 6 inter steps of 256 KiB (2.2 ms on the link) against a 2 ms CPU bound,
    # so the cores are busy 2 / 2.2 of a step and the other group's wait is that share of a bound step
    link = MIB / 4 / 0.12e9
    linked = cm.predict(4, 2, "hierarchical", MIB, LINKS, cores=2, step_cpu=c)
    assert linked == pytest.approx(6 * link + (2 - 1) * bound * bound / link + 4 * intra)  # inside: 4 ranks per core
    # a faster link makes the steps CPU-bound: 6 bounded steps, then one whole bound step for the other group
    fast = {**LINKS, "inter": (50e-6, 1 / 1e9)}
    assert cm.predict(4, 2, "hierarchical", MIB, fast, cores=2, step_cpu=c) == pytest.approx(
        6 * bound + (2 - 1) * bound + 4 * intra)
    # the wait has no jump where the link and the CPU bound cross
    at = {**LINKS, "inter": (0.0, bound / (MIB / 4))}
    below, above = (cm.predict(4, 2, "hierarchical", MIB, at, cores=2, step_cpu=c * s) for s in (1 - 1e-6, 1 + 1e-6))
    assert below == pytest.approx(above, rel=1e-4)
    # an empty message on a link without latency: no step to share, the whole bound is waited
    free = {**LINKS, "inter": (0.0, 1 / 1e9)}
    assert cm.predict(4, 2, "hierarchical", 0, free, cores=2, step_cpu=c) == pytest.approx(6 * bound + bound + 8 * 10e-6)
    # one rank per host (no other group) or a core per rank (no queue): nothing added
    assert cm.predict(4, 1, "hierarchical", MIB, fast, cores=4, step_cpu=c) == pytest.approx(6 * c)
    assert cm.predict(4, 2, "hierarchical", MIB, fast, step_cpu=c) == pytest.approx(
        cm.ring(4, MIB, 50e-6, 1 / 1e9, c) + intra)


def test_a_hosts_groups_hide_each_others_latency_on_their_shared_link():
    slow_start = {"intra": (0.0, 1 / 5e9), "inter": (0.4e-3, 1 / 0.12e9)}
    inside = 2 * 0.5 * 8 * MIB / 5e9
    # 2 x 1: one group, each of its 2 steps pays alpha and then sends 4 MiB
    assert cm.predict(2, 1, "hierarchical", 8 * MIB, slow_start) == pytest.approx(2 * (0.4e-3 + 4 * MIB / 0.12e9))
    # 2 x 2: two groups send 2 MiB each per step; while one pays its alpha the other keeps the link busy
    assert cm.predict(2, 2, "hierarchical", 8 * MIB, slow_start) == pytest.approx(2 * 4 * MIB / 0.12e9 + inside)
    # 4 x 8 with little per step: a group's alpha and its own bytes outlast the host's bytes per step
    small = 64 << 10
    assert cm.predict(4, 8, "hierarchical", small, slow_start) == pytest.approx(
        6 * (0.4e-3 + small / 32 / 0.12e9) + 2 * 7 * small / 8 / 5e9)


def test_an_8_bit_wire_sends_a_quarter_and_its_scales_and_gathers_float32_in_the_host():
    share = 0.25 + 1 / 256  # int8 values and a float32 scale per 256 of them
    size = 8 * MIB
    inside = 10e-6 + 0.5 * size / 5e9  # one step of half the message, reduce-scatter and all-gather alike
    # the extrapolation: no 8-bit class of its own, the float32 link carries the wire's bytes
    step = max(50e-6 + size / 4 * share / 0.12e9, size / 2 * share / 0.12e9)
    assert cm.predict(2, 2, "hierarchical", size, LINKS, "int8") == pytest.approx(2 * step + 2 * inside)
    # a fitted class: its beta beyond the wire's bytes is CPU work, which 4 ranks on 2 cores take twice as long for
    cpu = 0.1 / 0.12e9
    links = {**LINKS, cm.INTER_8: (0.0, share / 0.12e9 + cpu)}
    beta = share / 0.12e9 + 2 * cpu
    assert cm.predict(2, 2, "hierarchical", size, links, "float8_e4m3fn", cores=2) == pytest.approx(
        2 * size / 2 * beta + 2 * 2 * inside)  # inside the host: 2 ranks per core
    # a bfloat16 sum is gathered in bfloat16, an 8-bit one in float32
    free = {"intra": (0.0, 1 / 5e9), "inter": (0.0, 0.0)}
    half = 0.5 * size / 5e9
    assert cm.predict(2, 2, "hierarchical", size, free, "bfloat16") == pytest.approx(half + half / 2)
    assert cm.predict(2, 2, "hierarchical", size, free, "int8") == pytest.approx(half + half)


def test_an_8_bit_wires_quantizer_and_fixed_cpu_are_once_per_piece_and_stretch_where_ranks_share_cores():
    share = 0.25 + 1 / 256
    size, q, c8 = 8 * MIB, 1e-10, 5e-3
    links = {**LINKS, cm.INTER_8: (2e-3, share / 0.12e9)}  # its fitted latency is replaced by the network's
    inside = 10e-6 + 0.5 * size / 5e9
    step = max(50e-6 + size / 4 * share / 0.12e9, size / 2 * share / 0.12e9)
    # 2 hosts x 2 ranks on 2 cores: every CPU term twice; each rank passes 3 + 1/2 times over half the piece
    quantizer = 2 * 3.5 * size / 2 * q
    got = cm.predict(2, 2, "hierarchical", size, links, "int8", cores=2, quantizer=q, piece_cpu=c8)
    assert got == pytest.approx(2 * step + 2 * c8 + quantizer + 2 * 2 * inside)
    # a core per rank: nothing stretched; in 2 pieces, each pays both terms
    got = cm.predict(2, 2, "hierarchical", size, links, "int8", quantizer=q, piece_cpu=c8)
    assert got == pytest.approx(2 * step + c8 + 3.5 * size / 2 * q + 2 * inside)
    half = size / 2
    in_half = 10e-6 + 0.5 * half / 5e9
    step_half = max(50e-6 + half / 4 * share / 0.12e9, half / 2 * share / 0.12e9)
    across = 2 * step_half + c8 + 3.5 * half / 2 * q
    got = cm.predict(2, 2, "hierarchical", size, links, "int8", piece=half, quantizer=q, piece_cpu=c8)
    assert got == pytest.approx(in_half + max(across, 2 * in_half) + across + in_half)
    # other wires pay neither
    assert cm.predict(2, 2, "hierarchical", size, LINKS, "bfloat16", quantizer=q, piece_cpu=c8) == pytest.approx(
        cm.predict(2, 2, "hierarchical", size, LINKS, "bfloat16"))


def test_fit_link_takes_out_what_was_measured_apart():
    alpha, beta, extra = 300e-6, 1 / 0.12e9, 2e-12
    rows = [{"bytes": size, "time_s": 2 * (alpha + size / 2 * beta) + size * extra}
            for size in (MIB, 2 * MIB, 4 * MIB, 8 * MIB)]
    got = cm.fit_link(rows, 2, None, besides=lambda r: r["bytes"] * extra)
    assert got == pytest.approx((alpha, beta), rel=1e-6)


def test_the_quantizer_is_measured_alone_in_seconds_per_byte():
    q = cm.measure_quantizer(numel=1 << 14, rounds=2)
    assert 0 < q < 1e-7  # a pass over 64 KiB of float32 on one core: far under 7 ms


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


def _model_rows(links: dict, step_cpu: dict, cores: int) -> list[dict]:
    """One round of every configuration the sweep measures, timed by the model itself."""
    from benchmarks.scaling import COLLECTIVE_RUNS
    rows = []
    for hosts, per_host, env in COLLECTIVE_RUNS:
        alg, wire = env["SMDDP_ALGORITHM"], env.get("SMDDP_INTER_NODE_WIRE_DTYPE", "float32")
        for size in (64 << 10, 256 << 10, MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB):
            t = cm.predict(hosts, per_host, alg, size, links, wire, piece=4 * MIB, cores=cores, step_cpu=step_cpu[alg])
            rows.append({"hosts": hosts, "per_host": per_host, "algorithm": alg, "wire": wire, "bytes": size,
                         "time_s": t, "round": 0})
    return rows


def test_report_fits_each_algorithms_cpu_time_on_its_own_run_and_judges_the_rest(tmp_path, monkeypatch, capsys):
    # measurements made by known constants: the fits must find them and every judged point must agree
    links = {"intra": (4e-6, 1 / 11e9), "inter": (1e-6, 1 / 0.119e9), cm.INTER_16[2]: (0.0, 1 / 0.23e9),
             cm.INTER_16_MANY: (0.0, 1 / 0.2e9)}
    step_cpu = {"flat": 0.30e-3, "hierarchical": 0.49e-3}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"rate": "1gbit", "burst": "2mb", "cores": 2, "rows": _model_rows(links, step_cpu, 2)}))
    monkeypatch.setattr(sys, "argv", ["cost_model.py", str(path), "--piece-bytes", str(4 * MIB)])
    cm.main()
    report = capsys.readouterr().out
    assert "| one flat ring over all ranks | 8 x 1 flat float32 | 300 |" in report
    assert "| the hierarchical inter-host groups | 4 x 1 hierarchical bfloat16 | 490 |" in report
    assert "| inter, 8-bit exchange | 1 |" in report  # fitted on 2 x 1 int8
    assert "worst 0.0%, 55 of 55 within 20%" in report
    judged = [line for line in report.splitlines() if "MiB |" in line]
    assert not [line for line in judged if line.startswith("| 8 x 1") or line.startswith("| 4 x 1 | hierarchical | bf")]
    assert not [line for line in judged if line.startswith("| 2 x 1 | hierarchical | int8")]
    assert len(judged) == 55  # 11 held-out configurations x 5 sizes from 1 MiB
    assert len([line for line in judged if line.startswith("| 2 x 4 | hierarchical | float32 |")]) == 5
    assert len([line for line in judged if "| hierarchical | int8 |" in line]) == 15  # 4 x 1, 2 x 2, 4 x 2


def test_report_without_the_flat_cpu_run_says_which_run_to_measure(tmp_path, monkeypatch):
    links = {"intra": (4e-6, 1 / 11e9), "inter": (1e-6, 1 / 0.119e9)}
    rows = [r for r in _model_rows(links, {"flat": 0.3e-3, "hierarchical": 0.49e-3}, 2) if r["hosts"] != 8]
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"rate": "1gbit", "cores": 2, "rows": rows}))
    monkeypatch.setattr(sys, "argv", ["cost_model.py", str(path)])
    with pytest.raises(SystemExit, match=r"no 8 x 1 flat float32 run.*benchmarks.scaling --collectives"):
        cm.main()


def test_sweeps_of_one_lab_pool_their_rounds_and_different_labs_are_refused(tmp_path):
    row = {"hosts": 2, "per_host": 1, "algorithm": "flat", "wire": "float32", "bytes": MIB, "round": 0}
    lab = {"rate": "1gbit", "burst": "2mb", "cores": 2}
    paths = []
    for i, times in enumerate(((0.010, 0.011, 0.030), (0.012, 0.031, 0.032))):
        paths.append(tmp_path / f"sweep{i}.json")
        paths[-1].write_text(json.dumps({**lab, "rows": [{**row, "round": k, "time_s": t} for k, t in enumerate(times)]}))
    pooled = cm.load_sweeps([str(p) for p in paths])
    assert pooled["sweeps"] == 2 and pooled["rate"] == "1gbit"
    (median,) = cm.median_rows(pooled["rows"])
    assert median["time_s"] == pytest.approx(0.021) and len(median["rounds"]) == 6  # not either sweep's median
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**lab, "burst": "256kb", "rows": []}))
    with pytest.raises(SystemExit, match="only sweeps of the same lab can be pooled"):
        cm.load_sweeps([str(paths[0]), str(other)])
