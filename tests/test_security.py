"""What someone who can write into the rendezvous store can and cannot make a rank do
(docs/security.md): the store names the shared-memory segment, and a rank opens only a segment of
the shape rank 0 makes, so no store value redirects its writes to another file."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from smddp_lite.backend.errors import PeerFailureError, SegmentRefusedError
from smddp_lite.backend.transports import shm_segment
from smddp_lite.backend.transports.shm_segment import ShmSegment

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm (Linux)")

CHUNK = 4096
WORLD = 2


def _segment_size(world_size: int = WORLD, chunk: int = CHUNK) -> int:
    """The size rank 1 expects, made the way ShmSegment lays the segment out."""
    control = shm_segment._align(world_size * shm_segment.CONTROL_WORDS * 8)
    data = shm_segment._align(control + world_size * shm_segment.REASON_BYTES)
    return data + 2 * world_size * chunk


def _digest(path: Path) -> tuple[str, float]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def _victim(directory: Path, size: int) -> Path:
    """A file the rank must not write to: right size, this user's, mode 0600, known content."""
    path = directory / "victim.bin"
    path.write_bytes(bytes(range(256)) * (size // 256) + b"v" * (size % 256))
    path.chmod(0o600)
    return path


def _rank1_opens(published: str) -> Exception:
    """Rank 1 of 2 maps whatever the store says; returns what it raised."""
    store = dist.HashStore()
    store.set("shm/path", published)
    with pytest.raises(SegmentRefusedError) as raised:
        ShmSegment(store, 1, WORLD, CHUNK, timedelta(seconds=5))
    assert store.get(shm_segment._REFUSED_KEY).decode().startswith("rank 1: ")  # rank 0 hears of it
    return raised.value


@pytest.fixture
def shm_dir():
    """Names made in /dev/shm by the test, removed after it."""
    made: list[Path] = []
    yield made
    for path in made:
        path.unlink(missing_ok=True)


def _shm_name() -> Path:
    return Path(shm_segment.SHM_DIR) / shm_segment._segment_name()


def test_a_path_outside_dev_shm_is_refused_and_the_file_is_untouched(tmp_path):
    victim = _victim(tmp_path, _segment_size())
    before = _digest(victim)
    error = _rank1_opens(str(victim))
    assert str(victim) in str(error)
    assert f"expected /dev/shm/{shm_segment.SEGMENT_NAME_SHOWN}" in str(error)
    assert "[smddp rank 1/2" in str(error)
    assert _digest(victim) == before


@pytest.mark.parametrize("published", ["/dev/shm/../tmp/x", "/dev/shm/smddp-1-abc", "/dev/shm/other",
                                       "/dev/shm/sub/smddp-1-0123456789ab", "smddp-1-0123456789ab", ""])
def test_names_not_of_the_segment_pattern_are_refused(published):
    assert "expected /dev/shm/smddp-" in str(_rank1_opens(published))


def test_a_link_under_a_segment_name_is_not_followed(tmp_path, shm_dir):
    victim = _victim(tmp_path, _segment_size())
    before = _digest(victim)
    link = _shm_name()
    shm_dir.append(link)
    link.symlink_to(victim)
    assert "cannot be opened as a plain file" in str(_rank1_opens(str(link)))
    assert _digest(victim) == before


def test_a_hard_link_to_another_file_is_refused(shm_dir):
    victim = Path(shm_segment.SHM_DIR) / f"victim-{os.getpid()}"
    shm_dir.append(victim)
    victim.write_bytes(b"\x5a" * _segment_size())
    victim.chmod(0o600)
    before = _digest(victim)
    link = _shm_name()
    shm_dir.append(link)
    os.link(victim, link)
    assert "links 2 (expected 1)" in str(_rank1_opens(str(link)))
    assert _digest(victim) == before


@pytest.mark.parametrize("mode, size_delta, says", [(0o644, 0, "mode 0o644 (expected 0o600)"),
                                                     (0o600, 4096, "size"),
                                                     (0o600, -4096, "size")])
def test_a_file_of_another_mode_or_size_is_refused(shm_dir, mode, size_delta, says):
    planted = _shm_name()
    shm_dir.append(planted)
    planted.write_bytes(b"\x33" * (_segment_size() + size_delta))
    planted.chmod(mode)
    before = _digest(planted)
    assert says in str(_rank1_opens(str(planted)))
    assert _digest(planted) == before


def test_a_fifo_under_a_segment_name_is_refused_without_blocking(shm_dir):
    fifo = _shm_name()
    shm_dir.append(fifo)
    os.mkfifo(fifo, 0o600)
    assert "not a regular file" in str(_rank1_opens(str(fifo)))


def test_a_missing_segment_says_so():
    assert "does not exist" in str(_rank1_opens(str(_shm_name())))


def test_a_segment_gone_with_its_dead_maker_names_the_maker():
    """Rank 0 died after publishing its segment, and a sweep of segments whose maker died (any
    job's rank 0 makes one) removed the name before rank 1 opened it: rank 1 says rank 0 died,
    not that /dev/shm may not be shared."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(ended.stdout)
    name = f"smddp-{shm_segment._pid_namespace()}-{dead}-{'0' * 12}"
    store = dist.HashStore()
    store.set("shm/path", f"{shm_segment.SHM_DIR}/{name}")
    with pytest.raises(PeerFailureError, match=f"rank 0 \\(pid {dead}\\) died before this rank mapped"):
        ShmSegment(store, 1, WORLD, CHUNK, timedelta(seconds=5))


def _segments_of_this_process() -> set[Path]:
    """The segments this process made (their names hold its pid): other tests on the machine may
    make and remove segments of their own meanwhile."""
    return set(Path(shm_segment.SHM_DIR).glob(f"smddp-*-{os.getpid()}-*"))


def test_rank_0_stops_waiting_when_a_rank_refuses_and_leaves_nothing_in_dev_shm():
    """Rank 0 raises the refusal at once (not at the group timeout), and ranks that did map the
    segment see it broken with the same reason."""
    store = dist.HashStore()
    before = _segments_of_this_process()
    raised: list[BaseException] = []

    def rank0():
        try:
            ShmSegment(store, 0, 3, CHUNK, timedelta(seconds=60))
        except BaseException as exc:  # noqa: BLE001 - what rank 0 raised is the test's subject
            raised.append(exc)

    thread = threading.Thread(target=rank0)
    start = time.monotonic()
    thread.start()
    store.wait(["shm/path"])
    mm, _ = shm_segment._map_shared(store, 2, 3, _segment_size(3), 60)  # rank 2 maps the genuine segment
    store.set(shm_segment._REFUSED_KEY, "rank 1: refused the shared-memory segment path '/etc/passwd'")
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - start < 10
    (error,) = raised
    assert isinstance(error, SegmentRefusedError) and "/etc/passwd" in str(error)
    assert _segments_of_this_process() == before
    control = np.frombuffer(mm, dtype=np.int64, count=3 * shm_segment.CONTROL_WORDS).reshape(3, -1)
    assert control[0, shm_segment.BROKEN] == 1  # so rank 2's barrier raises rank 0's reason
    reason_at = shm_segment._align(3 * shm_segment.CONTROL_WORDS * 8)
    assert b"/etc/passwd" in mm[reason_at : reason_at + shm_segment.REASON_BYTES]
    del control
    mm.close()


def test_rank_0_removes_the_segment_when_a_rank_never_maps_it():
    store = dist.HashStore()
    before = _segments_of_this_process()
    with pytest.raises(PeerFailureError, match="rank 1 did not map the shared-memory segment within 1 s"):
        ShmSegment(store, 0, 2, CHUNK, timedelta(seconds=1))
    assert _segments_of_this_process() == before


def test_the_store_the_mpi_rendezvous_opens_listens_on_the_job_address_only():
    from smddp_lite.launch import open_store, store_address

    address = store_address(None, one_host=True)
    assert address == "127.0.0.1"
    store = open_store(address, 1, timedelta(seconds=10))
    assert _listening_addresses(store.port) == {"127.0.0.1"}  # torch's own TCPStore listens on 0.0.0.0
    store.set("k", "v")
    assert dist.TCPStore(address, store.port, 1, is_master=False, timeout=timedelta(seconds=10)).get("k") == b"v"


def test_a_job_across_hosts_refuses_a_store_address_other_hosts_cannot_reach():
    from smddp_lite.launch import store_address

    with pytest.raises(ValueError, match="resolves to the loopback address 127.0.0.1.*set MASTER_ADDR"):
        store_address("localhost", one_host=False)
    assert store_address("127.0.0.1", one_host=True) == "127.0.0.1"


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, _remote, state = line.split()[1:4]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    for line in Path("/proc/net/tcp6").read_text().splitlines()[1:] if Path("/proc/net/tcp6").exists() else []:
        local, _remote, state = line.split()[1:4]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            found.add("[" + address + "]")
    return found


def _dead_pid() -> int:
    """A pid no process has now: a child that ran and was reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_segments_whose_maker_died_are_removed_by_a_later_job_and_nothing_else(tmp_path, shm_dir):
    """A job killed before every rank mapped its segment leaves it; the next job's rank 0 removes
    it, and leaves alone every name it cannot prove dead or its own: a live maker, another pid
    namespace, a link (the file it points at stays too), another pattern."""
    namespace = shm_segment._pid_namespace()
    assert namespace != 0, "this machine's /proc shows no pid namespace"
    shm = Path(shm_segment.SHM_DIR)
    dead, alive_here = _dead_pid(), os.getpid()
    names = {"stale": f"smddp-{namespace}-{dead}-0123456789ab",
             "maker alive": f"smddp-{namespace}-{alive_here}-0123456789ab",
             "other namespace": f"smddp-{namespace + 1}-{dead}-0123456789ab",
             "link": f"smddp-{namespace}-{dead}-abcdef012345",
             "other pattern": f"smddp-{dead}-0123456789ab"}
    victim = _victim(tmp_path, 4096)
    before = _digest(victim)
    for what, name in names.items():
        path = shm / name
        shm_dir.append(path)
        if what == "link":
            path.symlink_to(victim)
        else:
            path.write_bytes(b"\0" * 4096)
            path.chmod(0o600)
    assert shm_segment.remove_stale_segments() == [names["stale"]]
    assert not (shm / names["stale"]).exists()
    for what in ("maker alive", "other namespace", "link", "other pattern"):
        assert os.path.lexists(shm / names[what]), what
    assert _digest(victim) == before


def test_a_new_job_sweeps_before_it_makes_its_segment(shm_dir):
    """Rank 0 sweeps when it makes a segment: a real ShmSegment of one rank removes a stale name."""
    stale = Path(shm_segment.SHM_DIR) / f"smddp-{shm_segment._pid_namespace()}-{_dead_pid()}-0123456789ab"
    shm_dir.append(stale)
    stale.write_bytes(b"\0" * 4096)
    stale.chmod(0o600)
    segment = ShmSegment(dist.HashStore(), 0, 1, CHUNK, timedelta(seconds=5))
    try:
        assert not stale.exists()
    finally:
        segment.close()
