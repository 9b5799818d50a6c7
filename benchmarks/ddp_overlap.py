"""Gradient fusion and overlap: how bucket size decides how much of DDP's communication hides
behind backward, and what gradient_as_bucket_view saves.

Two ranks (gloo on CPU, NCCL on CUDA) train resnet-mini (0.7 MB of gradients) under DDP over a
simulated slow link, with PyTorch's plain all-reduce, at several ``bucket_cap_mb`` (DDP's
default is 25 MB: one bucket here) and with ``gradient_as_bucket_view``. For each arm: the
communication time per step (any bucket in flight), the part the step waited for after the
gradient computation ended (exposed), the share hidden behind backward, and the speedup over
DDP's defaults. The link is a labelled simulation: each bucket is held back by latency + ring
all-reduce bytes / bandwidth.

Run:  python benchmarks/ddp_overlap.py [--json benchmarks/results/ddp-overlap.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

COLUMNS = [
    "arm", "status", "samples_per_s", "speedup", "speedup_low", "speedup_high", "step_ms", "backward_ms",
    "comm_ms", "comm_exposed_ms", "comm_hidden_share", "link_mb_per_step", "peak_mem_mb", "loss_vs_baseline",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--buckets", type=float, nargs="+", default=[0.05, 0.2, 1.0], help="bucket_cap_mb values"
    )
    parser.add_argument("--bandwidth", type=float, default=0.2, help="simulated link, Gbit/s")
    parser.add_argument("--latency-ms", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from record import table_rows, write_record

    import workbench as wb

    link = {"bandwidth_gbps": args.bandwidth, "latency_ms": args.latency_ms}
    res = wb.ablate(
        model="resnet-mini",
        data="textures",
        techniques={
            "ddp_compression": {
                "hook": "none",
                "bucket_cap_mb": [*args.buckets, 25.0],
                "gradient_as_bucket_view": [False, True],
            }
        },
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
    print(res.table[COLUMNS].round(3).to_string(index=False))
    if args.json:
        write_record(args.json, "ddp-overlap", model="resnet-mini", world_size=2, link=link, steps=args.steps,
                     blocks=args.blocks, table=table_rows(res, COLUMNS))  # fmt: skip
        res.plot().savefig(Path(args.json).with_suffix(".png"), dpi=90)


if __name__ == "__main__":
    main()
