"""The CuPy fused kernels on a GPU: bandwidth against the device's copy, speed against eager
PyTorch and torch.compile, and the end-to-end effect on a gpt-mini training step.

Run:  python benchmarks/fused_kernels.py [--json benchmarks/results/fused-kernels.json]
Goals: each kernel at >= 85% of the measured copy bandwidth; faster than the eager chain.
Needs a CUDA device and CuPy (cupy-cuda12x or cupy-cuda13x); on CPU it says so and exits.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per arm per block, end to end")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--skip-end-to-end", action="store_true")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import pandas as pd
    import torch

    import workbench as wb
    from workbench import raw_kernels
    from workbench.environment import machine_summary
    from workbench.kernel_bench import measure_kernels

    reason = raw_kernels.cupy_unavailable_reason()
    if reason:
        print(f"nothing to measure: {reason}", file=sys.stderr)
        return 2
    tables = [
        measure_kernels(args.rows, args.cols, getattr(torch, dtype), rounds=args.rounds)
        for dtype in args.dtypes
    ]
    kernels = pd.concat(tables, ignore_index=True)
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.precision", 2):
        print(kernels)
    report = {
        "benchmark": "fused-kernels",
        "machine": machine_summary(),
        "shape": [args.rows, args.cols],
        "kernels": kernels.to_dict(orient="records"),
    }
    if not args.skip_end_to_end:
        results = wb.ablate(
            model="gpt-mini",
            techniques={"cupy_fusion": True, "compile": True},
            steps=args.steps,
            warmup=10,
            blocks=args.blocks,
            batch_size=args.batch_size,
            device="cuda",
            out=False,
        )
        print(results.summary())
        columns = ["arm", "status", "samples_per_s", "samples_per_s_spread", "speedup", "speedup_low",
                   "speedup_high", "noisy", "step_ms", "forward_ms", "backward_ms", "optimizer_ms",
                   "peak_mem_mb", "notes"]  # fmt: skip
        table = results.table
        report["end_to_end"] = table[[c for c in columns if c in table.columns]].to_dict(orient="records")
        report["end_to_end_settings"] = {"model": "gpt-mini", "batch_size": args.batch_size, "steps": args.steps,
                                         "blocks": args.blocks}  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
