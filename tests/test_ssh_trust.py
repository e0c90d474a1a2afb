"""docker/ssh_trust.py, the image's ssh trust for one SageMaker job, against a real sshd.

Three simulated hosts (benchmarks/multinode/cluster.py: network namespaces on one bridge, each
with its own hostname and hosts file): algo-1 and algo-2, the job's (resourceconfig.json), and a
stranger on the same bridge. ssh_trust.py runs for algo-1 with its files in a temporary folder,
and Debian's own sshd runs in algo-1's namespace on port 22 with Debian's sshd_config, whose
Include is pointed at the generated snippet (and, test-only, the generated authorized_keys, a pid
file and no StrictModes, since /tmp is world-writable). Then the job's key logs in from algo-2,
the same key is refused from the stranger, which reaches port 22 all the same, and the host key
algo-1 shows is the one just made. Without Docker; the image itself runs it from its entry point,
which the last tests run as PID 1 with /etc/ssh and /root bound to temporary folders.

Needs root (namespaces) and OpenSSH's server (Debian: ``apt-get install openssh-server``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SSH_TRUST = ROOT / "docker" / "ssh_trust.py"
ENTRYPOINT = ROOT / "docker" / "entrypoint.py"
SSHD = "/usr/sbin/sshd"
DEADLINE_S = 120  # for any one step; generous for a loaded machine

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the simulated hosts need root (network namespaces)")
needs_keygen = pytest.mark.skipif(shutil.which("ssh-keygen") is None,
                                  reason="needs OpenSSH's ssh-keygen: apt-get install openssh-client")
needs_sshd = pytest.mark.skipif(
    not (os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("ssh-keygen") and shutil.which("ssh-keyscan")),
    reason=f"needs OpenSSH's server and client ({SSHD}, ssh, ssh-keygen, ssh-keyscan): "
           "apt-get install openssh-server openssh-client")


@pytest.fixture
def ssh_trust():
    spec = importlib.util.spec_from_file_location("ssh_trust_under_test", SSH_TRUST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resourceconfig(folder: Path, hosts: list[str], current: str) -> Path:
    path = folder / "input" / "config" / "resourceconfig.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"current_host": current, "hosts": hosts, "network_interface_name": "eth0"}))
    return path


def _job_key(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    key = folder / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=DEADLINE_S)
    return key


# --- without sshd ------------------------------------------------------------------------------

@needs_keygen
def test_the_trust_names_the_jobs_addresses_only(ssh_trust, tmp_path):
    config = _resourceconfig(tmp_path / "opt_ml", ["algo-1", "algo-2"], "algo-1")
    key = _job_key(tmp_path / "key")
    names = {"algo-1": ["10.0.0.1"], "algo-2": ["10.0.0.2", "fd00::2"]}
    made = ssh_trust.setup(str(config), str(tmp_path / "etc_ssh"), str(tmp_path / "etc_ssh" / "sshd_config.d"),
                           str(tmp_path / "root_ssh"), str(key) + ".pub", 5, resolve=lambda h: names[h])
    assert made["addresses"] == ["10.0.0.1", "10.0.0.2", "fd00::2"]
    authorized = Path(made["authorized_keys"]).read_text()
    assert authorized.startswith('from="10.0.0.1,10.0.0.2,fd00::2",no-agent-forwarding,')
    assert authorized.count("\n") == 1 and (key.with_suffix(".pub")).read_text().strip() in authorized
    assert oct(os.stat(made["authorized_keys"]).st_mode & 0o777) == "0o600"
    snippet = Path(made["sshd_snippet"]).read_text()
    assert "AllowUsers root@10.0.0.1 root@10.0.0.2 root@fd00::2\n" in snippet
    assert "PasswordAuthentication no\n" in snippet and f"HostKey {made['host_key']}\n" in snippet
    client = Path(made["client_hosts"]).read_text()
    assert "Host algo-1 algo-2 10.0.0.1 10.0.0.2 fd00::2\n" in client and "Host *" not in client
    first = Path(made["host_key"] + ".pub").read_text()
    again = ssh_trust.setup(str(config), str(tmp_path / "etc_ssh"), str(tmp_path / "etc_ssh" / "sshd_config.d"),
                            str(tmp_path / "root_ssh"), str(key) + ".pub", 5, resolve=lambda h: names[h])
    assert Path(again["host_key"] + ".pub").read_text() != first, "a host key is made anew at each start"


@needs_keygen
def test_a_name_that_never_resolves_fails_and_writes_nothing(ssh_trust, tmp_path):
    config = _resourceconfig(tmp_path / "opt_ml", ["algo-1", "algo-2"], "algo-1")
    key = _job_key(tmp_path / "key")

    def resolve(host):
        if host == "algo-2":
            raise OSError("Name or service not known")
        return ["10.0.0.1"]

    start = time.monotonic()
    with pytest.raises(ssh_trust.TrustError) as raised:
        ssh_trust.setup(str(config), str(tmp_path / "etc_ssh"), str(tmp_path / "etc_ssh" / "sshd_config.d"),
                        str(tmp_path / "root_ssh"), str(key) + ".pub", 1.0, resolve=resolve)
    assert time.monotonic() - start < 30
    message = str(raised.value)
    assert "algo-2: Name or service not known" in message and "within 1 s" in message, message
    assert "SSH_TRUST_DNS_WAIT_S" in message
    assert not (tmp_path / "etc_ssh").exists() and not (tmp_path / "root_ssh").exists()


def test_a_broken_resourceconfig_is_refused_clearly(ssh_trust, tmp_path):
    config = _resourceconfig(tmp_path / "opt_ml", ["algo-1", "algo 2; evil"], "algo-1")
    with pytest.raises(ssh_trust.TrustError, match="expected host names of letters"):
        ssh_trust.setup(str(config), str(tmp_path / "k"), str(tmp_path / "d"), str(tmp_path / "s"),
                        str(tmp_path / "none.pub"), 1, resolve=lambda h: ["10.0.0.1"])
    config.write_text("{not json")
    with pytest.raises(ssh_trust.TrustError, match="unreadable"):
        ssh_trust.setup(str(config), str(tmp_path / "k"), str(tmp_path / "d"), str(tmp_path / "s"),
                        str(tmp_path / "none.pub"), 1)


# --- a real sshd on simulated hosts -----------------------------------------------------------

def _debian_sshd_config(snippet_dir: Path, into: Path) -> Path:
    """/etc/ssh/sshd_config as the package ships it, its Include pointed at ``snippet_dir``."""
    text = Path("/etc/ssh/sshd_config").read_text()
    include = "Include /etc/ssh/sshd_config.d/*.conf"
    assert include in text, "Debian's sshd_config includes /etc/ssh/sshd_config.d; the image relies on it"
    into.write_text(text.replace(include, f"Include {snippet_dir}/*.conf"))
    return into


def _privilege_separation_dir() -> None:
    """sshd's empty folder (Debian's service makes it when it starts; on a machine where the
    service never ran, it is missing and sshd, even ``sshd -T``, refuses to run)."""
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)


def _on(cluster, host: int, argv: list[str], timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    proc = cluster.spawn(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate(timeout=30)
        return subprocess.CompletedProcess(argv, -9, out, err + f"\n(killed after {timeout:.0f} s)")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@needs_root
@needs_sshd
def test_the_jobs_key_logs_in_from_the_job_and_is_refused_from_a_stranger(tmp_path):
    from benchmarks.multinode.cluster import SimCluster

    config = _resourceconfig(tmp_path / "opt_ml", ["algo-1", "algo-2"], "algo-1")
    key = _job_key(tmp_path / "key")
    etc_ssh, root_ssh = tmp_path / "etc_ssh", tmp_path / "root_ssh"
    snippets = etc_ssh / "sshd_config.d"
    sshd_log = tmp_path / "sshd.log"
    with SimCluster(3, rate="", names=["algo-1", "algo-2", "stranger"]) as cluster:
        job, stranger_address = cluster.addresses[:2], cluster.addresses[2]
        made = _on(cluster, 0, [sys.executable, str(SSH_TRUST), "--config", str(config), "--host-key-dir", str(etc_ssh),
                                "--sshd-config-dir", str(snippets), "--ssh-dir", str(root_ssh),
                                "--public-key", f"{key}.pub", "--dns-wait-s", "60"])
        assert made.returncode == 0, made.stderr
        authorized = (root_ssh / "authorized_keys").read_text()
        assert authorized.startswith(f'from="{job[0]},{job[1]}",'), authorized
        assert stranger_address not in authorized

        sshd_config = _debian_sshd_config(snippets, tmp_path / "sshd_config")
        _privilege_separation_dir()
        effective = subprocess.run([SSHD, "-T", "-f", str(sshd_config), "-C", "user=root,host=x,addr=" + job[1]],
                                   capture_output=True, text=True, timeout=DEADLINE_S)
        assert effective.returncode == 0, effective.stderr
        settings = effective.stdout.splitlines()
        assert f"hostkey {etc_ssh}/ssh_host_ed25519_key" in settings and "passwordauthentication no" in settings
        assert f"allowusers root@{job[0]}" in settings and f"allowusers root@{job[1]}" in settings
        assert not any(s.startswith("hostkey ") and "ed25519" not in s for s in settings), "only the fresh host key"

        # the server: Debian's sshd and its config with the snippet, on port 22 of algo-1;
        # StrictModes off only because the test's files lie under the world-writable /tmp
        with open(sshd_log, "w") as log:
            cluster.spawn(0, ["sh", "-c", f"exec {SSHD} -D -e -f {sshd_config} -p 22 "
                                          f"-o PidFile={tmp_path}/sshd.pid -o StrictModes=no "
                                          f"-o AuthorizedKeysFile={root_ssh}/authorized_keys"],
                          stdout=log, stderr=subprocess.STDOUT)
        host_key = (etc_ssh / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        scanned, deadline = None, time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:  # until sshd listens
            scanned = _on(cluster, 1, ["ssh-keyscan", "-T", "10", "-t", "ed25519", "-p", "22", "algo-1"])
            if scanned.stdout.strip():
                break
            time.sleep(0.5)
        shown = lambda: f"\n--- sshd ---\n{sshd_log.read_text()[-3000:]}"  # noqa: E731
        assert scanned is not None and scanned.stdout.strip(), f"sshd never answered: {scanned}" + shown()
        assert scanned.stdout.split()[1:3] == host_key, "algo-1 shows the host key made at its start" + shown()
        machines = Path("/etc/ssh/ssh_host_ed25519_key.pub")
        assert not machines.exists() or host_key[1] not in machines.read_text(), "not the machine's own key"

        # the client: the generated block is all the config it has (BatchMode: an unknown host key
        # would fail here unless the block turns checking off for the job's hosts)
        client_config = tmp_path / "ssh_config"
        client_config.write_text(f"Include {root_ssh}/smddp_job_hosts\n")
        ssh = ["ssh", "-F", str(client_config), "-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
               "-o", "ConnectTimeout=30", "-p", "22"]
        inside = _on(cluster, 1, [*ssh, "root@algo-1", "hostname"])
        assert inside.returncode == 0 and inside.stdout.strip() == "algo-1", f"{inside}" + shown()

        checked = subprocess.run(["ssh", "-G", "-F", str(client_config), "stranger"], capture_output=True, text=True,
                                 timeout=DEADLINE_S)
        assert "stricthostkeychecking ask" in checked.stdout.splitlines(), "other hosts' keys stay checked"

        # the stranger: reaches port 22 (it reads the host key) but the same key is refused
        reached = _on(cluster, 2, ["ssh-keyscan", "-T", "10", "-t", "ed25519", "-p", "22", "algo-1"])
        assert reached.stdout.split()[1:3] == host_key, f"the stranger reaches sshd: {reached}" + shown()
        refused = _on(cluster, 2, [*ssh, "root@algo-1", "hostname"])
        assert refused.returncode == 255 and "Permission denied" in refused.stderr, f"{refused}" + shown()
        assert refused.stdout == ""
        why = f"User root from {stranger_address} not allowed because not listed in AllowUsers"
        deadline = time.monotonic() + DEADLINE_S  # sshd's monitor writes its children's log lines
        while why not in sshd_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert why in sshd_log.read_text(), shown()


@needs_root
@needs_sshd
def test_the_key_line_alone_refuses_a_stranger(ssh_trust, tmp_path):
    """authorized_keys' from= holds even where sshd's AllowUsers would let root in from anywhere."""
    from benchmarks.multinode.cluster import SimCluster

    key = _job_key(tmp_path / "key")
    with SimCluster(3, rate="", names=["algo-1", "algo-2", "stranger"]) as cluster:
        keys = tmp_path / "authorized_keys"
        keys.write_text(ssh_trust.authorized_keys_text(Path(f"{key}.pub").read_text(), cluster.addresses[:2]))
        keys.chmod(0o600)
        host_key = ssh_trust.make_host_key(str(tmp_path / "etc_ssh"), "algo-1")
        _privilege_separation_dir()
        sshd_log = tmp_path / "sshd.log"
        with open(sshd_log, "w") as log:
            cluster.spawn(0, ["sh", "-c", f"exec {SSHD} -D -e -f /dev/null -p 22 "
                                          f"-h {host_key} -o PidFile={tmp_path}/sshd.pid -o StrictModes=no "
                                          f"-o AuthorizedKeysFile={keys} -o PasswordAuthentication=no "
                                          "-o KbdInteractiveAuthentication=no -o UsePAM=no"],
                          stdout=log, stderr=subprocess.STDOUT)
        ssh = ["ssh", "-F", "/dev/null", "-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
               "-o", "ConnectTimeout=30", "-o", "StrictHostKeyChecking=no",
               "-o", f"UserKnownHostsFile={tmp_path}/known_hosts", "-p", "22"]
        deadline, inside = time.monotonic() + DEADLINE_S, None
        while time.monotonic() < deadline:  # until sshd listens
            inside = _on(cluster, 1, [*ssh, f"root@{cluster.addresses[0]}", "true"])
            if inside.returncode == 0 or "Connection refused" not in inside.stderr:
                break
            time.sleep(0.5)
        shown = f"\n--- sshd ---\n{sshd_log.read_text()[-3000:]}"
        assert inside is not None and inside.returncode == 0, f"{inside}{shown}"
        refused = _on(cluster, 2, [*ssh, f"root@{cluster.addresses[0]}", "true"])
        assert refused.returncode == 255 and "Permission denied" in refused.stderr, \
            f"{refused}\n--- sshd ---\n{sshd_log.read_text()[-3000:]}"


# --- the entry point ---------------------------------------------------------------------------

def _entrypoint_as_pid_1(tmp_path: Path, hosts_file: str) -> list[str]:
    """docker/entrypoint.py as PID 1 of a PID and mount namespace of its own, in which /etc/ssh,
    /root and /etc/hosts are this test's folders and file: nothing of the machine's is written."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare")
    for folder in ("etc_ssh", "root"):
        (tmp_path / folder).mkdir(exist_ok=True)
    # what the run needs from under /root (python, its venv, this checkout) is bound into the new one
    needed = map(os.path.realpath, (sys.base_prefix, sys.prefix, str(ROOT)))
    keep = sorted({p for p in needed if p.startswith("/root/")})
    binds = []
    for path in keep:
        inner = tmp_path / "root" / os.path.relpath(path, "/root")
        inner.mkdir(parents=True, exist_ok=True)
        binds.append(f"mount --bind {path} {inner} && ")
    script = (f"{''.join(binds)}mount --bind {tmp_path}/etc_ssh /etc/ssh && mount --rbind {tmp_path}/root /root && "
              f"mount --bind {hosts_file} /etc/hosts && exec {sys.executable} {ENTRYPOINT} train")
    return ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", script]


def _entrypoint_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    train = bin_dir / "train"  # shows what the container's ssh holds when `train` starts
    train.write_text("#!/bin/sh\ncat /root/.ssh/authorized_keys /etc/ssh/sshd_config.d/*.conf\n")
    train.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMDDP_", "SAGEMAKER_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SAGEMAKER_BASE_DIR=str(tmp_path / "opt_ml"),
               SSH_TRUST_DNS_WAIT_S="2")
    return env


@needs_root
def _entrypoint_of_job(tmp_path, hosts_file: str) -> subprocess.CompletedProcess:
    """The entry point as PID 1 of a job of algo-1 and algo-2 whose names resolve as ``hosts_file``
    says, root holding the job's key; what it and its `train` printed."""
    _resourceconfig(tmp_path / "opt_ml", ["algo-1", "algo-2"], "algo-1")
    hosts = tmp_path / "hosts"
    hosts.write_text(hosts_file)
    command = _entrypoint_as_pid_1(tmp_path, str(hosts))
    (tmp_path / "root" / ".ssh").mkdir()
    _job_key(tmp_path / "root" / ".ssh")
    (tmp_path / "root" / ".ssh" / "id_ed25519.pub").rename(tmp_path / "root" / ".ssh" / "id_rsa.pub")
    return subprocess.run(command, env=_entrypoint_env(tmp_path), capture_output=True, text=True, timeout=DEADLINE_S)


@needs_keygen
def test_the_entrypoint_makes_the_trust_before_train(tmp_path):
    done = _entrypoint_of_job(tmp_path, "127.0.0.1 localhost\n10.9.8.1 algo-1\n10.9.8.2 algo-2\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith('from="10.9.8.1,10.9.8.2",'), done.stdout
    assert "AllowUsers root@10.9.8.1 root@10.9.8.2" in done.stdout
    assert (tmp_path / "etc_ssh" / "ssh_host_ed25519_key").exists()


@needs_root
@needs_keygen
def test_the_entrypoint_stops_before_train_when_a_host_never_resolves(tmp_path):
    done = _entrypoint_of_job(tmp_path, "127.0.0.1 localhost\n10.9.8.1 algo-1\n")  # no algo-2 (nor in DNS)
    assert done.returncode == 1, done.stderr
    assert done.stdout == "", "train never started"
    assert "cannot limit ssh to the job's hosts" in done.stderr and "algo-2" in done.stderr, done.stderr
    assert "SSH_TRUST_DNS_WAIT_S" in (tmp_path / "opt_ml" / "output" / "failure").read_text()
    assert not (tmp_path / "root" / ".ssh" / "authorized_keys").exists()
    assert list((tmp_path / "etc_ssh").iterdir()) == []
