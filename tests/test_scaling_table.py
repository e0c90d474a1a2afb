"""The lab's table (benchmarks/scaling.py): each variant against gloo and against the lab's own
limit, the same ranks training alone; and that limit's run (ddp_throughput.py --variant no-sync)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import scaling  # noqa: E402

from . import tiers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(name: str, samples: float) -> dict:
    return {"hosts": 2, "per_host": 2, "name": name, "samples_per_s": samples, "step_s": 64 / samples,
            "runs_samples_per_s": [samples], "efficiency": None}


def test_every_variant_is_shown_against_gloo_and_against_the_no_sync_limit(tmp_path):
    rows = [_row("no-sync", 1000.0), _row("gloo", 250.0), _row("smddp-compiled-int8", 650.0)]
    scaling.write_outputs(rows, rows, str(tmp_path / "table"), "1gbit")
    table = (tmp_path / "table.md").read_text().splitlines()
    assert "| vs gloo | of the no-sync limit |" in table[0]
    assert "| 2 x 2 | smddp-compiled-int8 | 650 | 98 | 2.60x | 0.65x |" in table[-1], table
    assert "| 2 x 2 | gloo | 250 | 256 | 1.00x | 0.25x |" in table[3], table


def test_an_adamw_table_takes_the_adamw_limit_and_a_missing_limit_shows_a_dash(tmp_path):
    rows = [_row("gloo-adamw", 200.0), _row("smddp-compiled-bf16-adamw", 500.0)]
    scaling.write_outputs(rows, rows, str(tmp_path / "table"), "1gbit")
    table = (tmp_path / "table.md").read_text()
    assert "of the no-sync-adamw limit" in table and "| 2.50x | - |" in table, table


@tiers.FULL_ONLY
def test_the_no_sync_limit_runs_as_the_other_variants_do():
    """Two local ranks, no gradient sync: it runs under torchrun and reports as the others do."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "benchmarks/ddp_throughput.py", "--variant", "no-sync", "--steps", "2", "--warmup", "1",
                          "--width", "64"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["variant"] == "no-sync" and report["world"] == 2 and report["samples_per_s"] > 0
