"""AMP levels O1 (autocast) and O2 (a 16-bit model with float32 master weights), side by side.

For each built-in model, one ablation runs the float32 baseline, its control, amp at O1 and amp
at O2 in the same blocks: throughput (speedup with its interval), step time, peak tensor memory,
activation memory and loss parity after the same steps. On a CPU both run in bfloat16 (O2 in
float16 is refused there: float16 arithmetic is emulated); on a GPU pass --dtype float16 to
include loss scaling.

Run:  python benchmarks/amp_levels.py [--json benchmarks/results/amp-levels.json]
"""

from __future__ import annotations

import argparse

COLUMNS = [
    "arm", "status", "samples_per_s", "speedup", "speedup_low", "speedup_high", "step_ms", "peak_mem_mb",
    "activation_mb", "final_loss", "loss_vs_baseline", "notes",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet-mini", "gpt-mini"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from record import table_rows, write_record

    import workbench as wb

    runs = {}
    for model in args.models:
        print(f"\n=== {model} ===", flush=True)
        res = wb.ablate(
            model=model,
            techniques={"amp": {"dtype": args.dtype, "level": ["O1", "O2"]}},
            steps=args.steps,
            warmup=3,
            blocks=args.blocks,
            device=args.device,
            out=False,
        )
        print(res.table[COLUMNS].drop(columns=["notes"]).round(3).to_string(index=False))
        runs[model] = table_rows(res, COLUMNS)
    if args.json:
        write_record(
            args.json, "amp-levels", dtype=args.dtype, steps=args.steps, blocks=args.blocks, runs=runs
        )


if __name__ == "__main__":
    main()
