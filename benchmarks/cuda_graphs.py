"""CUDA Graphs against eager on a launch-bound built-in config, and the full stack with MFU.

Two ablations on one GPU:
1. launch-bound: mlp (or gpt-mini) at a small batch, eager against cuda_graphs (manual
   capture of the whole step) and cuda_graphs(mode="compile"). Goal: graphs >= 2x eager.
2. full stack: gpt-mini, the baseline against amp (bfloat16) + compile + cuda_graphs and
   against each leave-one-out combination, with tflops and MFU per arm.

Run:  python benchmarks/cuda_graphs.py [--json benchmarks/results/cuda-graphs.json]
Needs a CUDA device; on CPU it says so and exits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "gpt-mini"], help="the launch-bound config")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--stack-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import torch

    import workbench as wb
    from workbench.environment import machine_summary
    from workbench.results_folder import write_json_atomic

    if not torch.cuda.is_available():
        print("nothing to measure: CUDA Graphs need a CUDA device; none is visible", file=sys.stderr)
        return 2
    common = {"steps": args.steps, "warmup": 10, "blocks": args.blocks, "device": "cuda", "out": False}
    columns = ["arm", "status", "reason", "samples_per_s", "samples_per_s_spread", "speedup", "speedup_low",
               "speedup_high", "noisy", "step_ms", "replay_ms", "forward_ms", "backward_ms", "optimizer_ms",
               "tflops", "mfu_pct", "gpu_util_pct", "gpu_power_w", "peak_mem_mb", "startup_s",
               "loss_vs_baseline", "notes"]  # fmt: skip
    report = {"benchmark": "cuda-graphs", "machine": machine_summary()}

    def keep(part: str, model: str, batch_size: int, results) -> None:
        # Written after each ablation: a run stopped during the full stack keeps the launch-bound
        # figures (an H100 run, 2026-11-28, lost them to its timeout).
        print(results.summary(), flush=True)
        report[part] = {"model": model, "batch_size": batch_size,
                        "table": results.table[columns].to_dict(orient="records")}  # fmt: skip
        if args.json:
            write_json_atomic(Path(args.json), report)

    launch_bound = wb.ablate(
        model=args.model,
        techniques={"cuda_graphs": {"mode": ["manual", "compile"]}},
        batch_size=args.batch_size,
        **common,
    )
    keep("launch_bound", args.model, args.batch_size, launch_bound)
    stack = wb.ablate(
        model="gpt-mini",
        techniques={"amp": {"dtype": "bfloat16"}, "compile": True, "cuda_graphs": True},
        mode="leave-one-out",
        batch_size=args.stack_batch_size,
        **common,
    )
    keep("full_stack", "gpt-mini", args.stack_batch_size, stack)
    return 0


if __name__ == "__main__":
    sys.exit(main())
