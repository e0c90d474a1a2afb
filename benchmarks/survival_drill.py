"""The lost-rank drill: SurvivingSync training on simulated hosts through failure after failure.

A job of ``--hosts`` x ``--per-host`` ranks (network namespaces with rate-limited links, see
benchmarks/multinode/cluster.py) trains the convergence benchmark's classifier (64 -> 256 -> 256
-> 10, AdamW) with ``smddp_lite.SurvivingSync``, the rendezvous store in a process of its own on
host 0, and torch's default group timeout (30 minutes) unless ``--group-timeout`` says
otherwise. Each host's ranks are started by ``python -m smddp_lite.launch`` (``--launcher agent``: by
a small agent of the drill's, for uneven ``--layout``s), which starts a replacement in the
place of each rank whose process ends. The driver injects failures at random steps, one at a
time:

- ``sigkill``: a rank SIGKILLed;
- ``sigstop``: a rank stopped;
- ``exit``: a rank calling ``os._exit`` at its next step;
- ``link``: the last host's link taken down (every rank on it cut off from the others and from
  the store) until its ranks have raised the error that says so;
- ``pair``: two ranks SIGKILLed at once;
- ``comeback``: a rank stopped, and let go on once the others went on without it, which must
  end it with ``RankDeclaredLostError``;
- ``ghost``: a rank SIGKILLed, and its first replacement dying (``os._exit``) ``GHOST_AFTER_S``
  into its SurvivingSync, while it waits to be admitted with its ticket taken: the members must
  refuse it (or, where it was admitted first, lose it), and the next replacement must join;
- ``healer``: a rank SIGKILLed, and the member that sends its replacement the job's state (the
  healer) SIGKILLing itself as it sends the first chunk: the members left and the replacement
  must agree on the next generation, the new healer must send the state again, and both
  replacements must join.

The survivors must go on within ``stale_after`` (2 s) and a second of each (the heartbeat
finds the silent ones). The driver then ends what is left of the lost ranks, and waits for the
replacements to train; the next failure comes once the group is whole again and has trained
``--gap`` steps. Every rank logs each step's parameter checksum and optimizer-state checksum;
the driver checks after the run that every rank that logged a step logged the same ones, and
reports how long
the survivors took to go on, how long each replacement took to its first step done (from its
process's start, and from its SurvivingSync's, which JOIN_BOUND_S bounds), what the cut-off
ranks raised and when, and whether any process or /dev/shm segment was left. Needs root::

    python -m benchmarks.survival_drill --failures 100 --out benchmarks/results/<date>-survival-drill
    python -m benchmarks.survival_drill --failures 0 --steps 2000 --seed 1   # a fault-free run
    python -m benchmarks.survival_drill --failures 12 --cycle --hog 1         # beside a busy process
    python -m benchmarks.survival_drill --failures 7 --cycle --compiled       # smddp_lite.compile's step

``--ddp`` trains a DistributedDataParallel of the model, ``--compiled`` the model
``smddp_lite.compile`` makes (bfloat16 wire, fused AdamW); the plain module otherwise.

With ``--steps`` the run ends at that step (failures stop once it is near); without, it ends
after the last failure's replacement has trained ``--gap`` steps. The held-out loss at the end
is what the convergence comparison reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.convergence import _teacher_and_held_out as teacher_and_held_out  # the same task

STARTED_AT = time.time()  # this process's start (before torch's import), for a replacement's timing
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORE_PORT = 29500
GROUP_TIMEOUT_S = 1800.0  # torch's default: no failure may wait for it
KINDS = ("sigkill", "sigstop", "exit", "link", "pair", "comeback", "ghost", "healer")
GHOST_AFTER_S = 0.4  # from its SurvivingSync's start: after its ticket, before its admission
RESUME_BOUND_S = 3.0  # after any failure: the heartbeat's stale_after (2 s) and a second
# from a replacement's SurvivingSync (its script's imports and model are its own) to its first step
JOIN_BOUND_S = 5.0


# the ranks ----------------------------------------------------------------------------------------
def _state_checksum(state: dict) -> float:
    """The optimizer state's sum over every tensor (moments and step counts), in float64."""
    return sum(float(t.double().sum()) for per_param in state.values() for t in per_param.values()
               if hasattr(t, "double"))


def _die_healing_when_armed(logs: Path, me) -> None:
    """The ``healer`` kind: the first member to send a replacement the job's state once the driver
    armed it takes the part, and SIGKILLs itself at its first chunk (after the header)."""
    import torch.distributed as dist

    from smddp_lite import surviving_state

    send_state, armed = surviving_state.send, logs / "healer-armed"

    def send_or_die(*args, **kwargs) -> None:
        claimed = logs / f"healer-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):  # not armed, or another member took it
            os.rename(armed, claimed)
            (logs / f"healer-{os.getpid()}.id").write_text(str(me()))
            dist.isend = lambda *_args, **_kwargs: os.kill(os.getpid(), signal.SIGKILL)
        send_state(*args, **kwargs)

    surviving_state.send = send_or_die


def _path(args) -> list[str]:
    """The training path's option, passed on to the ranks."""
    return ["--ddp"] * args.ddp + ["--compiled"] * args.compiled


def worker(args) -> None:
    """One rank (or a replacement): train until the driver's stop step, logging every step."""
    import torch
    import torch.distributed as dist

    import smddp_lite
    from smddp_lite.surviving import RankDeclaredLostError

    torch.set_num_threads(1)
    logs = Path(args.dir)
    teacher, held_x, held_y = teacher_and_held_out(torch)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    trained = model
    if args.ddp or args.compiled:  # a replacement's init() makes a group of one to make the model on
        smddp_lite.init(timeout=timedelta(seconds=args.group_timeout))
    if args.ddp:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    if args.compiled:
        trained, optimizer = smddp_lite.compile(model, optimizer, wire_dtype=torch.bfloat16)
    log = None

    def write(record: dict) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    pending = []
    armed = logs / "ghost-armed"
    if os.environ.get("SMDDP_REPLACEMENT") and armed.exists():
        with contextlib.suppress(FileNotFoundError):  # another replacement took it first
            os.rename(armed, logs / f"ghost-{os.getpid()}")
            threading.Timer(GHOST_AFTER_S, os._exit, args=(7,)).start()
    _die_healing_when_armed(logs, lambda: me)
    sync_at = time.time()
    sync = smddp_lite.SurvivingSync(trained, optimizer, timeout=timedelta(seconds=args.group_timeout),
                                    on_change=lambda c: pending.append(c))
    me = sync.first_rank
    log = open(logs / f"rank-{me}.jsonl", "a")
    (logs / f"pid-{me}").write_text(str(os.getpid()))
    write({"event": "started", "id": me, "pid": os.getpid(), "at": time.time(), "step": sync.step,
           "process_at": STARTED_AT, "sync_at": sync_at, "host": int(os.environ["GROUP_RANK"])})
    stop_file, stop_at = logs / "stop-at", None
    step = sync.step
    while stop_at is None or step < stop_at:
        for c in pending:
            write({"event": "change", "id": me, "at": time.time(), "lost": list(c.lost), "joined": list(c.joined),
                   "world": c.world_size, "step": c.step, "seconds": c.seconds})
        pending.clear()
        if (logs / f"exit-{me}").exists():
            os._exit(1)
        data = torch.Generator().manual_seed(args.seed * 1_000_003 + me * 100_003 + step)
        x = torch.randn(64, 64, generator=data)
        with torch.no_grad():
            y = teacher(x).argmax(1)
        torch.nn.functional.cross_entropy(trained(x), y).backward()
        time.sleep(args.step_s)
        try:
            sync()
        except RankDeclaredLostError as exc:  # stopped and let go on, or cut off: the others went on
            write({"event": "refused", "id": me, "at": time.time(), "error": type(exc).__name__,
                   "message": str(exc)})
            sys.exit(1)
        optimizer.step()
        optimizer.zero_grad()
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        write({"step": sync.step - 1, "id": me, "world": sync.world_size, "checksum": checksum,
               "optimizer_checksum": _state_checksum(optimizer.state_dict()["state"]), "at": time.time()})
        step = sync.step
        if stop_at is None and stop_file.exists():
            stop_at = int(stop_file.read_text())
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(model(held_x), held_y))
    write({"event": "done", "id": me, "step": step, "held_out_loss": loss, "at": time.time()})
    sync.close()
    dist.destroy_process_group()


def agent(args) -> None:
    """One per simulated host: starts that host's ranks, and replacements when the driver asks
    (a file in the log folder), so that they share the host's /dev/shm; lists /dev/shm at the end."""
    logs, host = Path(args.dir), args.host
    children = []
    env = dict(os.environ)

    def start(rank_env: dict) -> None:
        argv = [sys.executable, "-m", "benchmarks.survival_drill", "worker", "--dir", args.dir, "--seed",
                str(args.seed), "--step-s", str(args.step_s), "--group-timeout", str(args.group_timeout)]
        argv += _path(args)
        out = open(logs / f"out-host{host}-{len(children)}.txt", "w")
        children.append(subprocess.Popen(argv, env={**env, **rank_env}, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))

    layout = _layout(args)
    first = sum(layout[:host])
    env["LOCAL_WORLD_SIZE"] = str(layout[host])
    env["GROUP_RANK"] = str(host)
    for rank in range(first, first + layout[host]):
        start({"RANK": str(rank), "LOCAL_RANK": str(rank - first)})
    served = set()
    while not (logs / "agents-stop").exists():
        for request in sorted(logs.glob(f"spawn-host{host}-*")):
            if request.name not in served:
                served.add(request.name)
                start({"RANK": "-1", "LOCAL_RANK": "0", "SMDDP_REPLACEMENT": "1"})
        time.sleep(0.05)
    for child in children:
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
    (logs / f"shm-host{host}.json").write_text(json.dumps(sorted(os.listdir("/dev/shm"))))


# the driver ---------------------------------------------------------------------------------------
class Drill:
    def __init__(self, cluster, logs: Path, layout: list[int], rng: random.Random, replace: bool = True,
                 by_launcher: bool = False) -> None:
        self.cluster, self.logs, self.rng, self.replace = cluster, logs, rng, replace
        self.by_launcher = by_launcher  # replacements come from smddp_lite.launch, not the drill's requests
        self.world = sum(layout)
        self.host_of = {r: h for h, n in enumerate(layout) for r in range(sum(layout[:h]), sum(layout[:h]) + n)}
        self.spawned = 0
        self.victims: set[int] = set()  # every rank the drill made fail
        self.records: dict[int, list[dict]] = {}
        self._read_at: dict[int, int] = {}

    def read(self) -> None:
        for path in self.logs.glob("rank-*.jsonl"):
            rid = int(path.stem.split("-")[1])
            with open(path) as f:
                f.seek(self._read_at.get(rid, 0))
                text = f.read()
            complete = text[:text.rfind("\n") + 1]
            self._read_at[rid] = self._read_at.get(rid, 0) + len(complete)
            self.records.setdefault(rid, []).extend(json.loads(line) for line in complete.splitlines())

    def steps_of(self, rid: int) -> list[dict]:
        return [r for r in self.records.get(rid, []) if "checksum" in r]

    def latest_step(self) -> int:
        return max((s["step"] for rid in self.records for s in self.steps_of(rid)), default=-1)

    def wait_for(self, what, timeout: float, why: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read()
            found = what()
            if found:
                return found
            time.sleep(0.05)
        raise RuntimeError(f"the drill waited {timeout:.0f} s for {why}")

    def members(self) -> list[int]:
        """The ids in the group, as the latest change said (or the first group)."""
        changes = [r for rid in self.records for r in self.records[rid] if r.get("event") == "change"]
        if not changes:
            return list(range(self.world))
        alive = set(range(self.world)) | {j for c in changes for j in c["joined"]}
        return sorted(alive - {r for c in changes for r in c["lost"]})

    def pid(self, rid: int) -> int:
        return int((self.logs / f"pid-{rid}").read_text())

    def spawn_replacement(self, host: int) -> float:
        at = time.time()
        (self.logs / f"spawn-host{host}-{self.spawned:04d}").write_text(repr(at))
        self.spawned += 1
        return at

    def fail_once(self, kind: str) -> dict:
        """Inject one failure; wait until the survivors go on and the replacements train."""
        live = self.members()
        before = self.latest_step()
        if kind == "link":
            host = self.cluster.hosts - 1  # never host 0, where the store is
            victims = [r for r in live if self.host_of[r] == host]
        elif kind == "pair":
            victims = self.rng.sample(live, 2)
        else:
            victims = [self.rng.choice(live)]
        self.victims.update(victims)
        fault_at = time.time()
        port = f"{self.cluster.bridge}p{self.cluster.hosts - 1}"
        if kind == "ghost":  # the next replacement to start takes it
            (self.logs / "ghost-armed").write_text(str(victims[0]))
        if kind == "healer":  # the member that sends the victim's replacement the state takes it
            (self.logs / "healer-armed").write_text(str(victims[0]))
        if kind in ("sigkill", "pair", "ghost", "healer"):
            for v in victims:
                os.kill(self.pid(v), signal.SIGKILL)
        elif kind in ("sigstop", "comeback"):
            os.kill(self.pid(victims[0]), signal.SIGSTOP)
        elif kind == "exit":
            (self.logs / f"exit-{victims[0]}").touch()
        elif kind == "link":
            subprocess.run(["ip", "link", "set", port, "down"], check=True)
        survivors = [r for r in live if r not in victims]

        def went_on():
            changes = [c for r in survivors for c in self.records.get(r, [])
                       if c.get("event") == "change" and c["at"] >= fault_at and set(victims) <= set(c["lost"])]
            return changes if len({c["id"] for c in changes}) == len(survivors) else None

        changes = self.wait_for(went_on, 60, f"the survivors of {kind} on {victims} to go on")
        resumed = max(c["at"] for c in changes) - fault_at
        refused, cut_off = None, None
        if kind == "link":  # the side without the store must end on an error of its own, not wait
            ended = self.wait_for(lambda: self._ended(victims), 60, f"the cut-off ranks {victims} to raise")
            cut_off = {str(r): {"error": e["error"], "after_s": e["at"] - fault_at, "message": e["message"]}
                       for r, e in ended.items()}
        if kind == "comeback":  # let it go on: it must find itself declared lost, and end
            os.kill(self.pid(victims[0]), signal.SIGCONT)
            refused = bool(self.wait_for(lambda: [r for r in self.records.get(victims[0], [])
                                                  if r.get("event") == "refused"], 60, f"{victims[0]} to be refused"))
        for v in victims:  # what is left of them: stopped, or cut off and still waiting
            with contextlib.suppress(ProcessLookupError):  # already gone (killed, or exited)
                os.kill(self.pid(v), signal.SIGKILL)
        if kind == "link":
            subprocess.run(["ip", "link", "set", port, "up"], check=True)
        if not self.replace:
            return {"kind": kind, "lost": victims, "joined": [], "step": before, "resumed_s": resumed,
                    "replacement_s": [], "join_s": [], "refused": refused, "cut_off": cut_off, "ghost": None,
                    "healer": None}
        if not self.by_launcher:  # the launcher starts them itself once their processes end
            for v in victims + victims[:kind == "ghost"]:  # a ghost's successor too
                self.spawn_replacement(self.host_of[v])
        first_new = max(self.host_of) + 1
        healer = self._healer_killed(survivors) if kind == "healer" else None
        if healer is not None:  # the healer is lost too, and replaced
            victims.append(healer["id"])
            if not self.by_launcher:
                self.spawn_replacement(self.host_of[healer["id"]])

        def grown_back():
            joined = [rid for rid in self.records if rid >= first_new and self.steps_of(rid)]
            return joined if len(joined) == len(victims) else None

        joined = self.wait_for(grown_back, 60, f"replacements for {victims} to train")
        training, joining = [], []
        for rid in sorted(joined):
            start = next(r for r in self.records[rid] if r.get("event") == "started")
            self.host_of[rid] = start["host"]
            first_step = self.steps_of(rid)[0]["at"]
            training.append(first_step - start["process_at"])
            joining.append(first_step - start["sync_at"])
        ghost = self._ghost_outcome(fault_at) if kind == "ghost" else None
        return {"kind": kind, "lost": victims, "joined": sorted(joined), "step": before, "resumed_s": resumed,
                "replacement_s": training, "join_s": joining, "refused": refused, "cut_off": cut_off, "ghost": ghost,
                "healer": healer}

    def _healer_killed(self, survivors: list[int]) -> dict:
        """The ``healer`` kind: wait for the member that took the part to die while it sent the
        state, and for the others to go on without it; its id and how long they took."""
        claimed = self.wait_for(lambda: list(self.logs.glob("healer-[0-9]*.id")), 60,
                                "a member to take the healer's part")[0]
        healer = int(claimed.read_text())
        died_at = claimed.stat().st_mtime  # written just before its first chunk, where it dies
        claimed.rename(self.logs / f"done-{claimed.name}")  # the next healer kind's claim is its own
        self.victims.add(healer)
        left = [r for r in survivors if r != healer]

        def went_on():
            changes = [c for r in left for c in self.records.get(r, [])
                       if c.get("event") == "change" and healer in c["lost"]]
            return changes if len({c["id"] for c in changes}) == len(left) else None

        changes = self.wait_for(went_on, 60, f"the members to go on without the healer {healer}")
        return {"id": healer, "resumed_s": max(c["at"] for c in changes) - died_at}

    def _ghosts_lost(self) -> set[int]:
        """Ids the members lost that never logged a record: replacements that died while they
        joined (the ``ghost`` kind's, admitted before they died)."""
        lost = {r for rid in self.records for c in self.records[rid] if c.get("event") == "change" for r in c["lost"]}
        return {r for r in lost if r not in self.records}

    def _ghost_outcome(self, fault_at: float) -> str:
        """What became of the ghost: "refused" (the members' change with no one lost or joined),
        "lost after its admission", or "died before its ticket" (the members saw nothing)."""
        if not list(self.logs.glob("ghost-[0-9]*")):
            raise RuntimeError("no replacement took the ghost's part")
        changes = [c for rid in self.records for c in self.records[rid]
                   if c.get("event") == "change" and c["at"] >= fault_at]
        if any(not c["lost"] and not c["joined"] for c in changes):
            return "refused"
        if any(r in self._ghosts_lost() for c in changes for r in c["lost"]):
            return "lost after its admission"
        return "died before its ticket"

    def _ended(self, ranks: list[int]) -> dict[int, dict] | None:
        """Each of ``ranks``' "refused" record (the error it raised), once every one logged it."""
        ended = {r: next((e for e in self.records.get(r, []) if e.get("event") == "refused"), None) for r in ranks}
        return ended if all(ended.values()) else None

    def check(self) -> dict:
        self.read()
        by_step: dict[int, set] = {}
        states_by_step: dict[int, set] = {}
        world_at: dict[int, int] = {}
        for rid in self.records:
            # a lost rank's steps too: a step commits only once every member's average arrived
            # (SurvivingSync._commit), so a rank lost mid-step never logged one the others redid
            for s in self.steps_of(rid):
                by_step.setdefault(s["step"], set()).add(s["checksum"])
                states_by_step.setdefault(s["step"], set()).add(s["optimizer_checksum"])
                world_at[s["step"]] = s["world"]
        differing = sorted(step for step, sums in by_step.items() if len(sums) > 1)
        differing_states = sorted(step for step, sums in states_by_step.items() if len(sums) > 1)
        done = [r for rid in self.records for r in self.records[rid] if r.get("event") == "done"]
        lost = {r for rid in self.records for c in self.records[rid] if c.get("event") == "change" for r in c["lost"]}
        lost -= self._ghosts_lost()
        return {"steps": len(by_step), "steps_with_differing_parameters": differing[:20],
                "steps_with_differing_optimizer_state": differing_states[:20],
                "unplanned_losses": sorted(lost - self.victims),
                # the batches the steps averaged, against a run that never shrank
                "rank_steps": sum(world_at.values()), "rank_steps_whole": self.world * len(world_at),
                "held_out_loss": sorted({round(d["held_out_loss"], 9) for d in done}),
                "ranks_done": len(done)}


def drive(args) -> dict:
    from benchmarks.multinode.cluster import SimCluster

    logs = Path(args.dir)
    logs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    layout = _layout(args)
    world = sum(layout)
    env = {"WORLD_SIZE": str(world), "MASTER_ADDR": "sim-host-0", "MASTER_PORT": str(STORE_PORT),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": ROOT, "SMDDP_ALGORITHM": "auto"}
    results = {"failures": [], "command": " ".join(sys.argv)}
    with SimCluster(len(layout), rate=args.rate) as cluster:
        server = f"import time, torch.distributed as d; s = d.TCPStore('0.0.0.0', {STORE_PORT}, is_master=True, " \
                 "wait_for_workers=False); time.sleep(1e9)"
        store_server = cluster.spawn(0, [sys.executable, "-c", server], env=env)
        shm_before = {n for n in os.listdir("/dev/shm") if n.startswith("smddp")}
        # busy processes beside the job, one core's worth each, on the hosts in turn
        hogs = [cluster.spawn(h % len(layout), [sys.executable, "-c", "while True: pass"], env=env)
                for h in range(args.hog)]
        by_launcher = args.launcher == "smddp" and len(set(layout)) == 1  # the launcher's ranks: as many per host
        worker_args = ["-m", "benchmarks.survival_drill", "worker", "--dir", str(logs), "--seed", str(args.seed),
                       "--step-s", str(args.step_s), "--group-timeout", str(args.group_timeout)]
        worker_args += _path(args)
        if by_launcher:
            agents = [cluster.spawn(h, [sys.executable, "-m", "smddp_lite.launch", "--nnodes", str(len(layout)),
                                        "--node-rank", str(h), "--nproc-per-node", str(layout[h]), "--master-addr",
                                        "sim-host-0", "--master-port", str(STORE_PORT), "--store-outside",
                                        "--max-restarts", str(0 if args.no_replace else 100_000), *worker_args],
                                    env=env) for h in range(len(layout))]
        else:
            agents = [cluster.spawn(h, [sys.executable, "-m", "benchmarks.survival_drill", "agent", "--dir",
                                        str(logs), "--host", str(h), "--layout", ",".join(map(str, layout)), "--seed",
                                        str(args.seed), "--step-s", str(args.step_s), "--group-timeout",
                                        str(args.group_timeout)] + _path(args), env=env)
                      for h in range(len(layout))]
        drill = Drill(cluster, logs, layout, rng, replace=not args.no_replace, by_launcher=by_launcher)
        started = time.time()
        drill.wait_for(lambda: all(drill.steps_of(r) for r in range(world)), 120, "the job to start")
        try:
            for n in range(args.failures):
                if args.steps and drill.latest_step() > args.steps - 3 * args.gap:
                    break
                target = drill.latest_step() + args.gap
                drill.wait_for(lambda: drill.latest_step() >= target, 120, f"{args.gap} steps before failure {n}")
                kinds = args.kinds.split(",")
                kind = kinds[n % len(kinds)] if args.cycle else rng.choice(kinds)
                outcome = drill.fail_once(kind)
                results["failures"].append(outcome)
                print(f"failure {n + 1}: {outcome['kind']:<8} lost {outcome['lost']} at step {outcome['step']}, "
                      f"went on {outcome['resumed_s']:.2f} s after, replacement(s) {outcome['joined']} training "
                      f"{', '.join(f'{s:.2f}' for s in outcome['replacement_s'])} s after their start (joining "
                      f"{', '.join(f'{s:.2f}' for s in outcome['join_s'])} s)"
                      + "".join(f"; cut-off rank {r} raised {e['error']} {e['after_s']:.1f} s after"
                                for r, e in (outcome["cut_off"] or {}).items())
                      + (f"; its first replacement, a ghost: {outcome['ghost']}" if outcome["ghost"] else ""),
                      flush=True)
        finally:
            stop_at = max(args.steps or 0, drill.latest_step() + args.gap)
            (logs / "stop-at").write_text(str(stop_at))
            try:
                drill.wait_for(lambda: len([r for rid in drill.records for r in drill.records[rid]
                                            if r.get("event") == "done"]) == len(drill.members()) or None,
                               max(300, (stop_at - drill.latest_step()) * (args.step_s + 0.05) * 3), "the end")
            finally:
                (logs / "agents-stop").touch()
                hung = []
                for host, a in enumerate(agents):
                    try:
                        a.wait(timeout=90)
                    except subprocess.TimeoutExpired:  # reported, and ended with the cluster
                        hung.append(host)
                results["agents_hung"] = hung
                results["launchers_exit"] = [a.returncode for a in agents] if by_launcher else None
                for process in [store_server, *hogs]:  # the job is over: what else is left?
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=10)
                results["processes_left"] = _left_in(cluster)
        results["seconds"] = time.time() - started
    if by_launcher:  # every host's ranks share this machine's /dev/shm
        results["shm_left"] = {0: sorted({n for n in os.listdir("/dev/shm") if n.startswith("smddp")} - shm_before)}
    else:
        results["shm_left"] = {h: json.loads((logs / f"shm-host{h}.json").read_text()) for h in range(len(layout))
                               if (logs / f"shm-host{h}.json").exists()}
    results.update(drill.check())
    if results["unplanned_losses"]:  # what the lost ranks printed, before the log folder goes
        results["outputs"] = {p.name: p.read_text()[-4000:] for p in sorted(logs.glob("out-host*.txt"))}
    if args.window:
        first, last = map(int, args.window.split(","))
        results["steps_per_s"] = _steps_per_s(drill, first, last)
    resumed = [f["resumed_s"] for f in results["failures"]]
    replaced = [s for f in results["failures"] for s in f["replacement_s"]]
    joins = [s for f in results["failures"] for s in f["join_s"]]
    cut_off = [e for f in results["failures"] if f["cut_off"] for e in f["cut_off"].values()]
    results["summary"] = {
        "failures": len(results["failures"]), "by_kind": {k: sum(f["kind"] == k for f in results["failures"])
                                                          for k in KINDS},
        "resumed_s": _spread(resumed), "replacement_s": _spread(replaced), "join_s": _spread(joins),
        "resumed_within_bound": sum(r <= RESUME_BOUND_S for r in resumed),
        "joins_within_bound": sum(s <= JOIN_BOUND_S for s in joins), "replacements": len(replaced),
        "cut_off_ranks": len(cut_off), "cut_off_errors": sorted({e["error"] for e in cut_off}),
        "cut_off_raised_s": _spread([e["after_s"] for e in cut_off]),
        "comebacks_refused": sum(f.get("refused") is True for f in results["failures"]),
        "ghosts": [f["ghost"] for f in results["failures"] if f["ghost"]],
        # the healer kind's second loss: from the healer's death to the members going on without it
        "healers_resumed_s": [f["healer"]["resumed_s"] for f in results["failures"] if f["healer"]]}
    return results


def _left_in(cluster, settle_s: float = 5.0) -> dict[int, list[str]]:
    """The processes still in each host's namespace, once those that are ending (the store
    server, killed just before) have had ``settle_s`` to go."""
    deadline = time.monotonic() + settle_s
    while True:
        left = {h: subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
                for h, ns in enumerate(cluster.ns)}
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _layout(args) -> list[int]:
    return [int(n) for n in args.layout.split(",")] if args.layout else [args.per_host] * args.hosts


def _steps_per_s(drill: Drill, first: int, last: int) -> float:
    """(last - first) / the median over ranks of the time between their logs of those steps."""
    spans = []
    for rid in drill.records:
        at = {s["step"]: s["at"] for s in drill.steps_of(rid)}
        if first in at and last in at:
            spans.append(at[last] - at[first])
    return (last - first) / statistics.median(spans) if spans else float("nan")


def _spread(values: list[float]) -> dict:
    if not values:
        return {}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", default="drive", choices=("drive", "agent", "worker"))
    parser.add_argument("--dir", help="the log folder (drive: a fresh temporary one unless given)")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--layout", help="ranks per host, e.g. 2,1 (instead of --hosts x --per-host)")
    parser.add_argument("--host", type=int, default=0)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--failures", type=int, default=8)
    parser.add_argument("--steps", type=int, default=0, help="end at this step (0: after the last failure)")
    parser.add_argument("--gap", type=int, default=10, help="steps the whole group trains between failures")
    parser.add_argument("--step-s", type=float, default=0.05, help="the compute a step stands for (a sleep)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-timeout", type=float, default=GROUP_TIMEOUT_S,
                        help="the process group's timeout, seconds (torch's default unless given)")
    parser.add_argument("--cycle", action="store_true", help="the kinds in turn instead of at random")
    parser.add_argument("--kinds", default=",".join(KINDS), help="the failures to draw from")
    parser.add_argument("--no-replace", action="store_true", help="no replacements: the group only shrinks")
    parser.add_argument("--window", help="FROM,TO: report the steps per second between these steps")
    parser.add_argument("--out", help="write OUT.json")
    parser.add_argument("--ddp", action="store_true", help="train a DistributedDataParallel of the model")
    parser.add_argument("--compiled", action="store_true",
                        help="train the model smddp_lite.compile makes (bfloat16 wire, fused AdamW)")
    parser.add_argument("--hog", type=int, default=0, help="busy processes beside the job (a core each)")
    parser.add_argument("--launcher", choices=("smddp", "agent"), default="smddp",
                        help="who starts the ranks and their replacements: python -m smddp_lite.launch on each "
                             "host (the store apart, on host 0), or the drill's own agent (any --layout)")
    args = parser.parse_args()
    if args.role == "worker":
        return worker(args)
    if args.role == "agent":
        return agent(args)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="smddp-drill-") as tmp:
        args.dir = args.dir or tmp
        results = drive(args)
    print(json.dumps(results["summary"], indent=1))
    print(json.dumps({k: results.get(k) for k in ("steps", "steps_with_differing_parameters", "unplanned_losses",
                                                  "held_out_loss",
                                                  "processes_left", "shm_left", "seconds", "steps_per_s")}))
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
