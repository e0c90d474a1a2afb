#!/usr/bin/env python3
"""Runs the image as SageMaker runs a training job, on this machine: SageMaker local mode's layout.

Each instance is a container named after its host (algo-1, algo-2, ...) on an internal network
of the job's own, started with the command ``train`` as SageMaker starts it, with ``/opt/ml``
laid out per instance as SageMaker lays it out:
- ``input/config/resourceconfig.json`` (current_host, hosts, instance groups, network interface);
- ``input/config/hyperparameters.json``, each value a JSON string, the distribution's switches and
  ``sagemaker_program``/``sagemaker_submit_directory`` among them;
- ``input/config/inputdataconfig.json`` and a "training" channel under ``input/data``;
- the script (smddp_lite/examples/sagemaker_train.py) under ``/opt/ml/code``;
- ``model/`` and ``output/`` of its own.
SageMaker stops a job's other instances once one fails (as local mode's compose does with
``--abort-on-container-exit``); this waits for them to end by themselves instead, and stops them
only once the case's time limit has passed twice over.

    python3 docker/sagemaker_local.py --image smddp-lite:cpu               # every case
    python3 docker/sagemaker_local.py --image smddp-lite:cpu torch_distributed:train smdistributed:stop-algo-1

A case is DISTRIBUTION:WHAT, DISTRIBUTION torch_distributed or smdistributed, WHAT one of:
- train: both containers exit 0, the model is in algo-1's /opt/ml/model, the logs show every
  rank on backend "smddp", the loss went down;
- fail: the last rank raises at its first step; its error is in an /opt/ml/output/failure, and
  every container exits non-zero within 60 s of it;
- stop-algo-N: SIGTERM to that container mid-training (StopTrainingJob); every container has
  ended within 30 s, and none is left running;
- stranger (smdistributed only: its runner starts sshd): while the job trains, algo-2 logs in to
  algo-1 over ssh with root's key, and a third container of the same image on the job's network,
  which holds the same key, reaches algo-1's port 22 (it reads a host key) and is refused.
Prints a line per case and a JSON summary at the end; exits 1 if any case failed. Needs a
Docker engine and the built image (docs/docker.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "smddp_lite", "examples", "sagemaker_train.py")
DISTRIBUTIONS = {
    # the hyperparameters the SageMaker Python SDK adds for each estimator `distribution`
    "torch_distributed": {"sagemaker_torch_distributed_enabled": True},
    "smdistributed": {"sagemaker_distributed_dataparallel_enabled": True,
                      "sagemaker_distributed_dataparallel_custom_mpi_options": "",
                      "sagemaker_instance_type": "local"},
}
FAIL_WITHIN_S, STOP_WITHIN_S = 60.0, 30.0
RANK_LINE = re.compile(r"rank (\d+)/(\d+) on (\S+): backend (\w+)")


def docker(*args: str, check: bool = True) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def when(stamp: str) -> float:
    """Docker's RFC 3339 time (nanoseconds, Z) as a POSIX time."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return dt.datetime.fromisoformat(whole).replace(tzinfo=dt.timezone.utc).timestamp() + float(f"0.{fraction or 0}")


def lay_out_instance(base: str, host: str, hosts: list[str], hyperparameters: dict, data: str) -> None:
    """One instance's /opt/ml under ``base``, as SageMaker lays it out: its config files, the
    "training" channel (a copy of ``data``), and empty model/ and output/ folders."""
    config = os.path.join(base, "input", "config")
    os.makedirs(config)
    group = {"instance_group_name": "homogeneousCluster", "instance_type": "local", "hosts": hosts}
    resources = {"current_host": host, "current_instance_type": "local", "current_group_name": "homogeneousCluster",
                 "hosts": hosts, "instance_groups": [group], "network_interface_name": "eth0"}
    channels = {"training": {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
                             "RecordWrapperType": "None"}}
    for filename, content in (("resourceconfig.json", resources),
                              ("hyperparameters.json", {k: json.dumps(v) for k, v in hyperparameters.items()}),
                              ("inputdataconfig.json", channels)):
        with open(os.path.join(config, filename), "w") as f:
            json.dump(content, f)
    shutil.copytree(data, os.path.join(base, "input", "data", "training"))
    for folder in ("model", "output"):
        os.makedirs(os.path.join(base, folder))


def job_hyperparameters(distribution: str, name: str, per_host: int, submit_directory: str, **script) -> dict:
    """What SageMaker's SDK puts in a job's hyperparameters for the distribution, with the
    script's own (``script``)."""
    return {"sagemaker_program": os.path.basename(SCRIPT), "sagemaker_submit_directory": submit_directory,
            "sagemaker_container_log_level": 20, "sagemaker_job_name": name, "sagemaker_region": "us-west-2",
            "sagemaker_mpi_num_of_processes_per_host": per_host, **DISTRIBUTIONS[distribution], **script}


class Job:
    """One training job: its folders, network and containers, removed by ``close``."""

    def __init__(self, image: str, distribution: str, hosts: int, per_host: int, root: str, name: str,
                 hyperparameters: dict) -> None:
        self.image, self.root, self.name = image, root, name
        self.hosts = [f"algo-{i + 1}" for i in range(hosts)]
        self.network = f"{name}-net"
        self.containers = {host: f"{name}-{host}" for host in self.hosts}
        self.hyperparameters = job_hyperparameters(distribution, name, per_host, "/opt/ml/code", **hyperparameters)

    def lay_out(self, data: str) -> None:
        code = os.path.join(self.root, "code")
        os.makedirs(code)
        shutil.copy(SCRIPT, code)
        for host in self.hosts:
            lay_out_instance(os.path.join(self.root, host), host, self.hosts, self.hyperparameters, data)

    def start(self) -> float:
        docker("network", "create", "--internal", self.network)
        started = time.time()
        for host in self.hosts:
            base = os.path.join(self.root, host)
            docker("run", "-d", "--name", self.containers[host], "--hostname", host, "--network", self.network,
                   "--network-alias", host, "--shm-size", "1g", "-e", "AWS_REGION=us-west-2",
                   "-e", f"TRAINING_JOB_NAME={self.name}",
                   "-v", f"{base}/input:/opt/ml/input", "-v", f"{base}/output:/opt/ml/output",
                   "-v", f"{base}/model:/opt/ml/model", "-v", f"{self.root}/code:/opt/ml/code",
                   self.image, "train")
        return started

    def state(self, host: str) -> dict:
        return json.loads(docker("inspect", "--format", "{{json .State}}", self.containers[host]))

    def wait(self, timeout: float, on_poll=None, after_failure_s: float = 2 * FAIL_WITHIN_S
             ) -> tuple[dict[str, dict], list[str]]:
        """Until every container has exited, or ``timeout``: their final states, and the
        containers this had to stop. Once one exits non-zero the others get ``after_failure_s``
        to end by themselves (SageMaker would stop them at once: the checks are stricter), then
        are stopped. ``on_poll`` may return a new, earlier deadline (a time.monotonic())."""
        deadline, stopped = time.monotonic() + timeout, []
        while True:
            states = {host: self.state(host) for host in self.hosts}
            running = [h for h, s in states.items() if s["Running"]]
            if not running:
                return states, stopped
            if on_poll is not None:
                deadline = min(deadline, on_poll() or deadline)
            if any(not s["Running"] and s["ExitCode"] != 0 for s in states.values()):
                deadline = min(deadline, time.monotonic() + after_failure_s)
            if time.monotonic() > deadline and not stopped:
                stopped = running
                for host in running:
                    docker("stop", "-t", "10", self.containers[host], check=False)
            time.sleep(0.5)

    def logs(self, host: str) -> str:
        done = subprocess.run(["docker", "logs", "--timestamps", self.containers[host]], capture_output=True,
                              text=True)
        return done.stdout + done.stderr

    def close(self) -> None:
        for container in self.containers.values():
            docker("rm", "-f", container, check=False)
        docker("network", "rm", self.network, check=False)


def stamped(log: str, pattern: str) -> float | None:
    """The time of the first log line matching ``pattern``."""
    for line in log.splitlines():
        stamp, _, text = line.partition(" ")
        if re.search(pattern, text):
            return when(stamp)
    return None


def probe_ssh(job: Job) -> dict:
    """Logs in to algo-1 with root's key (which every container of the image holds) from algo-2,
    and from a third container of the image on the job's network: the first gets in, the second
    reaches port 22 and is refused. Strict host key checking is off in the stranger's try so that
    the refusal shown is sshd's, not the client's."""
    ssh = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=20", "-o", "StrictHostKeyChecking=no",
           "-o", "UserKnownHostsFile=/dev/null", "root@algo-1", "hostname"]
    stranger = f"{job.name}-stranger"
    outcome: dict = {"problems": []}
    try:
        inside = subprocess.run(["docker", "exec", job.containers["algo-2"], *ssh], capture_output=True, text=True,
                                timeout=60)
        outcome["from_algo_2"] = {"exit": inside.returncode, "stdout": inside.stdout.strip(),
                                  "stderr": inside.stderr.strip()[-300:]}
        if inside.returncode != 0 or inside.stdout.strip() != "algo-1":
            outcome["problems"].append(f"algo-2 could not log in to algo-1: {outcome['from_algo_2']}")
        # no resourceconfig.json: the entry point sets up no trust and just runs the command
        docker("run", "-d", "--name", stranger, "--hostname", "stranger", "--network", job.network, job.image,
               "sleep", "300")
        scan = subprocess.run(["docker", "exec", stranger, "ssh-keyscan", "-T", "10", "-t", "ed25519", "algo-1"],
                              capture_output=True, text=True, timeout=60)
        outcome["stranger_reads_host_key"] = bool(scan.stdout.strip())
        if not scan.stdout.strip():
            outcome["problems"].append(f"the stranger did not reach algo-1's sshd, so its refusal shows nothing: "
                                       f"{scan.stderr.strip()[-300:]}")
        refused = subprocess.run(["docker", "exec", stranger, *ssh], capture_output=True, text=True, timeout=60)
        outcome["from_stranger"] = {"exit": refused.returncode, "stdout": refused.stdout.strip(),
                                    "stderr": refused.stderr.strip()[-300:]}
        if refused.returncode != 255 or "Permission denied" not in refused.stderr or refused.stdout:
            outcome["problems"].append(f"the stranger was not refused by sshd: {outcome['from_stranger']}")
    finally:
        docker("rm", "-f", stranger, check=False)
    return outcome


def run_case(case: str, args, data: str) -> dict:
    distribution, what = case.split(":")
    world = args.hosts * args.per_host
    hyper = {"epochs": 400 if what.startswith("stop-") or what == "stranger" else args.epochs}
    if what == "fail":
        hyper["fail-on-rank"] = world - 1
    root = tempfile.mkdtemp(prefix="smddp-sagemaker-")
    job = Job(args.image, distribution, args.hosts, args.per_host, root,
              f"smddp-sm-{os.getpid()}-{distribution.replace('_', '-')}-{what}", hyper)
    result = {"case": case, "problems": []}
    problems = result["problems"]
    try:
        job.lay_out(data)
        started = job.start()
        stop_sent: list[float] = []
        target = what[len("stop-"):] if what.startswith("stop-") else None

        def stop_when_training() -> float | None:
            if (target or what == "stranger") and not stop_sent and "epoch 1/" in job.logs("algo-1"):
                if what == "stranger":  # sshd runs in both while they train; then SageMaker's stop
                    result["ssh"] = probe_ssh(job)
                stop_sent.append(time.time())
                for host in [target] if target else job.hosts:
                    docker("kill", "--signal", "TERM", job.containers[host])
                return time.monotonic() + 2 * STOP_WITHIN_S  # then the harness stops what is left
            return None

        states, stopped = job.wait(args.timeout, stop_when_training)
        result["stopped_by_the_harness"] = stopped
        logs = {host: job.logs(host) for host in job.hosts}
        ended = {host: when(s["FinishedAt"]) for host, s in states.items()}
        codes = {host: s["ExitCode"] for host, s in states.items()}
        result.update(exit_codes=codes, seconds_from_start={h: round(t - started, 1) for h, t in ended.items()})
        everything = "\n".join(logs.values())
        ranks = {(int(r), host, backend) for r, w, host, backend in RANK_LINE.findall(everything) if int(w) == world}
        result["ranks"] = sorted(ranks)
        transport = re.search(r"group 0 \(.*?\) uses transport [^\n]*", everything)
        result["transport"] = transport.group(0) if transport else None
        if what == "train":
            if any(codes.values()):
                problems.append(f"exit codes {codes}, expected 0 everywhere")
            if not os.path.exists(os.path.join(root, "algo-1", "model", "model.pt")):
                problems.append("no model.pt in algo-1's /opt/ml/model")
            if sorted(r for r, _, backend in ranks if backend == "smddp") != list(range(world)):
                problems.append(f"the logs show ranks {sorted(ranks)}, expected {world} ranks on backend smddp")
            if len({host for _, host, _ in ranks}) != args.hosts:
                problems.append(f"the ranks ran on hosts {sorted({h for _, h, _ in ranks})}, expected {job.hosts}")
            verdict = re.search(r"done: loss ([\d.]+) -> ([\d.]+) \((went down|did NOT go down)\)", everything)
            result["loss"] = verdict.group(0) if verdict else None
            if not verdict or verdict.group(3) != "went down":
                problems.append(f"the loss did not go down: {result['loss']}")
        elif what == "fail":
            failed_at = min(filter(None, (stamped(log, "fails on purpose") for log in logs.values())), default=None)
            failures = {}
            for host in job.hosts:
                path = os.path.join(root, host, "output", "failure")
                if os.path.exists(path):
                    with open(path) as f:
                        failures[host] = f.read()
            result["failure_files"] = {h: text[-300:] for h, text in failures.items()}
            if not any("fails on purpose" in text for text in failures.values()):
                problems.append(f"no /opt/ml/output/failure holds the script's error (files: {sorted(failures)})")
            if not all(codes.values()):
                problems.append(f"exit codes {codes}, expected non-zero everywhere")
            if failed_at is None:
                problems.append("the failing rank's error is not in the logs")
            else:
                result["seconds_after_error"] = {h: round(t - failed_at, 1) for h, t in ended.items()}
                if max(ended.values()) - failed_at > FAIL_WITHIN_S:
                    problems.append(f"containers ended {result['seconds_after_error']} s after the error, "
                                    f"expected within {FAIL_WITHIN_S:g}")
        else:
            if what == "stranger" and "ssh" in result:
                problems.extend(result["ssh"].pop("problems"))
            if not stop_sent:
                problems.append("the job ended before its first epoch: nothing was stopped")
            else:
                result["seconds_after_sigterm"] = {h: round(t - stop_sent[0], 1) for h, t in ended.items()}
                if max(ended.values()) - stop_sent[0] > STOP_WITHIN_S:
                    problems.append(f"containers ended {result['seconds_after_sigterm']} s after SIGTERM, "
                                    f"expected within {STOP_WITHIN_S:g}")
            left = [h for h in job.hosts if job.state(h)["Running"]]
            if left:
                problems.append(f"still running: {left}")
        if stopped:
            problems.append(f"{stopped} did not end by themselves: the harness stopped them")
        if problems and args.show_logs:
            for host, log in logs.items():
                print(f"--- {case} {host} ---\n{log[-6000:]}", file=sys.stderr)
    finally:
        job.close()
        shutil.rmtree(root, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="DISTRIBUTION:WHAT (default: all)")
    parser.add_argument("--image", default="smddp-lite:cpu")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=2, help="processes per host (CPU instances)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a job may take")
    parser.add_argument("--show-logs", action="store_true", help="print a failed case's logs")
    args = parser.parse_args()
    cases = args.cases or [f"{d}:{w}" for d in DISTRIBUTIONS for w in ("train", "fail", "stop-algo-1", "stop-algo-2")]
    cases = cases if args.cases else cases + ["smdistributed:stranger"]
    for case in cases:
        distribution, _, what = case.partition(":")
        if distribution not in DISTRIBUTIONS or not re.fullmatch(r"train|fail|stop-algo-\d+|stranger", what):
            parser.error(f"case {case!r}: expected DISTRIBUTION:WHAT with DISTRIBUTION one of "
                         f"{', '.join(DISTRIBUTIONS)} and WHAT train, fail, stop-algo-N or stranger")
        if what == "stranger" and distribution != "smdistributed":
            parser.error(f"case {case!r}: only smdistributed's runner starts sshd; use smdistributed:stranger")
    data = tempfile.mkdtemp(prefix="smddp-sagemaker-data-")
    try:
        docker("run", "--rm", "-v", f"{data}:/data", args.image, "python", "-m",
               "smddp_lite.examples.sagemaker_train", "--make-data", "/data")
        results = []
        for case in cases:
            result = run_case(case, args, data)
            results.append(result)
            print(f"{'ok  ' if not result['problems'] else 'FAIL'} {case}: exit codes {result.get('exit_codes')}"
                  + "".join(f"; {p}" for p in result["problems"]), flush=True)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    print(json.dumps(results))
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
