"""How long should a block's windows be? A/A noise and a real technique, for several window plans.

Run:  python benchmarks/windows.py [--processes 16] [--model mlp] [--steps 200]
          [--plans 200:1,50:1,200:0,4:0] [--json benchmarks/results/windows.json]

Each process (a fresh one, as a block is) runs the same three arms, baseline, control and
amp, once for every window plan, in a random order of plans. A plan is ``rounds:rewarm``:
``200:1`` splits the 200 timed steps into 200 windows of one step, each after one untimed
re-warm step; ``4:0`` into 4 windows of 50 steps with no re-warm. For each plan and each
estimator of the typical step (workbench.stats.ESTIMATORS) the script reports the spread
of the control/baseline log ratio across processes (the A/A noise one block carries), and
the mean amp/baseline ratio (which should not depend on the plan: if it does, the windows
bias the measurement). It also reports how much slower a window's first step is than the
rest, without re-warm: the cost of the other arms having used the caches in between.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ONE_PROCESS = r"""
import json, sys
import numpy as np
from workbench import stats
from workbench.block import ArmSpec
from workbench.config import RunConfig
from workbench.data import resolve_data
from workbench.results import _side
from workbench.techniques import parse_techniques
from workbench.worker import BlockSpec, run_block

model, steps, plans = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
data = resolve_data(None, model)
arms = [ArmSpec("baseline", []), ArmSpec("control", []), ArmSpec("amp", parse_techniques({"amp": True}))]
found = {}
for index in np.random.default_rng().permutation(len(plans)):
    rounds, rewarm = plans[index]
    run = RunConfig(steps=steps, warmup=5, rounds=rounds, batch_size=32, device="cpu")
    spec = BlockSpec(model, data, None, arms, run, block=int(index), rewarm=rewarm)
    measured = run_block(spec)["arms"]
    plan = {}
    for estimator in stats.ESTIMATORS:
        for arm in ("control", "amp"):
            ratio = stats.block_ratio(_side(measured["baseline"]), _side(measured[arm]), paired=True, estimator=estimator)
            plan[f"{arm} {estimator}"] = ratio.log_ratio
    windows = measured["baseline"]["windows"]
    if rewarm == 0 and min(len(w["step_s"]) for w in windows) > 1:
        first = np.median([w["step_s"][0] for w in windows])
        later = np.median([s for w in windows for s in w["step_s"][1:]])
        plan["first_step_penalty"] = float(first / later - 1)
    plan["step_ms"] = 1e3 * float(np.median(measured["baseline"]["step_s"]))
    found[f"{rounds}:{rewarm}"] = plan

# The machine's own floor: the same A/A with a hand-written loop, no workbench at all. Two
# copies of the model alternate in windows of 4 steps, in random order, 50 rounds.
import time, torch
from workbench.loop import default_loss
from workbench.models import build_model
batches = [(x, y) for x, y in torch.utils.data.DataLoader(data.open_dataset(0), batch_size=32, drop_last=True)]
pairs = []
for _ in range(2):
    torch.manual_seed(0)
    net = build_model(model, data.spec)
    pairs.append((net, torch.optim.AdamW(net.parameters(), lr=1e-3)))
def bare_step(net, optimizer, index):
    x, y = batches[index % len(batches)]
    default_loss(net(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
times = {0: [], 1: []}
for index in range(10):
    for arm in (0, 1):
        bare_step(*pairs[arm], index)
rng = np.random.default_rng()
for round_index in range(steps // 4):
    for arm in rng.permutation(2):
        window = []
        for step in range(4):
            started = time.perf_counter()
            bare_step(*pairs[arm], round_index * 4 + step)
            window.append(time.perf_counter() - started)
        times[arm].append(window)
bare = {}
for estimator in stats.ESTIMATORS:
    ratio = stats.block_ratio(stats.Side(times[0], 32), stats.Side(times[1], 32), paired=True, estimator=estimator)
    bare[f"control {estimator}"] = ratio.log_ratio
found["bare"] = bare
print(json.dumps(found))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--plans", default="200:1,50:1,200:0,4:0", help="rounds:rewarm, comma-separated")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import numpy as np

    from workbench import stats
    from workbench.environment import machine_summary

    plans = [[int(part) for part in plan.split(":")] for plan in args.plans.split(",")]
    started, runs = time.time(), []
    for index in range(args.processes):
        done = subprocess.run(
            [sys.executable, "-c", ONE_PROCESS, args.model, str(args.steps), json.dumps(plans)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            sys.exit(done.stderr[-3000:])
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"process {index + 1}/{args.processes} done", flush=True)
    report = {}
    print(f"\n{args.model}, {args.steps} timed steps per arm, {args.processes} processes:")
    bare = {estimator: 100 * float(np.std([run["bare"][f"control {estimator}"] for run in runs], ddof=1))
            for estimator in stats.ESTIMATORS}  # fmt: skip
    print("  a hand-written loop, two copies alternating in windows of 4 steps: A/A sd "
          + ", ".join(f"{name} {value:.2f}%" for name, value in bare.items()))  # fmt: skip
    report["bare"] = {estimator: {"aa_sd_pct": value} for estimator, value in bare.items()}
    for plan in [plan for plan in runs[0] if plan != "bare"]:
        entry = {"step_ms": float(np.mean([run[plan]["step_ms"] for run in runs]))}
        penalties = [run[plan]["first_step_penalty"] for run in runs if "first_step_penalty" in run[plan]]
        if penalties:
            entry["first_step_penalty_pct"] = 100 * float(np.median(penalties))
        rounds, rewarm = plan.split(":")
        window = args.steps / int(rounds)
        print(f"  {plan} ({int(rounds)} windows of {window:g} steps, re-warm {rewarm}), step {entry['step_ms']:.2f} ms"
              + (f", first step of a window {entry['first_step_penalty_pct']:+.1f}%" if penalties else ""))  # fmt: skip
        for estimator in stats.ESTIMATORS:
            control = np.array([run[plan][f"control {estimator}"] for run in runs])
            amp = np.array([run[plan][f"amp {estimator}"] for run in runs])
            entry[estimator] = {
                "aa_sd_pct": 100 * float(control.std(ddof=1)),
                "amp_mean": math.exp(float(amp.mean())),
                "amp_sd_pct": 100 * float(amp.std(ddof=1)),
            }
            print(f"    {estimator:26s} A/A sd {entry[estimator]['aa_sd_pct']:.2f}%   amp {entry[estimator]['amp_mean']:.3f} "
                  f"(sd {entry[estimator]['amp_sd_pct']:.1f}%)")  # fmt: skip
        report[plan] = entry
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "benchmark": "windows",
                    "model": args.model,
                    "steps": args.steps,
                    "processes": args.processes,
                    "plans": report,
                    "wall_s": time.time() - started,
                    "machine": machine_summary(),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
