"""The README's commands and Python examples work as written, on 2 CPU ranks, without a warning."""

from __future__ import annotations

import re

import pytest

from . import harness, tiers

DOCUMENTS = ["README.md", "docs/compiled-step.md", "docs/surviving.md"]


def _python_examples() -> dict[str, str]:
    """Each distinct ```python block of the documents, named by where it first appears."""
    examples: dict[str, str] = {}
    for document in DOCUMENTS:
        text = (harness.ROOT / document).read_text()
        for match in re.finditer(r"```python\n(.*?)```", text, re.S):
            line = text.count("\n", 0, match.start()) + 1
            if match.group(1) not in examples.values():
                examples[f"{document}:{line}"] = match.group(1)
    return examples


@tiers.FULL_ONLY
@pytest.mark.parametrize("where", list(_python_examples()))
def test_python_examples_run_on_two_cpu_ranks_without_a_warning(tmp_path, where):
    """The compiled-step example built a GradScaler("cuda"), which warns on a CPU machine."""
    script = tmp_path / "example.py"
    script.write_text("import warnings\nwarnings.simplefilter('error')\n" + _python_examples()[where])
    run = harness.torchrun([str(script)], cwd=tmp_path, python_flags=("-W", "error"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Warning" not in run.stderr, run.stderr


def test_the_main_job_of_the_quick_start_trains():
    text = (harness.ROOT / "README.md").read_text()
    command = next(line for line in text.splitlines() if line.startswith("pip install") and "torchrun" in line)
    launch = command.split("&& torchrun ", 1)[1].split()
    assert launch[:3] == ["--standalone", "--nproc-per-node", "2"], command
    run = harness.torchrun(launch[3:], cwd=harness.ROOT, python_flags=("-W", "error"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Warning" not in run.stderr, run.stderr
