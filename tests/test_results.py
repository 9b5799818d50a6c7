"""Statistics, the results table, saving/loading (JSON/CSV only) and the plot."""

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import synthetic_results
from matplotlib.figure import Figure

import workbench as wb
from workbench import stats
from workbench.results import TABLE_COLUMNS, load_results


def test_median_and_spread():
    assert stats.median_and_spread([1.0, 2.0, 3.0, 4.0, 100.0]) == (3.0, 2.0)
    median, spread = stats.median_and_spread([])
    assert math.isnan(median) and math.isnan(spread)


def _side(step_s: float, windows: int = 4, steps: int = 5) -> stats.Side:
    """An arm in a block whose every step took ``step_s`` (one sample per step)."""
    return stats.Side([[step_s] * steps for _ in range(windows)], 1.0)


def test_blocks_combine_into_a_t_interval():
    """Three blocks with ratios e^0.1, e^0.2, e^0.3: mean 0.2, sd 0.1, t(0.975, 2) = 4.3027."""
    ratios = [stats.block_ratio(_side(0.01), _side(0.01 / math.exp(x)), paired=True) for x in (0.1, 0.2, 0.3)]
    speedup = stats.combine_blocks(ratios)
    half = 4.302652729911275 * 0.1 / math.sqrt(3)
    assert speedup.point == pytest.approx(math.exp(0.2))
    assert (speedup.low, speedup.high) == (
        pytest.approx(math.exp(0.2 - half)),
        pytest.approx(math.exp(0.2 + half)),
    )
    assert speedup.between_block_pct == pytest.approx(10.0) and speedup.blocks == 3


def test_pairing_inside_a_block_cancels_drift():
    """The machine slows down 30% over the block; a 10% faster arm is still found at 1.10, exactly."""
    drift = [1.0, 0.9, 0.8, 0.7]
    baseline = stats.Side([[0.010 / d] * 5 for d in drift], 1.0)
    arm = stats.Side([[0.010 / (1.1 * d)] * 5 for d in drift], 1.0)
    ratio = stats.block_ratio(baseline, arm, paired=True)
    assert math.exp(ratio.log_ratio) == pytest.approx(1.1, rel=0.02) and ratio.within_se == pytest.approx(0)


def test_block_luck_cancels_in_the_ratio():
    """Whole blocks run 2x faster or slower (process luck): the ratio inside each is unmoved."""
    ratios = [
        stats.block_ratio(_side(0.01 * luck), _side(0.01 * luck / 1.2), paired=True) for luck in (0.5, 1, 2)
    ]
    speedup = stats.combine_blocks(ratios)
    assert speedup.point == pytest.approx(1.2) and speedup.high - speedup.low == pytest.approx(0, abs=1e-9)


def test_interval_coverage_on_simulated_a_a_blocks():
    """Identical arms, 2% noise per block and 20% per step: the bare t-interval over blocks holds
    1.0 about 95% of the time; the floor at the blocks' own rounds makes it a little more often
    (here the rounds' noise is most of a block's), at a little more width."""
    rng = np.random.default_rng(1)
    trials = 1000
    hits = {True: 0, False: 0}
    widths: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(trials):
        ratios = []
        for _block in range(3):
            shift = rng.normal(0, 0.02)
            baseline = stats.Side([list(0.01 * np.exp(rng.normal(0, 0.2, 4))) for _ in range(10)], 1.0)
            arm = stats.Side([list(0.01 * np.exp(shift + rng.normal(0, 0.2, 4))) for _ in range(10)], 1.0)
            ratios.append(stats.block_ratio(baseline, arm, paired=True))
        for floored in (True, False):
            speedup = stats.combine_blocks(ratios, floored=floored)
            hits[floored] += speedup.low <= 1.0 <= speedup.high
            widths[floored].append(math.log(speedup.high / speedup.low))
    assert 0.92 <= hits[False] / trials <= 0.98
    assert hits[False] <= hits[True] and hits[True] / trials <= 0.99
    assert np.median(widths[True]) <= 1.25 * np.median(widths[False])


def test_blocks_that_agree_by_chance_do_not_narrow_the_interval_past_their_own_noise():
    """Three blocks within 0.01% of each other, each uncertain by 1% from its 200 rounds: the
    interval is the one their rounds give (t with 597 degrees of freedom), not as narrow as
    their agreement."""
    ratios = [stats.BlockRatio(x, 0.01, 199, None, None) for x in (0.0, 0.0001, -0.0001)]
    speedup = stats.combine_blocks(ratios)
    half = 1.9639 * 0.01 / math.sqrt(3)
    assert (speedup.low, speedup.high) == (
        pytest.approx(math.exp(-half), rel=1e-4),
        pytest.approx(math.exp(half), rel=1e-4),
    )
    assert speedup.between_block_pct == pytest.approx(0.01), "the spread reported is still the blocks' own"
    bare = stats.combine_blocks(ratios, floored=False)
    assert bare.high - bare.low < (speedup.high - speedup.low) / 20


def test_a_stalled_round_that_the_point_sets_aside_does_not_widen_the_interval():
    """One 359 ms stall on one of 600 rounds of 2.5 ms steps: the trimmed mean set it aside, but
    the rounds' plain standard error took it in, and the interval's floor widened by 75%. The
    spread now follows the estimate (the trimmed mean's influence, as in Yuen's standard
    error); by the mean, which counts the stall, it still widens."""

    def pairs(stall: float | None):
        rng = np.random.default_rng(3)
        made = []
        for block in range(3):
            luck = math.exp(rng.normal(0, 0.01))
            base = [[0.0025 * luck * math.exp(rng.normal(0, 0.03))] for _ in range(200)]
            arm = [[0.0025 * luck * math.exp(rng.normal(0, 0.03))] for _ in range(200)]
            if stall and block == 0:
                arm[57] = [stall]
            made.append((stats.Side(base, 32.0), stats.Side(arm, 32.0)))
        return made

    def half_width(stall, estimator):
        speedup = stats.arm_speedup(pairs(stall), paired=True, estimator=estimator).speedup
        return speedup.high / speedup.point - 1

    assert half_width(0.359, "trimmed_mean") == pytest.approx(half_width(None, "trimmed_mean"), rel=0.02)
    assert half_width(0.359, "mean") > 2 * half_width(None, "mean")
    # Each arm's rounds winsorized on their own: the influence of each on the log of the trimmed mean.
    steps = np.array([1.0, 2.0, 3.0, 4.0, 100.0] * 4)  # 20 rounds, 4 trimmed at each end
    spread, kept = stats._log_influence(steps, 0.2)
    winsorized = np.array([2.0, 2.0, 3.0, 4.0, 4.0] * 4)
    assert kept == 12 and spread == pytest.approx((winsorized - 3.0) / (0.6 * 3.0))
    # Among fewer rounds the winsorized values tie: the plain spread of the log steps.
    few, kept = stats._log_influence(steps[:5], 0.2)
    assert kept == 5 and few == pytest.approx(np.log(steps[:5]) - np.log(steps[:5]).mean())


def test_a_single_block_takes_its_interval_from_its_rounds():
    rng = np.random.default_rng(0)
    baseline = stats.Side([list(rng.normal(0.010, 0.0005, 5)) for _ in range(8)], 1.0)
    arm = stats.Side([list(rng.normal(0.008, 0.0004, 5)) for _ in range(8)], 1.0)
    speedup = stats.combine_blocks([stats.block_ratio(baseline, arm, paired=True)])
    assert speedup.blocks == 1 and math.isnan(speedup.between_block_pct)
    assert speedup.low < 1.25 < speedup.high and speedup.high - speedup.low < 0.3
    # One round too: the steps of the two windows are resampled (a bootstrap).
    one = stats.combine_blocks(
        [
            stats.block_ratio(
                stats.Side([baseline.windows[0] * 4], 1.0), stats.Side([arm.windows[0] * 4], 1.0), paired=True
            )
        ]
    )
    assert one.low < one.point < one.high
    # One step a side: no spread to resample, so no interval (not one of zero width).
    single = stats.combine_blocks(
        [stats.block_ratio(stats.Side([[0.010]], 1.0), stats.Side([[0.008]], 1.0), paired=True)]
    )
    assert single.point == pytest.approx(1.25) and math.isnan(single.low) and math.isnan(single.high)


def test_a_one_window_interval_is_centred_on_the_speedup_the_row_reports():
    """An arm whose every fifth step is 4x slower is compared by its capped mean (its own slow
    steps count); the bootstrap must resample around that point, not the trimmed mean's."""
    baseline = stats.Side([[0.010, 0.0101, 0.0099, 0.0100, 0.0102] * 4], 1.0)
    arm = stats.Side([[0.008, 0.0081, 0.0079, 0.0080, 0.032] * 4], 1.0)
    result = stats.arm_speedup([(baseline, arm)], paired=True)
    assert result.estimator == "capped_mean"
    speedup = result.speedup
    assert speedup.point < 1.0  # slower, once its slow steps count
    assert speedup.low <= speedup.point <= speedup.high


def test_estimators_are_the_candidates_the_calibration_compares():
    windows = [[0.010, 0.011, 0.050], [0.012, 0.010, 0.013]]
    assert stats.typical_step_s(windows, "mean") == pytest.approx(np.mean(windows))
    assert stats.typical_step_s(windows, "median_of_window_medians") == pytest.approx(0.0115)
    assert stats.typical_step_s(windows, "p10") == pytest.approx(0.010)
    assert stats.typical_step_s(windows, "trimmed_mean") == pytest.approx(
        np.mean([0.010, 0.011, 0.012, 0.013])
    )
    assert stats.typical_step_s(windows, "capped_mean") == pytest.approx(np.mean(windows))  # nothing to cap
    stalled = [[0.010] * 9 + [1.0]]  # one step 100x the median counts as 10 (STALL_CAP)
    assert stats.typical_step_s(stalled, "capped_mean") == pytest.approx((9 * 0.010 + 0.100) / 10)
    assert stats.ESTIMATOR in stats.ESTIMATORS


def test_blocks_that_disagree_beyond_their_noise_are_flagged():
    steady = [stats.BlockRatio(x, 0.002, 9, None, None) for x in (0.0, 0.001, -0.001)]
    assert not stats.combine_blocks(steady).blocks_disagree
    apart = [stats.BlockRatio(x, 0.002, 9, None, None) for x in (0.0, 0.08, -0.08)]
    assert stats.combine_blocks(apart).blocks_disagree


def test_windows_slowed_by_the_arm_before_them_are_traced_to_it():
    rng = np.random.default_rng(0)
    arms = ["baseline", "control", "lingering"]
    sequences = []
    for _ in range(3):
        sequence, previous = [], None
        for _round in range(30):
            for arm in rng.permutation(arms):
                slowed = 0.25 if previous == "lingering" else 0.0
                sequence.append((str(arm), slowed + rng.normal(0, 0.03)))
                previous = arm
        sequences.append(sequence)
    effects = stats.follower_effects(sequences)
    assert effects["lingering"].clear and effects["lingering"].slowdown == pytest.approx(0.25, abs=0.05)
    assert not effects["baseline"].clear and not effects["control"].clear


def test_noisy_flag():
    assert stats.is_noisy(1.5, 1.2, 1.8)  # interval +-20%
    assert not stats.is_noisy(1.5, 1.45, 1.55)
    assert not stats.is_noisy(float("nan"), float("nan"), float("nan"))


# The tests that use this run carry the timing mark: its breakdown is checked against its wall clock.
@pytest.fixture(scope="module")
def small_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("results") / "run"
    return wb.ablate(
        model="mlp",
        techniques={"amp": True, "grad_accum": {"steps": 2}, "tf32": True},
        steps=8,
        warmup=2,
        blocks=2,
        out=out,
        progress=False,
    )


@pytest.mark.timing
def test_table_has_the_contract_columns_and_sane_values(small_results):
    table = small_results.table
    assert list(table.columns) == TABLE_COLUMNS
    assert list(table.arm) == ["baseline", "baseline (control)", "amp", "grad_accum", "tf32"]
    ok = table[table.status == "ok"]
    assert (
        (ok.samples_per_s > 0).all()
        and (ok.speedup_low <= ok.speedup).all()
        and (ok.speedup <= ok.speedup_high).all()
    )
    assert (ok.step_ms > 0).all() and (ok.peak_mem_mb > 0).all() and (ok.startup_s > 0).all()
    parts = ok[["data_ms", "forward_ms", "backward_ms", "optimizer_ms"]].sum(axis=1)
    # The phases divide step_ms by their shares of the timed windows: never more than the step
    # (on the CPU every step's phases are clocked), and the rest is the harness between steps.
    # Where the run saw other processes take the cores (its load warning), a stall can land
    # between two steps, outside every phase, and no lower bound holds.
    assert (parts <= ok.step_ms * 1.001).all(), "the breakdown claims more than the step"
    if not small_results.load.get("warning"):
        assert (parts >= ok.step_ms * 0.9).all(), "the breakdown must explain the step"
    assert table.set_index("arm").loc["baseline", "speedup"] == 1.0
    assert (ok.loss_vs_baseline.between(0.5, 2.0)).all()
    assert set(ok.blocks) == {2} and set(ok.process) == {"block"}
    assert (ok.activation_mb > 0).all() and ok.peak_rss_mb.isna().all()  # RSS: the block's, not an arm's


@pytest.mark.timing
def test_save_and_load_round_trip_json_and_csv(small_results, tmp_path):
    folder = small_results.save(tmp_path / "saved")
    for name in ("results.json", "table.csv", "losses.csv", "telemetry.csv"):
        assert (folder / name).exists()
    record = json.loads((folder / "results.json").read_text())  # plain JSON, nothing to unpickle
    assert record["schema"] == "workbench-results/2"
    assert record["environment"]["torch"] and record["environment"]["cpu"]
    loaded = load_results(folder)
    assert loaded.table.equals(small_results.table)
    assert loaded.complete and loaded.config["steps"] == 8
    losses = loaded.losses
    assert set(losses.columns) == {"arm", "block", "step", "loss", "timed"}
    assert len(losses[losses.timed]) == 4 * 2 * 8  # 4 arms that ran, 2 blocks, the timed steps
    assert set(losses[~losses.timed].step) >= {1, 2}  # the warm-up, and any re-warm steps between windows
    assert load_results(folder / "results.json").table.equals(loaded.table)


@pytest.mark.timing
def test_an_unavailable_value_is_one_thing_in_each_form(small_results, tmp_path):
    """None in the record and its JSON, NaN in a table's number columns, "" in its text columns."""
    loaded = load_results(small_results.save(tmp_path / "saved"))
    assert loaded.record == small_results.record  # fresh and read back: the same, None and all

    def floats(value):
        if isinstance(value, dict):
            return [f for item in value.values() for f in floats(item)]
        if isinstance(value, list):
            return [f for item in value for f in floats(item)]
        return [value] if isinstance(value, float) else []

    assert all(math.isfinite(f) for f in floats(small_results.record))  # never a NaN in the record
    table = small_results.table
    text = ["arm", "kind", "process", "techniques", "status", "verdict", "reason", "notes"]
    assert table[text].map(lambda v: isinstance(v, str)).all().all()  # never None or NaN there
    numbers = table.drop(columns=text + ["noisy", "blocks", "speedup_blocks"])
    assert all(dtype == np.float64 for dtype in numbers.dtypes)
    assert numbers.loc[table.arm == "tf32"].isna().all().all()  # unavailable here: every figure NaN
    assert table.loc[table.arm == "tf32", "process"].tolist() == [""]  # it ran in no process (read "block")
    plan = wb.plan(model="mlp", techniques={"amp": True, "tf32": True}, device="cpu")
    for column in ("process", "techniques", "unavailable", "own_process"):
        assert plan[column].map(lambda v: isinstance(v, str)).all(), column


@pytest.mark.timing
def test_ablate_out_folder_is_loadable(small_results):
    assert load_results(small_results.path).table.equals(small_results.table)
    assert (small_results.path / "plan.json").exists()
    # One process per block: all four arms that can run here ran side by side in it.
    assert sorted(p.name for p in (small_results.path / "units").glob("*.json")) == [
        "b0-block.json",
        "b1-block.json",
    ]
    assert sorted(p.name for p in (small_results.path / "logs").glob("*.log")) == [
        "b0-block.log",
        "b1-block.log",
    ]  # the warm template's own log is kept with it, outside the run (workbench.template)


def test_loading_rejects_what_is_not_ours(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"schema": "something-else"}))
    with pytest.raises(ValueError, match="is not a workbench results file"):
        load_results(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_results(tmp_path / "missing")


def test_a_file_that_is_not_json_is_not_called_a_results_file_cut_short(tmp_path):
    """`workbench show notes.txt` said "is not valid JSON ...; it may be cut short"."""
    (tmp_path / "notes.txt").write_text("the user's notes")
    with pytest.raises(ValueError, match=r"notes.txt is not a workbench results file: not JSON"):
        load_results(tmp_path / "notes.txt")
    (tmp_path / "spaced.txt").write_text("\n  the user's notes")  # white space first: still not JSON
    with pytest.raises(ValueError, match=r"spaced.txt is not a workbench results file: not JSON"):
        load_results(tmp_path / "spaced.txt")
    (tmp_path / "cut.json").write_text('{"schema": "workbench-results/2", "table": [')
    with pytest.raises(ValueError, match="it may be cut short"):
        load_results(tmp_path / "cut.json")
    (tmp_path / "cut-in-a-word.json").write_text(
        '{"schema": "workbench-res'
    )  # "starting at at line 1" was said
    with pytest.raises(
        ValueError, match=r"\(Unterminated string starting at: line 1, column 12\); it may be cut"
    ):
        load_results(tmp_path / "cut-in-a-word.json")
    (tmp_path / "other.json").write_text('{"name": "a package.json"}')
    with pytest.raises(ValueError, match="a JSON object without its schema"):
        load_results(tmp_path / "other.json")


@pytest.mark.timing
def test_plot_has_speedup_breakdown_and_memory(small_results, tmp_path):
    figure = small_results.plot()
    assert isinstance(figure, Figure)
    titles = [axes.get_title() for axes in figure.axes]
    assert titles == ["Throughput", "Step breakdown", "Memory"]
    figure.savefig(tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000
    speed, phases, _ = figure.axes
    assert speed.get_xscale() == "log"  # 0.5x and 2x equally far from 1x
    # One legend below the panels: the noise band, then only the phases that occurred.
    (legend,) = figure.legends
    shown = [t.get_text() for t in legend.get_texts()]
    assert shown[0] == "noise band (control's interval)"
    assert "replay" not in shown and {"forward", "backward", "optimizer"} <= set(shown)
    # Activation memory, the part checkpointing and grad_accum shrink, drawn inside the peak.
    assert "of it, activations saved for backward" in shown
    memory_bars = [bar for bar in figure.axes[2].patches if bar.get_width() > 0]
    table = small_results.table.iloc[::-1]
    ran = table[table.status == "ok"]
    widths = sorted(round(bar.get_width(), 6) for bar in memory_bars)
    assert all(round(value, 6) in widths for value in ran.activation_mb)


def _fake_unit(arm: str, losses: list[float], step_s: list[float] | None = None, block: int = 0) -> dict:
    """A finished unit as a block records it: ``step_s`` are its timed steps (one sample each)."""
    step_s = step_s or [0.01] * 4
    result = {
        "samples_per_s": len(step_s) / sum(step_s),
        "step_s": step_s,
        "wall_s": sum(step_s),
        "steps": len(step_s),
        "samples": len(step_s),
        "losses": losses,
        "phase_ms": dict.fromkeys(("data", "forward", "backward", "optimizer"), 1.0),
        "peak_mem_mib": 1.0,
        "peak_rss_mib": 1.0,
        "startup_s": 0.1,
        "cpu_util_pct": 50.0,
        "notes": [],
        "warmup": 1,
    }
    return {"arm": arm, "block": block, "status": "ok", "reason": "", "result": result}


def test_loss_drift_is_called_out():
    from workbench.results import summarize

    unit = _fake_unit
    arms = [
        {"name": "baseline", "role": "baseline", "techniques": "none", "unavailable": None},
        {"name": "amp", "role": "treatment", "techniques": "amp", "unavailable": None},
        {
            "name": "dali",
            "role": "treatment",
            "techniques": "dali",
            "unavailable": None,
            "input_pipeline": True,
        },
        {
            "name": "loader: baseline",
            "kind": "loader",
            "role": "baseline",
            "techniques": "none",
            "unavailable": None,
        },
        {
            "name": "loader: dali",
            "kind": "loader",
            "role": "treatment",
            "techniques": "dali",
            "unavailable": None,
        },
    ]
    units = [
        unit("baseline", [1.0] * 5),
        unit("amp", [1.5] * 5),
        unit("dali", [0.8] * 5),
        unit("loader: baseline", [0.0] * 5),
        unit("loader: dali", [0.0] * 5),
    ]
    rows = summarize(arms, units, planned_blocks=1, complete=True)
    assert rows[1]["loss_vs_baseline"] == 1.5
    assert "convergence: final loss 50% above the baseline's" in rows[1]["notes"]
    assert "the technique changed the numerics" in rows[1]["notes"]
    assert "convergence" not in rows[0]["notes"]
    # A different input pipeline sees differently augmented samples: said so, not "changed the numerics".
    assert "20% below" in rows[2]["notes"] and "draws its own random augmentations" in rows[2]["notes"]
    # Loader-only arms train a no-op model: no loss to compare, and their own baseline.
    assert (
        rows[4]["kind"] == "loader"
        and math.isnan(rows[4]["final_loss"])
        and "convergence" not in rows[4]["notes"]
    )
    assert rows[3]["speedup"] == 1.0 and rows[4]["speedup"] == 1.0  # equal throughput, own baseline


def test_a_control_without_an_interval_is_not_called_a_failed_a_a_check():
    """With the baseline failed in every block, nothing has an interval: the control's row says
    there was no baseline to compare with, not that it missed its own interval."""
    from workbench.results import summarize

    arms = [
        {"name": "baseline", "role": "baseline", "techniques": "none", "unavailable": None},
        {"name": "baseline (control)", "role": "control", "techniques": "none", "unavailable": None},
    ]
    failed = {
        "arm": "baseline",
        "block": 0,
        "status": "failed",
        "reason": "RuntimeError: boom",
        "result": None,
    }
    rows = summarize(
        arms, [failed, _fake_unit("baseline (control)", [1.0] * 5)], planned_blocks=1, complete=True
    )
    control = rows[1]
    assert math.isnan(control["speedup_low"]) and "no baseline block to compare with" in control["notes"]
    assert "A/A check failed" not in control["notes"]


def test_a_run_of_one_timed_step_says_it_has_no_interval_and_plots_every_point():
    """One block, one step: no interval for any arm; no A/A warning for the control either (it has
    no interval to miss), and the plot's axis still reaches every point."""
    results = wb.ablate(
        model="mlp",
        techniques={"checkpointing": True},
        steps=1,
        warmup=1,
        blocks=1,
        out=False,
        progress=False,
    )
    table = results.table.set_index("arm")
    assert set(table.status) == {"ok"}, table.reason
    row = table.loc["checkpointing"]
    assert row.verdict == "not compared" and "1 block of 1 step: no interval" in row.notes
    said = " ".join(results.warnings()) + table.loc["baseline (control)", "notes"]
    assert "A/A" not in said and "the control arm" not in said
    assert "[no interval]" in results.summary(width=100)
    results.plot()  # draws


def test_the_speedup_axis_reaches_points_that_have_no_interval():
    import pandas as pd

    from workbench.plots import plot_speedups

    table = pd.DataFrame(
        {"arm": ["baseline", "amp"], "status": ["ok", "ok"], "speedup": [1.0, 2.94],
         "speedup_low": [1.0, math.nan], "speedup_high": [1.0, math.nan]}
    )  # fmt: skip
    (axes,) = plot_speedups(table, "one timed step").axes
    assert axes.get_xlim()[1] > 2.94


def test_an_arm_moved_to_its_own_process_mid_run_is_compared_only_with_the_lone_baseline():
    """amp ran beside the others in block 1, then out of memory there in block 2, and alone from
    then on (from_block); its shared block is not paired with the lone baseline's blocks, and
    neither it nor the lone baseline is short of blocks."""
    from workbench.results import summarize

    def arm(name, role, process="block", from_block=0):
        return {"name": name, "role": role, "process": process, "from_block": from_block,
                "techniques": name, "unavailable": None}  # fmt: skip

    arms = [
        arm("baseline", "baseline"),
        arm("baseline (own process)", "baseline", "own", from_block=1),
        arm("amp", "treatment", "own", from_block=1),
    ]

    def unit(name, block, process, step_s):
        return {**_fake_unit(name, [1.0] * 5, [step_s] * 4, block=block), "process": process}

    units = [
        unit("baseline", 0, "block", 0.010), unit("amp", 0, "block", 0.005),  # beside the others: 2x
        unit("baseline", 1, "block", 0.010), unit("baseline", 2, "block", 0.010),
        unit("baseline (own process)", 1, "own", 0.012), unit("amp", 1, "own", 0.010),  # alone: 1.2x
        unit("baseline (own process)", 2, "own", 0.012), unit("amp", 2, "own", 0.010),
    ]  # fmt: skip
    rows = {row["arm"]: row for row in summarize(arms, units, planned_blocks=3, complete=True)}
    amp, lone = rows["amp"], rows["baseline (own process)"]
    assert amp["status"] == lone["status"] == "ok", (amp["reason"], lone["reason"])
    assert amp["blocks"] == 2 and amp["speedup"] == pytest.approx(1.2)
    assert "block(s) 1 measured it beside the other arms before it moved to its own process" in amp["notes"]


def test_the_blocks_behind_a_speedup_are_those_its_baseline_measured_in_too():
    """The baseline failed in two of three blocks: amp measured in three, but its interval comes
    from the one block it shares with the baseline, and the tuner, which will not name a winner
    from one block, reads that count."""
    from workbench.results import summarize
    from workbench.tuner import _figures

    arms = [
        {"name": name, "role": role, "techniques": name, "unavailable": None}
        for name, role in (("baseline", "baseline"), ("amp", "treatment"))
    ]
    units = [_fake_unit("amp", [1.0] * 5, [0.008, 0.009, 0.008, 0.008], block=b) for b in range(3)]
    units.append(_fake_unit("baseline", [1.0] * 5, [0.010, 0.011, 0.010, 0.010], block=0))
    units += [
        {"arm": "baseline", "block": b, "status": "failed", "reason": "boom", "result": None} for b in (1, 2)
    ]
    rows = {row["arm"]: row for row in summarize(arms, units, planned_blocks=3, complete=True)}
    amp = rows["amp"]
    assert amp["blocks"] == 3 and amp["speedup_blocks"] == 1
    assert "1 block: the interval ignores process-to-process variation" in amp["notes"]
    table = synthetic_results(list(rows.values()), roles={"baseline": "baseline"}).table
    row = next(table[table.arm == "amp"].itertuples())
    assert _figures(0, row, "faster", (1.0, 1.0))["blocks"] == 1


def test_an_arms_samples_per_s_and_step_are_read_in_the_baselines_typical_block():
    """Another job came and went: the baseline's blocks ran at 334, 1804 and 5612 samples/s, amp's
    at 318, 6692 and 4870. amp was slower than the baseline in two blocks of three, but its own
    median over blocks (4870, from the third block) read 2.7x the baseline's (1804, from the
    second), and its bar in the step breakdown was the shorter. Its figures are now its median
    ratio inside the blocks (0.95) times the baseline's median."""
    from workbench.results import summarize

    arms = [
        {"name": name, "role": role, "techniques": name, "unavailable": None}
        for name, role in (("baseline", "baseline"), ("amp", "treatment"))
    ]
    speeds = {"baseline": (334, 1804, 5612), "amp": (318, 6692, 4870)}
    units = [
        _fake_unit(arm, [1.0] * 5, [1 / speed] * 4, block=block)
        for arm, per_block in speeds.items()
        for block, speed in enumerate(per_block)
    ]
    rows = {row["arm"]: row for row in summarize(arms, units, planned_blocks=3, complete=True)}
    base, amp = rows["baseline"], rows["amp"]
    assert base["samples_per_s"] == pytest.approx(1804)
    assert amp["samples_per_s"] == pytest.approx(318 / 334 * 1804)
    assert amp["step_ms"] == pytest.approx(1e3 / amp["samples_per_s"])
    phases = ("data_ms", "forward_ms", "backward_ms", "optimizer_ms")
    assert sum(amp[p] for p in phases) > sum(base[p] for p in phases)  # the longer bar, as it was slower


def test_near_the_end_of_the_fall_a_ratio_of_tiny_losses_is_not_a_loss_of_parity():
    """mlp on digits nearly fits its data: final losses of a few thousandths, whose ratio is noise
    (0.01x to 110x over five seeds). An arm 3x the baseline's there is 1% of the fall from 2.0,
    and is not flagged; an arm that stopped a third of the way short still is."""
    from workbench.results import summarize
    from workbench.results_view import loss_drifted, loss_text

    falling = list(np.geomspace(2.0, 0.01, 40))
    names = ("baseline", "tiny gap", "short of it")
    arms = [
        {"name": name, "role": "baseline" if name == "baseline" else "treatment", "techniques": name}
        | {"unavailable": None}
        for name in names
    ]
    ends = {"baseline": 0.01, "tiny gap": 0.03, "short of it": 0.7}
    units = [_fake_unit(name, falling[:-5] + [ends[name]] * 5) for name in names]
    rows = {row["arm"]: row for row in summarize(arms, units, planned_blocks=1, complete=True)}
    tiny, short = rows["tiny gap"], rows["short of it"]
    assert tiny["loss_vs_baseline"] == pytest.approx(3.0)
    assert tiny["loss_gap_of_fall"] == pytest.approx(0.02 / (np.mean(falling[:5]) - 0.01))
    assert "convergence:" not in tiny["notes"] and "not a change in convergence" in tiny["notes"]
    assert "convergence: final loss" in short["notes"] and short["loss_gap_of_fall"] > 0.3
    assert not loss_drifted(tiny["loss_vs_baseline"], tiny["loss_gap_of_fall"])
    assert loss_drifted(short["loss_vs_baseline"], short["loss_gap_of_fall"])
    assert loss_drifted(3.0) and not loss_drifted(1.05)  # no fall known (older records): the ratio decides
    assert loss_drifted(3.0, None) and not loss_drifted(None, None)  # figures read back from JSON (null)

    class Row:
        loss_vs_baseline, loss_gap_of_fall = tiny["loss_vs_baseline"], tiny["loss_gap_of_fall"]

    assert loss_text(Row) == "3.00×"  # no "!" in the reader's table


def test_slow_steps_of_the_jobs_own_count_and_stalls_from_outside_do_not():
    """The speedup counts typical steps (a trimmed mean), which sets stalls from outside the
    job aside. An arm whose every fifth step is 4x slower, in every block, would look 1.25x
    faster by its typical steps while it runs at 0.78x: its speedup counts every step, and
    says so. An arm with one stall in one block keeps the typical steps, and so does a
    control whose steps, like the baseline's, have a long tail on a noisy machine (their
    means 5-10% above their typical steps in every block) while the baseline also stalled
    for a third of a second: the tails differ only by chance."""
    from workbench.results import summarize

    rng = np.random.default_rng(0)
    names = ("baseline", "spiky", "stalled once", "control")
    arms = [
        {"name": name, "role": "baseline" if name == "baseline" else "treatment", "techniques": name}
        | {"unavailable": None}
        for name in names
    ]

    def noisy(n: int) -> list[float]:  # a long right tail: the mean ~7% above the trimmed mean
        return list(0.0027 * (1 + rng.exponential(0.08, n)) * np.where(rng.random(n) < 0.1, 1.5, 1.0))

    units = []
    for block in range(3):
        baseline, control = noisy(200), noisy(200)
        if block == 0:
            baseline[50] = 0.36
        spiky = [0.0022 * (4 if i % 5 == 4 else 1) for i in range(200)]
        stalled = [0.0022] * 200
        if block == 1:
            stalled[7] = 0.022
        for name, steps in zip(names, (baseline, spiky, stalled, control), strict=True):
            units.append(_fake_unit(name, [1.0] * 5, steps, block))
    rows = {row["arm"]: row for row in summarize(arms, units, planned_blocks=3, complete=True)}
    spiky, stalled, control = rows["spiky"], rows["stalled once"], rows["control"]
    assert (
        spiky["speedup"] < 0.9
        and "median steps) exceeded its typical step by 60% in the blocks" in spiky["notes"]
    )
    # The baseline's 360 ms stall in block 0 is capped, as the rule capped it: not the job's own.
    said = re.search(r"the baseline's by (-?\d+)%(?: to (-?\d+)%)?", spiky["notes"])
    assert said and max(int(n) for n in said.groups() if n) < 15, spiky["notes"]
    assert "by typical steps alone it would be 1.3" in spiky["notes"]  # its fast steps only
    assert "slow steps" not in stalled["notes"] and stalled["speedup"] > 1.15
    assert "slow steps" not in control["notes"] and control["speedup"] == pytest.approx(1.0, abs=0.03)


def test_samples_per_s_far_from_the_speedup_is_explained_beside_the_arm():
    """On a loaded machine, stalls from outside the job landed on the control's windows in two of
    three blocks: its samples/s (every step) fell to about 0.6x the baseline's while its speedup
    (typical steps) stayed at 1.0. The table shows both, so the row says why they differ."""
    from workbench.results import summarize

    names = ("baseline", "control", "steady")
    arms = [
        {"name": name, "role": "baseline" if name == "baseline" else "treatment", "techniques": name}
        | {"unavailable": None}
        for name in names
    ]
    units = []
    for block in range(3):
        stalled = [0.002] * 200
        if block < 2:
            stalled[::10] = [0.02] * 20  # every tenth step waits 10x: 0.53x the rate
        for name, steps in zip(names, ([0.002] * 200, stalled, [0.002] * 200), strict=True):
            units.append(_fake_unit(name, [1.0] * 5, steps, block))
    rows = {row["arm"]: row for row in summarize(arms, units, planned_blocks=3, complete=True)}
    control = rows["control"]
    assert control["speedup"] == pytest.approx(1.0, abs=0.02)
    said = "samples/s, which counts every timed step, came out at 0.53x the baseline's inside the blocks"
    assert said in control["notes"]
    # and so is the ratio of the table's two columns: both are read in the baseline's typical block
    assert control["samples_per_s"] / rows["baseline"]["samples_per_s"] == pytest.approx(0.53, abs=0.01)
    assert "against a speedup of 1.00x from typical steps" in control["notes"]
    assert "samples/s" not in rows["steady"]["notes"] and "samples/s" not in rows["baseline"]["notes"]


def test_a_summed_loss_under_grad_accum_is_named_not_read_as_a_better_fit():
    """loss_fn with reduction='sum' and grad_accum steps=4: the arm's loss came out at 0.25x the
    baseline's, and its note read 'final loss 75% below the baseline's ... the technique changed
    the numerics', as if it fit better."""
    from workbench.results import summarize

    def arm(name, steps=None):
        settings = {"grad_accum": {"steps": steps}} if steps else {}
        return {"name": name, "role": "baseline" if name == "baseline" else "treatment", "techniques": name,
                "settings": settings, "unavailable": None}  # fmt: skip

    arms = [arm("baseline"), arm("summed", 4), arm("other", 4)]
    units = [
        _fake_unit("baseline", [4.0] * 5),
        _fake_unit("summed", [1.02] * 5),
        _fake_unit("other", [2.4] * 5),
    ]
    rows = {row["arm"]: row for row in summarize(arms, units, planned_blocks=1, complete=True)}
    summed = rows["summed"]["notes"]
    assert (
        "about 1/4 of the baseline's, as a loss summed over the batch gives under 4 micro-batches" in summed
    )
    assert "changed the numerics" not in summed
    assert "the technique changed the numerics" in rows["other"]["notes"]


def test_an_arm_in_its_own_process_gets_a_verdict_only_from_more_than_one_block():
    """One block of an arm in its own process gave amp 0.73x [0.57, 0.94] 'slower' and, run again,
    1.37x [0.79, 2.35]: one pair of processes says nothing of how processes differ, and its notes
    said both that the interval left that out and that it was in it."""
    from workbench.results import summarize

    arms = [
        {"name": "baseline", "role": "baseline", "process": "own", "techniques": "none", "unavailable": None},
        {"name": "amp", "role": "treatment", "process": "own", "techniques": "amp", "unavailable": None},
    ]

    def units(blocks):
        found = []
        for block in range(blocks):
            found.append({**_fake_unit("baseline", [1.0] * 5, [0.010, 0.011] * 10, block), "process": "own"})
            found.append({**_fake_unit("amp", [1.0] * 5, [0.014, 0.015] * 10, block), "process": "own"})
        return found

    one = synthetic_results(
        summarize(arms, units(1), planned_blocks=1, complete=True), {"baseline": "baseline"}
    )
    amp = one.table.set_index("arm").loc["amp"]
    assert amp.speedup < 0.8 and amp.verdict == "not compared", amp.verdict
    assert (
        "is not in this interval, so it gets no verdict" in amp.notes
        and "is in this interval" not in amp.notes
    )
    three = synthetic_results(
        summarize(arms, units(3), planned_blocks=3, complete=True), {"baseline": "baseline"}
    )
    assert three.table.set_index("arm").loc["amp"].verdict == "slower"


def test_the_wall_clock_note_names_the_estimator_the_speedup_used():
    """When the job's own slow steps made the speedup count every step (capped), the note said it
    came "from typical steps" and that stalls could not move it, beside a note saying the opposite."""
    from workbench.results import _wall_clock_notes, _wall_ratio

    wall = _wall_ratio([({"samples_per_s": 100.0}, {"samples_per_s": 40.0})])
    (typical,) = _wall_clock_notes(0.6, wall, stats.ESTIMATOR, [(0.4, 0.6)])
    assert "0.40x the baseline's" in typical and "from typical steps" in typical
    (capped,) = _wall_clock_notes(0.6, wall, "capped_mean", [(0.4, 0.6)])
    assert "from typical steps" not in capped and "does not let such stalls move it" not in capped
    assert (
        f"from the mean step with no step counting for more than {stats.STALL_CAP:.0f} median steps" in capped
    )


def test_where_each_block_agrees_with_itself_the_wall_clock_note_blames_the_blocks_not_stalls():
    """Blocks of 0.86x, 2.25x and 0.83x samples/s, each agreeing with its own speedup: the table's
    samples/s (the middle block's, 0.86x) and speedup (all blocks', 1.18x) differ, and the note
    blamed stalls from outside the job, which the blocks themselves did not show."""
    from workbench.results import _wall_clock_notes

    (note,) = _wall_clock_notes(1.18, 0.86, stats.ESTIMATOR, [(0.86, 0.81), (2.25, 2.37), (0.83, 0.87)])
    assert "because the blocks disagree (this arm's speedup was 0.81x, 2.37x, 0.87x in them" in note
    assert "stalled" not in note


@pytest.mark.timing
def test_summary_and_repr_mention_what_did_not_run(small_results):
    text = repr(small_results)
    assert "tf32: unavailable: needs a CUDA device" in text
    assert "<table" in small_results._repr_html_()


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"schema": "%s"}', "damaged workbench results file: it has no 'table'"),
        (
            '{"schema": "%s", "table": {}, "units": [], "config": {}, "environment": {}}',
            "its 'table' is a JSON dict",
        ),
        (
            '{"schema": "%s", "table": [3], "units": [], "config": {}, "environment": {}}',
            "row 0 of its table",
        ),
        (
            '{"schema": "%s", "table": [{"arm": "a", "speedup": "abc"}], "units": [], "config": {}, "environment": {}}',
            "row 0 of its table has speedup 'abc', not a number",
        ),
        (
            '{"schema": "%s", "table": [], "units": [], "config": {}, "environment": {}, "arms": null}',
            "its 'arms' is null, not a list",
        ),
        (
            '{"schema": "%s", "table": [], "units": [], "config": {}, "environment": {}, "arms": [{"role": "x"}]}',
            "arm 0 of its plan has no name or role",
        ),
        (
            '{"schema": "%s", "table": [{"arm": "a", "status": 5}], "units": [], "config": {}, "environment": {}}',
            "row 0 of its table has status 5, not text",
        ),
        (
            '{"schema": "%s", "table": [{"arm": null}], "units": [], "config": {}, "environment": {}}',
            r"row 0 of its table is not an arm's row \(no arm name\)",
        ),
        (
            '{"schema": "%s", "table": [{"arm": "a", "final_loss": "x"}], "units": [], "config": {}, "environment": {}}',
            "row 0 of its table has final_loss 'x', not a number",
        ),
        (
            '{"schema": "%s", "table": [], "units": [], "config": {}, "environment": {}, "tune": {"nope": 1}}',
            r"its search record \('tune'\) lacks budget_s, spent_s",
        ),
        ("[1, 2, 3]", "it holds a JSON list, not an object"),
        ('{"schema": "%s", "table": [', "is not valid JSON"),
        ("", "is not valid JSON"),
    ],
)
def test_show_on_a_malformed_file_says_what_is_wrong_in_one_line(tmp_path, content, message):
    from workbench.results import SCHEMA

    file = tmp_path / "results.json"
    file.write_text(content.replace("%s", SCHEMA))
    with pytest.raises(ValueError, match=message) as caught:
        load_results(tmp_path)
    assert str(file) in str(caught.value) and "\n" not in str(caught.value)
    done = subprocess.run(
        [sys.executable, "-m", "workbench", "show", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr and str(file) in done.stderr


@pytest.mark.timing
def test_step_ms_and_samples_per_s_are_one_figure(small_results):
    """With an even number of blocks, two separate medians could disagree; one is derived."""
    ok = small_results.table[small_results.table.status == "ok"]
    assert np.allclose(ok.step_ms * ok.samples_per_s / 1e3, 32.0)  # batch 32 per step


@pytest.mark.timing
def test_a_failed_control_and_a_busy_machine_are_said_first(small_results):
    record = json.loads(json.dumps(small_results.record))
    control = next(row for row in record["table"] if row["arm"] == "baseline (control)")
    control.update(speedup=1.2, speedup_low=1.1, speedup_high=1.3)
    record["load"] = {
        "warning": "other processes used 0.80 of this machine's 2 cores (median) while the arms ran"
    }
    busy = wb.Results(record, None)
    warnings = busy.warnings()
    assert warnings[0].startswith(
        "the control arm (the baseline measured again) came out at 1.20 [1.10, 1.30]"
    )
    assert "more blocks" in warnings[0] and warnings[1].startswith("other processes used 0.80")
    assert busy.summary().startswith("WARNING: the control arm")
    title = busy.plot()._suptitle.get_text()
    assert "WARNING: the control arm" in title and "other processes used 0.80" in title


def test_blocks_on_different_devices_or_at_very_different_speeds_are_warned_about():
    """Nodes of a cluster (or a busy one): the speedups stay fair, being computed inside each
    block, but the run then averages over machines, and says so."""
    from workbench.results import mixed_blocks

    def units(speeds):
        return [
            {"arm": "baseline", "block": b, "status": "ok", "result": {"samples_per_s": s}}
            for b, s in enumerate(speeds)
        ]

    same = [{"block": b, "host": f"node{b}", "device_name": "NVIDIA H100"} for b in range(3)]
    assert mixed_blocks(same, units([1000, 1200, 1350])) == []  # within a process's luck
    (slow,) = mixed_blocks(same, units([1000, 1600, 1200]))
    assert "block 1 on node0 and 1600 in block 2 on node1, 1.6x" in slow and slow.endswith(
        "slow and fast machines"
    )
    # Every block on one machine: not "machines"
    one_host = [{**block, "host": "vm"} for block in same]
    assert mixed_blocks(one_host, units([1000, 1600, 1200]))[0].endswith("mix slow and fast blocks")
    mixed = [*same[:2], {"block": 2, "host": "node2", "device_name": "NVIDIA A100"}]
    (kinds,) = mixed_blocks(mixed, units([1000, 1100, 1050]))
    assert "2 kinds of device (NVIDIA A100; NVIDIA H100)" in kinds and "constraint" in kinds


def test_the_step_breakdown_divides_the_tables_step_even_when_one_block_stalled():
    """Each phase's figure is its share of the arm's timed windows times step_ms, so the bars add
    up to the step the table shows. Medians of each phase over blocks, apart from step_ms's,
    claimed three times the step here: one block ran ten times slower (a loaded machine)."""
    from workbench.results import summarize

    arms = [{"name": "baseline", "role": "baseline", "techniques": "none", "unavailable": None}]
    quiet, stalled = _fake_unit("baseline", [1.0] * 5), _fake_unit("baseline", [1.0] * 5, [0.1] * 4, block=1)
    quiet["result"]["phase_ms"] = {"data": 1.0, "forward": 3.0, "backward": 5.0, "optimizer": 0.5}
    stalled["result"]["phase_ms"] = {"data": 10.0, "forward": 30.0, "backward": 50.0, "optimizer": 5.0}
    (row,) = summarize(arms, [quiet, stalled], planned_blocks=2, complete=True)
    parts = [row[f"{phase}_ms"] for phase in ("data", "forward", "backward", "optimizer")]
    assert sum(parts) == pytest.approx(0.95 * row["step_ms"])  # 5% of each window between the steps
    assert parts == pytest.approx([share * row["step_ms"] for share in (0.1, 0.3, 0.5, 0.05)])
