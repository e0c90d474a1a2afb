"""Multi-node scaling of data-parallel training, on simulated hosts with rate-limited links.

Runs benchmarks/ddp_throughput.py under torchrun's multi-node rendezvous on 1, 2 and 4
simulated hosts (network namespaces, see benchmarks/multinode/cluster.py) x 1-2 ranks, for
each variant, and writes a table (markdown), the raw JSON and a plot of scaling efficiency,
throughput(N hosts) / (N x throughput(1 host)). Needs root.

    python -m benchmarks.scaling --rate 1gbit --out benchmarks/results/YYYY-MM-DD-scaling-<what>
    python -m benchmarks.scaling --hosts 2 --per-host 2 --variants gloo,smddp-hier-bf16 --repeat 5
    python -m benchmarks.scaling --quick        # one small run: does the harness work here?
    python -m benchmarks.scaling --launcher mpiexec   # the same runs started by mpiexec with a host list
    python -m benchmarks.scaling --hosts 2 --per-host 2 --env SMDDP_ALGORITHM=hierarchical \
        --run "collectives.py --backends smddp,gloo --ops reduce_scatter --dtype bfloat16 -b 1M"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.multinode.cluster import DEFAULT_BURST, SimCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {  # name: (ddp_throughput --variant, extra arguments, environment)
    # the lab's limit: the same ranks, model and batches, each training alone (no gradient sync)
    "no-sync": ("no-sync", [], {}),
    "no-sync-adamw": ("no-sync", ["--optimizer", "adamw"], {}),
    "gloo": ("gloo", [], {}),
    "gloo-fp16-hook": ("gloo-fp16-hook", [], {}),
    "smddp-flat": ("smddp", [], {"SMDDP_ALGORITHM": "flat"}),
    "smddp-hier": ("smddp", [], {"SMDDP_ALGORITHM": "auto"}),
    "smddp-hier-bf16": ("smddp", [], {"SMDDP_ALGORITHM": "auto", "SMDDP_INTER_NODE_WIRE_DTYPE": "bfloat16"}),
    # float32 sums between hosts blockwise in int8 (a float32 scale per 256 values), summed in float32
    "smddp-hier-int8": ("smddp", [], {"SMDDP_ALGORITHM": "auto", "SMDDP_INTER_NODE_WIRE_DTYPE": "int8"}),
    # the same without the per-call check that ranks made the same call (on by default): its cost
    "smddp-hier-bf16-unchecked": ("smddp", [], {"SMDDP_ALGORITHM": "auto", "SMDDP_INTER_NODE_WIRE_DTYPE": "bfloat16",
                                                "SMDDP_CHECK_COLLECTIVES": "0"}),
    # partial sums rounded to bfloat16 on every hop of gloo's ring (the same as above on 2 hosts)
    "smddp-hier-bf16-wire-sums": ("smddp", [], {"SMDDP_ALGORITHM": "auto", "SMDDP_INTER_NODE_WIRE_DTYPE": "bfloat16",
                                                "SMDDP_INTER_NODE_ACCUMULATE": "wire"}),
    "smddp-compiled-bf16": ("smddp-compiled", ["--wire-dtype", "bfloat16"], {"SMDDP_ALGORITHM": "auto"}),
    # the compiled step's 8-bit wire with error feedback (an all-to-all and an all-gather per bucket)
    "smddp-compiled-int8": ("smddp-compiled", ["--wire-dtype", "int8"], {"SMDDP_ALGORITHM": "auto"}),
    # AdamW, the compiled step with its optimizer state on every rank or sharded (ZeRO-1)
    "gloo-adamw": ("gloo", ["--optimizer", "adamw"], {}),
    "smddp-compiled-bf16-adamw": ("smddp-compiled", ["--wire-dtype", "bfloat16", "--optimizer", "adamw"],
                                  {"SMDDP_ALGORITHM": "auto"}),
    "smddp-compiled-bf16-adamw-sharded": ("smddp-compiled", ["--wire-dtype", "bfloat16", "--optimizer", "adamw",
                                                             "--shard-optimizer-state"], {"SMDDP_ALGORITHM": "auto"}),
    # FSDP2 with bfloat16 parameters and gradient reductions (all_gather + reduce_scatter)
    "gloo-fsdp-bf16": ("gloo-fsdp", ["--param-dtype", "bfloat16"], {}),
    "smddp-fsdp-bf16": ("smddp-fsdp", ["--param-dtype", "bfloat16"], {"SMDDP_ALGORITHM": "auto"}),
}
DDP_VARIANTS = [name for name in VARIANTS if "fsdp" not in name]  # the scaling table's default


def start_job(cluster: SimCluster, per_host: int, script: list[str], env: dict, launcher: str) -> list:
    """Start ``script`` (a benchmarks/ file and its arguments) on every host of ``cluster``:
    one torchrun per host joined by its multi-node rendezvous, or one mpiexec with the host
    list. Returns the processes to wait for; the first one's output has rank 0's."""
    env = {**env, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": ROOT}
    out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = os.path.join(ROOT, "benchmarks", script[0])
    if launcher == "mpiexec":
        return [cluster.mpiexec(per_host, [sys.executable, path, *script[1:]], env=env, **out)]
    procs = []
    for i in range(cluster.hosts):
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={cluster.hosts}",
                f"--nproc-per-node={per_host}", f"--node-rank={i}", f"--master-addr={cluster.names[0]}",
                # the port is inside this job's own network namespaces, where nothing else listens
                "--master-port=29500", path, *script[1:]]
        procs.append(cluster.spawn(i, argv, env=env, **out))
    return procs


def run_job(hosts: int, per_host: int, script: list[str], env: dict, rate: str, launcher: str, timeout: float,
            what: str, tries: int = 2, burst: str = DEFAULT_BURST, tcp: dict | None = None) -> list[str]:
    """Run ``script`` on ``hosts`` fresh simulated hosts; returns each host's output. A failed
    job is run again once on a fresh cluster, saying why on stderr: torch's own gloo sometimes
    aborts a rank while the process group is torn down, after the measurement (2026-11-23,
    "terminate called without an active exception" in 4 of about 40 runs), and a half-finished run
    must not end a sweep of many. A second failure raises. ``tcp``, when given, receives the
    successful run's TCP counters (SimCluster.tcp_counters)."""
    for attempt in range(1, tries + 1):
        try:
            with SimCluster(hosts, rate=rate, burst=burst) as cluster:
                outputs = cluster.wait_all(start_job(cluster, per_host, script, env, launcher), timeout=timeout)
                if tcp is not None:
                    try:
                        tcp.update(cluster.tcp_counters())
                    except subprocess.CalledProcessError as exc:  # a failed run: tried again like one
                        raise RuntimeError(f"reading the hosts' TCP counters failed: {exc}; {exc.stderr}") from exc
                return outputs
        except RuntimeError as exc:
            failure = f"{what}: {exc}"
            print(f"attempt {attempt} of {tries} failed: {failure}", file=sys.stderr, flush=True)
    raise RuntimeError(failure)


def run_one(hosts: int, per_host: int, variant: str, rate: str, steps: int, save: str | None,
            launcher: str = "torchrun", burst: str = DEFAULT_BURST) -> dict:
    """One training job on ``hosts`` fresh simulated hosts; returns rank 0's JSON report."""
    kind, extra, env = VARIANTS[variant]
    script = ["ddp_throughput.py", f"--variant={kind}", f"--steps={steps}", *extra] + (["--save-params", save] if save else [])
    outputs = run_job(hosts, per_host, script, env, rate, launcher, 900, f"{variant} on {hosts}x{per_host}",
                      burst=burst)
    report = next((json.loads(line) for line in outputs[0].splitlines() if line.startswith("{")), None)
    if report is None:
        raise RuntimeError(f"{variant} on {hosts}x{per_host} printed no report:\n" + outputs[0][-3000:])
    # the worker's "hosts" lists each rank's hostname: keep it as rank_hosts beside the count
    return {**report, "hosts": hosts, "per_host": per_host, "name": variant, "launcher": launcher,
            "rank_hosts": report["hosts"]}


BF16 = {"SMDDP_ALGORITHM": "hierarchical", "SMDDP_INTER_NODE_WIRE_DTYPE": "bfloat16"}
INT8 = {"SMDDP_ALGORITHM": "hierarchical", "SMDDP_INTER_NODE_WIRE_DTYPE": "int8"}
COLLECTIVE_RUNS = [  # (hosts, ranks per host, SMDDP_* environment); the cost model fits the 1-rank-per-host and 1 x 2 runs
    (1, 2, {"SMDDP_ALGORITHM": "flat"}),
    (2, 1, {"SMDDP_ALGORITHM": "flat"}),
    (2, 1, BF16),
    (4, 1, {"SMDDP_ALGORITHM": "flat"}),
    (4, 1, BF16),
    (2, 2, {"SMDDP_ALGORITHM": "flat"}),
    (2, 2, {"SMDDP_ALGORITHM": "hierarchical"}),
    (2, 2, BF16),
    (4, 2, {"SMDDP_ALGORITHM": "flat"}),
    (4, 2, {"SMDDP_ALGORITHM": "hierarchical"}),
    (4, 2, BF16),
    # fitted, never judged: the CPU time per step of one flat ring of 8 ranks (4 x 2 flat is judged)
    (8, 1, {"SMDDP_ALGORITHM": "flat"}),
    # held out: four inter-host groups share each host's link and cores, as eight GPUs per host do
    # in the extrapolation (4 x 2 has two)
    (2, 4, {"SMDDP_ALGORITHM": "hierarchical"}),
    # the 8-bit wire: fitted on 2 x 1, judged on the rest
    (2, 1, INT8),
    (4, 1, INT8),
    (2, 2, INT8),
    (4, 2, INT8),
]


def run_collectives(hosts: int, per_host: int, env: dict, rate: str, tmp: str, launcher: str = "torchrun",
                    sizes: tuple[str, str] = ("64K", "16M"), burst: str = DEFAULT_BURST) -> list[dict]:
    """all_reduce timings (benchmarks/collectives.py, smddp only) on a fresh simulated cluster,
    for message sizes from ``sizes[0]`` to ``sizes[1]`` bytes in steps of 2x."""
    out = os.path.join(tmp, f"coll-{hosts}x{per_host}-{len(os.listdir(tmp))}.json")
    # The tbf bucket (2 MB) fills while the link idles between sizes. 10 warm-up calls spend most
    # of it, but not where a call's CPU time is close to its wire time (a bfloat16 1 MiB call on
    # 2 hosts moves 512 KiB per link in 4.4 ms, and the bucket refills for most of that), so
    # each size is timed over at least 64 MiB of messages (64 calls at 1 MiB, at most 100):
    # what credit is left is then worth a few percent, not the 10-20% it was with 20 calls.
    script = ["collectives.py", "--backends=smddp", "--ops=all_reduce", "-b", sizes[0], "-e", sizes[1], "-f", "2",
              "-n", "20", "-w", "10", "--timed-bytes", "64M", "--max-iters", "100", "--json", out]
    tcp: dict = {}  # the whole run's (every size, warm-up and start-up included): why a round was slow
    run_job(hosts, per_host, script, env, rate, launcher, 1200, f"collectives on {hosts}x{per_host} {env}", burst=burst,
            tcp=tcp)
    rows = json.load(open(out))["rows"]
    return [{"hosts": hosts, "per_host": per_host, "algorithm": env["SMDDP_ALGORITHM"],
             "wire": env.get("SMDDP_INTER_NODE_WIRE_DTYPE", "float32"), "bytes": r["size"],
             "time_s": r["out_of_place"]["time_us"] * 1e-6, "env": env, "tcp": tcp} for r in rows]


def median_runs(runs: list[dict]) -> list[dict]:
    """One row per (hosts, ranks per host, variant): the median of its repeated runs by
    samples/s (the lower middle one for an even count), with every run's figure beside it."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["hosts"], r["per_host"], r["name"]), []).append(r)
    rows = []
    for group in groups.values():
        ranked = sorted(group, key=lambda r: r["samples_per_s"])
        rows.append({**ranked[(len(ranked) - 1) // 2], "runs_samples_per_s": [round(r["samples_per_s"], 1) for r in group]})
    return rows


def efficiency(rows: list[dict]) -> None:
    base = {(r["name"], r["per_host"]): r["samples_per_s"] for r in rows if r["hosts"] == 1}
    for r in rows:
        one = base.get((r["name"], r["per_host"]))
        r["efficiency"] = r["samples_per_s"] / (r["hosts"] * one) if one else None


def write_outputs(rows: list[dict], runs: list[dict], out: str, rate: str, burst: str = DEFAULT_BURST) -> None:
    with open(out + ".json", "w") as f:
        json.dump({"rate": rate, "burst": burst, "rows": rows, "runs": runs, "torch": torch.__version__}, f, indent=1)
    # the baseline: torch's gloo with the optimizer the others use ("gloo", or "gloo-adamw")
    names = [r["name"] for r in rows]
    adamw = "gloo" not in names and "gloo-adamw" in names
    baseline = "gloo-adamw" if adamw else "gloo"
    limit = "no-sync-adamw" if adamw else "no-sync"
    lines = [f"| hosts x ranks | variant | samples/s | step (ms) | vs {baseline} | of the {limit} limit | "
             "scaling efficiency | runs (samples/s) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    gloo = {(r["hosts"], r["per_host"]): r["samples_per_s"] for r in rows if r["name"] == baseline}
    alone = {(r["hosts"], r["per_host"]): r["samples_per_s"] for r in rows if r["name"] == limit}
    for r in rows:
        g, a = gloo.get((r["hosts"], r["per_host"])), alone.get((r["hosts"], r["per_host"]))
        eff = f"{100 * r['efficiency']:.0f}%" if r.get("efficiency") is not None else "-"
        runs = ", ".join(f"{x:.0f}" for x in r["runs_samples_per_s"])
        vs_gloo = f"{r['samples_per_s'] / g:.2f}x" if g else "-"
        of_limit = f"{r['samples_per_s'] / a:.2f}x" if a else "-"
        lines.append(f"| {r['hosts']} x {r['per_host']} | {r['name']} | {r['samples_per_s']:.0f} | "
                     f"{1000 * r['step_s']:.0f} | {vs_gloo} | {of_limit} | {eff} | {runs} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(line for line in lines if line) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (pip install -e '.[bench]')")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for per_host, ax in zip((1, 2), axes):
        for name in VARIANTS:
            pts = sorted((r["hosts"], r["samples_per_s"]) for r in rows if r["name"] == name and r["per_host"] == per_host)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_title(f"{per_host} rank(s) per host, {rate} links (tbf burst {burst})")
        ax.set_xlabel("simulated hosts")
        ax.set_ylabel("samples/s")
        ax.set_xticks([1, 2, 4])
        ax.grid(alpha=0.3)
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of every host link")
    parser.add_argument("--burst", default=DEFAULT_BURST, help="tc tbf burst (token bucket depth) of every host link")
    parser.add_argument("--hosts", help="simulated host counts (default: 1,2,4; --collectives: every "
                                         "configuration of the cost model, 8 hosts included)")
    parser.add_argument("--per-host", help="ranks per simulated host (default: 1,2; --collectives: every "
                                            "configuration of the cost model, 2 x 4 included)")
    parser.add_argument("--variants", default=",".join(DDP_VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds per configuration, the variants alternating within each; the table "
                             "shows each variant's median run (--collectives: the cost model takes each "
                             "size's median)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", time.strftime("%Y-%m-%d") + "-scaling"))
    parser.add_argument("--launcher", choices=["torchrun", "mpiexec"], default="torchrun",
                        help="one torchrun per host (multi-node rendezvous), or mpiexec with a host list")
    parser.add_argument("--quick", action="store_true", help="2 hosts x 1 rank, smddp only, 2 steps; no files")
    parser.add_argument("--collectives", action="store_true",
                        help="instead: time all_reduce on the cost model's configurations (those with --hosts and "
                             "--per-host), write OUT.json")
    parser.add_argument("--run", metavar="SCRIPT ARGS",
                        help="instead: run this benchmarks/ script (with its arguments, one string) on each "
                             "--hosts x --per-host cluster, --repeat times, and print the first host's output")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="--collectives, --run: also set this SMDDP_* variable in every run (repeatable)")
    parser.add_argument("--min-bytes", default="64K", help="--collectives: smallest message (suffixes K, M)")
    parser.add_argument("--max-bytes", default="16M", help="--collectives: largest message")
    args = parser.parse_args()
    if args.run:
        extra = dict(kv.split("=", 1) for kv in args.env)
        for h in map(int, (args.hosts or "2").split(",")):
            for p in map(int, (args.per_host or "1").split(",")):
                for rep in range(args.repeat):
                    outputs = run_job(h, p, shlex.split(args.run), extra, args.rate, args.launcher, 1800,
                                      f"{args.run} on {h}x{p}", burst=args.burst)
                    print(f"## round {rep}: {h} hosts x {p} ranks, {args.rate} links (tbf burst {args.burst}), "
                          f"{extra or 'no SMDDP_* variables'}\n{outputs[0]}", flush=True)
        return
    if args.collectives:
        hosts = set(map(int, args.hosts.split(","))) if args.hosts else {h for h, _, _ in COLLECTIVE_RUNS}
        per_host = set(map(int, args.per_host.split(","))) if args.per_host else {p for _, p, _ in COLLECTIVE_RUNS}
        extra = dict(kv.split("=", 1) for kv in args.env)
        runs = [(h, p, {**env, **extra}) for h, p, env in COLLECTIVE_RUNS if h in hosts and p in per_host]
        with tempfile.TemporaryDirectory() as tmp:
            rows = []
            for rep in range(args.repeat):  # every configuration once per round: drifts hit each alike
                for h, p, env in runs:
                    run = run_collectives(h, p, env, args.rate, tmp, args.launcher, (args.min_bytes, args.max_bytes),
                                          args.burst)
                    rows += [{**r, "round": rep} for r in run]
                    tcp = run[0]["tcp"]
                    print(f"round {rep}: {h} x {p} {env} (TCP: {tcp['RetransSegs']} of {tcp['OutSegs']} segments "
                          f"retransmitted, {tcp['TCPDSACKRecvSegs']} of them needlessly; {tcp['qdisc_drops']} "
                          "packets dropped by the links)", flush=True)
        with open(args.out + ".json", "w") as f:
            # every simulated host shares this machine's cores: the cost model's contention term
            json.dump({"rate": args.rate, "burst": args.burst, "cores": os.cpu_count(), "rounds": args.repeat,
                       "rows": rows}, f, indent=1)
        for h, p, env in runs:  # each size's median over the rounds
            times = {}
            for r in rows:
                if (r["hosts"], r["per_host"], r["env"]) == (h, p, env):
                    times.setdefault(r["bytes"], []).append(r["time_s"])
            cells = ", ".join(f"{b >> 10} KiB {1e3 * sorted(t)[(len(t) - 1) // 2]:.1f} ms" for b, t in sorted(times.items()))
            print(f"{h} x {p} {env}: {cells}")
        print(f"wrote {args.out}.json ({len(rows)} measurements)")
        return
    if args.quick:
        report = run_one(2, 1, "smddp-hier", args.rate, 2, None, args.launcher, args.burst)
        print(json.dumps(report))
        return
    runs = []
    variants = args.variants.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for hosts in map(int, (args.hosts or "1,2,4").split(",")):
            for per_host in map(int, (args.per_host or "1,2").split(",")):
                for rep in range(args.repeat):  # alternate the variants, so drifts hit each alike
                    for name in variants:
                        save = os.path.join(tmp, f"{name}-{hosts}x{per_host}.pt")
                        row = run_one(hosts, per_host, name, args.rate, args.steps, save, args.launcher, args.burst)
                        runs.append({**row, "round": rep})
                        print(f"{hosts} x {per_host} {name:<20} {row['samples_per_s']:8.0f} samples/s", flush=True)
                    ref = os.path.join(tmp, f"gloo-{hosts}x{per_host}.pt")
                    if os.path.exists(ref):  # final parameters of each variant against float32 gloo
                        want = torch.load(ref)
                        for r in runs[-len(variants):]:
                            got = torch.load(os.path.join(tmp, f"{r['name']}-{hosts}x{per_host}.pt"))
                            r["max_param_diff_vs_gloo"] = float((got - want).abs().max())
                            r["max_param_abs"] = float(want.abs().max())
    rows = median_runs(runs)
    efficiency(rows)
    write_outputs(rows, runs, args.out, args.rate, args.burst)
    print(f"wrote {args.out}.md, .json and .png")


if __name__ == "__main__":
    main()
