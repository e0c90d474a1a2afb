"""Plot bus bandwidth against message size from collectives.py --json output, one line per backend.

    python benchmarks/plot_collectives.py RESULT.json [RESULT2.json ...] -o busbw.png

Needs matplotlib (pip install matplotlib, or pip install -e '.[bench]' in the checkout).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="JSON files written by collectives.py --json")
    parser.add_argument("-o", "--output", required=True, help="PNG to write")
    parser.add_argument("--op", default="all_reduce")
    parser.add_argument("--label", action="append", default=[], help="name per file, in order (default: file name)")
    args = parser.parse_args()

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, path in enumerate(args.results):
        data = json.load(open(path))
        tag = args.label[i] if i < len(args.label) else path.rsplit("/", 1)[-1]
        curves = defaultdict(list)
        for row in data["rows"]:
            if row["op"] == args.op:
                curves[row["backend"]].append((row["size"], row["out_of_place"]["busbw"]))
        for backend, points in curves.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=f"{backend} ({tag})")
        pre = data["preamble"]
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{args.op}, {pre['world_size']} ranks, {pre['device']}, torch {pre['torch']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
