"""DALI (CPU operators) against the DataLoader, loader-only, at equal CPU threads, on the JPEG set.

Both pipelines read the same files and do the same work per image: JPEG decode, random
resized crop, flip, normalise to CHW float32. Each arm feeds a model that does nothing
(``loader_arms="only"``), so samples/s is the rate the loader can feed. "Equal threads"
pairs DataLoader ``num_workers=N`` (N worker processes) with DALI ``threads=N``; the
training process itself only waits in both.

Run:  python benchmarks/dali_loader.py [--images-per-class 200 --size 256 --crop 224]
      [--json benchmarks/results/dali-loader.json]
The goal is DALI >= 1.5x the DataLoader at equal threads.

On a GPU machine, ``--device cuda --threads 2 8 --training`` runs DALI's GPU pipeline (nvJPEG's
mixed decode, batches left on the GPU) and adds the training arms beside their loader-only
twins. benchmarks/dali_gpu_wheels.sh says how to bring DALI to a machine that lacks it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images-per-class", type=int, default=None, help="default: the built-in set's")
    parser.add_argument("--size", type=int, default=None, help="side of the stored JPEG files")
    parser.add_argument("--crop", type=int, default=None, help="side of the crops (default: the built-in's)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the arms run")
    parser.add_argument(
        "--training", action="store_true", help="also the arms that train mlp, beside the loader-only ones"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from workbench.datasets import jpeg

    import workbench as wb
    from workbench.environment import machine_summary

    images_per_class = args.images_per_class or jpeg.IMAGES_PER_CLASS
    size = args.size or jpeg.SIZE
    crop = args.crop or jpeg.CROP
    with tempfile.TemporaryDirectory() as scratch:
        if (images_per_class, size) == (jpeg.IMAGES_PER_CLASS, jpeg.SIZE):
            root = jpeg.ensure_built()
        else:
            root = jpeg.build(Path(scratch) / "images", images_per_class, size)
        results = wb.ablate(
            model="mlp",
            data=wb.JpegFolder(str(root), size=crop),
            techniques={
                "dataloader": {"num_workers": list(args.threads)},
                "dali": {"threads": list(args.threads)},
            },
            loader_arms=True if args.training else "only",
            steps=args.steps,
            warmup=5,
            blocks=args.blocks,
            batch_size=args.batch_size,
            device=args.device,
            out=False,
            control=False,
        )
    table = results.table.set_index("arm")
    print(results.summary())
    print()
    from workbench import stats
    from workbench.results import _side

    def blocks(arm: str) -> dict[int, dict]:
        return {
            u["block"]: u["result"]
            for u in results.record["units"]
            if u["arm"] == arm and u["status"] == "ok"
        }

    def loader_only_arm(technique: str, setting: str, value: int) -> str:
        """The loader-only arm that runs ``technique`` with ``setting=value``, found by its
        recorded settings (its name carries the value only when several were swept)."""
        return next(
            arm["name"]
            for arm in results.record["arms"]
            if arm["kind"] == "loader" and arm["settings"].get(technique, {}).get(setting) == value
        )

    rows = []
    for threads in args.threads:
        loader_arm = loader_only_arm("dataloader", "num_workers", threads)
        dali_arm = loader_only_arm("dali", "threads", threads)
        loader, dali = blocks(loader_arm), blocks(dali_arm)
        paired = sorted(set(loader) & set(dali))  # both pipelines ran alone, in the same block
        speedup = stats.combine_blocks(
            [stats.block_ratio(_side(loader[b]), _side(dali[b]), paired=False) for b in paired]
        )
        ratio, low, high = speedup.point, speedup.low, speedup.high
        rows.append(
            {
                "threads": threads,
                "dataloader_img_s": table.loc[loader_arm, "samples_per_s"],
                "dali_img_s": table.loc[dali_arm, "samples_per_s"],
                "dali_over_dataloader": ratio,
                "low": low,
                "high": high,
                "pairs": len(paired),
            }
        )
        print(
            f"{threads} thread(s): DataLoader {rows[-1]['dataloader_img_s']:,.0f} img/s, "
            f"DALI {rows[-1]['dali_img_s']:,.0f} img/s -> DALI/DataLoader {ratio:.2f}x "
            f"(95% interval [{low:.2f}, {high:.2f}], {len(paired)} blocks)"
        )
    if args.json:
        columns = [
            "arm",
            "status",
            "samples_per_s",
            "samples_per_s_spread",
            "speedup",
            "speedup_low",
            "speedup_high",
            "noisy",
            "step_ms",
            "data_ms",
            "cpu_util_pct",
            "startup_s",
            "blocks",
        ]
        report = {
            "benchmark": "dali-loader",
            "dataset": {"images": len(jpeg.CLASSES) * images_per_class, "stored_px": size, "crop_px": crop},
            "steps": args.steps,
            "blocks": args.blocks,
            "batch_size": args.batch_size,
            "device": args.device,
            "comparison": rows,
            "table": json.loads(results.table[columns].to_json(orient="records")),
            "machine": machine_summary(),
        }
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
