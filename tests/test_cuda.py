"""CUDA tensors on "smddp": NCCL through cupy, the staged path, streams, errors, EFA reporting.

The first half needs no GPU and runs in CI: how the CUDA side is chosen and what it says when
cupy is missing, the NCCL unique-id and version encodings, the EFA/plugin report, the watchdog's
decisions, configuration. The second half (marked ``gpu``) runs real jobs on a CUDA device and
skips without one; the conformance suite's CUDA runs are in test_conformance.py.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from datetime import timedelta

import pytest
import torch

from smddp_lite.backend.cuda import CudaPaths
from smddp_lite.backend.cuda.communicators import decode_unique_id, encode_unique_id, nccl_version_string
from smddp_lite.backend.cuda.environment import find_net_plugin, network_report
from smddp_lite.backend.cuda.watchdog import Watchdog
from smddp_lite.backend.errors import PeerFailureError, ranks_said
from smddp_lite.config import backend_config

from . import harness

HAS_CUPY = importlib.util.find_spec("cupy") is not None
needs_cupy = pytest.mark.skipif(not HAS_CUPY, reason="needs cupy with NCCL: pip install -e '.[cuda12]'")


# --- no GPU needed ------------------------------------------------------------------------------

@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed here: the missing-cupy path cannot be shown")
def test_without_cupy_cuda_tensors_are_staged_with_advice():
    with pytest.warns(UserWarning, match=r"host memory.*pip install cupy-cuda12x nvidia-nccl-cu12"):
        paths = CudaPaths(None, 0, 1, timedelta(seconds=5), backend_config({}), lambda reason: None)
    assert paths.nccl is None and "cupy is not installed" in paths.reason


@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed here: the missing-cupy path cannot be shown")
def test_forcing_nccl_without_cupy_is_an_error_that_says_what_to_install():
    config = backend_config({"SMDDP_CUDA_TRANSPORT": "nccl"})
    with pytest.raises(ImportError, match=r"SMDDP_CUDA_TRANSPORT=nccl, but cupy is not installed.*cuda12"):
        CudaPaths(None, 0, 1, timedelta(seconds=5), config, lambda reason: None)


def test_staged_by_choice_needs_nothing_and_warns_nothing(recwarn):
    paths = CudaPaths(None, 0, 1, timedelta(seconds=5), backend_config({"SMDDP_CUDA_TRANSPORT": "staged"}),
                      lambda reason: None)
    assert paths.nccl is None and paths.staged.kind == "staged" and not recwarn.list


@pytest.mark.parametrize("world, without_nccl", [(2, [1]), (3, [0, 2])])
def test_ranks_that_load_nccl_and_ranks_that_cannot_are_told_on_every_rank(world, without_nccl):
    """Under SMDDP_CUDA_TRANSPORT=auto a host without cupy would stage through host memory while
    the others waited in NCCL: every rank raises, naming both sets of ranks and the reason, and
    again at the next CUDA call (at 2 ranks the store's counts alone would then agree)."""
    results = harness.values(harness.launch("tests.cuda_programs:cuda_paths_compared", world,
                                            without_nccl=without_nccl))
    loaded = [r for r in range(world) if r not in without_nccl]
    for rank, r in enumerate(results):
        assert r["type"] == "ValueError", (rank, r)
        for words in (f"SMDDP_CUDA_TRANSPORT=auto: NCCL (through cupy) loaded on {ranks_said(loaded)} but not on "
                      f"{ranks_said(without_nccl)} ({ranks_said(without_nccl[:1])}: cupy is not installed (test))",
                      "SMDDP_CUDA_TRANSPORT=staged on every rank", f"rank {rank}/{world}"):
            assert words in r["message"], (rank, r)
        assert r["again"]["type"] == "ValueError" and r["again"]["message"] == r["message"], (rank, r)
        assert r["usable_after"], (rank, r)


def test_ranks_that_agreed_agree_again_when_the_paths_are_made_again():
    """NCCL's set-up failing after the ranks agreed leaves the paths unmade, and the next CUDA
    call compares again: on fresh keys, not on counts that now add up to twice the world."""
    for rank, r in enumerate(harness.values(harness.launch("tests.cuda_programs:cuda_paths_compared", 2,
                                                           without_nccl=[]))):
        assert r["type"] is None and r["again"]["type"] is None, (rank, r)


@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed here: every rank would load NCCL")
@pytest.mark.parametrize("setting", ["auto", "nccl"])
def test_ranks_that_all_lack_nccl_agree_and_each_says_why(setting):
    """The comparison on the path every CI rank takes (no cupy anywhere): under auto every rank
    stages with the warning; under nccl every rank raises the ImportError saying what to install."""
    for rank, r in enumerate(harness.values(harness.launch("tests.cuda_programs:cuda_paths_compared", 2,
                                                           setting=setting))):
        if setting == "auto":
            assert r["type"] is None and r["staged"], (rank, r)
            assert any("host memory" in w and "cupy is not installed" in w for w in r["warnings"]), (rank, r)
        else:
            assert r["type"] == "ImportError" and "SMDDP_CUDA_TRANSPORT=nccl, but cupy is not installed" in r["message"]
        assert r["usable_after"], (rank, r)


def test_cuda_configuration_is_checked():
    assert backend_config({"SMDDP_BLOCKING_WAIT": "1"}).blocking_wait is True
    with pytest.raises(ValueError, match=r"SMDDP_CUDA_TRANSPORT='cupy'.*auto, nccl, staged"):
        backend_config({"SMDDP_CUDA_TRANSPORT": "cupy"})


@pytest.mark.parametrize("uid", [bytes(range(128)), tuple(range(-64, 64)), bytes([255, 0, 128] * 42 + [1, 2])])
def test_unique_id_survives_the_store(uid):
    back = decode_unique_id(encode_unique_id(uid), char_is_signed=True)
    assert back == uid and type(back) is type(uid)


def test_unique_id_tuple_comes_back_in_the_range_of_the_platforms_char():
    # cupy < 14 on an Arm host gives 0..255 (unsigned char) and its NcclCommunicator takes only that
    unsigned = tuple(range(128, 256))
    assert decode_unique_id(encode_unique_id(unsigned), char_is_signed=False) == unsigned
    assert decode_unique_id(encode_unique_id(unsigned), char_is_signed=True) == tuple(range(-128, 0))
    assert decode_unique_id(encode_unique_id(tuple(range(-128, 0))), char_is_signed=False) == unsigned


def test_nccl_versions_read_as_released():
    assert nccl_version_string(21903) == "2.19.3"
    assert nccl_version_string(23203) == "2.32.3"
    assert nccl_version_string(2804) == "2.8.4"  # before 2.9 NCCL counted major * 1000


def test_efa_host_without_plugin_gets_a_warning_that_says_what_to_set():
    lines, warnings = network_report("2.21.5", {"FI_PROVIDER": "efa"}, None, ["rdmap16s27"])
    assert "NCCL 2.21.5" in lines[0] and "none found" in lines[0]
    assert "rdmap16s27" in lines[1] and "FI_PROVIDER=efa" in lines[1]
    (warning,) = warnings
    for needed in ("aws-ofi-nccl", "FI_EFA_USE_DEVICE_RDMA=1", "NCCL_SOCKET_IFNAME", "LD_LIBRARY_PATH"):
        assert needed in warning


def test_efa_host_with_plugin_and_wrong_provider():
    _, warnings = network_report("2.21.5", {"FI_PROVIDER": "tcp"}, "/opt/amazon/ofi-nccl/lib/libnccl-net.so",
                                 ["rdmap0"])
    assert warnings == ["FI_PROVIDER=tcp on an EFA host; set FI_PROVIDER=efa"]
    assert network_report("2.21.5", {}, None, [])[1] == []  # no EFA: nothing to warn about


def test_plugin_is_found_on_ld_library_path_first():
    present = {"/custom/lib/libnccl-net.so", "/opt/amazon/ofi-nccl/lib/libnccl-net.so"}
    assert find_net_plugin({"LD_LIBRARY_PATH": "/custom/lib"}, present.__contains__) == "/custom/lib/libnccl-net.so"
    assert find_net_plugin({}, present.__contains__) == "/opt/amazon/ofi-nccl/lib/libnccl-net.so"
    assert find_net_plugin({"NCCL_NET_PLUGIN": "aws-ofi"}, {"/usr/local/lib/libnccl-net-aws-ofi.so"}.__contains__) \
        == "/usr/local/lib/libnccl-net-aws-ofi.so"
    assert find_net_plugin({}, lambda path: False) is None


class _InFlight:
    """A collective as the watchdog sees one (CudaWork's fields), without a device."""

    def __init__(self, describe: str, age_s: float, timeout_s: float, ended: bool = False) -> None:
        self.describe, self.timeout_s, self.error = describe, timeout_s, None
        self.device = -1  # torch.cuda.device(-1) changes nothing, on a machine without CUDA too
        self.started = time.monotonic() - age_s
        self._ended = ended
        self.released = False

    def ended(self) -> bool:
        return self._ended

    def release(self) -> None:
        self.released = True

    def fail(self, error: BaseException) -> None:
        self.error = error


def _watchdog(async_error: Exception | None = None):
    events = []

    def check() -> None:
        if async_error is not None:
            raise async_error

    dog = Watchdog("test", check, lambda: events.append("abort"), lambda reason: events.append(reason))
    dog.stop()  # drive it by hand, one poll at a time
    return dog, events


def test_watchdog_releases_ended_work_and_leaves_young_work_alone():
    dog, events = _watchdog()
    done, young = _InFlight("done", 0.0, 10, ended=True), _InFlight("young", 1.0, 10)
    dog.track(done)
    dog.track(young)
    dog.poll()
    assert dog.in_flight() == 1 and events == [] and young.error is None
    assert done.released and not young.released


class _Counted(_InFlight):
    """A collective that counts how often the watchdog asks whether it has ended."""

    asked = 0

    def ended(self) -> bool:
        _Counted.asked += 1
        return super().ended()


def test_watchdog_asks_the_newest_collective_first_and_releases_all_before_it():
    # one stream per device ends a group's collectives in launch order: the newest that has ended
    # vouches for the older ones, so a poll does not query thousands of events while the caller waits
    dog, events = _watchdog()
    _Counted.asked = 0
    for i in range(1000):
        dog.track(_Counted(f"old {i}", 0.0, 10, ended=True))
    young = [_Counted(f"young {i}", 0.0, 10) for i in range(3)]
    for work in young:
        dog.track(work)
    dog.poll()
    assert dog.in_flight() == 3 and events == [] and _Counted.asked == 4  # 3 still running, then 1 ended
    dog.poll()
    assert dog.in_flight() == 3 and _Counted.asked == 7  # none has ended: each still running is asked


def test_watchdog_aborts_a_stuck_collective_and_fails_everything_in_flight():
    dog, events = _watchdog()
    stuck = _InFlight("[smddp rank 0/2 host h] all_reduce:", 11.0, 10)
    behind = _InFlight("[smddp rank 0/2 host h] broadcast:", 1.0, 10)
    dog.track(stuck)
    dog.track(behind)
    dog.poll()
    assert events[-1] == "abort" and "all_reduce: did not complete within 10 s" in events[0]
    assert isinstance(stuck.error, PeerFailureError) and isinstance(behind.error, PeerFailureError)
    assert dog.in_flight() == 0


def test_watchdog_turns_an_async_nccl_error_into_a_failure_naming_it():
    dog, events = _watchdog(RuntimeError("NCCL_ERROR_REMOTE_ERROR: remote process exited"))
    work = _InFlight("[smddp rank 1/2 host h] all_gather:", 0.5, 10)
    dog.track(work)
    dog.poll()
    assert "NCCL_ERROR_REMOTE_ERROR" in events[0] and events[-1] == "abort"
    assert "NCCL_ERROR_REMOTE_ERROR" in str(work.error)


def test_watchdog_fail_all_aborts_and_fails_what_is_in_flight():
    # a launch NCCL refuses: what was enqueued before it must not end "successfully" on aborted comms
    dog, events = _watchdog()
    earlier = _InFlight("[smddp rank 0/2 host h] all_reduce:", 0.1, 10)
    dog.track(earlier)
    dog.fail_all("[smddp rank 0/2 host h] broadcast: NCCL failed: NCCL_ERROR_INVALID_ARGUMENT")
    assert events == ["[smddp rank 0/2 host h] broadcast: NCCL failed: NCCL_ERROR_INVALID_ARGUMENT", "abort"]
    assert "NCCL_ERROR_INVALID_ARGUMENT" in str(earlier.error) and dog.in_flight() == 0


def test_watchdog_thread_fails_the_group_when_its_own_check_raises():
    # a sticky CUDA error reaches the watchdog's thread too: it must fail the group, not die quietly
    failed = threading.Event()

    class Broken(_InFlight):
        def ended(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    dog = Watchdog("broken", lambda: None, lambda: None, lambda reason: failed.set())
    try:
        work = Broken("[smddp rank 0/2 host h] all_reduce:", 0.0, 60)
        dog.track(work)
        assert failed.wait(2), "the watchdog did not fail the group"
        assert "illegal memory access" in str(work.error)
    finally:
        dog.stop()


def test_watchdog_thread_polls_on_its_own():
    aborted = threading.Event()
    dog = Watchdog("thread", lambda: None, aborted.set, lambda reason: None)
    try:
        dog.track(_InFlight("old", 5.0, 1))
        assert aborted.wait(2), "the watchdog thread did not abort a timed-out collective"
    finally:
        dog.stop()


# --- on a GPU -----------------------------------------------------------------------------------

def on_gpu(test):
    """Marked ``gpu`` (select with ``-m gpu``) and skipped, saying why, where there is no GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(),
                                              reason="needs a CUDA device (CI has none)")(test))


@on_gpu
@pytest.mark.parametrize("transport, world", [pytest.param("nccl", 1, marks=needs_cupy), ("staged", 1), ("staged", 2)])
def test_stream_ordering(transport, world):
    env = {"SMDDP_CUDA_TRANSPORT": transport}
    for rank, r in enumerate(harness.values(harness.launch("tests.cuda_programs:stream_ordering", world, env=env))):
        assert r["transport"] == transport, r
        assert r["gathered"] == r["want"] and r["all_equal"], (rank, r)
        assert r["chained"] == r["chained_want"], (rank, r)
        if transport == "nccl":  # enqueued behind a 0.1 s kernel: the host must not have waited for it
            assert r["host_returned_s"] < 0.05, (rank, r)


@on_gpu
@pytest.mark.parametrize("transport, world", [pytest.param("nccl", 1, marks=needs_cupy), ("staged", 2)])
def test_ddp_on_cuda_matches_torch(transport, world):
    env = {"SMDDP_CUDA_TRANSPORT": transport}
    for r in harness.values(harness.launch("tests.cuda_programs:ddp_parity", world, env=env)):
        # world 1: no reduction at all, so bit for bit; world 2: one float32 addition of two
        # numbers, which IEEE makes order-free, so bit for bit as well
        assert r["max_diff"] == 0.0, r


@on_gpu
@pytest.mark.parametrize("wire", [None, "bfloat16"])
@pytest.mark.parametrize("world", [1, 2])
def test_compiled_step_on_cuda_matches_ddp_with_a_grad_scaler(world, wire):
    """The compiled step on the GPU: its agreement check and buckets on CUDA, the fused update as
    a compiled Triton kernel (not the interpreter CI runs), the unscaled, clipped .grad it writes
    back, and a skipped inf step, against DDP on torch's backend + AdamW + GradScaler. Two ranks
    share the GPU through the staged path; one rank reduces nothing, so makes no CUDA transport."""
    env = {"SMDDP_CUDA_TRANSPORT": "staged"}
    results = harness.values(harness.launch("tests.cuda_programs:compiled_parity", world, env=env, wire_dtype=wire))
    for rank, r in enumerate(results):
        assert r["transport"] == ("staged" if world > 1 else "none"), (rank, r)
        assert r["bucket_device"] == "cuda:0" and r["buckets"] > 1, (rank, r)
        assert r["scales"]["compiled"] == r["scales"]["eager"] and r["steps_taken"] == 9, (rank, r)  # 1 of 10 skipped
        if wire is None or world == 1:  # (one rank puts nothing on a wire)
            # float32: one addition of two numbers at most (order-free), then the fused update's
            # few ulps per step against torch's AdamW
            assert r["max_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 * max(1.0, r["grad_abs"]), (rank, r)
        else:
            # 8 bits of mantissa on the wire: ~2**-8 relative per gradient. The parameters moved
            # ~lr per step; on CPU (the same program) they ended 0.003 apart after moving 0.027,
            # and a step that updated nothing would end a whole move apart
            assert r["max_diff"] < 0.3 * r["moved"] and r["grad_diff"] < 0.05 * r["grad_abs"], (rank, r)
    losses = results[0]["losses"]["compiled"]
    assert losses[-1] < losses[0], losses


@on_gpu
@needs_cupy
def test_dtypes_without_an_nccl_type_are_moved_as_bytes_over_nccl():
    """float8 (FSDP2's float8 all_gather), int16 and complex: broadcast, all_gather and
    all_to_all carry their bytes over NCCL instead of copying them through host memory."""
    (r,) = harness.values(harness.launch("tests.cuda_programs:moved_dtypes", 1, env={"SMDDP_CUDA_TRANSPORT": "nccl"}))
    assert r["transport"] == "nccl" and not r["wrong"], r
    assert not r["staged"], r


@on_gpu
@pytest.mark.parametrize("transport", [pytest.param("nccl", marks=needs_cupy), "staged"])
def test_mixed_devices_are_refused_clearly(transport):
    (r,) = harness.values(harness.launch("tests.cuda_programs:bad_input", 1, env={"SMDDP_CUDA_TRANSPORT": transport}))
    assert "several devices (cpu, cuda:0)" in r["errors"]["mixed"] and r["still_works"], r


@on_gpu
@needs_cupy
def test_common_calls_take_the_fast_path_and_compute_what_the_general_route_does():
    (r,) = harness.values(harness.launch("tests.cuda_programs:fast_calls", 1, env={"SMDDP_CUDA_TRANSPORT": "nccl"}))
    assert not r["wrong"], r
    general = {"all_reduce strided", "all_reduce two tensors"}
    for call, kind in r["kinds"].items():
        assert kind == ("CudaWork" if call in general else "FastWork"), (call, r)
    assert r["strided_right"], r
    for mode in ("sync", "async"):  # behind a 0.1 s kernel: the host did not wait for it
        assert r[f"{mode}_returned_s"] < 0.05 and r[f"{mode}_value"] == 6.0, r
    assert not r["async_completed_at_once"], r
    assert r["in_flight_after"] == 0 and r["pooled_events"] > 0, r


@on_gpu
def test_staged_peer_stuck_raises_within_the_timeout():
    results = harness.launch("tests.cuda_programs:peer_stuck", 2, env={"SMDDP_CUDA_TRANSPORT": "staged"}, timeout=60)
    r0 = results[0].value
    assert r0 is not None and r0["error"] is not None and r0["seconds"] < 8, results[0].output[-2000:]


@on_gpu
@needs_cupy
def test_all_reduce_captured_in_a_cuda_graph_replays():
    (r,) = harness.values(harness.launch("tests.cuda_programs:graph_capture", 1, env={"SMDDP_CUDA_TRANSPORT": "nccl"}))
    assert "warm-up" in r["errors"].get("before_warm_up", ""), r
    for replay in r["replays"]:
        assert replay["got"] == replay["want"] and replay["all_equal"] and replay["gathered_all_equal"], r
    assert r["after"] == r["after_want"], r


@on_gpu
def test_staged_peer_dying_during_ddp_backward_raises_on_every_survivor():
    """As on the CPU (test_errors.py): DDP's reducer takes each bucket through the CUDA work's
    future, so a failure must be an error of that future, not its value. The staged path lets
    three ranks share the one GPU; rank 1 exits between forward and backward."""
    results = harness.launch("tests.errors_programs:ddp_peer_dies", 3, env={"SMDDP_CUDA_TRANSPORT": "staged"},
                             device="cuda")
    assert results[1].returncode == 3, results[1].output[-3000:]
    for result in (results[0], results[2]):
        error = result.value
        assert result.returncode == 0 and error is not None, (result.rank, result.returncode, result.output[-3000:])
        assert "PeerFailureError" in error["message"] and "all_reduce" in error["message"], (result.rank, error)
        assert error["seconds"] < 60, (result.rank, error)
