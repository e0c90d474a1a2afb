"""``smddp_lite.compile(..., torch_compile=True)``: each repeated block a torch.compile graph, the
buckets still overlapping backward, the same training as without it."""

from __future__ import annotations

import warnings

import pytest

from . import harness


@pytest.mark.parametrize("shard, wire", [(False, None), (True, "bfloat16")], ids=["replicated", "sharded-bfloat16"])
def test_compiled_blocks_train_as_eager_ones_and_keep_the_overlap(shard, wire):
    results = harness.values(harness.launch("tests.compile_graph_programs:graph_parity", 2, timeout=400,
                                            shard=shard, wire_dtype=wire))
    for rank, r in enumerate(results):
        assert r["compiled_blocks"] == 3, (rank, r)
        # inductor fuses the blocks' arithmetic in another order: float32 ulps over 4 AdamW steps,
        # which a bfloat16 wire can round apart by one of its steps (AdamW then moves up to lr)
        assert r["max_diff"] < (1e-4 if wire is None else 1e-2), (rank, r)
        assert r["losses_graph"] == pytest.approx(r["losses_eager"], rel=1e-4), (rank, r)
        # one bucket per block and one for the head (sized so): every block's bucket went out while
        # backward still ran, before it reached the blocks' input and the first layer
        assert r["buckets"] >= 4, (rank, r)
        assert r["issued_before_input_grad"] >= 3, (rank, r)


def test_a_changed_input_shape_is_named_once_and_debug_shows_graph_breaks_and_recompiles():
    quiet, loud = (harness.launch("tests.compile_graph_programs:shapes_and_debug", 1, timeout=400, debug=debug)[0]
                   for debug in (False, True))
    for run in (quiet, loud):
        assert run.error is None, run.output
        said = [s for s in run.value["said"] if "changed shape" in s]
        assert len(said) == 1, run.value["said"]
        assert "argument 0 changed shape from [4, 6, 12] to [4, 9, 12]" in said[0], said
        assert "pad inputs to a fixed shape" in said[0].lower() and "torch_compile=False" in said[0], said
    assert "Graph break" not in quiet.output and "Recompiling" not in quiet.output, quiet.output
    assert "Graph break" in loud.output, loud.output
    assert "Recompiling" in loud.output, loud.output


def test_a_model_compiled_whole_is_warned_of_since_no_bucket_can_overlap_its_backward():
    import torch

    import smddp_lite

    from .compile_graph_programs import Net

    module = Net()
    with warnings.catch_warnings():  # inductor's first import warns of torch's own deprecations
        warnings.simplefilter("ignore", DeprecationWarning)
        whole = torch.compile(module)
    with pytest.warns(UserWarning, match=r"compile'd as a whole.*model\._orig_mod.*torch_compile=True"):
        smddp_lite.compile(whole, torch.optim.AdamW(module.parameters()), torch_compile=True)
    assert not any("forward" in vars(m) for m in module.modules()), "the whole model's own graph stands"
