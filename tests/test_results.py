"""Statistics, the results table, saving/loading (JSON/CSV only) and the plot."""

import json
import math

import numpy as np
import pytest
from matplotlib.figure import Figure

import workbench as wb
from workbench import stats
from workbench.results import TABLE_COLUMNS, load_results


def test_median_and_spread():
    assert stats.median_and_spread([1.0, 2.0, 3.0, 4.0, 100.0]) == (3.0, 2.0)
    median, spread = stats.median_and_spread([])
    assert math.isnan(median) and math.isnan(spread)


def test_t_interval_arithmetic():
    """Three paired rounds with ratios e^0.1, e^0.2, e^0.3: mean 0.2, sd 0.1, t(0.975, 2) = 4.3027."""
    base = [stats.Window(100.0, [])] * 3
    arm = [stats.Window(100.0 * math.exp(x), []) for x in (0.1, 0.2, 0.3)]
    point, low, high = stats.speedup_interval(base, arm)
    half = 4.302652729911275 * 0.1 / math.sqrt(3)
    assert point == pytest.approx(math.exp(0.2))
    assert (low, high) == (pytest.approx(math.exp(0.2 - half)), pytest.approx(math.exp(0.2 + half)))


def test_pairing_cancels_drift():
    """The machine slows down 30% over the run; a 10% faster arm is still found at 1.10."""
    drift = [1.0, 0.9, 0.8, 0.7]
    base = [stats.Window(1000 * d, []) for d in drift]
    arm = [stats.Window(1100 * d, []) for d in drift]
    point, low, high = stats.speedup_interval(base, arm)
    assert point == pytest.approx(1.1) and low == pytest.approx(1.1) and high == pytest.approx(1.1)


def test_interval_coverage_on_simulated_a_a_runs():
    """Simulated identical arms with 15% per-run noise: the 95% interval holds 1.0 about 95% of the time."""
    rng = np.random.default_rng(1)
    hits = 0
    trials = 2000
    for _ in range(trials):
        base = [stats.Window(v, []) for v in 1000 * np.exp(rng.normal(0, 0.15, 3))]
        arm = [stats.Window(v, []) for v in 1000 * np.exp(rng.normal(0, 0.15, 3))]
        _, low, high = stats.speedup_interval(base, arm)
        hits += low <= 1.0 <= high
    assert 0.93 <= hits / trials <= 0.97


def test_single_repeat_uses_within_window_steps():
    rng = np.random.default_rng(0)
    base = [stats.Window(1000.0, list(rng.normal(0.010, 0.001, 50)))]
    arm = [stats.Window(1250.0, list(rng.normal(0.008, 0.0008, 50)))]
    point, low, high = stats.speedup_interval(base, arm)
    assert point == pytest.approx(1.25) and low < 1.25 < high and high - low < 0.2


def test_noisy_flag():
    assert stats.is_noisy([100, 140, 100], 1.0, 0.99, 1.01)  # 40% spread between repeats
    assert stats.is_noisy([100, 101, 100], 1.5, 1.2, 1.8)  # interval +-20%
    assert not stats.is_noisy([100, 101, 102], 1.5, 1.45, 1.55)


@pytest.fixture(scope="module")
def small_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("results") / "run"
    return wb.ablate(
        model="mlp",
        techniques={"amp": True, "grad_accum": {"steps": 2}, "tf32": True},
        steps=8,
        warmup=2,
        repeats=2,
        out=out,
        progress=False,
    )


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
    assert ((parts <= ok.step_ms * 1.05) & (parts >= ok.step_ms * 0.5)).all(), (
        "the breakdown must explain the step"
    )
    assert table.set_index("arm").loc["baseline", "speedup"] == 1.0
    assert (ok.loss_vs_baseline.between(0.5, 2.0)).all()
    assert set(ok.repeats) == {2}


def test_save_and_load_round_trip_json_and_csv(small_results, tmp_path):
    folder = small_results.save(tmp_path / "saved")
    for name in ("results.json", "table.csv", "losses.csv", "telemetry.csv"):
        assert (folder / name).exists()
    record = json.loads((folder / "results.json").read_text())  # plain JSON, nothing to unpickle
    assert record["schema"] == "workbench-results/1"
    assert record["environment"]["torch"] and record["environment"]["cpu"]
    loaded = load_results(folder)
    assert loaded.table.equals(small_results.table)
    assert loaded.complete and loaded.config["steps"] == 8
    assert len(loaded.losses) == 4 * 2 * 10  # 4 arms that ran, 2 repeats, warmup + steps
    assert set(loaded.losses.columns) == {"arm", "repeat", "step", "loss", "timed"}
    assert load_results(folder / "results.json").table.equals(loaded.table)


def test_ablate_out_folder_is_loadable(small_results):
    assert load_results(small_results.path).table.equals(small_results.table)
    assert (small_results.path / "plan.json").exists()
    assert len(list((small_results.path / "units").glob("*.json"))) == 8
    assert len(list((small_results.path / "logs").glob("*.log"))) == 8


def test_loading_rejects_what_is_not_ours(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"schema": "something-else"}))
    with pytest.raises(ValueError, match="is not a workbench results file"):
        load_results(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_results(tmp_path / "missing")


def test_plot_has_speedup_breakdown_and_memory(small_results, tmp_path):
    figure = small_results.plot()
    assert isinstance(figure, Figure)
    titles = [axes.get_title() for axes in figure.axes]
    assert titles == ["Throughput", "Step breakdown", "Memory"]
    figure.savefig(tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_loss_drift_is_called_out():
    from workbench.results import summarize

    def unit(arm, losses):
        result = {
            "samples_per_s": 100.0,
            "step_s": [0.01] * 4,
            "wall_s": 0.04,
            "steps": 4,
            "losses": losses,
            "phase_ms": dict.fromkeys(("data", "forward", "backward", "optimizer"), 1.0),
            "peak_mem_mib": 1.0,
            "peak_rss_mib": 1.0,
            "startup_s": 0.1,
            "cpu_util_pct": 50.0,
            "notes": [],
            "warmup": 1,
        }
        return {"arm": arm, "repeat": 0, "status": "ok", "reason": "", "result": result}

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
    rows = summarize(arms, units, planned_repeats=1, complete=True)
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


def test_summary_and_repr_mention_what_did_not_run(small_results):
    text = repr(small_results)
    assert "tf32: unavailable: needs a CUDA device" in text
    assert "<table" in small_results._repr_html_()
