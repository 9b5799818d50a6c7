"""What moves channels_last's speedup: the threads' cost of working together, probed segment by segment.

Run:  python benchmarks/core_state.py [--segments 100] [--rounds 12]
          [--json benchmarks/results/core-state-channels-last.json]

Why: channels_last's speedup over the baseline moves between two levels on the CI VM, inside
one process, with neither address layout nor huge pages deciding it
(benchmarks/process_dependence.py). This script runs one process for several minutes and,
segment after segment, measures three things side by side:

- the ratio at torch's usual thread count: ``--rounds`` rounds of one baseline step and one
  channels_last step in a random order (resnet-mini on 32 textures, plain PyTorch, the heap
  held steady, as benchmarks/heap_faults.py builds them), each arm's typical step a 20%
  trimmed mean, as workbench takes it;
- workbench's fork-join probe (workbench.core_sync.fork_join_us) at that thread count, and
  a 256 x 256 matrix product on one thread pinned to each core in turn;
- the same ratio on one thread (half the rounds, the steps being twice as long).

If the probe at two threads separates the segments into the same two groups as the ratio,
while the one-thread ratio stays put, the state lies in how the threads work together.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _ratio_segment(steps: dict, rounds: int, order: random.Random) -> dict:
    from workbench.stats import typical_step_s

    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name in order.sample(list(steps), len(steps)):
            started = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - started)
    ms = {name: 1e3 * typical_step_s([values]) for name, values in times.items()}
    return {
        "baseline_ms": ms["baseline"],
        "channels_last_ms": ms["channels_last"],
        "ratio": ms["baseline"] / ms["channels_last"],
    }


def _one_core_matmul_us(threads: int) -> list[float]:
    """A 256 x 256 matrix product on one thread, pinned to each core in turn (median of 50)."""
    import torch

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    allowed = sorted(os.sched_getaffinity(0))
    found = []
    torch.set_num_threads(1)
    try:
        for cpu in allowed:
            os.sched_setaffinity(0, {cpu})
            torch.mm(a, b)
            times = []
            for _ in range(50):
                started = time.perf_counter()
                torch.mm(a, b)
                times.append(time.perf_counter() - started)
            found.append(1e6 * statistics.median(times))
    finally:
        os.sched_setaffinity(0, set(allowed))
        torch.set_num_threads(threads)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=12, help="rounds per segment at the usual thread count")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import torch
    from heap_faults import resnet_mini_steps
    from record import write_record

    from workbench.core_sync import fork_join_us, split_states
    from workbench.heap import hold_heap_steady

    hold_heap_steady("steady")
    threads = torch.get_num_threads()
    if threads < 2:
        sys.exit("this needs at least two intra-op threads: the probe times them working together")
    steps = resnet_mini_steps(["baseline", "channels_last"])
    for step in steps.values():
        for _ in range(3):
            step()
    order = random.Random(0)
    started = time.time()
    segments = []
    for index in range(args.segments):
        torch.set_num_threads(threads)
        many = _ratio_segment(steps, args.rounds, order)
        probe = fork_join_us()
        one_core = _one_core_matmul_us(threads)
        torch.set_num_threads(1)
        one = _ratio_segment(steps, max(2, args.rounds // 2), order)
        torch.set_num_threads(threads)
        segment = {
            "t_s": time.time() - started,
            "threads": many,
            "one_thread": one,
            "fork_join_us": probe,
            "one_core_matmul_us": one_core,
        }
        segments.append(segment)
        print(
            f"segment {index + 1:3d}: {threads} threads {many['ratio']:.3f} ({many['baseline_ms']:.1f}/{many['channels_last_ms']:.1f} ms), "
            f"probe {probe:.2f} us; 1 thread {one['ratio']:.3f}; one-core matmul "
            + " ".join(f"{us:.0f}" for us in one_core)
            + " us",
            flush=True,
        )

    probes = [s["fork_join_us"] for s in segments]
    middle = split_states(probes)
    summary: dict = {"states_found": middle is not None}
    groups = {"all": segments}
    if middle is not None:
        slow = [probe > middle for probe in probes]
        summary["probe_split_us"] = middle
        groups = {
            "fast probe": [s for s, flag in zip(segments, slow, strict=True) if not flag],
            "slow probe": [s for s, flag in zip(segments, slow, strict=True) if flag],
        }
    print(f"\nchannels_last against the baseline, {len(segments)} segments, grouped by the fork-join probe:")
    for label, members in groups.items():
        row = {"segments": len(members)}
        for key in ("threads", "one_thread"):
            ratios = [s[key]["ratio"] for s in members]
            row[key] = {
                "median_ratio": statistics.median(ratios),
                "range": [min(ratios), max(ratios)],
                "baseline_ms_median": statistics.median(s[key]["baseline_ms"] for s in members),
            }
        row["fork_join_us_median"] = statistics.median(s["fork_join_us"] for s in members)
        summary[label] = row
        print(
            f"  {label:10s} {len(members):3d} segments, probe {row['fork_join_us_median']:.2f} us: "
            f"{threads} threads {row['threads']['median_ratio']:.3f} ({row['threads']['range'][0]:.3f}-{row['threads']['range'][1]:.3f}), "
            f"1 thread {row['one_thread']['median_ratio']:.3f} ({row['one_thread']['range'][0]:.3f}-{row['one_thread']['range'][1]:.3f})"
        )
    many_ratios = [s["threads"]["ratio"] for s in segments]
    summary["correlation_probe_vs_ratio"] = statistics.correlation(probes, many_ratios)
    summary["correlation_probe_vs_one_thread_ratio"] = statistics.correlation(
        probes, [s["one_thread"]["ratio"] for s in segments]
    )
    print(
        f"  correlation of the probe with the {threads}-thread ratio {summary['correlation_probe_vs_ratio']:.2f}, "
        f"with the 1-thread ratio {summary['correlation_probe_vs_one_thread_ratio']:.2f}"
    )
    if args.json:
        write_record(
            args.json,
            "core-state",
            threads=threads,
            segments_run=len(segments),
            rounds=args.rounds,
            summary=summary,
            segments=segments,
            wall_s=time.time() - started,
        )


if __name__ == "__main__":
    main()
