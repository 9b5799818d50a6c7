"""Results: the table, the raw measurements behind it, and saving/loading them.

Everything is stored as JSON (``results.json``) and CSV (``table.csv``, ``losses.csv``,
``telemetry.csv``). Loading reads JSON only; nothing is ever unpickled.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workbench import stats
from workbench.config import OVER_THE_CAP
from workbench.core_sync import oversubscription, split_states
from workbench.peak_flops import achieved_tflops, mfu_percent, peak_tflops
from workbench.plots import plot_results, plot_tune
from workbench.results_folder import ResultsFolder, json_values, write_json_atomic
from workbench.results_view import (
    LOSS_DRIFT,
    TERMINAL_WIDTH,
    WHERE_OTHER_COLUMNS_ARE,
    loss_drifted,
    results_html,
    results_text,
    shows_comm,
    shows_peak,
    verdicts,
)
from workbench.stats import PHASES

SCHEMA = "workbench-results/2"  # 2: blocks (several arms per process) replaced one process per run
READABLE_SCHEMAS = (SCHEMA, "workbench-results/1")
MAX_RESULTS_BYTES = 2**30  # read no further: a checkpoint passed by mistake is refused, not loaded
STATUSES = ("ok", "unavailable", "failed", "oom", "skipped", "diverged", "interrupted")  # an arm's, per block
# Arms that measured nothing through a fault of their own (skipped: it failed in an earlier
# block): the CLI's exit code 1, and what retry_failed runs again when resuming.
DID_NOT_RUN = ("failed", "oom", "skipped")
TABLE_COLUMNS = [
    "arm",
    "kind",
    "process",  # "block": side by side with the other arms; "own": a process of its own (see reason)
    "techniques",
    "status",
    # faster / slower / within noise: the speedup's interval against the control arm's band
    # (workbench.results_view); derived from the columns here, again whenever a record is read,
    # and stored in it as shown whenever its files are saved (Results.save), for readers of results.json.
    "verdict",
    "reason",
    "samples_per_s",
    "samples_per_s_spread",
    "speedup",
    "speedup_low",
    "speedup_high",
    # The spread of the speedup's logarithm, in percent: inside a block (from its rounds), and
    # between blocks. See workbench/stats.py.
    "within_block_pct",
    "between_block_pct",
    "step_ms",
    "data_ms",
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
    "replay_ms",
    "peak_mem_mb",
    "activation_mb",
    "peak_rss_mb",
    "startup_s",
    "final_loss",
    "loss_vs_baseline",
    "loss_gap_of_fall",  # the final losses' gap over how far the baseline's fell (results_view.loss_drifted)
    "cpu_util_pct",
    # Achieved model TFLOP/s on every device; MFU and NVML readings (GPU utilization, power
    # and SM clock, averaged over the timed windows) on CUDA. See workbench/mfu.py and workbench/peak_flops.py.
    "tflops",
    "mfu_pct",
    "gpu_util_pct",
    "gpu_power_w",
    "sm_clock_mhz",
    # Data-parallel arms (world_size > 1) only: per-rank throughput and measured communication.
    "samples_per_s_per_rank",
    "comm_mb_per_step",
    "compression_ratio",
    # What a rank sends per step with ring algorithms (a model, not a measurement): 2(N-1)/N of an
    # all-reduce's payload, (N-1) parts of a gather's; and the baseline's over the arm's.
    "wire_mb_per_step",
    "wire_ratio",
    "link_mb_per_step",  # what the simulated link carried per rank (ring algorithms), with link=
    "comm_ms",
    "comm_share",
    "comm_exposed_ms",  # communication the step waited for, after the gradients were computed
    "comm_hidden_share",  # of comm_ms, the share that ran while backward still computed
    "blocks",  # the blocks in which this arm measured
    # ... and of them, those whose baseline measured too: the blocks behind the speedup's interval
    "speedup_blocks",
    "noisy",
    "notes",
]
SHORT_WINDOW_S = 0.5  # below this (all of an arm's windows in a block), timer noise weighs on each
FINAL_LOSS_STEPS = 5  # final_loss averages the last few steps, so one noisy batch does not decide it


def _median(values: list[float]) -> float:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else math.nan


def _final_loss(result: dict) -> float:
    return float(np.mean(result["losses"][-FINAL_LOSS_STEPS:]))


def _first_loss(result: dict) -> float:
    """Where the loss started: the mean over the first steps, warm-up included."""
    return float(np.mean(result["losses"][:FINAL_LOSS_STEPS]))


def _divergence(result: dict) -> str | None:
    for index, loss in enumerate(result["losses"]):
        if loss is None or not math.isfinite(loss):
            return f"loss became {loss} at step {index + 1} (counting warm-up)"
    return None


def _side(result: dict) -> stats.Side:
    """One arm's windows in one block, for workbench.stats."""
    windows = result.get("windows") or [{"step_s": result["step_s"]}]
    return stats.Side([w["step_s"] for w in windows], result["samples"] / result["steps"])


def _baseline_of(arm: dict, arms: list[dict]) -> str | None:
    """Each kind of arm (training, loader-only) in each kind of process has its own baseline."""
    for other in arms:
        if (
            other["role"] == "baseline"
            and other.get("kind", "train") == arm.get("kind", "train")
            and other.get("process", "block") == arm.get("process", "block")
        ):
            return other["name"]
    return None


def summarize(
    arms: list[dict],
    units: list[dict],
    planned_blocks: int,
    complete: bool,
    telemetry: list[dict] | None = None,
) -> list[dict]:
    """One row per arm, from the arms' plan, the finished units and the sampler's telemetry.

    A unit is one arm in one block: ``{"arm", "block", "status", "reason", "result"}``.
    """
    by_arm: dict[str, list[dict]] = {arm["name"]: [] for arm in arms}
    earlier: dict[str, set[int]] = {}  # an arm moved to its own process -> blocks it ran in shared
    process_of = {arm["name"]: arm.get("process", "block") for arm in arms}
    for unit in units:
        arm_process = process_of.get(unit["arm"])
        if arm_process is not None and unit.get("process", "block") != arm_process:
            # Measured beside the other arms before it had to move: against another baseline,
            # in another kind of process, so not combined with its own-process blocks.
            if unit["status"] == "ok":
                earlier.setdefault(unit["arm"], set()).add(unit["block"])
            continue
        by_arm.setdefault(unit["arm"], []).append(unit)
    lingering = follower_effects(units)  # work that goes on after an arm's windows
    rows = []
    for arm in arms:
        baseline = _baseline_of(arm, arms)
        base_ok = {u["block"]: u["result"] for u in by_arm.get(baseline, []) if u["status"] == "ok"}
        # An arm moved to its own process in a later block runs alone from there on (from_block).
        planned = planned_blocks - arm.get("from_block", 0)
        row = _row(arm, sorted(by_arm[arm["name"]], key=lambda u: u["block"]), planned, complete)
        if arm["name"] in earlier:
            shared = ", ".join(str(block + 1) for block in sorted(earlier[arm["name"]]))
            row["_notes"].append(
                f"block(s) {shared} measured it beside the other arms before it moved to its own process; "
                "those figures are in the record's units, not in this row"
            )
        if row["status"] != "unavailable" and row["blocks"]:
            notes = row.pop("_notes")
            ok = [u for u in by_arm[arm["name"]] if u["status"] == "ok"]
            notes += _compare(row, arm, ok, baseline, base_ok)
            notes += _utilization(row, [u["result"] for u in ok], telemetry or [])
            effect = lingering.get(arm["name"])
            if effect is not None and effect.clear:
                notes.append(
                    f"windows that ran right after this arm's were {100 * effect.slowdown:.0f}% slower "
                    f"(+/-{100 * effect.se:.0f}%) than after other arms': its work seems to go on between its "
                    "windows (threads, prefetching), which slows the other arms; isolate=True measures every "
                    "arm in a process of its own, where it cannot"
                )
            row["notes"] = "; ".join(dict.fromkeys(notes))  # in order, each note once
        else:
            row["notes"] = "; ".join(row.pop("_notes", []))
        rows.append(row)
    return rows


def follower_effects(units: list[dict]) -> dict[str, stats.FollowerEffect]:
    """For each arm of the shared blocks: how much slower the windows right after its windows ran."""
    windows: dict[int, list[tuple[float, str, float]]] = {}  # block -> (start, arm, deviation)
    for unit in units:
        result = unit.get("result")
        if unit.get("process", "block") != "block" or not result or not result.get("windows"):
            continue
        means = [float(np.mean(w["step_s"])) for w in result["windows"] if w["step_s"]]
        usual = float(np.median(means)) if means else math.nan
        for window in result["windows"]:
            if window["step_s"]:
                deviation = math.log(float(np.mean(window["step_s"])) / usual)
                windows.setdefault(unit["block"], []).append((window["start"], unit["arm"], deviation))
    sequences = [[(arm, deviation) for _, arm, deviation in sorted(block)] for block in windows.values()]
    return stats.follower_effects(sequences)


def _row(arm: dict, arm_units: list[dict], planned_blocks: int, complete: bool) -> dict[str, Any]:
    """The arm's status and its own measurements (no comparison with the baseline yet)."""
    row: dict[str, Any] = dict.fromkeys(TABLE_COLUMNS, math.nan)
    row.update(
        arm=arm["name"],
        kind=arm.get("kind", "train"),
        # an arm that did not run ran in no process (it read "block", though DDP arms run alone)
        process="" if arm.get("unavailable") else arm.get("process", "block"),
        techniques=arm["techniques"],
        status="ok",
        reason="",
        blocks=0,
        noisy=False,
        notes="",
        _notes=[],
    )
    if arm.get("unavailable"):
        row.update(status="unavailable", reason=arm["unavailable"])
        return row
    results = _set_status(row, arm_units, planned_blocks, complete)
    if not results:
        # an arm over memory_cap_mb was measured before it was refused: its peak is the finding
        row["peak_mem_mb"] = _median([u.get("over_cap_peak_mib") for u in arm_units])
        return row
    notes = list(dict.fromkeys(note for r in results for note in r["notes"]))
    if arm.get("own_process"):
        notes.insert(0, f"its own process: {arm['own_process']}")
    notes += _set_measurements(row, results)
    row["_notes"] = notes
    return row


def _set_status(row: dict, arm_units: list[dict], planned_blocks: int, complete: bool) -> list[dict]:
    """The arm's status from its units (failed, interrupted, diverged...); its blocks' results."""
    ok = [u for u in arm_units if u["status"] == "ok"]
    bad = [u for u in arm_units if u["status"] not in ("ok", "skipped")]
    results = [u["result"] for u in ok]
    if bad:
        row.update(status=bad[0]["status"], reason=f"block {bad[0]['block'] + 1}: {bad[0]['reason']}")
    elif len(ok) < planned_blocks:
        row.update(
            status="interrupted" if not complete else "failed",
            reason=f"{len(ok)} of {planned_blocks} blocks finished before the run was stopped",
        )
    for result in results:
        divergence = _divergence(result)
        if divergence and row["status"] == "ok":
            row.update(status="diverged", reason=divergence)
    return results


def _set_measurements(row: dict, results: list[dict]) -> list[str]:
    """The arm's own figures: medians over its blocks. Returns notes about them."""
    notes = []
    # Wall clock, all timed steps: what a job like this one would see (the speedup compares
    # typical steps, so that stalls from outside the job do not move it: workbench.stats).
    throughputs = [r["samples_per_s"] for r in results]
    row["samples_per_s"], row["samples_per_s_spread"] = stats.median_and_spread(throughputs)
    # step_ms is the same figure as samples_per_s, per step (one median of one set of samples:
    # two separate medians can disagree when the number of blocks is even).
    samples_per_step = _median([r["samples_per_s"] * r["wall_s"] / r["steps"] for r in results])
    row["step_ms"] = 1e3 * samples_per_step / row["samples_per_s"]
    # The breakdown divides that same step: each phase's share of its block's timed wall clock,
    # averaged over blocks, times step_ms. Medians of each phase over blocks, taken apart from
    # step_ms's, could add up to far more or less than the step when one block stalled (a
    # bar 73% longer than the table's step was seen on a loaded machine). What no phase holds
    # (the harness between steps) stays visible as the rest of the step.
    shares = np.mean([stats.phase_shares(r) for r in results], axis=0)
    for phase, share in zip(PHASES, shares, strict=True):
        row[f"{phase}_ms"] = share * row["step_ms"]
    row["peak_mem_mb"] = _median([r["peak_mem_mib"] for r in results])
    row["activation_mb"] = _median([r.get("activation_mib") for r in results])
    row["peak_rss_mb"] = _median([r.get("peak_rss_mib") for r in results])
    # Each block builds the arm afresh; the median is the typical start-up in such a process.
    row["startup_s"] = _median([r["startup_s"] for r in results])
    if row["kind"] == "train":  # a loader-only arm trains a no-op model: its loss means nothing
        row["final_loss"] = _median([_final_loss(r) for r in results if not _divergence(r)])
    row["cpu_util_pct"] = _median([r["cpu_util_pct"] for r in results])
    row["blocks"] = len(results)
    window_s = _median([r["wall_s"] for r in results])
    if window_s < SHORT_WINDOW_S:
        notes.append(
            f"timed windows total only {1e3 * window_s:.0f} ms per block; more steps give tighter intervals"
        )
    return notes


def _compare(
    row: dict, arm: dict, ok: list[dict], baseline: str | None, base_ok: dict[int, dict]
) -> list[str]:
    """Speedup, loss and communication against the baseline of the same kind and process."""
    notes: list[str] = []
    results = [u["result"] for u in ok]
    base_results = list(base_ok.values())
    base_loss = _median([_final_loss(r) for r in base_results]) if row["kind"] == "train" else math.nan
    row["loss_vs_baseline"] = row["final_loss"] / base_loss if base_loss else math.nan
    base_first = _median([_first_loss(r) for r in base_results]) if row["kind"] == "train" else math.nan
    fall = base_first - base_loss
    row["loss_gap_of_fall"] = (row["final_loss"] - base_loss) / fall if fall > 0 else math.nan
    if all("comm_bytes_per_step" in r for r in results):
        base_comm, base_wire = (
            _median([r[key] for r in base_results if r.get(key) is not None])
            for key in ("comm_bytes_per_step", "wire_bytes_per_step")
        )
        _communication(row, results, base_comm, base_wire)
        notes += _wire_note(row, base_wire, results[0].get("world_size", 1))
    paired = [(base_ok[u["block"]], u["result"]) for u in ok if u["block"] in base_ok]
    row["speedup_blocks"] = len(paired)
    if arm["name"] == baseline:
        row.update(speedup=1.0, speedup_low=1.0, speedup_high=1.0)
    elif paired:
        notes += _speedup(row, paired, base_results)
    else:
        notes.append("no baseline block to compare with")
    row["noisy"] = stats.is_noisy(row["speedup"], row["speedup_low"], row["speedup_high"])
    notes += _parity_notes(row, arm, baseline)
    return notes


def _speedup(row: dict, paired: list[tuple[dict, dict]], base_results: list[dict]) -> list[str]:
    """The arm's speedup over the baseline from its blocks' pairs (each block's baseline result and
    its own), with its interval, into ``row``; and the notes on how far to trust it."""
    notes = []
    shared = row["process"] == "block"  # then window i of both ran in round i of one process
    sides = [(_side(b), _side(a)) for b, a in paired]
    measured = stats.arm_speedup(sides, paired=shared)
    speedup = measured.speedup
    row.update(
        speedup=speedup.point,
        speedup_low=speedup.low,
        speedup_high=speedup.high,
        within_block_pct=speedup.within_block_pct,
        between_block_pct=speedup.between_block_pct,
    )
    if speedup.blocks == 1 and not math.isfinite(speedup.low):
        notes.append("1 block of 1 step: no interval (one step says nothing of the noise); time more steps")
    elif speedup.blocks == 1:
        notes.append("1 block: the interval ignores process-to-process variation")
    if speedup.blocks_disagree:
        notes.append(
            f"blocks disagree: their ratios spread {speedup.between_block_pct:.1f}% where the noise inside a "
            f"block is {speedup.within_block_pct:.1f}%; the processes (or nodes) differed, or the machine's "
            "state changed what this arm gains, in a way the ratio does not cancel; more blocks, spread in "
            "time, average it"
        )
    if not shared:
        notes.append(_own_process_note(speedup.blocks))
    wall = _wall_ratio(paired)
    _in_the_baselines_typical_block(row, wall, base_results)
    notes += _slow_step_notes(measured, sides, shared)
    in_blocks = [  # each block's samples/s ratio beside the ratio its speedup combined
        (
            base["samples_per_s"] and arm_result["samples_per_s"] / base["samples_per_s"],
            math.exp(ratio.log_ratio),
        )
        for (base, arm_result), ratio in zip(paired, measured.ratios, strict=True)
    ]
    return notes + _wall_clock_notes(speedup.point, wall, measured.estimator, in_blocks)


def _summed_loss(ratio: float, arm: dict) -> str | None:
    """Why a grad_accum arm's loss is about 1/k of the baseline's, when it is: a loss summed over
    the batch, not averaged. Each micro-batch's sum is 1/k of the batch's, and accumulation weights
    it by its share again, so the arm's loss and gradients come out k times smaller: that read as a
    loss far 'below' the baseline's, as if the technique had helped the fit."""
    settings = (arm.get("settings") or {}).get("grad_accum") or {}
    steps = settings.get("steps")
    if (
        not isinstance(steps, int)
        or steps < 2
        or not ratio > 0
        or abs(math.log(ratio * steps)) > math.log(1.2)
    ):
        return None
    return (
        f"about 1/{steps} of the baseline's, as a loss summed over the batch gives under {steps} micro-batches: "
        f"each micro-batch's sum is 1/{steps} of the batch's, so this arm's loss and gradients read {steps} times "
        "smaller (SGD's updates with them; Adam's mostly not) and its loss does not compare; return the batch's "
        "mean loss (PyTorch's default reduction) for grad_accum to match"
    )


def _own_process_note(blocks: int) -> str:
    """What an arm measured in a process of its own, against a baseline in another, can claim."""
    if blocks == 1:  # results_view.against_noise gives it no verdict
        return (
            "measured in its own process against a baseline in another, in 1 block: the luck of two "
            "processes (10-15% here) is not in this interval, so it gets no verdict; blocks=3 or more measure it"
        )
    return (
        "measured in its own process against a baseline in its own process: the luck of two processes "
        "(10-15% here) is in this interval"
    )


def _slow_step_notes(
    measured: stats.ArmSpeedup, pairs: list[tuple[stats.Side, stats.Side]], shared: bool
) -> list[str]:
    """Say when the speedup counts every step because of a side's own slow steps (see
    workbench.stats.arm_speedup), and what the typical steps alone would have given."""
    if measured.estimator == stats.ESTIMATOR:
        return []
    typical = stats.combine_blocks(
        [stats.block_ratio(base, arm, paired=shared, estimator=stats.ESTIMATOR) for base, arm in pairs]
    ).point
    # The figures the rule judged by: the capped mean over the typical step (a stall's share
    # of the plain mean would show here as the job's own, which the rule did not count).
    arm_excess = [stats.slow_step_excess_pct(arm, every_step="capped_mean") for _, arm in pairs]
    base_excess = [stats.slow_step_excess_pct(base, every_step="capped_mean") for base, _ in pairs]
    return [
        f"slow steps of the job's own: its mean step (no step counting for more than {stats.STALL_CAP:.0f} "
        f"median steps) exceeded its typical step by {_percent_range(arm_excess)} in the blocks, the "
        f"baseline's by {_percent_range(base_excess)}, so the speedup counts every step (that mean); "
        f"by typical steps alone it would be {typical:.2f}"
    ]


def _wall_ratio(paired: list[tuple[dict, dict]]) -> float:
    """The arm's samples/s over the baseline's inside the blocks: the median of each block's ratio."""
    return _median(
        [arm["samples_per_s"] / base["samples_per_s"] for base, arm in paired if base["samples_per_s"]]
    )


def _in_the_baselines_typical_block(row: dict, wall: float, base_results: list[dict]) -> None:
    """The arm's samples/s, step and phases as they would read in the baseline's typical block.

    Each arm's own median over blocks would take its figures from other blocks than the
    baseline's: when blocks differ a lot (another job on the machine slowed one block 17x), an
    arm slower than the baseline in two blocks of three showed 2.7x its samples/s. So, as a
    blocked design adjusts for its blocks, the arm's figure is its ratio to the baseline inside
    each block (``wall``, the median of those ratios) times the baseline's own median: the columns then
    agree with each other and, up to what typical steps leave out, with the speedup. With blocks
    that agree, this is the arm's own median, near enough."""
    typical = _median([result["samples_per_s"] for result in base_results])
    own = row["samples_per_s"]
    if not (wall > 0 and typical > 0 and own > 0):
        return
    factor = wall * typical / own
    row["samples_per_s"] = own * factor
    row["step_ms"] /= factor
    for phase in PHASES:
        row[f"{phase}_ms"] /= factor


WALL_CLOCK_GAP = 0.10  # samples/s against the speedup: on a quiet machine they agree within about 1%


def _wall_clock_notes(
    speedup: float, wall: float, estimator: str, in_blocks: list[tuple[float, float]]
) -> list[str]:
    """Say why the arm's samples/s and its speedup disagree, when they do by more than WALL_CLOCK_GAP.

    samples/s counts every timed step (what a job would see); the speedup compares typical steps,
    so that a stall from outside the job, landing on one arm's window by chance, does not move it
    (workbench.stats). On a loaded machine the two can then differ a lot, and a table showing a
    control at 0.99x beside 40% fewer samples/s than the baseline needs its reason beside it.
    ``wall``: the arm's samples/s over the baseline's inside the blocks (``_wall_ratio``).
    ``in_blocks``: each block's (samples/s ratio, speedup). Where those agree block by block, the
    gap is not stalls but the blocks: samples/s is the middle block's, the speedup all blocks'."""
    if not (wall > 0 and speedup > 0) or abs(math.log(wall / speedup)) <= math.log1p(WALL_CLOCK_GAP):
        return []
    gaps = [abs(math.log(w / s)) for w, s in in_blocks if w > 0 and s > 0]
    if gaps and max(gaps) <= math.log1p(WALL_CLOCK_GAP):
        shown = ", ".join(f"{s:.2f}x" for _, s in in_blocks)
        return [
            f"samples/s reads {wall:.2f}x the baseline's and the speedup {speedup:.2f}x because the blocks "
            f"disagree (this arm's speedup was {shown} in them, each block's samples/s agreeing with it): "
            "samples/s is the middle block's, the speedup combines every block"
        ]
    if estimator != stats.ESTIMATOR:  # the speedup already counts every step, each stall capped
        return [
            f"samples/s, which counts every timed step, came out at {wall:.2f}x the baseline's inside the blocks "
            f"against a speedup of {speedup:.2f}x from the mean step with no step counting for more than "
            f"{stats.STALL_CAP:.0f} median steps: a few very long stalls cost this arm or the baseline more time "
            "than the cap lets them count (workbench.stats)"
        ]
    return [
        f"samples/s, which counts every timed step, came out at {wall:.2f}x the baseline's inside the blocks "
        f"against a speedup of {speedup:.2f}x from typical steps: steps stalled by something outside the job "
        "(another process, the host) cost this arm or the baseline more time by chance, and the speedup does "
        "not let such stalls move it (workbench.stats)"
    ]


def _percent_range(values: list[float]) -> str:
    """``"5% to 9%"`` (a minus sign stays readable: "-1% to 9%"), or ``"6%"`` when they round alike."""
    low, high = (round(value) + 0 for value in (min(values), max(values)))  # + 0: never "-0"
    return f"{low}%" if low == high else f"{low}% to {high}%"


def _parity_notes(row: dict, arm: dict, baseline: str | None) -> list[str]:
    """Warnings when the loss drifted from the baseline's, or the control missed its own interval."""
    notes = []
    drift = row["loss_vs_baseline"] - 1.0
    drifted = arm["name"] != baseline and loss_drifted(row["loss_vs_baseline"], row["loss_gap_of_fall"])
    if arm["name"] != baseline and abs(drift) > LOSS_DRIFT and not drifted:
        notes.append(
            f"final loss {abs(drift):.0%} {'above' if drift > 0 else 'below'} the baseline's, but both near the end "
            f"of their fall: the gap is {abs(row['loss_gap_of_fall']):.1%} of how far the baseline's loss fell, "
            "which the last steps' batches decide; not a change in convergence"
        )
    if drifted:
        why = (
            # A different pipeline draws its own random augmentations (crops, flips): the arms
            # trained on different samples of the same distribution, not on different maths.
            "this input pipeline draws its own random augmentations, so the arms saw different "
            "samples; compare over more steps"
            if arm.get("input_pipeline")
            else _summed_loss(row["loss_vs_baseline"], arm) or "the technique changed the numerics"
        )
        notes.append(
            f"convergence: final loss {abs(drift):.0%} {'above' if drift > 0 else 'below'} the baseline's "
            f"after the same steps; {why}"
        )
    interval = (row["speedup_low"], row["speedup_high"])
    if (
        arm["role"] == "control"
        and all(map(math.isfinite, interval))
        and not interval[0] <= 1.0 <= interval[1]
    ):
        notes.append(
            "A/A check failed: this rerun of the baseline is outside its own interval, so the machine "
            "is noisier than the intervals say; distrust small speedups"
        )
    return notes


def _utilization(row: dict, results: list[dict], telemetry: list[dict]) -> list[str]:
    """tflops and mfu_pct from the counted FLOPs; the GPU's NVML readings inside the timed windows."""
    notes = []
    if all("flops_per_sample" in r for r in results):
        # from the row's samples/s: read in the baseline's typical block, as the other columns are
        row["tflops"] = achieved_tflops(
            _median([r["flops_per_sample"] for r in results]), row["samples_per_s"]
        )
        device_name, dtype = results[0].get("device_name", "cpu"), results[0].get("compute_dtype", "float32")
        if device_name != "cpu":
            peak, which = peak_tflops(device_name, dtype)
            if peak is None:
                notes.append(f"no MFU: {which}")
            else:
                row["mfu_pct"] = mfu_percent(row["tflops"], peak, gpus=max(1, len(results[0]["nvml_gpus"])))
    gpus = results[0].get("nvml_gpus") or []
    if gpus and telemetry:
        for column, reading in (("gpu_util_pct", "util_percent"), ("gpu_power_w", "power_w"),
                                ("sm_clock_mhz", "sm_clock_mhz")):  # fmt: skip
            # Only the samples taken while one of this arm's windows ran (not another arm's).
            spans = [(w["start"], w["end"]) for r in results for w in r.get("windows", [])]
            values = [
                sample[f"gpu{index}_{reading}"]
                for sample in telemetry
                if any(start <= sample["time"] <= end for start, end in spans)
                for index in gpus
                if f"gpu{index}_{reading}" in sample
            ]
            row[column] = float(np.mean(values)) if values else math.nan
        if math.isnan(row["gpu_util_pct"]) and row["process"] == "block":
            notes.append(
                "no GPU readings for this arm: in a block the arms take turns every few milliseconds and NVML "
                "samples once a second, so GPU utilization, power and clock describe the block (res.telemetry)"
            )
        elif math.isnan(row["gpu_util_pct"]):
            notes.append(
                "no GPU readings inside this arm's timed windows (NVML samples once a second); use more steps"
            )
    return notes


def _communication(row: dict, results: list[dict], base_comm: float, base_wire: float) -> None:
    """The DDP columns: bytes the hooks handed to collectives, their ratio to the baseline's, time."""
    comm_bytes = _median([r["comm_bytes_per_step"] for r in results])
    row["comm_mb_per_step"] = comm_bytes / 2**20
    row["compression_ratio"] = base_comm / comm_bytes if comm_bytes else math.nan
    wire = _median([r.get("wire_bytes_per_step") for r in results])  # nan in a record from before
    row["wire_mb_per_step"] = wire / 2**20
    row["wire_ratio"] = base_wire / wire if wire else math.nan
    row["comm_ms"] = _median([r["comm_ms_per_step"] for r in results])
    row["comm_share"] = row["comm_ms"] / row["step_ms"] if row["step_ms"] else math.nan
    row["link_mb_per_step"] = _median([r.get("link_bytes_per_step") for r in results]) / 2**20
    row["comm_exposed_ms"] = _median([r.get("comm_exposed_ms_per_step") for r in results])
    row["comm_hidden_share"] = (
        float(np.clip(1.0 - row["comm_exposed_ms"] / row["comm_ms"], 0.0, 1.0))  # medians of blocks
        if row["comm_ms"] and row["comm_ms"] > 0
        else math.nan
    )
    per_rank = [r.get("per_rank") or [r] for r in results]
    row["samples_per_s_per_rank"] = _median(
        [float(np.mean([x["samples_per_s"] for x in ranks])) for ranks in per_rank]
    )


WIRE_GAIN_SHORT = 1.5  # a payload gain this many times the wire's is worth a note


def _wire_note(row: dict, base_wire: float, ranks: int) -> list[str]:
    """Where a hook's payload shrinks far more than what goes over the wire: a gather (topk, int8)
    sends its part to every other rank, so its compression_ratio (int8's 4.0 at any world size)
    overstated the saving, and at 16 ranks int8 sends twice the baseline's bytes."""
    payload, wire = row.get("compression_ratio", math.nan), row.get("wire_ratio", math.nan)
    if not (math.isfinite(payload) and math.isfinite(wire)) or payload <= WIRE_GAIN_SHORT * wire:
        return []
    more = "more than" if wire < 1 else "against"
    return [
        f"its payload is {payload:.1f}x smaller than the baseline's, but on the wire (ring algorithms, "
        f"{ranks} ranks) it sends {row['wire_mb_per_step']:.3g} MiB per step per rank, {more} the baseline's "
        f"{base_wire / 2**20:.3g} (wire_ratio {wire:.2f}): a gather hands each rank's part to every other"
    ]


class Results:
    """The outcome of an ablation. ``table`` is the summary; the rest is what it came from."""

    def __init__(self, record: dict, path: Path | None = None):
        # The record in its JSON form (an unavailable figure is None, never NaN), so a Results
        # fresh from a run and one read back from results.json are equal; Results.table turns
        # None into NaN in its number columns, as pandas does.
        self.record = json_values(record)
        self.path = path

    @property
    def table(self):
        import pandas as pd

        table = pd.DataFrame(self.record["table"], columns=TABLE_COLUMNS)
        text = (
            "arm",
            "kind",
            "process",
            "techniques",
            "status",
            "verdict",
            "reason",
            "notes",
            "noisy",
            "blocks",
        )
        numeric = [c for c in TABLE_COLUMNS if c not in text]
        table[numeric] = table[numeric].astype(float)
        table["blocks"] = table["blocks"].fillna(0).astype(int)
        # Records saved before the column existed: their arms' blocks (all paired, as a rule).
        table["speedup_blocks"] = table["speedup_blocks"].fillna(table["blocks"]).astype(int)
        table["noisy"] = table["noisy"].astype(bool)
        table["verdict"] = verdicts(table, self.record.get("arms", []))
        return table

    @property
    def best(self) -> dict[str, dict]:
        """The winning techniques mapping, ready for ``wb.ablate(techniques=...)``: the tuner's
        winner (``wb.tune``), or in an ablation the arm with the highest speedup among those whose
        verdict is "faster" (the whole interval above the control arm's band) and whose loss
        matches the baseline's. ``{}`` (the baseline:
        switch nothing on) when nothing was measurably faster."""
        if "tune" in self.record:
            return dict((self.record["tune"].get("best") or {}).get("techniques") or {})
        roles = {arm["name"]: arm for arm in self.record["arms"]}
        table = self.table
        matching = [
            not loss_drifted(ratio, gap)
            for ratio, gap in zip(table.loss_vs_baseline, table.loss_gap_of_fall, strict=True)
        ]
        winners = table[
            table.arm.map(lambda name: roles.get(name, {}).get("role") == "treatment")
            & (table.kind == "train")
            & (table.verdict == "faster")
            & np.array(matching, dtype=bool)
        ]
        if winners.empty:
            return {}
        arm = roles[winners.sort_values("speedup", ascending=False).arm.iloc[0]]
        return dict(arm.get("settings") or dict.fromkeys(arm["technique_names"], True))

    @property
    def tuning(self):
        """The tuner's candidates (``wb.tune``): how far each got, its last figures, why it left."""
        import pandas as pd

        columns = ["name", "rounds", "blocks", "speedup", "speedup_low", "speedup_high",
                   "loss_vs_baseline", "dropped_in_round", "dropped", "techniques"]  # fmt: skip
        tune = self.record.get("tune")
        if tune is None:
            raise ValueError("Results.tuning: these results come from an ablation, not from wb.tune")
        rows = [{**entry, "techniques": json.dumps(entry["techniques"])} for entry in tune["candidates"]]
        table = pd.DataFrame(rows, columns=columns)
        for column in ("speedup", "speedup_low", "speedup_high", "loss_vs_baseline"):
            table[column] = table[column].astype(float)
        # a round is a whole number, and a finalist has none: 1 and <NA>, not 1.0 and NaN
        table["dropped_in_round"] = table["dropped_in_round"].astype("Int64")
        return table

    @property
    def config(self) -> dict:
        return self.record["config"]

    @property
    def environment(self) -> dict:
        return self.record["environment"]

    @property
    def complete(self) -> bool:
        return bool(self.record.get("complete"))

    @property
    def losses(self):
        """Long-format loss curves: arm, block, step (1 = first warm-up step), loss, timed. Training
        arms only: a loader-only arm trains a no-op model, whose loss means nothing."""
        import pandas as pd

        loader_only = {arm["name"] for arm in self.record.get("arms", []) if arm.get("kind") == "loader"}
        rows = []
        for unit in self.record["units"]:
            if unit["status"] != "ok" or unit["arm"] in loader_only:
                continue
            result = unit["result"]
            # Which steps the clock timed: not the warm-up, nor the untimed re-warm step of each window.
            timed = result.get("timed") or [
                index >= result["warmup"] for index in range(len(result["losses"]))
            ]
            for index, (loss, in_window) in enumerate(zip(result["losses"], timed, strict=True)):
                rows.append(
                    {
                        "arm": unit["arm"],
                        "block": unit["block"],
                        "step": index + 1,
                        "loss": loss,
                        "timed": in_window,
                    }
                )
        return pd.DataFrame(rows, columns=["arm", "block", "step", "loss", "timed"])

    @property
    def blocks(self):
        """One row per process that ran: its block, the arms side by side in it, rounds, order, RSS,
        what it did to its C heap, the median of its fork-join probes (how fast the CPU threads
        worked together, workbench.core_sync; NaN where not probed) and how many of its rounds
        the threads were in the slow state, where the run saw two (see core_sync_states)."""
        import pandas as pd

        blocks = self.record.get("blocks", [])
        middle = split_states(_probes_of(blocks))
        rows = [
            {
                "block": b["block"],
                "process": "block" if len(b["arms"]) > 1 else "own",
                "arms": ", ".join(b["arms"]),
                "rounds": b["rounds"],
                "window_steps": b["window_steps"][0] if b["window_steps"] else 0,
                "warmup": b["warmup"],
                "rss_growth_mb": b["rss_growth_mib"],
                "attempts": b.get("attempts", 1),
                "wall_s": b.get("wall_s"),
                "host": b.get("host"),
                "device_name": b.get("device_name"),
                "slurm_job_id": b.get("slurm_job_id"),
                "heap": b.get("heap"),  # what the process did to glibc's malloc (workbench.heap)
                "core_sync_us": _median(b.get("core_sync_us") or []),
                "core_sync_slow_rounds": sum(p > middle for p in b.get("core_sync_us") or [])
                if middle
                else 0,
            }
            for b in blocks
        ]
        return pd.DataFrame(
            rows,
            columns=[
                "block",
                "process",
                "arms",
                "rounds",
                "window_steps",
                "warmup",
                "rss_growth_mb",
                "attempts",
                "wall_s",
                "host",
                "device_name",
                "slurm_job_id",
                "heap",
                "core_sync_us",
                "core_sync_slow_rounds",
            ],
        )

    @property
    def telemetry(self):
        """Machine-wide samples taken while the ablation ran (time, cpu_percent, memory_used_mib)."""
        import pandas as pd

        return pd.DataFrame(self.record.get("telemetry", []))

    def plot(self, width: float = 13.0):
        """Speedups with their intervals, the step breakdown and memory, one row per arm;
        ``width`` in inches (the panel draws at 10, to keep its text legible in a notebook);
        narrower than 10, the three panels stand one above the other."""
        return plot_results(self, width)

    def plot_tuning(self, path=None):
        """The tuner's search (``wb.tune``): each candidate's speedup and interval round by round,
        the winner marked; also saved as tune.png in the search's folder."""
        if "tune" not in self.record:
            raise ValueError("Results.plot_tuning: these results come from an ablation, not from wb.tune")
        return plot_tune(self, path)

    @property
    def tuning_verdict(self) -> str:
        """The tuner's verdict in one paragraph: the winner with its interval and loss, the runner-up."""
        if "tune" not in self.record:
            raise ValueError("Results.tuning_verdict: these results come from an ablation, not from wb.tune")
        return tune_verdict(self.record["tune"])

    def save(self, path: str | os.PathLike | ResultsFolder) -> Path:
        """Write results.json, table.csv, losses.csv, telemetry.csv and plot.png into the folder
        ``path``; each is entered in the folder's manifest (see workbench.results_folder).

        The folder must be new, empty, or this same run's (saved again): one that holds the
        user's own files or another run's results is refused, as ``ablate`` refuses such an
        ``out``, and the folder's lock is held while the files are written."""
        if isinstance(path, ResultsFolder):  # a run's own folder, which the run holds locked
            return self._write(path)
        folder = ResultsFolder(path)
        if folder.path.exists() and not folder.path.is_dir():
            raise ValueError(f"save: {str(folder.path)!r} is a file; name a folder for the results")
        folder.refuse_inside_another_run("save: ")
        foreign = folder.foreign_files(limit=5)
        if foreign:
            raise ValueError(
                f"save: {str(folder.path)!r} holds files that workbench did not write ({', '.join(foreign)}"
                f"{', ...' if len(foreign) == 5 else ''}); choose a new or empty folder"
            )
        if folder.own_files() and not self._is_saved_in(folder.path):
            raise ValueError(
                f"save: {str(folder.path)!r} holds another workbench run's results; choose a new or empty folder"
            )
        folder.lock()
        try:
            return self._write(folder)
        finally:
            folder.unlock()

    def _is_saved_in(self, path: Path) -> bool:
        """Whether ``path`` holds this run's results (an earlier save, or the run's own folder)."""
        try:
            saved = json.loads((path / "results.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(saved, dict) and run_identity(saved) == run_identity(self.record)

    def _write(self, folder: ResultsFolder) -> Path:
        folder.path.mkdir(parents=True, exist_ok=True)
        table = self.table
        # The verdicts as shown, for whoever reads results.json; Results.table derives them again.
        for row, verdict in zip(self.record["table"], table["verdict"], strict=True):
            row["verdict"] = verdict
        write_json_atomic(folder.file("results.json"), self.record)
        table.to_csv(folder.file("table.csv"), index=False)
        self.losses.to_csv(folder.file("losses.csv"), index=False)
        self.telemetry.to_csv(folder.file("telemetry.csv"), index=False)
        figure = self.plot()
        figure.savefig(folder.file("plot.png"), dpi=110)
        return folder.path

    @property
    def core_sync_us(self) -> float | None:
        """The median of every block's fork-join probes (workbench.core_sync): how fast the CPU
        threads worked together during this run; None where nothing was probed."""
        probes = _probes_of(self.record.get("blocks", []))
        return _median(probes) if probes else None

    @property
    def load(self) -> dict:
        """The competing load while the run measured (workbench.telemetry.competing_load)."""
        return self.record.get("load") or {}

    def warnings(self, thread_states: bool = True) -> list[str]:
        """What makes this run's figures less trustworthy, most important first: a budget cut for a
        smoke test (WORKBENCH_SMOKE=1), a control arm that failed its own A/A check, other processes
        competing for the machine, more CPU threads than cores, blocks that ran at very different
        speeds, then (``thread_states``; a comparison says it its own way) the CPU threads'
        cooperation changing state."""
        found = [self.record["smoke_test"]] if self.record.get("smoke_test") else []
        table = self.table
        found += _baseline_did_not_run(table)
        control = table[
            (table.arm == "baseline (control)") & table.speedup_low.notna() & table.speedup_high.notna()
        ]
        for row in control.itertuples():
            if not row.speedup_low <= 1.0 <= row.speedup_high:
                found.append(
                    f"the control arm (the baseline measured again) came out at {row.speedup:.2f} "
                    f"[{row.speedup_low:.2f}, {row.speedup_high:.2f}], not 1: this run's noise is larger than its "
                    "intervals say. Treat every speedup here with suspicion; rerun with more blocks, on a quieter "
                    "machine, or with fewer threads than cores (the threads setting)"
                )
        if self.load.get("warning"):
            found.append(self.load["warning"])
        found += oversubscribed_blocks(self.record.get("blocks", []))
        found += mixed_blocks(self.record.get("blocks", []), self.record.get("units", []))
        if not thread_states:
            return found
        # An oversubscribed block's probe times threads waiting for cores: that is warned of above.
        fitting = [block for block in self.record.get("blocks", []) if not _oversubscribed(block)]
        found += core_sync_states(
            fitting, self.record.get("units", []), self.record.get("arms"), bool(self.load.get("warning"))
        )
        return found

    def summary(
        self, width: int | None = None, colour: bool = False, spell: Callable[[str], str] | None = None
    ) -> str:
        """The reader's table as text within ``width`` columns (80 unless given): each arm's
        verdict, speedup with its interval, throughput, step time, activations and loss parity;
        then why an arm did not run, and each arm's notes. ``colour``: ANSI colours for the verdicts.
        ``spell``: rewords the warnings and the notes under the table, and why an arm ran out of
        memory (not an arm's other reasons and notes, which may quote a technique's options or the
        user's own error) before they are wrapped; the CLI's
        ``ablate`` and ``show`` pass one that names its flags (``--blocks 9``) for the API's
        keywords (``blocks=9``)."""
        width = width or TERMINAL_WIDTH
        spell = spell or (lambda text: text)
        table = self.table
        text = "".join(
            # not broken at hyphens: a flag ("--batch-size") or a path would be cut in two
            textwrap.fill(f"WARNING: {spell(warning)}", width, break_on_hyphens=False) + "\n\n"
            for warning in self.warnings()
        )
        text += results_text(table, width, colour, self.path, spell)
        peak, comm = shows_peak(table), shows_comm(table)
        text += "\n" + textwrap.fill(
            spell(
                (
                    "peak: the most the arm's tensors held in a step (MiB), what memory_cap_mb is checked against. "
                    if peak
                    else ""
                )
                + "activations: what autograd saved for backward (MiB). "
                + (
                    "comm: what a rank's gradient synchronization sent per optimizer step (MiB, the payload "
                    "its hook handed over). "
                    if comm
                    else ""
                )
                + "Every other column ("
                + ("" if peak else "peak memory, ")
                + "the step's phases, utilization, "
                + ("communication's time and share" if comm else "communication")
                + f") {WHERE_OTHER_COLUMNS_ARE}."
            ),
            width,
            break_on_hyphens=False,
        )
        problems = [
            (row.arm, f"{row.status}: {_reason(row, spell)}") for row in table.itertuples() if row.reason
        ]
        flagged = [(row.arm, row.notes) for row in table.itertuples() if row.notes]
        for heading, entries in (("Not run or not ok", problems), ("Notes", flagged)):
            if entries:
                text += f"\n\n{heading}:\n" + "\n".join(
                    textwrap.fill(
                        f"{arm}: {words}",
                        width,
                        initial_indent="  ",
                        subsequent_indent="    ",
                        break_on_hyphens=False,
                    )
                    for arm, words in entries
                )
        return text

    def __repr__(self) -> str:
        state = "complete" if self.complete else "partial"
        return f"<workbench Results ({state}, {len(self.record['table'])} arms)>\n{self.summary()}"

    def _repr_html_(self) -> str:
        """In a notebook: the reader's table (verdicts, formatted figures) that fits the page,
        every other column behind a "details" toggle."""
        return results_html(self.table, self.warnings(), self.path)

    def to_html(self, path: str | os.PathLike | None = None) -> Path:
        """Write one self-contained HTML report (the plots embedded, the table and verdicts, the
        warnings, the environment and the command that reproduces the run) to ``path``,
        by default report.html in the results folder. It opens offline."""
        from workbench.report import write_report

        return write_report(self, path)


def _baseline_did_not_run(table) -> list[str]:
    """Said first: with no baseline, no arm has a speedup, and the reason is usually the user's
    model, data or loss (an arm of its own would fail alike)."""
    baseline = table[(table.arm == "baseline") & table.samples_per_s.isna()]
    return [_why_no_speedup(row) for row in baseline.itertuples() if row.status != "unavailable"]


def _why_no_speedup(row) -> str:
    if row.status == "oom" and OVER_THE_CAP in row.reason:
        # it ran, and was measured: what it needs is the finding, not a fault to fix
        return (
            f"the baseline needs more memory than the cap allows, so no arm has a speedup: {row.reason}. "
            "peak_mem_mb shows what each arm needs; raise memory_cap_mb to compare their speed"
        )
    return f"the baseline did not run, so no arm has a speedup: {row.status}, {row.reason}. " + (
        "Run the same command again (the same out) to resume it"
        if row.status == "interrupted"  # stopped before it finished: nothing to fix
        else "Fix that and run again (each arm's traceback is kept under units in results.json: "
        "res.record['units'])"
    )


def oversubscribed_blocks(blocks: list[dict]) -> list[str]:
    """A warning when a CPU block ran more intra-op threads than it had cores
    (workbench.core_sync.oversubscription): its steps measured threads waiting for cores."""
    where: dict[tuple[str, str], list[int]] = {}
    for block in blocks:
        what = _oversubscribed(block)
        if what:
            where.setdefault((what, _remedy(block)), []).append(block["block"] + 1)
    return [
        f"block{'s' * (len(set(numbers)) > 1)} {', '.join(map(str, sorted(set(numbers))))} ran {what}: a "
        "parallel operation ends when its slowest thread does, and threads without a core wait for one, so "
        "every arm's steps ran slower and noisier than the same job with a thread per core, and the speedups "
        f"describe that oversubscribed job. {remedy}"
        for (what, remedy), numbers in where.items()
    ]


def _remedy(block: dict) -> str:
    """What to change when a block's threads outnumbered its cores: with more ranks than cores,
    one thread each (the fewest) is still too many, so the ranks are what to cut."""
    ranks, cores = block.get("ranks_here") or 1, block["usable_cores"]
    if ranks > cores:
        return (
            f"Run at most {cores} ranks on this machine (world_size), or spread them over machines "
            "(torchrun, or Slurm)"
        )
    return "Leave threads at its default, or set it (or OMP_NUM_THREADS) to at most the cores per rank"


def _oversubscribed(block: dict) -> str | None:
    if block.get("device_type") != "cpu" or not block.get("usable_cores") or not block.get("torch_threads"):
        return None  # a GPU block's steps do not wait on the CPU's threads; older records lack the figures
    return oversubscription(block["torch_threads"], block["usable_cores"], block.get("ranks_here") or 1)


BLOCK_SPEED_SPREAD = 1.5  # baseline speeds of blocks further apart than this are not process luck


def mixed_blocks(blocks: list[dict], units: list[dict]) -> list[str]:
    """Blocks that ran on different kinds of device, or at very different speeds (nodes of
    different kinds, a busy node): each speedup is still computed inside its block, so it stays
    fair, but a mix means the figures average over machines, and the absolute throughputs do."""
    found = []
    kinds = sorted({b["device_name"] for b in blocks if b.get("device_name")})
    if len(kinds) > 1:
        found.append(
            f"the blocks ran on {len(kinds)} kinds of device ({'; '.join(kinds)}): a speedup can depend on the "
            "device, so this run's average over them. On a cluster, keep one kind with slurm's constraint"
        )
    speeds: dict[int, list[float]] = {}
    for unit in units:
        rate = (unit.get("result") or {}).get("samples_per_s")
        if unit["arm"] == "baseline" and unit["status"] == "ok" and rate:
            speeds.setdefault(unit["block"], []).append(rate)
    if len(speeds) >= 2:
        typical = {block: _median(values) for block, values in speeds.items()}
        slowest, fastest = min(typical, key=typical.get), max(typical, key=typical.get)
        if typical[fastest] > BLOCK_SPEED_SPREAD * typical[slowest]:
            hosts = {b["block"]: b["host"] for b in blocks if b.get("host")}

            def where(block: int) -> str:
                return f"block {block + 1}" + (f" on {hosts[block]}" if block in hosts else "")

            found.append(
                f"the blocks ran at very different speeds: the baseline made {typical[slowest]:.0f} samples/s in "
                f"{where(slowest)} and {typical[fastest]:.0f} in {where(fastest)}, {typical[fastest] / typical[slowest]:.1f}x "
                f"(more than the {BLOCK_SPEED_SPREAD}x that a process's luck gives). The speedups are computed inside "
                "each block, so the difference cancels in them; the absolute throughputs mix "
                + ("slow and fast machines" if len(set(hosts.values())) > 1 else "slow and fast blocks")
            )
    return found


# An arm whose speedup differs between the machine's two states by more than this, and by more
# than STATE_GAP_SE standard errors of the difference, is named. Three, not two: the rounds of
# a block drift, so their ratios are not independent and two standard errors named an arm
# that did not move in 8.3% of trials; three in 0.7%, while still naming a 7% gap in 68%
# (benchmarks/state_naming.py, BENCHMARKS.md).
STATE_SPEEDUP_GAP = 0.03
STATE_GAP_SE = 3.0
MIN_ROUNDS_PER_STATE = 3  # fewer rounds in a state give its speedup no weight


def _probes_of(blocks: list[dict]) -> list[float]:
    """Every fork-join probe the run's blocks took (workbench.core_sync), block after block."""
    return [probe for block in blocks for probe in block.get("core_sync_us") or []]


def core_sync_states(
    blocks: list[dict], units: list[dict], arms: list[dict] | None = None, others_busy: bool = False
) -> list[str]:
    """A warning when the machine's threads worked together at two speeds while the run measured.

    Each block probed, after every round, how long a tiny operation split over the CPU threads
    takes (workbench.core_sync). If the probes fall into two states, the warning says which
    blocks were slow. In blocks that saw both states, each shared-process arm's speedup is also
    taken in each state (from that state's rounds: process luck cancels), and the arms whose
    speedup clearly differs between the states (StateGain.moved) are named. ``arms`` (the
    record's) gives each arm its own baseline (a loader-only arm's is the loader's baseline);
    without it every arm is compared with "baseline". ``others_busy``: other processes' load was
    warned of, and is then the likelier cause than the host's placement of virtual CPUs.
    """
    probes = _probes_of(blocks)
    middle = split_states(probes)
    if middle is None:
        return []
    fast_us = _median([p for p in probes if p <= middle])
    slow_us = _median([p for p in probes if p > middle])
    where, slow = [], 0
    for block in blocks:
        probed = block.get("core_sync_us") or []
        slow_here = sum(probe > middle for probe in probed)
        # not a passing interruption; a block that took no probes (one thread) says nothing
        if probed and slow_here >= min(MIN_ROUNDS_PER_STATE, len(probed)):
            share = "all its rounds" if slow_here == len(probed) else f"{slow_here} of {len(probed)}"
            own = f"the process of {block['arms'][0]} in " if len(block.get("arms", [])) == 1 else ""
            where.append(f"{own}block {block['block'] + 1} ({share})")
            slow += slow_here
    if not where:
        return []
    text = (
        f"the CPU threads worked together at two speeds while this ran (workbench.core_sync's probe after each "
        f"round: {slow_us:.1f} us in {slow} rounds, in {', '.join(where)}; {fast_us:.1f} us in the others). "
        + (
            "Other processes were busy on this machine meanwhile (warned of above): a thread that waits for a "
            "core they hold slows the others, most likely the cause here. "
            if others_busy
            else "On a virtual machine this most likely follows where the host puts its virtual CPUs. "
        )
        + "Blocks cancel what slows every arm alike, "
        "not a change in an arm's gain, and some gains move with this state (channels_last's most, by up to 7% "
        "on the CI VM): their blocks can disagree, and their figures move from run to run"
    )
    gaps = [
        f"{arm} {gain.fast:.2f}x when they were fast, {gain.slow:.2f}x when slow"
        for arm, gain in _speedups_by_state(blocks, units, middle, arms).items()
        if gain.moved
    ]
    if gaps:
        text += (
            ". Inside the blocks that saw both states, these speedups differed: " + "; ".join(gaps) + ". "
            "Give such arms more blocks, spread in time, or compare at one thread (threads=1)"
        )
    return [text]


@dataclass
class StateGain:
    """One arm's speedup in the fast and the slow state, and whether the difference is clear."""

    fast: float
    slow: float
    log_gap_se: float  # the standard error of log(slow / fast)

    @property
    def moved(self) -> bool:
        """Further apart than STATE_SPEEDUP_GAP, and than STATE_GAP_SE standard errors."""
        gap = abs(math.log(self.slow / self.fast))
        return gap > math.log1p(STATE_SPEEDUP_GAP) and gap > STATE_GAP_SE * self.log_gap_se


def _speedups_by_state(
    blocks: list[dict], units: list[dict], middle: float, arms: list[dict] | None = None
) -> dict[str, StateGain]:
    """Each shared-process arm's speedup over its own baseline in its block, in the fast and the
    slow state (baselines themselves are not compared: a loader's with the training one's would
    measure nothing).

    Round by round inside a block the arm and the baseline ran side by side, so each round gives a
    log ratio of their typical steps with the process's luck cancelled. A block that saw both
    states (at least MIN_ROUNDS_PER_STATE rounds in each) gives the mean log ratio in each state
    and the difference's standard error; blocks are combined weighted by the inverse variance.
    """
    probes = {
        block["block"]: block["core_sync_us"]
        for block in blocks
        if len(block.get("arms", [])) > 1 and block.get("core_sync_us")
    }
    windows: dict[tuple[int, str], dict[int, list[float]]] = {}
    for unit in units:
        result = unit.get("result")
        if (
            unit.get("process", "block") == "block"
            and unit["status"] == "ok"
            and result
            and unit["block"] in probes
        ):
            windows[unit["block"], unit["arm"]] = {
                w["round"]: w["step_s"] for w in result.get("windows") or []
            }
    reference = {"baseline": None}  # an arm -> its baseline's name; None: it is a baseline
    for arm in arms or []:
        reference[arm["name"]] = None if arm.get("role") == "baseline" else _baseline_of(arm, arms)
    per_block: dict[str, list[tuple[float, float, float]]] = {}  # arm -> (fast, slow, variance of the gap)
    for (block, arm), rounds in windows.items():
        baseline = reference.get(arm, "baseline")
        base = windows.get((block, baseline)) if baseline is not None else None
        if base is None:
            continue
        states: dict[bool, list[float]] = {False: [], True: []}
        for r, probe in enumerate(probes[block]):
            if rounds.get(r) and base.get(r):
                ratio = stats.typical_step_s([base[r]]) / stats.typical_step_s([rounds[r]])
                states[probe > middle].append(math.log(ratio))
        fast, slow = states[False], states[True]
        if min(len(fast), len(slow)) >= MIN_ROUNDS_PER_STATE:
            variance = float(np.var(fast, ddof=1)) / len(fast) + float(np.var(slow, ddof=1)) / len(slow)
            per_block.setdefault(arm, []).append((float(np.mean(fast)), float(np.mean(slow)), variance))
    gains = {}
    for arm, found in per_block.items():
        weights = np.array([1 / max(variance, 1e-12) for _, _, variance in found])
        fast = float(np.average([f for f, _, _ in found], weights=weights))
        slow = float(np.average([s for _, s, _ in found], weights=weights))
        gains[arm] = StateGain(math.exp(fast), math.exp(slow), math.sqrt(1 / weights.sum()))
    return gains


def load_results(path: str | os.PathLike) -> Results:
    """Load results saved by ``ablate(out=...)`` or ``Results.save``: a folder or its results.json."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"load_results: pass a results folder or its results.json; got {path!r}")
    path = Path(path).expanduser()
    file = path / "results.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(
            f"no results at {path} (expected a folder with results.json, or the file itself)"
        )
    if not file.is_file():  # a FIFO would block the read, a device would never end it
        raise ValueError(f"{file} is not a workbench results file: not a regular file")
    size = file.stat().st_size
    if size > MAX_RESULTS_BYTES:
        raise ValueError(
            f"{file} is not a workbench results file: {size / 2**30:.1f} GiB, "
            f"where results.json holds kilobytes to a few MiB"
        )
    try:
        with open(file) as handle:
            record = json.load(handle)
    except json.JSONDecodeError as error:
        # Not JSON from its first character (a text file, a CSV) is another kind of file; JSON
        # that breaks off later is most likely a results file cut short.
        other = f"{file} is not a workbench results file: not JSON (a results folder's results.json is)"
        cut = f"{file} is not valid JSON ({error.msg}: line {error.lineno}, column {error.colno}); it may be cut short"
        # nothing before the error but white space, in a file that is not empty (empty: cut short)
        not_json = not error.doc[: error.pos].strip() and error.doc.strip()
        raise ValueError(_in_a_run_folder(file) or (other if not_json else cut)) from None
    except (UnicodeDecodeError, IsADirectoryError) as error:
        raise ValueError(f"{file} is not a workbench results file ({error})") from None
    if not isinstance(record, dict):
        raise ValueError(
            f"{file} is not a workbench results file: it holds a JSON {type(record).__name__}, not an object"
        )
    if record.get("schema") not in READABLE_SCHEMAS:
        raise ValueError(
            _in_a_run_folder(file)
            or (
                f"{file} is not a workbench results file (schema {record['schema']!r}, expected {SCHEMA!r})"
                if "schema" in record
                else f"{file} is not a workbench results file: a JSON object without its schema ({SCHEMA!r})"
            )
        )
    problem = _malformed(record)
    if problem:
        raise ValueError(f"{file} is a damaged workbench results file: {problem}")
    if record["schema"] != SCHEMA:
        _read_as_blocks(record)
    return Results(record, file.parent)


def _read_as_blocks(record: dict) -> None:
    """A record from before blocks (schema 1: one process per arm and repeat), read in today's terms:
    its repeats as blocks of one arm each, and each arm's technique settings, which it kept only in
    labels (``amp(dtype=bfloat16)``), as the settings the report's Reproduce and compare read. Without
    them Reproduce dropped every technique, and compare saw 'repeats' and 'blocks' differ."""
    for row in record["table"]:
        row["blocks"] = row.pop("repeats", 0)
    for unit in record["units"]:
        unit["block"] = unit.get("repeat", 0)
    config = record["config"]
    if "repeats" in config and "blocks" not in config:
        config["blocks"] = config.pop("repeats")
    labels = config.get("techniques") or {}
    for arm in record.get("arms", []):
        if "settings" not in arm:
            found = {
                name: settings_from_label(labels.get(name, "")) for name in arm.get("technique_names", [])
            }
            if all(settings is not None for settings in found.values()):
                arm["settings"] = found


def settings_from_label(label: str) -> dict | None:
    """``amp(dtype=bfloat16, level=O1)`` -> {"dtype": "bfloat16", "level": "O1"}; a bare name -> {};
    None when the label does not read so (a value with commas of its own, say)."""
    opened = re.fullmatch(r"\w+(?:\((.*)\))?", label.strip(), flags=re.S)
    if opened is None:
        return None
    settings = {}
    for item in filter(None, (part.strip() for part in (opened.group(1) or "").split(","))):
        key, equals, text = item.partition("=")
        if not equals or not key.strip().isidentifier():
            return None
        try:
            settings[key.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            settings[key.strip()] = text.strip()  # a bare word: bfloat16, O1
    return settings


def _in_a_run_folder(file: Path) -> str:
    """For one of a run's other files (its table.csv, plan.json, units/...), where its results are."""
    for folder in (file.parent, file.parent.parent):
        if file != folder / "results.json" and (folder / "results.json").is_file():
            return f"{file} is one of a run's files, not its results; pass the run's folder: {folder}"
    return ""


def _malformed(record: dict) -> str | None:
    """What a results record with the right schema line lacks, or None when it reads."""
    expected = {"table": list, "units": list, "config": dict, "environment": dict}
    for key, kind in expected.items():
        if key not in record:
            return f"it has no {key!r}"
        if not isinstance(record[key], kind):
            return f"its {key!r} is a JSON {type(record[key]).__name__}, not a {'list' if kind is list else 'object'}"
    named = [row.get("arm") for row in record["table"] if isinstance(row, dict)]
    if len(set(named)) < len(named):
        twice = next(name for name in named if named.count(name) > 1)
        return f"its table has two rows for the arm {twice!r}"
    for index, row in enumerate(record["table"]):
        problem = _malformed_row(index, row)
        if problem:
            return problem
    for index, unit in enumerate(record["units"]):
        if not isinstance(unit, dict) or "arm" not in unit:
            return f"unit {index} is not a measured arm"
    return _malformed_plan(record) or _malformed_settings(record)


def _malformed_settings(record: dict) -> str | None:
    """What a results record's config and blocks lack, or None."""
    for key in ("model", "device"):  # what every view names the run by
        if not isinstance(record["config"].get(key), str):
            return f"its config has no {key}"
    blocks = record.get("blocks", [])
    if not isinstance(blocks, list) or not all(isinstance(block, dict) for block in blocks):
        return "its 'blocks' is not a list of the blocks' records"
    return None


def _malformed_row(index: int, row) -> str | None:
    """What one row of a results table lacks, or None."""
    if not isinstance(row, dict) or not isinstance(row.get("arm"), str):
        return f"row {index} of its table is not an arm's row (no arm name)"
    for column in ("status", "verdict", "reason", "notes"):
        value = row.get(column)
        if value is not None and not isinstance(value, str):
            return f"row {index} of its table has {column} {value!r}, not text"
    for column in ("speedup", "speedup_low", "speedup_high", "samples_per_s", "step_ms", "final_loss",
                   "loss_vs_baseline", "blocks"):  # fmt: skip
        value = row.get(column)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"row {index} of its table has {column} {value!r}, not a number"
    low, high = row.get("speedup_low"), row.get("speedup_high")
    if None not in (low, high) and math.isfinite(low) and math.isfinite(high) and not 0 < low <= high:
        return f"row {index} of its table has the interval [{low}, {high}], which no speedup has"
    return None


def _malformed_plan(record: dict) -> str | None:
    """What a results record's plan of arms, or its search record, lacks, or None."""
    arms = record.get("arms", [])
    if not isinstance(arms, list):
        return f"its 'arms' is {'null' if arms is None else 'a JSON ' + type(arms).__name__}, not a list"
    for index, arm in enumerate(arms):
        if not isinstance(arm, dict) or not isinstance(arm.get("name"), str) or "role" not in arm:
            return f"arm {index} of its plan has no name or role"
    tune = record.get("tune")
    if tune is not None:
        missing = [key for key in TUNE_KEYS if key not in tune] if isinstance(tune, dict) else list(TUNE_KEYS)
        if missing:
            return f"its search record ('tune') lacks {', '.join(missing)}"
    return None


def run_identity(record: dict) -> str:
    """A run's start and settings as canonical JSON: two records with the same identity are one
    run (its folder read twice, or a saved copy of it), however they were loaded."""
    chosen = {key: record.get(key) for key in ("created", "config")}
    return json.dumps(json_values(chosen), sort_keys=True, default=str)


# What a search's record must hold for its views (tune_verdict, the candidates table, tune.png).
TUNE_KEYS = ("budget_s", "spent_s", "rounds", "candidates", "fastest", "runner_up")


def tune_verdict(record: dict) -> str:
    """One paragraph: the winner with its interval and loss parity, the runner-up, the spend."""
    fastest, runner = record.get("fastest"), record.get("runner_up")
    spent = f"{record['spent_s']:.0f} s of a {record['budget_s']:.0f} s budget"
    if fastest is None:
        return f"no candidate was measured to the end ({spent})"

    def figures(entry: dict) -> str:
        return (
            f"x{entry['speedup']:.2f} [{entry['speedup_low']:.2f}, {entry['speedup_high']:.2f}] over "
            f"{entry['blocks']} block{'s' * (entry['blocks'] != 1)}, final loss {entry['loss_vs_baseline']:.3f}x "
            "the baseline's"
        )

    if record.get("best"):
        text = f"best: {fastest['name']}, {figures(fastest)}"
    else:  # searches saved before "undecided" was recorded judged by the interval alone
        why = record.get("undecided") or "not measurably faster than the baseline"
        text = f"no winner: the fastest, {fastest['name']}, came out at {figures(fastest)}, but {why}"
    if runner is not None:
        text += f"; runner-up: {runner['name']}, {figures(runner)}"
        if runner.get("dropped", "").startswith("faster by its point, but "):
            text += f" ({runner['dropped']})"  # why the higher point estimate did not win
    text += f" ({spent}"
    text += f"; {record['stopped']})" if record.get("stopped") else ")"
    return text


def _reason(row, spell: Callable[[str], str]) -> str:
    """Why an arm did not run or is not ok, as ``summary`` shows it: an out-of-memory reason is
    workbench's own words (a run setting, ``memory_cap_mb=``, named as ``spell`` names it)."""
    return spell(row.reason) if row.status == "oom" else row.reason
