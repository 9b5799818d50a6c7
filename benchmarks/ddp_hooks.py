"""DDP gradient-compression hooks: measured bytes, ratios, throughput, and a simulated-link crossover.

Two ranks (gloo on CPU, NCCL on CUDA) train resnet-mini under DDP. Each hook (16-bit casting,
PowerSGD, batched PowerSGD, top-k sparsification at 1% density, int8 quantization) is an arm of
one ablation, against the baseline (PyTorch's allreduce_hook). First over the real
connection between the ranks (loopback here), then over simulated links of decreasing
bandwidth: each bucket is delayed by latency + ring all-reduce bytes / bandwidth, a model
of a slower network, not a measurement of one. The crossover is the bandwidth below which a
hook's speedup interval lies above 1.

Run:  python benchmarks/ddp_hooks.py [--json benchmarks/results/ddp-hooks.json]
The goal: PowerSGD rank 1 compresses resnet-mini's gradients at least 100x, or an explanation.
"""

from __future__ import annotations

import argparse

HOOKS = ["fp16", "powersgd", "batched_powersgd", "topk", "int8"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidths", type=float, nargs="+", default=[10.0, 1.0, 0.1], help="Gbit/s")
    parser.add_argument("--latency-ms", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from record import link_conditions, table_rows, write_record

    import workbench as wb

    columns = [
        "arm",
        "status",
        "samples_per_s",
        "samples_per_s_per_rank",
        "speedup",
        "speedup_low",
        "speedup_high",
        "noisy",
        "comm_mb_per_step",
        "compression_ratio",
        "link_mb_per_step",
        "comm_ms",
        "comm_share",
        "comm_exposed_ms",
        "comm_hidden_share",
        "step_ms",
        "final_loss",
        "loss_vs_baseline",
        "notes",
    ]
    runs = {}
    for label, link in link_conditions(args.bandwidths, args.latency_ms):
        print(f"\n=== {label} ===", flush=True)
        res = wb.ablate(
            model="resnet-mini",
            data="textures",
            techniques={"ddp_compression": {"hook": HOOKS}},
            world_size=2,
            link=link,
            steps=args.steps,
            warmup=4,
            blocks=args.blocks,
            batch_size=32,
            device=args.device,
            control=False,
            out=False,
        )
        print(res.summary())
        runs[label] = table_rows(res, columns)

    print("\nspeedup over the allreduce baseline [95% interval], by link:")
    for hook in HOOKS:
        arm = f"ddp_compression[hook={hook}]"
        cells = []
        for label, table in runs.items():
            row = next(r for r in table if r["arm"] == arm)
            cells.append(
                f"{label}: {row['speedup']:.2f} [{row['speedup_low']:.2f}, {row['speedup_high']:.2f}]"
            )
        ratio = next(r for r in runs["loopback"] if r["arm"] == arm)["compression_ratio"]
        print(f"  {hook:17s} ratio {ratio:7.1f}x | " + " | ".join(cells))
    if args.json:
        write_record(args.json, "ddp-hooks", model="resnet-mini", world_size=2, latency_ms=args.latency_ms,
                     steps=args.steps, blocks=args.blocks, runs=runs)  # fmt: skip


if __name__ == "__main__":
    main()
