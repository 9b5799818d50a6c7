"""Does a technique's speedup depend on the process it runs in? With address-space layout randomization, and without.

Run:  python benchmarks/process_dependence.py [--processes 10] [--arm channels_last]
          [--segments 6] [--rounds 15] [--json benchmarks/results/process-dependence-channels-last.json]

Why: in the quick preset, channels_last's speedup strayed furthest from run to run (1.21x
to 1.32x over five runs), and its blocks sometimes disagreed far beyond their own rounds'
noise. Each block is a fresh process. This script asks whether the process itself decides
the ratio, and whether its address layout is what decides it.

Each fresh process (plain PyTorch, no harness; benchmarks/heap_faults.py builds the steps)
holds the heap steady as workbench does, builds resnet-mini on 32 textures three times:
the baseline, a control (the baseline again) and the arm, warms each up for 3 steps, then
runs ``--segments`` segments of ``--rounds`` rounds, one step of each per round in a fresh
random order. Each segment gives each arm's typical step time (a 20% trimmed mean, as
workbench takes it) and the arm's and the control's ratio to the baseline. Processes alternate between the
kernel's usual randomized layout and a fixed one (``setarch -R``, which turns
randomization off for that process only).

If the ratio is a property of the process, segments inside one process agree with each
other far more closely than processes agree with each other. If the layout decides it,
processes with randomization turned off (all given the same layout) agree with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# How each fresh process is started: the kernel's usual randomized address layout; a fixed one
# (setarch -R); PyTorch's CPU allocator asking for transparent huge pages for tensors of 2 MiB
# and more (THP_MEM_ALLOC_ENABLE=1: aligned to 2 MiB and madvise(MADV_HUGEPAGE)); glibc's malloc
# asking for them for its whole heap (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, glibc 2.35 and
# later); or no transparent huge pages at all for the process (prctl PR_SET_THP_DISABLE).
CONDITIONS = ["randomized", "fixed", "thp", "heap-thp", "no-thp"]
_PR_SET_THP_DISABLE = 41  # <linux/prctl.h>


def child(arm: str, segments: int, rounds: int) -> dict:
    """One fresh process: the arm's and the control's ratio to the baseline, per segment."""
    sys.path.insert(0, str(ROOT))
    from workbench.heap import hold_heap_steady

    hold_heap_steady("steady")
    from heap_faults import resnet_mini_steps

    from workbench.stats import typical_step_s

    names = ["baseline", "control", arm]
    steps = resnet_mini_steps(names)
    for step in steps.values():
        for _ in range(3):
            step()
    order = random.Random(os.getpid())
    ratios: dict[str, list[float]] = {"control": [], arm: []}
    step_ms: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(segments):
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(rounds):
            for name in order.sample(names, len(names)):
                started = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - started)
        for name in names:
            step_ms[name].append(1e3 * typical_step_s([times[name]]))
        for name in ratios:
            ratios[name].append(step_ms["baseline"][-1] / step_ms[name][-1])
    return {"ratios": ratios, "step_ms": step_ms, "anon_huge_pages_kib": _anon_huge_pages_kib()}


def _anon_huge_pages_kib() -> int | None:
    """Anonymous memory this process holds in transparent huge pages: whether THP took hold."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _no_transparent_huge_pages() -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE) failed")


def spread_pct(values: list[float]) -> float:
    """Standard deviation relative to the mean, in percent."""
    return 100 * statistics.stdev(values) / statistics.mean(values) if len(values) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=10, help="fresh processes per condition")
    parser.add_argument(
        "--conditions", nargs="+", default=["randomized", "fixed"], choices=CONDITIONS,
        help="how the processes are started, in turn (see CONDITIONS)",
    )  # fmt: skip
    parser.add_argument("--arm", default="channels_last", choices=["channels_last", "amp", "grad_accum"])
    parser.add_argument("--segments", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.arm, args.segments, args.rounds)))
        return
    setarch = shutil.which("setarch")
    if "fixed" in args.conditions and setarch is None:
        sys.exit("setarch (util-linux) is needed to run a process without layout randomization")

    sys.path.insert(0, str(ROOT))
    from record import write_record

    started = time.time()
    processes: list[dict] = []
    conditions = args.conditions
    for index in range(args.processes * len(conditions)):
        layout = conditions[index % len(conditions)]  # in turn, so the hour's noise falls on each
        command = [sys.executable, __file__, "--child", "--arm", args.arm]
        command += ["--segments", str(args.segments), "--rounds", str(args.rounds)]
        env = {key: value for key, value in os.environ.items() if key != "THP_MEM_ALLOC_ENABLE"}
        if layout == "fixed":
            command = [setarch, platform.machine(), "-R", *command]
        if layout == "thp":
            env["THP_MEM_ALLOC_ENABLE"] = "1"
        if layout == "heap-thp":
            env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
        # Set between fork and exec: the child's every allocation falls under it.
        before_exec = _no_transparent_huge_pages if layout == "no-thp" else None
        done = subprocess.run(
            command, capture_output=True, text=True, check=True, env=env, preexec_fn=before_exec
        )
        found = json.loads(done.stdout.splitlines()[-1])
        ratios, step_ms = found["ratios"], found["step_ms"]
        processes.append(
            {
                "layout": layout,
                "ratios": ratios,
                "step_ms": step_ms,
                "anon_huge_pages_kib": found["anon_huge_pages_kib"],
            }
        )
        print(
            f"process {index + 1:2d} ({layout:10s}, {found['anon_huge_pages_kib']} KiB in huge pages): {args.arm} "
            + " ".join(
                f"{r:.3f} ({b:.0f}/{a:.0f} ms)"
                for r, b, a in zip(ratios[args.arm], step_ms["baseline"], step_ms[args.arm], strict=True)
            )
            + f"; control mean {statistics.mean(ratios['control']):.3f}",
            flush=True,
        )
    summary: dict[str, dict] = {}
    print(
        f"\n{args.arm} and the control against the baseline, {args.segments} segments of {args.rounds} rounds:"
    )
    for layout in conditions:
        summary[layout] = {}
        for name in ("control", args.arm):
            means = [statistics.mean(p["ratios"][name]) for p in processes if p["layout"] == layout]
            within = statistics.median(
                spread_pct(p["ratios"][name]) for p in processes if p["layout"] == layout
            )
            summary[layout][name] = {
                "process_means": means,
                "between_processes_pct": spread_pct(means),
                "within_process_pct": within,
                "range": [min(means), max(means)],
            }
            print(
                f"  {layout:10s} {name:14s} process means {min(means):.3f}-{max(means):.3f}: "
                f"spread between processes {spread_pct(means):.1f}%, between segments in a process {within:.1f}%"
            )
    if args.json:
        write_record(
            args.json,
            "process-dependence",
            arm=args.arm,
            processes_per_layout=args.processes,
            conditions=conditions,
            segments=args.segments,
            rounds=args.rounds,
            summary=summary,
            processes=processes,
            wall_s=time.time() - started,
        )


if __name__ == "__main__":
    main()
