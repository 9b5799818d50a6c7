"""Hierarchical all-reduce against a flat ring, on two simulated nodes, as the link between the
nodes slows down.

Four ranks on one machine (gloo on CPU) stand for two nodes of two ranks. The simulated link is
the network between the nodes: for the flat ring (PyTorch's allreduce_hook) all of its traffic
crosses it, 2 (N-1)/N = 1.5x the gradients per rank; for the ``hierarchical`` hook only the
leaders' all-reduce does, 2 (M-1)/M = 1.0x, and the reduce and broadcast inside a node are free.
Each link condition is one ablation: both arms in every block, resnet-mini, batch 16 per rank.
The crossover is the slowest link at which the hierarchy is not yet measurably faster.

The link is a labelled simulation: latency + wire bytes / bandwidth per bucket, not a network.
Four ranks share two cores here, so the compute part of each step is slow and noisy; the
simulated link's delays are what the sweep changes.

Run:  python benchmarks/hierarchical_allreduce.py [--json benchmarks/results/hierarchical-allreduce.json]
"""

from __future__ import annotations

import argparse

COLUMNS = [
    "arm", "status", "samples_per_s", "speedup", "speedup_low", "speedup_high", "step_ms", "comm_ms",
    "comm_exposed_ms", "comm_mb_per_step", "link_mb_per_step", "loss_vs_baseline",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidths", type=float, nargs="+", default=[1.0, 0.1, 0.03], help="Gbit/s")
    parser.add_argument("--latency-ms", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from record import link_conditions, table_rows, write_record

    import workbench as wb

    runs = {}
    for label, link in link_conditions(args.bandwidths, args.latency_ms):
        print(f"\n=== {label} ===", flush=True)
        res = wb.ablate(
            model="resnet-mini",
            data="textures",
            techniques={"ddp_compression": {"hook": "hierarchical", "ranks_per_node": 2}},
            world_size=4,
            link=link,
            steps=args.steps,
            warmup=3,
            blocks=args.blocks,
            batch_size=16,
            device="cpu",
            control=False,
            out=False,
        )
        print(res.table[COLUMNS].round(3).to_string(index=False))
        runs[label] = table_rows(res, COLUMNS)

    print("\nhierarchical over the flat ring [95% interval], by link between the nodes:")
    for label, table in runs.items():
        row = next(r for r in table if r["arm"] == "ddp_compression")
        print(f"  {label:12s} {row['speedup']:.2f} [{row['speedup_low']:.2f}, {row['speedup_high']:.2f}]")
    if args.json:
        write_record(args.json, "hierarchical-allreduce", model="resnet-mini", world_size=4, ranks_per_node=2,
                     latency_ms=args.latency_ms, steps=args.steps, blocks=args.blocks, runs=runs)  # fmt: skip


if __name__ == "__main__":
    main()
