"""Test-wide setup. Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter,
which must be chosen before anything imports triton."""

import os

import pytest
import torch

from tests import tiers, warning_gate

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="the full tier (what CI runs): every case of every matrix and each drill at full size; "
                          "without it, the quick tier: every test file at its smallest size (tests/tiers.py)")


# The whole suite (no path on the command line) runs its files side by side in this many worker
# processes (pytest-xdist), each file whole in one worker. Many tests wait on the wall clock
# (heartbeats, timeouts, a replacement's start), and two at a time keep 2 cores busy where one
# test leaves them idle. A run of chosen files stays in this process, which starts faster;
# -n N chooses a count either way, and -n 0 none.
WORKERS = 2


# The files that build simulated hosts (network namespaces, rate-limited links): one worker runs
# them one after another. A lab test may look for namespaces left behind, and its bounds were
# set with the lab's ranks alone on the cores.
LAB_FILES = {"tests/test_compiled_ddp.py", "tests/test_multinode.py", "tests/test_sagemaker.py",
             "tests/test_ssh_trust.py", "tests/test_survival_drill.py"}


def pytest_xdist_make_scheduler(config, log):
    """Whole files to workers as ``--dist loadfile`` does, with the ``LAB_FILES`` as one unit."""
    if config.option.dist != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesWithTheLabAsOne(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "the lab" if file in LAB_FILES else file

    return FilesWithTheLabAsOne(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """``WORKERS`` workers for the whole suite where the command line chose none, before
    pytest-xdist reads the choice."""
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if (whole_suite and config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and config.option.numprocesses is None and not config.option.collectonly
            and not config.getoption("usepdb") and (os.cpu_count() or 1) >= WORKERS):
        config.option.numprocesses = WORKERS
        if config.option.dist == "no":
            config.option.dist = "loadfile"


def pytest_configure(config):
    tiers.configure(config.getoption("--full"))


def pytest_collection_modifyitems(config, items):
    """The quick tier's cases (tests/tiers.py); the rest are reported as deselected."""
    if tiers.full():
        return
    chosen = tiers.in_quick_tier(items)
    kept = set(map(id, chosen))
    left_out = [item for item in items if id(item) not in kept]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = chosen


def pytest_report_header(config):
    if tiers.full():
        return "tier: full (every matrix, each drill at full size)"
    return "tier: quick (python -m pytest --full runs every case, as CI does)"


@pytest.fixture(autouse=True)
def _no_deprecated_api_in_our_code():
    """A deprecation raised through this project's code fails the test (tests/warning_gate.py)."""
    with warning_gate.installed():
        yield


_DRILL_LINES: list[tuple[str, str]] = []  # the fault drill's (test id, line), one per cell that ran


def pytest_runtest_logreport(report):
    """Collects the fault drill's lines from each cell's report, which reaches this process from
    a worker too (pytest-xdist) with the properties its test recorded."""
    if report.when == "call" and report.user_properties:
        from tests.test_fault_drill import SUMMARY_PROPERTY

        _DRILL_LINES.extend((report.nodeid, value) for name, value in report.user_properties
                            if name == SUMMARY_PROPERTY)


def pytest_terminal_summary(terminalreporter):
    """The fault drill's one line per cell (tests/test_fault_drill.py), where it ran."""
    if _DRILL_LINES:
        terminalreporter.section("fault drill")
        for _, line in sorted(_DRILL_LINES):
            terminalreporter.write_line(line)
