"""The panel's live view and the results figure, read the way a person reads them: which points a
line joins, what a legend covers, whether a label is cut off, which colours look alike."""

import types

import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_rgba

from workbench import live_run
from workbench.live_run import LiveRun
from workbench.plots import plot_live, plot_results

ARMS = ["baseline", "amp"]


class FakeClock:
    """Stands in for the time module in workbench.live_run, so events arrive at chosen seconds."""

    def __init__(self):
        self.now = 1000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(live_run, "time", types.SimpleNamespace(time=fake.time))
    return fake


def _plan(live: LiveRun, processes: int = 3) -> None:
    arms = [{"name": arm, "unavailable": None} for arm in ARMS]
    live({"type": "plan", "arms": arms, "blocks": 2, "processes": processes, "remaining": processes})


def _process(live: LiveRun, clock: FakeClock, block: int, start: float, end: float, rates=None) -> None:
    """One process of ``block``, from ``start`` to ``end`` seconds after the run started: the arms'
    readings one second apart, then the process ends (or dies, when it is run again)."""
    clock.now = live.started + start
    live({"type": "start", "block": block, "arms": ARMS, "process": "block", "attempt": 1})
    for second in range(int(start) + 1, int(end)):
        clock.now = live.started + second
        for arm in ARMS:
            live({"type": "phase", "block": block, "arm": arm, "phase": "measure", "round": 1, "of": 9})
            rate = rates(second) if rates else 100.0 + second
            live({"type": "progress", "block": block, "arm": arm, "samples_per_s": rate})
    clock.now = live.started + end
    live({"type": "process_done", "block": block, "job": "block"})


def _throughput_axes(figure):
    return next(axes for axes in figure.axes if axes.get_title().startswith("Throughput"))


def test_live_lines_never_join_readings_of_two_processes(clock):
    """Block 0, then block 1, which dies and runs again: three processes, and a line inside each."""
    live = LiveRun()
    _plan(live)
    spans = [(0, 11), (20, 30), (40, 50)]
    for block, (start, end) in zip([0, 1, 1], spans, strict=True):
        _process(live, clock, block, start, end)
    axes = _throughput_axes(plot_live(live.snapshot()))
    lines = [line for line in axes.get_lines() if len(line.get_xdata()) > 1]
    assert len(lines) == len(ARMS) * len(spans), "one line per arm per process"
    for line in lines:
        seconds = np.asarray(line.get_xdata(), dtype=float)
        inside = [start <= seconds.min() and seconds.max() <= end for start, end in spans]
        assert any(inside), (
            f"a line joins readings of two processes: {seconds.min():.0f}..{seconds.max():.0f} s"
        )


def test_live_lines_are_rolling_medians_that_ignore_one_odd_window(clock):
    live = LiveRun()
    _plan(live, processes=1)
    _process(live, clock, 0, 0, 30, rates=lambda second: {10: 0.0, 20: 1000.0}.get(second, 100.0))
    axes = _throughput_axes(plot_live(live.snapshot()))
    drawn = np.concatenate([line.get_ydata() for line in axes.get_lines()])
    assert np.all(drawn == 100.0), "a single window's reading moved the line"


def test_live_lines_do_not_zig_zag_between_two_levels(clock):
    """On a busy machine readings often alternate between two levels: the line holds between them."""
    live = LiveRun()
    _plan(live, processes=1)
    _process(live, clock, 0, 0, 30, rates=lambda second: 50.0 if second % 2 else 150.0)
    axes = _throughput_axes(plot_live(live.snapshot()))
    for line in axes.get_lines():
        assert set(np.asarray(line.get_ydata())[1:]) == {100.0}, "the line zig-zags"


def test_the_running_arm_is_marked(clock):
    live = LiveRun()
    _plan(live, processes=1)
    clock.now = live.started + 1
    live({"type": "start", "block": 0, "arms": ARMS, "process": "block", "attempt": 1})
    for second, arm in enumerate(["baseline", "amp", "baseline", "amp"], start=2):
        clock.now = live.started + second
        live({"type": "phase", "block": 0, "arm": arm, "phase": "measure", "round": 1, "of": 9})
        live({"type": "progress", "block": 0, "arm": arm, "samples_per_s": 100.0})
    axes = _throughput_axes(plot_live(live.snapshot()))
    texts = {text.get_text(): text for text in axes.get_legend().get_texts()}
    assert "amp (running)" in texts and texts["amp (running)"].get_fontweight() == "bold"
    assert "baseline" in texts, "only the arm measured now is marked"
    rings = [line for line in axes.get_lines() if len(line.get_xdata()) == 1]
    assert len(rings) == 1 and rings[0].get_xdata()[0] == 5.0, "its latest reading is ringed"
    live({"type": "done", "out": ""})
    finished = _throughput_axes(plot_live(live.snapshot()))
    assert not any("running" in text.get_text() for text in finished.get_legend().get_texts())


def _overlaps(first, second) -> bool:
    return first.x0 < second.x1 and second.x0 < first.x1 and first.y0 < second.y1 and second.y0 < first.y1


def _assert_no_legend_covers_data(figure) -> None:
    figure.draw_without_rendering()
    legends = [axes.get_legend() for axes in figure.axes if axes.get_legend() is not None] + figure.legends
    assert legends
    for legend in legends:
        box = legend.get_window_extent()
        for axes in figure.axes:
            if axes.axison:
                assert not _overlaps(box, axes.get_window_extent()), (
                    f"the legend ({', '.join(t.get_text() for t in legend.get_texts())}) covers "
                    f"the axes '{axes.get_title()}'"
                )


NVML_READING = {
    "gpu0_util_percent": 90.0,
    "gpu0_memory_used_mib": 4096.0,
    "gpu0_power_w": 300.0,
    "gpu0_sm_clock_mhz": 1800.0,
}


@pytest.mark.parametrize("nvml", [False, True], ids=["cpu", "nvml"])
def test_live_legends_never_cover_the_data(clock, nvml):
    live = LiveRun()
    _plan(live, processes=1)
    _process(live, clock, 0, 0, 12)
    result = {
        "losses": [2.0, 1.0],
        "phase_ms": {"data": 1.0, "forward": 3.0, "backward": 5.0, "optimizer": 1.0},
        "wall_s": 0.1,
        "steps": 10,
    }
    for arm in ARMS:
        live({"type": "unit", "arm": arm, "block": 0, "status": "ok", "result": result})
    reading = {"cpu_percent": 80.0, "memory_used_mib": 2048.0, **(NVML_READING if nvml else {})}
    for second in (3, 4):
        live({"type": "telemetry", "time": live.started + second, **reading})
    _assert_no_legend_covers_data(plot_live(live.snapshot()))


def test_live_losses_leave_out_the_loader_only_twins(clock):
    # A loader-only twin trains a stand-in model that does no work: its flat loss near zero
    # would sit beside the model's curve as if it were a technique's (H100 suite, bfbf9f5).
    live = LiveRun()
    arms = [{"name": "baseline", "unavailable": None, "kind": "train"},
            {"name": "loader: baseline", "unavailable": None, "kind": "loader"}]  # fmt: skip
    live({"type": "plan", "arms": arms, "blocks": 1, "processes": 1, "remaining": 1})
    phases = {"data": 1.0, "forward": 3.0, "backward": 5.0, "optimizer": 1.0}
    live({"type": "unit", "arm": "baseline", "block": 0, "status": "ok",
          "result": {"losses": [2.0, 1.5, 1.0], "phase_ms": phases, "wall_s": 0.1, "steps": 10}})  # fmt: skip
    live({"type": "unit", "arm": "loader: baseline", "block": 0, "status": "ok",
          "result": {"losses": [0.0, 0.0, 0.0], "phase_ms": phases, "wall_s": 0.1, "steps": 10}})  # fmt: skip
    figure = plot_live(live.snapshot())
    losses = next(axes for axes in figure.axes if axes.get_title().startswith("Loss"))
    assert [list(line.get_ydata()) for line in losses.get_lines()] == [[2.0, 1.5, 1.0]]


@pytest.mark.parametrize(("rates", "scale"), [((1000.0, 1200.0), "linear"), ((1000.0, 15000.0), "log")])
def test_live_throughput_turns_logarithmic_when_the_arms_rates_are_far_apart(clock, rates, scale):
    # A loader-only twin at 15,000 samples/s beside training arms at 1,000 flattened their lines
    # at the bottom of a linear axis (H100 suite, bfbf9f5); arms of like speed keep it linear.
    live = LiveRun()
    _plan(live, processes=1)
    _process(live, clock, 0, 0, 6, rates=None)
    live.throughput = {
        arm: [(1.0 + s, rate, 0, 1) for s in range(5)] for arm, rate in zip(ARMS, rates, strict=True)
    }
    figure = plot_live(live.snapshot())
    axes = _throughput_axes(figure)
    assert axes.get_yscale() == scale
    if scale == "log":
        figure.draw_without_rendering()
        labels = [label.get_text() for label in axes.get_yticklabels() if label.get_text()]
        assert "1,000" in labels and "10,000" in labels, labels  # plain numbers, not powers of ten


def _results(arms: list[str], peaks: list[float], activations: list[float]):
    """What plot_results reads of a Results: its table (the plotted columns), config, environment."""
    count = len(arms)
    speedups = np.linspace(0.8, 1.3, count)
    table = pd.DataFrame(
        {
            "arm": arms,
            "status": ["ok"] * count,
            "speedup": speedups,
            "speedup_low": speedups * 0.9,
            "speedup_high": speedups * 1.1,
            "step_ms": [10.0] * count,  # half a millisecond more than the phases: an "other" bar
            "data_ms": [1.0] * count,
            "forward_ms": [3.0] * count,
            "backward_ms": [4.0] * count,
            "optimizer_ms": [1.5] * count,
            "peak_mem_mb": peaks,
            "activation_mb": activations,
        }
    )
    config = {"model": "mlp", "data": "digits", "mode": "one-at-a-time", "steps": 200, "blocks": 3,
              "batch_size": 32, "device": "cpu"}  # fmt: skip
    return types.SimpleNamespace(
        table=table, config=config, environment={"cpu": "a CPU"}, warnings=lambda: []
    )


MEMORY_CASES = {
    # the quickstart's panel: peaks alike, so the bars reach far right, and long arm names
    "alike": (["baseline", "baseline (control)", "amp", "grad_accum[steps=2]"], [4.8, 4.9, 4.9, 4.9], [0.42, 0.42, 0.71, 0.21]),
    "long names": (["baseline", "dataloader[num_workers=4,pin_memory=True]", "ddp_compression[hook=powersgd]"],
                   [1234.0, 1240.0, 1251.0], [567.0, 570.0, 401.0]),
    "one far ahead": (["baseline", "checkpointing"], [37.3, 23.0], [34.0, float("nan")]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MEMORY_CASES))
def test_memory_labels_stay_inside_their_chart(case):
    figure = plot_results(_results(*MEMORY_CASES[case]))
    figure.draw_without_rendering()
    memory = next(axes for axes in figure.axes if axes.get_title() == "Memory")
    box = memory.get_window_extent()
    for label in memory.texts:
        right = label.get_window_extent().x1
        assert right <= box.x1, f"'{label.get_text()}' ends {right - box.x1:.0f} px past the chart's edge"


def _as_seen(color) -> np.ndarray:
    """A bar's colour as drawn on the white figure: its alpha blended in."""
    red, green, blue, alpha = to_rgba(color)
    return alpha * np.array([red, green, blue]) + (1 - alpha) * np.ones(3)


def test_memory_bars_look_unlike_every_colour_of_the_breakdown():
    figure = plot_results(_results(*MEMORY_CASES["alike"]))
    breakdown = next(axes for axes in figure.axes if axes.get_title() == "Step breakdown")
    memory = next(axes for axes in figure.axes if axes.get_title() == "Memory")
    seen = [_as_seen(bar.get_facecolor()) for bar in breakdown.patches if bar.get_fill()]
    for bar in memory.patches:
        distance = min(np.linalg.norm(_as_seen(bar.get_facecolor()) - other) for other in seen)
        assert distance >= 0.15, f"a memory bar looks like a breakdown colour (RGB distance {distance:.2f})"


def test_live_arm_colours_look_unlike_the_verdicts_colours(clock):
    """The panel shows the live view above the results' plot, whose bars are green for faster and
    red for slower: amp was drawn green live and red ("slower") below it. No arm's line is of the
    red family (brown included) or the green one."""
    import colorsys

    global ARMS
    live = LiveRun()
    arms, ARMS = ARMS, [f"arm {index}" for index in range(8)]
    try:
        _plan(live, processes=1)
        _process(live, clock, 0, 0, 4)
    finally:
        ARMS = arms
    axes = _throughput_axes(plot_live(live.snapshot()))
    lines = [line for line in axes.get_lines() if len(line.get_xdata()) > 1]
    assert len({line.get_color() for line in lines}) >= 7
    for line in lines:
        hue, _, saturation = colorsys.rgb_to_hls(*to_rgba(line.get_color())[:3])
        if saturation > 0.3:  # a grey has no hue to mistake
            assert not (hue < 0.05 or hue > 0.95), f"{line.get_label()} is drawn red, like a slower bar"
            assert not 0.25 < hue < 0.45, f"{line.get_label()} is drawn green, like a faster bar"


def test_the_live_breakdown_names_only_phases_a_bar_shows(clock):
    """A data phase of 0.01% of the step had a legend entry and no visible bar."""
    live = LiveRun()
    _plan(live, processes=1)
    _process(live, clock, 0, 0, 4)
    result = {"losses": [2.0, 1.0], "wall_s": 0.1, "steps": 10,
              "phase_ms": {"data": 0.001, "forward": 3.0, "backward": 5.0, "optimizer": 1.0}}  # fmt: skip
    for arm in ARMS:
        live({"type": "unit", "arm": arm, "block": 0, "status": "ok", "result": result})
    figure = plot_live(live.snapshot())
    breakdown = next(axes for axes in figure.axes if axes.get_title().startswith("Step breakdown"))
    named = [text.get_text() for text in breakdown.get_legend().get_texts()]
    assert named == ["forward", "backward", "optimizer"], named
