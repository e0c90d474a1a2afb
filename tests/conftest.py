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


def pytest_terminal_summary(terminalreporter):
    """The fault drill's one line per cell (tests/test_fault_drill.py), where it ran."""
    import sys

    drill = sys.modules.get("tests.test_fault_drill")
    if drill is not None and drill.SUMMARY:
        terminalreporter.section("fault drill")
        for line in drill.SUMMARY:
            terminalreporter.write_line(line)
