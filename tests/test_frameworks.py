"""The training frameworks' examples of docs/frameworks.md, each on 2 CPU ranks under torchrun,
on "smddp" and on gloo: the same losses and weights."""

from __future__ import annotations

import importlib.util
import json

import pytest

from . import harness, tiers

# the first, which needs torch alone, is the quick tier's (tests/tiers.py)
EXAMPLES = {"dcp_resume": "torch", "hf_trainer": "transformers", "accelerate_loop": "accelerate",
            "lightning_fit": "lightning"}


def _run(example: str, backend: str, out) -> dict:
    run = harness.torchrun(["-m", f"smddp_lite.examples.{example}", "--backend", backend, "--out", str(out)],
                           cwd=harness.ROOT)
    assert run.returncode == 0, f"{example} on {backend}:\n{run.stdout}\n{run.stderr}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_framework_example_gives_the_results_it_gives_on_gloo(tmp_path, example):
    if importlib.util.find_spec(EXAMPLES[example]) is None:
        pytest.skip(f"{EXAMPLES[example]} is not installed (pip install -e '.[test]' installs it)")
    ours, gloo = _run(example, "smddp", tmp_path / "smddp.json"), _run(example, "gloo", tmp_path / "gloo.json")
    assert ours["world_size"] == gloo["world_size"] == 2
    assert len(ours["losses"]) == len(gloo["losses"]) >= 6, (ours["losses"], gloo["losses"])
    # two ranks: every sum has two terms, in either order the same float
    assert ours["losses"] == pytest.approx(gloo["losses"], rel=1e-6), (ours["losses"], gloo["losses"])
    assert ours["parameter_sums"] == pytest.approx(gloo["parameter_sums"], rel=1e-6, abs=1e-9)
    if example == "dcp_resume":  # resumed in the compiled step with AdamW's moments: as if never stopped
        assert ours["losses"] == pytest.approx(ours["uninterrupted"], rel=1e-5)
