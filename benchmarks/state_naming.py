"""How often the thread-state warning names an arm whose gain did not move, and how often it names one that did.

Run:  python benchmarks/state_naming.py [--runs 4] [--cuts 30] [--json benchmarks/results/state-naming.json]

Why: when a run saw the CPU threads work together at two speeds, workbench names the arms
whose speedup differed between the two states, from the rounds of blocks that saw both
(workbench.results.core_sync_states). The rounds' log ratios are treated as independent;
they drift within a block, so the nominal error rate may not hold. This script measures it.

It runs ``workbench ablate --preset quick`` ``--runs`` times (resnet-mini, five arms). In every
block that stayed in one state, it pretends the state changed at a random round (``--cuts``
cuts per block, seeded) and asks whether each arm would be named: a false naming, since
nothing changed. Then it makes channels_last gain 5% or 7% more in the "slow" rounds, and asks
whether channels_last is named: the detection rate. Each rule is a required gap and a number
of standard errors; workbench's is STATE_SPEEDUP_GAP and STATE_GAP_SE.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # quick_preset.run_once: the preset as a user types it

RULES = [(0.03, 2.0), (0.03, 2.5), (0.03, 3.0), (0.05, 2.0)]  # (gap, standard errors)
FAST_US, SLOW_US = 9.0, 11.5  # stand-in probe values: only which side of the split matters


def named(gain, gap: float, errors: float) -> bool:
    moved = abs(math.log(gain.slow / gain.fast))
    return moved > math.log1p(gap) and moved > errors * gain.log_gap_se


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--cuts", type=int, default=30, help="pretended state changes per block")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from quick_preset import run_once
    from record import write_record

    from workbench.core_sync import split_states
    from workbench.results import STATE_GAP_SE, STATE_SPEEDUP_GAP, _speedups_by_state

    started = time.time()
    cases = []  # (block record, its units): the blocks whose probes saw one state
    with tempfile.TemporaryDirectory() as folder:
        for run in range(args.runs):
            _, results = run_once(Path(folder) / f"run{run}", start="template", plan=None)
            blocks, units = results.record["blocks"], results.record["units"]
            for block in blocks:
                one_state = split_states(block.get("core_sync_us") or []) is None
                if one_state and len(block["arms"]) > 1:
                    cases.append((block, [u for u in units if u["block"] == block["block"]]))
            print(f"run {run + 1}/{args.runs}: {len(cases)} blocks in one state so far", flush=True)

    rng = random.Random(0)
    cuts = []
    for block, _ in cases:
        rounds = len(block["core_sync_us"])
        cuts.append([rng.randint(5, rounds - 5) for _ in range(args.cuts)])
    middle = (FAST_US + SLOW_US) / 2

    def gains_for(block: dict, units: list[dict], cut: int, arm: str | None, extra: float) -> dict:
        rounds = len(block["core_sync_us"])
        pretended = {**block, "core_sync_us": [FAST_US] * cut + [SLOW_US] * (rounds - cut)}
        if extra:
            units = copy.deepcopy(units)
            for unit in units:
                if unit["arm"] == arm:
                    for window in unit["result"]["windows"]:
                        if window["round"] >= cut:
                            window["step_s"] = [s / (1 + extra) for s in window["step_s"]]
        return _speedups_by_state([pretended], units, middle)

    figures: dict = {}
    for gap, errors in RULES:
        false = [
            named(g, gap, errors)
            for (b, u), cs in zip(cases, cuts, strict=True)
            for c in cs
            for g in gains_for(b, u, c, None, 0.0).values()
        ]
        row = {"false_naming": sum(false) / len(false), "trials": len(false)}
        for extra in (0.05, 0.07):
            hits = [
                named(gains_for(b, u, c, "channels_last", extra)["channels_last"], gap, errors)
                for (b, u), cs in zip(cases, cuts, strict=True)
                for c in cs
            ]
            row[f"detects_{round(100 * extra)}pct"] = sum(hits) / len(hits)
        figures[f"gap {gap:.0%}, {errors:g} SE"] = row
        mark = "   <- workbench's" if (gap, errors) == (STATE_SPEEDUP_GAP, STATE_GAP_SE) else ""
        print(
            f"gap {gap:.0%}, {errors:g} standard errors: names an unmoved arm in {row['false_naming']:.1%} of "
            f"{row['trials']} trials; names channels_last when it gains 5% more in {row['detects_5pct']:.0%}, "
            f"7% more in {row['detects_7pct']:.0%}{mark}"
        )
    if args.json:
        write_record(
            args.json,
            "state-naming",
            runs=args.runs,
            blocks_in_one_state=len(cases),
            cuts_per_block=args.cuts,
            rules=figures,
            wall_s=time.time() - started,
        )


if __name__ == "__main__":
    main()
