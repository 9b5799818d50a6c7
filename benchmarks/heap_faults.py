"""Page faults per training step, alone and beside other arms, with glibc's malloc as it is and held steady.

Run:  python benchmarks/heap_faults.py [--processes 3] [--rounds 30]
          [--json benchmarks/results/heap-faults.json]

Why: in a block, every arm allocates from one C heap, and glibc's adaptive thresholds (when
a chunk gets fresh pages from the kernel, when free pages go back) follow the allocations of
all of them. This script shows what that does to one arm, and what ``heap="steady"``
(workbench.heap) changes. For each heap setting and each set of arms, several fresh
processes each build resnet-mini arms on textures (batch 32; the baseline, amp with
bfloat16, grad_accum with 4 micro-batches), warm each up for 3 steps, then run one step of
each arm per round, in a fresh random order, and count the minor page faults and the time
of every step (``getrusage``, ``perf_counter``). Plain PyTorch, no harness: what is
measured is the allocator, not workbench.

A second part runs one arm alone (the baseline, then channels_last) for ``--long-rounds``
steps in fresh processes, as a user's own job would run, and counts the faults of the last
quarter of its steps: whether glibc, left as it is, settles by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARM_SETS = [["baseline"], ["baseline", "amp"], ["baseline", "amp", "grad_accum"]]
LONG_ALONE = [["baseline"], ["channels_last"]]  # a longer job, one arm alone, as a user's job runs
HEAPS = ["as-is", "steady"]


def resnet_mini_steps(arms: list[str]) -> dict:
    """A training step for each named arm, in plain PyTorch: resnet-mini on 32 textures with
    AdamW; "baseline" and "control" alike, "amp" with bfloat16 autocast, "channels_last" in
    NHWC, "grad_accum" in 4 micro-batches. Each arm has its own model and optimizer.
    (benchmarks/process_dependence.py uses it too.)"""
    sys.path.insert(0, str(ROOT))
    import torch

    from workbench.data import resolve_data
    from workbench.models import build_model

    source = resolve_data("textures", "resnet-mini")
    dataset = source.open_dataset(0)
    inputs = torch.stack([torch.as_tensor(dataset[i][0]) for i in range(32)])
    targets = torch.tensor([int(dataset[i][1]) for i in range(32)])

    def make_step(name: str):
        torch.manual_seed(0)
        model = build_model("resnet-mini", source.spec)
        optimizer = torch.optim.AdamW(model.parameters())
        splits = 4 if name == "grad_accum" else 1
        layout = torch.channels_last if name == "channels_last" else torch.contiguous_format
        model = model.to(memory_format=layout)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            for x, y in zip(
                inputs.contiguous(memory_format=layout).chunk(splits), targets.chunk(splits), strict=True
            ):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "amp"):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
            optimizer.step()

        return step

    return {name: make_step(name) for name in arms}


def child(heap: str, arms: list[str], rounds: int) -> dict:
    """One fresh process: hold (or not) the heap, build the arms, count each step's faults and time."""
    sys.path.insert(0, str(ROOT))
    from workbench.heap import hold_heap_steady

    held = hold_heap_steady(heap)
    steps = resnet_mini_steps(arms)
    for step in steps.values():
        for _ in range(3):
            step()
    faults: dict[str, list[int]] = {name: [] for name in arms}
    times: dict[str, list[float]] = {name: [] for name in arms}
    order = random.Random(os.getpid())
    for _ in range(rounds):
        for name in order.sample(arms, len(arms)):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - started)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {
        "heap": held,
        "arms": {
            name: {
                "faults_per_step": statistics.mean(faults[name]),
                # the last quarter of the steps: has glibc settled by then?
                "late_faults_per_step": statistics.mean(faults[name][-max(1, rounds // 4) :]),
                "ms_per_step": 1e3 * statistics.mean(times[name]),
            }
            for name in arms
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--processes", type=int, default=3, help="fresh processes per heap setting and set of arms"
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument(
        "--long-rounds", type=int, default=200, help="steps of each lone job in the second part (0: skip it)"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        heap, arms = json.loads(args.child)
        print(json.dumps(child(heap, arms, args.rounds)))
        return

    sys.path.insert(0, str(ROOT))
    from workbench.environment import machine_summary

    def measure(arms: list[str], heap: str, rounds: int, process: int, part: str) -> dict:
        command = [sys.executable, __file__, "--rounds", str(rounds), "--child", json.dumps([heap, arms])]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        found = json.loads(done.stdout.splitlines()[-1])
        line = "  ".join(
            f"{name} {m['faults_per_step']:6.0f} faults ({m['late_faults_per_step']:.0f} late) {m['ms_per_step']:5.1f} ms"
            for name, m in found["arms"].items()
        )
        print(f"{part:6s} {heap:6s} {'+'.join(arms):25s} {line}", flush=True)
        return {
            "part": part,
            "heap": heap,
            "arm_set": arms,
            "rounds": rounds,
            "process": process,
            "held": found["heap"],
            "arms": found["arms"],
        }

    runs = []
    # The settings alternate, process by process, so that the machine's drift touches each alike.
    for process in range(args.processes):
        for arms in ARM_SETS:
            for heap in HEAPS:
                runs.append(measure(arms, heap, args.rounds, process, "block"))
    # Part two: one arm alone for longer, as a user's job runs. Does glibc settle by itself?
    for process in range(args.processes if args.long_rounds else 0):
        for arms in LONG_ALONE:
            for heap in HEAPS:
                runs.append(measure(arms, heap, args.long_rounds, process, "alone"))
    print("\nthe baseline's minor page faults per step, per process:")
    for heap in HEAPS:
        for arms in ARM_SETS:
            counts = [
                r["arms"]["baseline"]["faults_per_step"]
                for r in runs
                if r["part"] == "block" and r["heap"] == heap and r["arm_set"] == arms
            ]
            print(f"  heap {heap:6s}  {'+'.join(arms):25s} {', '.join(f'{c:.0f}' for c in counts)}")
    if args.long_rounds:
        print(
            f"\none arm alone for {args.long_rounds} steps: faults per step over the last quarter, per process:"
        )
        for heap in HEAPS:
            for (name,) in LONG_ALONE:
                late = [
                    r["arms"][name]["late_faults_per_step"]
                    for r in runs
                    if r["part"] == "alone" and r["heap"] == heap and r["arm_set"] == [name]
                ]
                print(f"  heap {heap:6s}  {name:25s} {', '.join(f'{c:.0f}' for c in late)}")
    if args.json:
        record = {
            "benchmark": "heap-faults",
            "model": "resnet-mini",
            "data": "textures",
            "batch_size": 32,
            "rounds": args.rounds,
            "long_rounds": args.long_rounds,
            "runs": runs,
            "machine": machine_summary(),
        }
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
