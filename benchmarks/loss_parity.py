"""Loss parity near the end of training: how far apart final losses land by chance, against a real loss of parity.

For each seed, one block runs the float32 baseline beside a technique, on the same batches from
the same seed, and records each arm's final loss (the mean of its last 5), the ratio to the
baseline's, and the gap as a share of how far the baseline's loss fell (``loss_gap_of_fall``).
Two cases:

- mlp on digits with bfloat16 autocast, 300 steps: the model nearly fits the data, so the final
  losses are thousandths and their ratio is decided by the last batches;
- resnet-mini on textures with grad_accum (4 micro-batches), 20 steps: BatchNorm sees micro-batches
  of 8, a known change in what the step computes.

The parity rule (workbench.results_view.loss_drifted) should flag the second in every seed and
the first in none.

Run:  python benchmarks/loss_parity.py [--seeds 5] [--json benchmarks/results/loss-parity.json]
"""

from __future__ import annotations

import argparse

CASES = {
    "mlp + amp (bfloat16), 300 steps": dict(
        model="mlp", data="digits", techniques={"amp": {"dtype": "bfloat16"}}, steps=300, warmup=2
    ),
    "resnet-mini + grad_accum (4), 20 steps": dict(
        model="resnet-mini", data="textures", techniques={"grad_accum": {"steps": 4}}, steps=20, warmup=2
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from record import write_record

    import workbench as wb
    from workbench.results_view import loss_drifted

    runs, summary = [], {}
    for case, settings in CASES.items():
        gaps, ratios, flagged = [], [], 0
        for seed in range(args.seeds):
            res = wb.ablate(**settings, blocks=1, batch_size=32, device="cpu", seed=seed, control=False,
                            out=False, progress=False)  # fmt: skip
            table = res.table.set_index("arm")
            base = table.loc["baseline"]
            arm = table.drop(index="baseline").iloc[0]
            drifted = loss_drifted(arm.loss_vs_baseline, arm.loss_gap_of_fall)
            runs.append({"case": case, "seed": seed, "baseline_final_loss": base.final_loss,
                         "arm_final_loss": arm.final_loss, "loss_vs_baseline": arm.loss_vs_baseline,
                         "loss_gap_of_fall": arm.loss_gap_of_fall, "flagged": drifted})  # fmt: skip
            gaps.append(arm.loss_gap_of_fall)
            ratios.append(arm.loss_vs_baseline)
            flagged += drifted
            print(f"{case}, seed {seed}: final {base.final_loss:.4f} -> {arm.final_loss:.4f}, "
                  f"ratio {arm.loss_vs_baseline:.2f}, gap {arm.loss_gap_of_fall:+.1%} of the fall, "
                  f"{'flagged' if drifted else 'parity'}", flush=True)  # fmt: skip
        summary[case] = {
            "ratio_range": [min(ratios), max(ratios)],
            "gap_of_fall_range": [min(gaps), max(gaps)],
            "ratio_rule_alone_flags": sum(abs(r - 1) > 0.10 for r in ratios),
            "flagged": flagged,
            "seeds": args.seeds,
        }
    for case, figures in summary.items():
        print(f"\n{case}: ratio {figures['ratio_range'][0]:.2f}-{figures['ratio_range'][1]:.2f}, gap "
              f"{figures['gap_of_fall_range'][0]:+.1%} to {figures['gap_of_fall_range'][1]:+.1%} of the fall; "
              f"the ratio alone flags {figures['ratio_rule_alone_flags']} of {figures['seeds']}, "
              f"the rule {figures['flagged']}")  # fmt: skip
    if args.json:
        write_record(args.json, "loss-parity", summary=summary, runs=runs)


if __name__ == "__main__":
    main()
