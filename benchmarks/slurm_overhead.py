"""What a block costs as a Slurm job, against the same block run locally.

Run:  bash .ci/slurm start && export SLURM_CONF=/tmp/workbench-slurm/slurm.conf
      python benchmarks/slurm_overhead.py [--pairs 3] [--blocks 2] [--json FILE]

Each pair runs one ablation twice, in a random order: with ``executor="local"`` (the blocks
one after another in this process's runner, from one warm template) and with
``executor="slurm"`` (each block a job on the one-node cluster that .ci/slurm starts here,
which runs one job at a time because each asks for every core). Both are timed from the
call to its return, in this process. The overhead of a Slurm block is the difference divided
by the blocks: submitting, Slurm's scheduling and job start (a new interpreter that imports
torch and starts its own warm template), the polling interval, and merging its records. The
block's own work (its processes' wall time) is reported beside it, and so is the time from
the end of a job's last process to its merge here (the polling interval's share).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from record import write_record

SETTINGS = {"steps": 60, "warmup": 5, "device": "cpu", "progress": False}


def run_once(executor: str, blocks: int, folder: Path) -> dict:
    import workbench as wb

    out = folder / f"{executor}-{time.monotonic_ns()}"
    started = time.perf_counter()
    results = wb.ablate("mlp", techniques=["amp"], out=out, blocks=blocks, executor=executor, **SETTINGS)
    wall = time.perf_counter() - started
    assert results.complete, f"the {executor} run did not complete"
    # The block's own work: its processes' wall time (start-up, warm-up, windows), which both
    # executors spend; the rest of a block's share of the wall time is what running it costs.
    work = sum(b["wall_s"] for b in results.record["blocks"]) / blocks
    figures = {"executor": executor, "wall_s": wall, "per_block_s": wall / blocks, "work_per_block_s": work}
    if executor == "slurm":
        attempts = json.loads((out / "slurm" / "state.json").read_text())["attempts"]
        # From the end of a job's last process to the merge here: the polling interval's share.
        merges = [attempt["ended"] - max(r["finished_at"] for r in _records(out / attempt["folder"]))
                  for attempt in attempts]  # fmt: skip
        figures["work_to_merge_s"] = statistics.median(merges)
    return figures


def _records(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (folder / "units").glob("*.json")]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from workbench.slurm import check_cluster

    check_cluster()
    runs = []
    with tempfile.TemporaryDirectory(prefix="slurm-overhead-") as scratch:
        for pair in range(args.pairs):
            order = random.sample(["local", "slurm"], 2)
            for executor in order:
                figures = run_once(executor, args.blocks, Path(scratch))
                runs.append({"pair": pair, **figures})
                print(json.dumps(runs[-1]), flush=True)
    per = {e: [r["per_block_s"] for r in runs if r["executor"] == e] for e in ("local", "slurm")}
    overhead = [s - loc for s, loc in zip(per["slurm"], per["local"], strict=True)]
    summary = {
        "local_per_block_s_median": statistics.median(per["local"]),
        "slurm_per_block_s_median": statistics.median(per["slurm"]),
        "overhead_per_block_s_median": statistics.median(overhead),
        "overhead_per_block_s_range": [min(overhead), max(overhead)],
        "work_per_block_s_median": statistics.median(r["work_per_block_s"] for r in runs),
        "work_to_merge_s_median": statistics.median(
            r["work_to_merge_s"] for r in runs if r["executor"] == "slurm"
        ),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        write_record(args.json, "slurm_overhead", settings={**SETTINGS, "blocks": args.blocks,
                     "pairs": args.pairs, "model": "mlp", "techniques": ["amp"]}, runs=runs, summary=summary)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
