"""Honesty check of blocks: each technique measured side by side in a block, and alone in its own process.

Run:  python benchmarks/isolation.py [--model resnet-mini] [--pairs 4] [--blocks 3]
          [--json benchmarks/results/isolation-resnet-mini.json]

A pair is two ablations of the same arms, one after the other: one with the arms side by
side in blocks (the default), one with ``isolate=True`` (every arm, baseline included, in a
process of its own per block, as workbench measured before blocks). The two kinds alternate,
so the machine's drift touches both. For every arm the script prints the two speedups,
pooled over the pairs, and the difference with a 95% interval. Where the interval excludes
0 the two ways of measuring disagree beyond the noise, and BENCHMARKS.md says why.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

TECHNIQUES = {
    "resnet-mini": {"amp": True, "channels_last": True, "checkpointing": True, "grad_accum": {"steps": 4}},
    "mlp": {"amp": True, "checkpointing": True, "grad_accum": {"steps": 4}},
    "gpt-mini": {"amp": True, "checkpointing": True, "grad_accum": {"steps": 4}},
}


def log_speedups(results) -> dict[str, float]:
    table = results.table.set_index("arm")
    return {
        arm: math.log(row.speedup) for arm, row in table.iterrows() if row.status == "ok" and row.speedup > 0
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet-mini", choices=sorted(TECHNIQUES))
    parser.add_argument("--techniques", help="JSON, instead of the model's default set")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import numpy as np

    import workbench as wb
    from workbench.environment import machine_summary
    from workbench.stats import t_quantile

    techniques = json.loads(args.techniques) if args.techniques else TECHNIQUES[args.model]
    runs: dict[str, list[dict[str, float]]] = {"block": [], "isolated": []}
    started = time.time()
    for pair in range(args.pairs):
        order = ("block", "isolated") if pair % 2 == 0 else ("isolated", "block")
        for kind in order:
            results = wb.ablate(
                model=args.model, techniques=techniques, steps=args.steps, warmup=3, blocks=args.blocks,
                isolate=kind == "isolated", out=False, progress=False, seed=pair,
            )  # fmt: skip
            runs[kind].append(log_speedups(results))
            print(f"pair {pair + 1}/{args.pairs} {kind}: " + ", ".join(
                f"{arm} {math.exp(v):.3f}" for arm, v in runs[kind][-1].items()), flush=True)  # fmt: skip
    report = {}
    print(f"\n{args.model}, {args.steps} steps x {args.blocks} blocks, {args.pairs} pairs of ablations:")
    print(f"  {'arm':20s} {'in a block':>10s} {'alone':>10s}   alone / block [95% interval]")
    arms = [arm for arm in runs["block"][0] if arm not in ("baseline", "baseline (own process)")]
    for arm in arms:
        shared = np.array([run[arm] for run in runs["block"] if arm in run])
        alone = np.array([run[arm] for run in runs["isolated"] if arm in run])
        difference = alone.mean() - shared.mean()
        se = math.sqrt(shared.var(ddof=1) / len(shared) + alone.var(ddof=1) / len(alone))
        half = t_quantile(0.95, min(len(shared), len(alone)) - 1) * se
        report[arm] = {
            "block": math.exp(shared.mean()),
            "alone": math.exp(alone.mean()),
            "ratio": math.exp(difference),
            "ratio_interval": [math.exp(difference - half), math.exp(difference + half)],
            "block_runs": [math.exp(v) for v in shared],
            "alone_runs": [math.exp(v) for v in alone],
        }
        flag = "" if difference - half <= 0 <= difference + half else "   <- differ beyond the noise"
        print(
            f"  {arm:20s} {math.exp(shared.mean()):10.3f} {math.exp(alone.mean()):10.3f}   "
            f"{math.exp(difference):.3f} [{math.exp(difference - half):.3f}, {math.exp(difference + half):.3f}]{flag}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "benchmark": "isolation",
                    "model": args.model,
                    "techniques": techniques,
                    "steps": args.steps,
                    "blocks": args.blocks,
                    "pairs": args.pairs,
                    "arms": report,
                    "wall_s": time.time() - started,
                    "machine": machine_summary(),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
