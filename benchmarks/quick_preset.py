"""The main job's figures: wall time and table of ``workbench ablate --preset quick``.

Run:  python benchmarks/quick_preset.py [--json benchmarks/results/quick-preset.json]
The goal is a meaningful CPU ablation in about 90 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from workbench.environment import machine_summary
    from workbench.results import load_results

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "quick"
        started = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "workbench",
                "ablate",
                "--preset",
                "quick",
                "--out",
                str(out),
                "--no-progress",
            ],
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - started
        if done.returncode != 0:
            sys.exit(f"the quick preset failed:\n{done.stderr}")
        results = load_results(out)
    print(results.summary())
    print(f"\nwall time of `workbench ablate --preset quick` (start to exit): {wall:.1f} s")
    if args.json:
        columns = [
            "arm",
            "status",
            "samples_per_s",
            "speedup",
            "speedup_low",
            "speedup_high",
            "noisy",
            "step_ms",
            "peak_mem_mb",
            "peak_rss_mb",
            "startup_s",
            "final_loss",
            "loss_vs_baseline",
        ]
        report = {
            "benchmark": "quick-preset",
            "wall_s": wall,
            "table": json.loads(results.table[columns].to_json(orient="records")),
            "machine": machine_summary(),
        }
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
