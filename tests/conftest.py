"""Test-wide setup. Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter,
which must be chosen before anything imports triton."""

import os

import pytest
import torch

from tests import warning_gate

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
