"""The results figure: speedup with interval whiskers, step-time breakdown, peak memory.

Built on matplotlib's object API (``Figure``), never pyplot's global state, so it is safe
from threads and shows once in a notebook (returned, not also auto-displayed).
"""

from __future__ import annotations

import io
import math
import re
import textwrap

import numpy as np
from matplotlib.figure import Figure


class ResultsFigure(Figure):
    """A Figure that renders itself in notebooks, with no pyplot state behind it."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=90)
        return buffer.getvalue()


PHASE_COLORS = {
    "data": "#8c8c8c",
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "optimizer": "#55a868",
    "replay": "#8172b3",  # cuda_graphs: forward, backward and optimizer as one graph replay
}
# Data-parallel arms: the communication the step waited for after backward's computation, cut
# out of the backward phase it happened in; the hidden part is hatched over the backward bar.
EXPOSED_COMM_COLOR = "#c44e52"
# Teal: unlike every colour of the step breakdown, also when faded for the peak (a faded brown
# looked like the breakdown's light grey "other").
MEMORY_COLOR = "#1a9e9e"
# Not the red of a "slower" verdict: a diverged arm is not a slower one.
STATUS_COLORS = {"ok": "#4c72b0", "diverged": "#dd8452", "interrupted": "#b0b0b0"}
VERDICT_COLORS = {"faster": "#2e8b57", "slower": "#c44e52"}  # any other verdict keeps its status's colour
VERDICT_ORDER = ("faster", "within noise", "slower")  # the verdicts a treatment's bar can show


def _percent(value: float) -> str:
    """Two significant digits, written plainly: "85%", "100%", "0.12%" (never "1e+02%")."""
    from workbench.results_view import plain_number

    return f"{plain_number(value, digits=2)}%"


def _mib(value: float) -> str:
    """Two significant digits below 10 MiB (small models), whole MiB above; never in scientific
    notation, and below a thousandth of a MiB (a kilobyte) "<0.001", not 4.2e-05."""
    from workbench.results_view import plain_number

    return plain_number(value, digits=2, smallest=0.001) if value < 10 else f"{value:,.0f}"


SIDE_BY_SIDE_INCHES = 10.0  # the narrowest figure that holds the three panels side by side


def plot_results(results, width: float = 13.0) -> ResultsFigure:
    """Speedups, step breakdown and memory per arm, side by side, ``width`` inches wide."""
    from workbench.results_view import with_roles

    # first arm at the top; each arm's role, for the noise band its verdict is judged against
    # (a table without a record's arms, as tests draw, is given roles by the arms' names)
    arms = getattr(results, "record", {}).get("arms")
    table = (with_roles(results.table, arms) if arms else results.table).iloc[::-1].reset_index(drop=True)
    if table.step_ms.isna().all():  # no arm measured a step: what to draw is why
        return _plot_nothing_measured(results, table.iloc[::-1], width)
    y = np.arange(len(table))
    rows_tall = 0.42 * max(len(table), 3)
    if width >= SIDE_BY_SIDE_INCHES:
        figure = ResultsFigure(figsize=(width, 1.6 + rows_tall), layout="constrained")
        speed_ax, phase_ax, memory_ax = figure.subplots(1, 3, sharey=True, width_ratios=[1.2, 1.2, 0.8])
    else:  # too narrow for three panels' ticks and labels side by side: one above the other
        figure = ResultsFigure(figsize=(width, 2.2 + 3 * (0.9 + rows_tall)), layout="constrained")
        speed_ax, phase_ax, memory_ax = figure.subplots(3, 1)
        for axes in (phase_ax, memory_ax):
            axes.set_yticks(y, list(table.arm))
    _plot_speedups(speed_ax, table, y)
    _plot_step_breakdown(phase_ax, table, y)
    _plot_memory(memory_ax, table, y)
    _add_figure_legend(figure, (speed_ax, phase_ax, memory_ax))
    # A line of 10-point text holds about 7 characters per inch of the figure's width (0.6 em a
    # character); longer title lines are wrapped, as matplotlib would otherwise cut them off.
    title, warned = _results_title(results, line_chars=int(figure.get_figwidth() * 72 / (10 * 0.6)))
    figure.suptitle(title, fontsize=10, color="#c44e52" if warned else "black")
    _make_room_for_labels(memory_ax)
    return figure


def _plot_nothing_measured(results, table, width: float) -> ResultsFigure:
    """When no arm measured a step (each failed, was stopped or cannot run here), empty panels
    and axes would say nothing: each arm's status and reason say what to fix."""
    line_chars = int(width * 72 / (9 * 0.6))  # 9-point text, as in plot_results' title
    lines = []
    for arm, status, reason in zip(table.arm, table.status, table.reason.fillna(""), strict=True):
        said = textwrap.wrap(f"{arm}: {status}" + (f", {reason}" if reason else ""), line_chars,
                             subsequent_indent="    ")  # fmt: skip
        lines += said or [f"{arm}: {status}"]
    title, warned = _results_title(results, line_chars=int(width * 72 / (10 * 0.6)))
    # As tall as its text: 10-point title lines and 9-point rows, 1.3 line spacing, in inches.
    tall = 0.45 + 1.3 * (10 * (title.count("\n") + 2) + 9 * len(lines)) / 72
    figure = ResultsFigure(figsize=(width, tall), layout="constrained")
    figure.suptitle(title, fontsize=10, color="#c44e52" if warned else "black")
    axes = figure.subplots()
    axes.set_axis_off()
    axes.set_title("No arm measured a step", fontsize=10, loc="left")
    axes.text(0, 1, "\n".join(lines), va="top", ha="left", fontsize=9, family="monospace",
              transform=axes.transAxes, color="#c44e52")  # fmt: skip
    return figure


def plot_speedups(table, title: str) -> ResultsFigure:
    """The throughput panel of ``plot_results`` alone, from a table with ``arm``, ``status``,
    ``speedup``, ``speedup_low`` and ``speedup_high``: for figures recorded elsewhere and read back
    as a DataFrame, such as the GPU suite's (benchmarks/results/gpu), which keep no Results."""
    table = table.iloc[::-1].reset_index(drop=True)  # first arm at the top
    figure = ResultsFigure(figsize=(8, 1.2 + 0.42 * max(len(table), 3)), layout="constrained")
    axes = figure.subplots()
    _plot_speedups(axes, table, np.arange(len(table)))
    _legend_below(axes)
    figure.suptitle(title, fontsize=10)
    return figure


def _plot_speedups(axes, table, y) -> None:
    """Speedup: point and 95% interval per arm, on a log axis (0.5x and 2x are equally far from
    1x); rows that did not run say why."""
    measured = table.speedup.notna()
    colors = [STATUS_COLORS.get(s, "#dd8452") for s in table.status]
    # The verdict in the bar's colour: an interval that ends at the band's edge reads alike
    # either side of it, and the table's verdict is what the plot should not contradict.
    verdicts = table.verdict if "verdict" in table else [None] * len(table)
    colors = [VERDICT_COLORS.get(verdict, color) for verdict, color in zip(verdicts, colors, strict=True)]
    _shade_noise_band(axes, table, measured)
    axes.barh(
        y[measured],
        table.speedup[measured] - 1,
        left=1,
        color=[colors[i] for i in y[measured]],
        alpha=0.35,
        height=0.6,
    )
    # A legend entry per verdict that a bar shows, in that bar's colour ("within noise" keeps the
    # status's): a bar of no width, since an empty one has no colour.
    shown = {v: c for v, c, m in zip(verdicts, colors, measured, strict=True) if m and v in VERDICT_ORDER}
    for verdict in sorted(shown, key=VERDICT_ORDER.index):
        axes.barh(y[:1], [0], left=1, color=shown[verdict], alpha=0.35, label=f"{verdict} (the verdict)")
    axes.errorbar(
        table.speedup[measured],
        y[measured],
        xerr=[
            table.speedup[measured] - table.speedup_low[measured],
            table.speedup_high[measured] - table.speedup[measured],
        ],
        fmt="o",
        color="black",
        capsize=3,
        markersize=4,
    )
    axes.axvline(1.0, color="black", linewidth=0.8)
    for index in y[~measured]:  # from the left edge: beside 1x it ran past the axes when every arm was slower
        # an arm that ran but has no speedup (its baseline did not run) is not compared, and not red
        ran = table.status[index] == "ok"
        axes.text(0.02, index, "not compared" if ran else table.status[index], va="center", ha="left",
                  color="#666666" if ran else "#c44e52", fontsize=9, transform=axes.get_yaxis_transform())  # fmt: skip
    axes.set_xscale("log")
    # Points without an interval (one timed step) count too, so that none falls off the axis.
    readable_log_ticks(
        axes,
        [*table.speedup_low[measured], *table.speedup[measured]],
        [*table.speedup_high[measured], *table.speedup[measured]],
    )
    axes.set_xlabel("speedup vs baseline (95% interval, log scale)")
    axes.set_yticks(y, list(table.arm))
    axes.set_title("Throughput")


def _shade_noise_band(axes, table, measured) -> None:
    """Behind each arm, the band its verdict is judged against (results_view.noise_band): the
    control's interval for its kind of process, widened to hold 1. A speedup inside it is not
    told apart from noise. An arm with no control of its own kind (one in its own process)
    has no band: 1 alone. Tables without roles (figures read back from elsewhere) name the
    control "baseline (control)", as workbench does."""
    from workbench.results_view import noise_band

    defaults = {
        "role": table.arm.map(
            lambda arm: {"baseline": "baseline", "baseline (control)": "control"}.get(arm, "treatment")
        ),
        "kind": "train",
        "process": "block",
    }
    table = table.assign(**{column: value for column, value in defaults.items() if column not in table})
    label = "noise band (control's interval)"
    for index, row in enumerate(table.itertuples()):
        if not measured.iloc[index] or row.role == "baseline":
            continue
        low, high = noise_band(row, table)
        if high > low:
            axes.barh(
                index, high - low, left=low, height=0.9, color="#d9d9d9", alpha=0.6, zorder=0, label=label
            )
            label = None  # one legend entry


def _plot_step_breakdown(axes, table, y) -> None:
    """Step breakdown: where the time of one optimizer step goes.

    Only the phases a bar can show (VISIBLE_SHARE of the longest step) get one, and a legend
    entry ("replay" only with cuda_graphs); a phase too short to draw is counted in "other".
    """
    left = np.zeros(len(table))
    largest_step = max(np.nan_to_num(table.step_ms.to_numpy(dtype=float)).max(initial=0.0), 1e-9)
    exposed, hidden = _communication_ms(table)
    for phase, color in PHASE_COLORS.items():
        values = table[f"{phase}_ms"].fillna(0).to_numpy() if f"{phase}_ms" in table else np.zeros(len(table))
        if phase == "backward" and exposed.any():
            values = np.clip(values - exposed, 0, None)  # backward() returns after the wait
        if (values > VISIBLE_SHARE * largest_step).any():  # else no bar, no legend entry: "other" holds it
            axes.barh(y, values, left=left, color=color, label=phase, height=0.6)
            if phase == "backward" and hidden.any():
                axes.barh(y, np.minimum(hidden, values), left=left, height=0.6, fill=False, hatch="///",
                          edgecolor="#7a3e12", linewidth=0, label="communication hidden behind backward")  # fmt: skip
            left += values
        if phase == "backward" and exposed.any():
            axes.barh(
                y, exposed, left=left, color=EXPOSED_COMM_COLOR, label="communication (exposed)", height=0.6
            )
            left += exposed
    other = np.clip(table.step_ms.fillna(0).to_numpy() - left, 0, None)
    if (other > VISIBLE_SHARE * largest_step).any():  # more than rounding, and a bar would show it
        axes.barh(y, other, left=left, color="#e0e0e0", label="other", height=0.6)
    axes.set_xlabel("ms per optimizer step")
    axes.set_title("Step breakdown")


# Of the longest step: about a pixel of a 500-pixel axis (the optimizer, 3 ms of 860, shows).
VISIBLE_SHARE = 0.002


def _communication_ms(table) -> tuple[np.ndarray, np.ndarray]:
    """Per arm: communication the step waited for, and communication hidden behind backward (ms)."""
    if "comm_exposed_ms" not in table or not table.comm_exposed_ms.notna().any():
        zeros = np.zeros(len(table))
        return zeros, zeros
    exposed = table.comm_exposed_ms.fillna(0).to_numpy(dtype=float)
    return exposed, np.clip(table.comm_ms.fillna(0).to_numpy(dtype=float) - exposed, 0, None)


def _plot_memory(axes, table, y) -> None:
    """Memory: the step's peak, and inside it the activations autograd saved for backward, the
    part that checkpointing and grad_accum shrink (weights, gradients and optimizer state
    dominate the peak and would hide those savings)."""
    memory = table.peak_mem_mb.to_numpy(dtype=float)
    activations = table.activation_mb.to_numpy(dtype=float)
    axes.barh(
        y, np.nan_to_num(memory), color=MEMORY_COLOR, alpha=0.35, height=0.6, label="peak tensor memory"
    )
    axes.barh(
        y,
        np.nan_to_num(activations),
        color=MEMORY_COLOR,
        height=0.6,
        label="of it, activations saved for backward",
    )
    for index, (peak, saved) in enumerate(zip(memory, activations, strict=True)):
        if math.isfinite(peak):
            text = f" {_mib(peak)}" + (f" ({_mib(saved)} act.)" if math.isfinite(saved) else "")
            axes.text(peak, index, text, va="center", fontsize=8)
    axes.set_xlabel("memory per step, MiB")
    axes.set_title("Memory")


def _make_room_for_labels(axes) -> None:
    """Widen the x axis until the labels right of the bars end inside the axes.

    How much room a label needs in data units depends on the axes' width once the whole figure
    is laid out (its legend and title included), so the figure is laid out first, and again after
    (new limits may change the ticks, and so the layout)."""
    widest_bar = max((bar.get_width() for bar in axes.patches), default=0.0)
    if not axes.texts or widest_bar <= 0:
        return
    axes.set_xlim(0, widest_bar * 1.05)
    for _ in range(2):
        axes.figure.draw_without_rendering()
        widest_label = max(label.get_window_extent().width for label in axes.texts)
        bars_share = max(1 - widest_label / axes.get_window_extent().width - 0.03, 0.25)  # a quarter at least
        axes.set_xlim(0, widest_bar / bars_share)


def _add_figure_legend(figure, panels) -> None:
    """One legend for the figure, below the panels: constrained layout keeps it clear of the axis
    labels at any number of arms (a legend hung under one axes overlapped them with few arms)."""
    handles, labels = [], []
    for axes in panels:
        more_handles, more_labels = axes.get_legend_handles_labels()
        handles += more_handles
        labels += more_labels
    columns = max(1, min(len(labels), 5, int(figure.get_figwidth() / 2.4)))  # an entry is about 2.4 inches
    figure.legend(handles, labels, loc="outside lower center", ncol=columns, fontsize=8, frameon=False)


def _results_title(results, line_chars: int) -> tuple[str, bool]:
    """The figure's title (run settings and the machine) and whether it carries warnings; each
    warning shortened to its first clause, the whole wrapped at ``line_chars``."""
    config = results.config
    device = config.get("device", "")
    env = results.environment
    where = ", ".join(env.get("gpus") or []) if device.startswith("cuda") else env.get("cpu", "")
    blocks = config.get("blocks", config.get("repeats"))
    # a run stopped (or a search's round cut by its budget) measured fewer blocks than it planned
    units = getattr(results, "record", {}).get("units", [])  # the live plot's run has none yet
    done = len({unit["block"] for unit in units if unit.get("status") == "ok"})
    of = f"{done} of " if units and not results.complete and done < blocks else ""
    title = (
        f"{config['model']} on {config['data']}, {config['mode']}: {config['steps']} steps per arm x "
        f"{of}{blocks} block{'s' * (blocks != 1)}, batch {config['batch_size']}, {device} ({where})"
    )
    warnings = results.warnings()
    if warnings:  # said on the figure itself: a plot travels without its table
        short = [first_clause(w) for w in warnings]
        title += "\n" + textwrap.fill("WARNING: " + "; ".join(short), line_chars)
    return title, bool(warnings)


def first_clause(warning: str) -> str:
    """A warning in a few words, for a figure's title: up to its first colon or 'while'."""
    return re.split(r": | while ", warning, maxsplit=1)[0]


TICK_LABEL_INCHES = 0.45  # a speedup tick's label ("0.67") and the space it needs beside the next


def readable_log_ticks(axis, lows, highs) -> None:
    """Plain speedup ticks (0.5, 0.8, 1, 1.25, 2...) on the log axis, not powers of ten."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    finite = [v for v in [*lows, *highs, 1.0] if np.isfinite(v) and v > 0]
    low, high = min(finite), max(finite)
    # 6 and 8: with only 5 and 10 above 4, CUDA Graphs' 6.7x on an H200 had no number near it.
    # The decades at both ends: an interval of one noisy block can reach 0.0001x or 1000x.
    candidates = [0.00001, 0.0001, 0.001, 0.01, 0.02, 0.05, 0.1, 0.2, 0.25, 0.33, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1,
                  1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50, 100, 200, 500, 1000, 10000, 100000]  # fmt: skip
    # Labels need room: on a wide axis, 0.8, 1 and 1.25 sit too close to be read. Keep 1; then a
    # number beyond each end of the intervals (1 itself where they all lie on one side of it),
    # the nearest at least a ninth of the axis (in log terms; a fifth beyond 3 decades) from 1; then, nearest to 1 first,
    # the ticks inside at least that far from every tick kept.
    span = math.log(max(high, 1.0) * 1.08 / (min(low, 1.0) / 1.08))
    # Across decades, only their round numbers: 0.001, 0.01, 0.1, 1, 8, 100 read as a misprint.
    if span > math.log(1000):
        candidates = [t for t in candidates if _leading_digit(t) == 1]
    elif span > math.log(100):
        candidates = [t for t in candidates if _leading_digit(t) in (1, 2, 5)]
    # At most 9 ticks across, and fewer on a narrow axis: a label such as "0.33" needs about
    # TICK_LABEL_INCHES (in the panel's 2.7-inch axis, 0.25 and 0.33 ran together).
    inches = axis.figure.get_figwidth() * axis.get_position().width
    across = min(9.0, max(3.0, inches / TICK_LABEL_INCHES))
    # beyond three decades the labels grow long
    gap = span / (across if span < math.log(1000) else min(5.0, across))
    kept = [1.0]
    if high > 1.0:
        kept += [t for t in candidates if t >= high and math.log(t) >= gap][:1]
    if low < 1.0:
        kept += [t for t in candidates[::-1] if t <= low and -math.log(t) >= gap][:1]
    for tick in sorted((t for t in candidates if low <= t <= high), key=lambda t: abs(math.log(t))):
        if all(abs(math.log(tick / other)) >= gap for other in kept):
            kept.append(tick)
    ticks = sorted(kept)
    axis.xaxis.set_major_locator(FixedLocator(ticks))
    axis.xaxis.set_major_formatter(
        lambda value, _: np.format_float_positional(value, trim="-")
    )  # 0.00001, not 1e-05
    axis.xaxis.set_minor_locator(NullLocator())
    axis.xaxis.set_minor_formatter(NullFormatter())
    # The axis reaches the outermost ticks kept, so the farthest interval has a number beyond it
    # (an amp arm at 0.11x showed no tick below 0.2 when the axis stopped at 0.102).
    axis.set_xlim(min(min(low, 1.0) / 1.08, min(ticks) / 1.02), max(max(high, 1.0) * 1.08, max(ticks) * 1.02))


def _leading_digit(value: float) -> float:
    """1 for 0.01, 10 and 1000; 2 for 0.2 and 20; 3.3 for 0.33: the value over its decade."""
    return round(value / 10 ** math.floor(math.log10(value) + 1e-9), 6)


# tab10 without its green, red and brown: under the live view, the results' plot colours bars
# green for faster and red for slower, and an arm drawn green live and red below read as both.
LIVE_ARM_COLORS = ("#1f77b4", "#ff7f0e", "#9467bd", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


# Past seven arms (a grid of three techniques plans ten) the colours come round again, each
# round in a line style of its own, so that no two arms are drawn alike.
LIVE_ARM_LINES = ("-", "--", ":", "-.")


def _arm_styles(arms: list[str]) -> dict[str, dict]:
    """Each arm's colour and line style in the live view, in the plan's order."""
    per_round = len(LIVE_ARM_COLORS)
    return {
        arm: {
            "color": LIVE_ARM_COLORS[index % per_round],
            "linestyle": LIVE_ARM_LINES[index // per_round % len(LIVE_ARM_LINES)],
        }
        for index, arm in enumerate(arms)
    }


def plot_live(snapshot: dict) -> ResultsFigure:
    """The panel's live view of a running ablation (a LiveRun snapshot): throughput over time and
    the step breakdown per arm on top; loss curves and the machine's utilization (CPU; GPU through
    NVML) below. Every legend sits outside its axes, so none covers the data."""
    figure = ResultsFigure(figsize=(11, 6.4), layout="constrained")  # about the panel's width at 90 dpi
    arms_row, machine_row = figure.subfigures(2, 1, height_ratios=[1.1, 1])
    speed_ax, phase_ax = arms_row.subplots(1, 2, width_ratios=[1.5, 1])
    samples = snapshot["telemetry"]
    gpu_keys = gpu_util_keys(samples)
    loss_ax, cpu_ax, *machine_axes = machine_row.subplots(1, 4 if gpu_keys else 3)
    arms = snapshot["arms"] or sorted(snapshot["throughput"])
    styles = _arm_styles(arms)
    running = snapshot.get("running_arm") if snapshot["state"] == "running" else None
    _plot_live_throughput(speed_ax, snapshot["throughput"], styles, running)
    finished = [unit for unit in snapshot["finished"] if unit.get("result")]
    _plot_live_breakdown(phase_ax, finished, arms)
    loader_arms = set(snapshot.get("loader_arms", ()))  # their stand-in model's loss says nothing
    _plot_live_losses(loss_ax, [unit for unit in finished if unit["arm"] not in loader_arms], styles)
    seconds = [s["time"] - snapshot["started"] for s in samples]
    _plot_cpu_utilization(cpu_ax, samples, seconds)
    if gpu_keys:
        _plot_gpu_telemetry(*machine_axes, gpu_keys, samples, seconds)
    else:
        _plot_machine_memory(machine_axes[0], samples, seconds)
        machine_row.supxlabel(
            "No GPU telemetry: NVML readings of GPU utilization, memory, power and SM clock appear here "
            "on a CUDA machine with nvidia-ml-py installed.",
            fontsize=8,
            color="#666",
        )
    title = (
        f"{snapshot['state']}: {snapshot['processes_done']} of {snapshot['processes'] or '?'} processes finished"
        + (f"; now {snapshot['current']}" if snapshot["state"] == "running" and snapshot["current"] else "")
    )
    # a search's long round and arm names ran past both edges of the figure on one line
    figure.suptitle(textwrap.fill(title, LIVE_TITLE_CHARS), fontsize=10)
    return figure


LIVE_TITLE_CHARS = 130  # what the live figure's width holds at the title's size


def _waiting_for_a_block(axes) -> None:
    """An empty panel says what it will show, rather than showing bare 0-1 axes."""
    axes.text(0.5, 0.5, "shown once a block\nhas finished", ha="center", va="center",
              transform=axes.transAxes, color="#888", fontsize=9)  # fmt: skip
    axes.set_xticks([])
    axes.set_yticks([])


# Progress readings in each rolling median. A reading is one window's rate, and windows are a few
# milliseconds long, so on a busy machine readings swing with the scheduler, from 0 to twice the
# median, often between two levels. An even count: where a window holds as many readings of each
# level, an odd count's median would flip from one level to the other at every reading, a zig-zag
# again; an even count's lies between them. An arm reports about twice a second: ten readings
# follow a real change within about 5 s.
ROLLING_READINGS = 10


def _legend_outside(axes) -> None:
    """The axes' legend to the right of it, never over the data (constrained layout makes room)."""
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, fontsize=8, frameon=False)


def _legend_below(axes) -> None:
    """The axes' legend under its x label, for the narrow axes of the machine's row (none where
    nothing is labelled, e.g. a table without a control arm has no noise band)."""
    if not axes.get_legend_handles_labels()[1]:
        return
    axes.legend(
        loc="upper center", bbox_to_anchor=(0.5, -0.3), borderaxespad=0, fontsize=7, frameon=False, ncol=1
    )


def _rolling_median(values: list[float], window: int = ROLLING_READINGS) -> np.ndarray:
    """The median of each value and those before it, up to ``window`` readings, and an even count
    of them wherever there are two or more (see ROLLING_READINGS)."""
    values = np.asarray(values, dtype=float)
    medians = []
    for end in range(1, len(values) + 1):
        count = min(end, window)
        count -= count % 2 if count > 1 else 0
        medians.append(np.median(values[end - count : end]))
    return np.array(medians)


def _throughput_segments(points: list[tuple]) -> list[list[tuple]]:
    """An arm's live readings, split by the process that measured them, in time order.

    A point is (seconds, samples/s, block, process); ``process`` counts the processes started.
    Between two processes (another block, a process run again after a crash, the arm moved to a
    process of its own) the arm did not run, so no line may join their readings.
    """
    segments: dict[int, list[tuple]] = {}
    for point in points:
        segments.setdefault(point[3], []).append(point)
    return [sorted(segment) for segment in segments.values()]


# When the arms' median rates differ by more than this factor, the live throughput axis is logarithmic.
LIVE_LOG_SCALE_SPREAD = 4.0


def _plot_live_throughput(axes, throughput: dict, styles: dict, running: str | None) -> None:
    """Each process's readings of an arm as a segment of its own: their rolling median, in the arm's
    colour and line style. The arm measured now is named in bold and ringed at its latest reading."""
    planned = {arm: index for index, arm in enumerate(styles)}  # the legend in the plan's order
    for arm in sorted(throughput, key=lambda name: planned.get(name, len(planned))):
        points, now = throughput[arm], arm == running
        for index, segment in enumerate(_throughput_segments(points)):
            seconds = [point[0] for point in segment]
            rates = _rolling_median([point[1] for point in segment])
            label = (f"{arm} (running)" if now else arm) if index == 0 else None
            axes.plot(seconds, rates, **styles.get(arm, {}), linewidth=2.4 if now else 1.4, label=label)
        if now:  # its latest reading: processes start one after another, so it ends the last segment
            axes.plot(seconds[-1], rates[-1], "o", markersize=9, markerfacecolor="none", markeredgewidth=2,
                      color=styles.get(arm, {}).get("color"))  # fmt: skip
    axes.set_title("Throughput (rolling median)", fontsize=10)
    axes.set_xlabel("seconds since start")
    medians = [np.median([point[1] for point in points]) for points in throughput.values() if points]
    medians = [value for value in medians if value > 0]
    if medians and max(medians) > LIVE_LOG_SCALE_SPREAD * min(medians):
        # Loader-only twins run 5-10x faster than training arms (H100 suite, bfbf9f5): on a linear
        # axis the training arms' lines lay flat together at the bottom.
        from matplotlib.ticker import LogLocator, NullLocator

        axes.set_yscale("log")
        axes.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axes.yaxis.set_major_formatter(lambda value, _: f"{value:,.0f}")
        axes.yaxis.set_minor_locator(NullLocator())
        axes.set_ylabel("samples/s (log scale)")
    else:
        axes.set_ylabel("samples/s")
        axes.set_ylim(bottom=0)
    if throughput:
        _legend_outside(axes)
        for text in axes.get_legend().get_texts():
            if text.get_text().endswith("(running)"):
                text.set_fontweight("bold")


def _plot_live_breakdown(axes, finished: list[dict], arms: list[str]) -> None:
    """Per arm, its median step over its finished blocks, divided by the phases' mean shares of
    their windows (as the results table divides it: ``stats.phase_shares``)."""
    from workbench.stats import PHASES, phase_shares

    per_arm: dict[str, list[dict]] = {}
    for unit in finished:
        per_arm.setdefault(unit["arm"], []).append(unit["result"])
    names = [arm for arm in arms if arm in per_arm]
    step_ms = np.array([1e3 * np.median([r["wall_s"] / r["steps"] for r in per_arm[arm]]) for arm in names])
    shares = np.array([np.mean([phase_shares(r) for r in per_arm[arm]], axis=0) for arm in names])
    left = np.zeros(len(names))
    for phase, color in PHASE_COLORS.items():
        values = shares[:, PHASES.index(phase)] * step_ms if names else np.zeros(0)
        # only phases a bar shows, as in the results' plot ("replay" appears with cuda_graphs alone)
        if (values > VISIBLE_SHARE * step_ms.max(initial=0)).any():
            axes.barh(names, values, left=left, color=color, label=phase, height=0.6)
        left += values
    axes.invert_yaxis()
    # as small as the other panels' titles: at the top row's size it ran past the figure's edge
    axes.set_title("Step breakdown (finished blocks)", fontsize=10)
    axes.set_xlabel("ms per optimizer step")
    if names:
        _legend_outside(axes)
    else:
        _waiting_for_a_block(axes)


def _plot_live_losses(axes, finished: list[dict], styles: dict) -> None:
    for unit in finished:
        axes.plot(
            range(1, len(unit["result"]["losses"]) + 1),
            unit["result"]["losses"],
            **styles.get(unit["arm"], {}),
            alpha=0.7,
            linewidth=1,
        )
    axes.set_title("Loss (finished blocks)", fontsize=10)
    axes.set_xlabel("optimizer step, warm-up included")
    if not finished:
        _waiting_for_a_block(axes)


def _plot_cpu_utilization(axes, samples: list[dict], seconds: list[float]) -> None:
    axes.plot(seconds, [s["cpu_percent"] for s in samples], color="#4c72b0")
    axes.set_ylim(0, 105)
    axes.set_title("CPU utilization (machine)", fontsize=10)
    axes.set_ylabel("%")
    axes.set_xlabel("seconds since start")


def gpu_util_keys(samples: list[dict]) -> list[str]:
    """The NVML readings' utilization keys (gpu0_util_percent...): none without NVML or a GPU."""
    return sorted(
        {key for s in samples for key in s if key.startswith("gpu") and key.endswith("_util_percent")}
    )


def _plot_gpu_telemetry(
    gpu_ax, gpu_detail_ax, gpu_keys: list[str], samples: list[dict], seconds: list[float]
) -> None:
    """NVML readings per GPU: utilization and memory; power and SM clock."""
    for key in gpu_keys:
        index = key[3 : key.index("_")]
        gpu_ax.plot(seconds, [s.get(key, np.nan) for s in samples], label=f"GPU {index} util %")
        gpu_ax.plot(
            seconds,
            [s.get(f"gpu{index}_memory_used_mib", np.nan) / 1024 for s in samples],
            "--",
            label=f"GPU {index} memory, GiB",
        )
        gpu_detail_ax.plot(
            seconds, [s.get(f"gpu{index}_power_w", np.nan) for s in samples], label=f"GPU {index} W"
        )
        gpu_detail_ax.plot(
            seconds,
            [s.get(f"gpu{index}_sm_clock_mhz", np.nan) / 10 for s in samples],
            ":",
            label=f"GPU {index} SM clock, x10 MHz",
        )
    for axes in (gpu_ax, gpu_detail_ax):
        _legend_below(axes)
        axes.set_xlabel("seconds since start")
    gpu_ax.set_title("GPU util. and memory (NVML)", fontsize=10)
    gpu_detail_ax.set_title("GPU power and clock (NVML)", fontsize=10)


def _plot_machine_memory(axes, samples: list[dict], seconds: list[float]) -> None:
    used = [s["memory_used_mib"] / 1024 for s in samples]
    axes.plot(seconds, used, color=MEMORY_COLOR)
    axes.set_title("Memory used (machine)", fontsize=10)
    axes.set_ylabel("GiB")
    # From zero, so that a few hundred MiB's swing is not drawn as a cliff; headroom above the line.
    axes.set_ylim(0, 1.1 * max(used, default=0) or 1)
    axes.set_xlabel("seconds since start")


# --- the advisor's figure ----------------------------------------------------------------------

PART_COLORS = {
    "data": PHASE_COLORS["data"],
    "launch": "#c44e52",  # red: time the step spends on overhead, not on work
    "compute": PHASE_COLORS["forward"],
    "communication": "#8172b3",
}
PART_LABELS = {
    "data": "waiting for data",
    "launch": "launch / overhead",
    "compute": "compute (work that grows with the batch)",
    "communication": "gradient communication",
}


def plot_advice(advice, path=None) -> ResultsFigure:
    """One step split into its parts, the bottleneck marked; memory against the capacity."""
    facts = advice.facts
    figure = ResultsFigure(figsize=(11, 3.2), layout="constrained")
    step_ax, memory_ax = figure.subplots(1, 2, width_ratios=[2.2, 1])
    _plot_step_parts(step_ax, facts.parts_ms, facts.step_ms, advice.bottleneck, facts.device)
    _plot_memory_limit(memory_ax, facts, advice.bottleneck == "memory")
    figure.suptitle(f"bottleneck: {advice.bottleneck}", fontsize=11, fontweight="bold")
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure


def _plot_step_parts(axes, parts_ms: dict, step_ms: float, bottleneck: str, device: str) -> None:
    from workbench.results_view import plain_number  # "1,170 ms", not "1.17e+03 ms"

    left = 0.0
    for part, ms in parts_ms.items():
        if ms <= 0:
            continue
        marked = part == bottleneck
        axes.barh(0, ms, left=left, color=PART_COLORS[part], height=0.5,
                  edgecolor="black" if marked else "white", linewidth=2.5 if marked else 0.5,
                  hatch="//" if marked else None, label=f"{PART_LABELS[part]}: {plain_number(ms)} ms ({100 * ms / step_ms:.0f}%)")  # fmt: skip
        if ms / step_ms >= 0.08:  # room for a label inside the bar
            axes.text(left + ms / 2, 0, f"{100 * ms / step_ms:.0f}%", ha="center", va="center",
                      color="white", fontsize=10, fontweight="bold")  # fmt: skip
        left += ms
    axes.set_xlim(0, step_ms * 1.02)
    axes.set_ylim(-0.5, 0.5)
    axes.set_yticks([])
    axes.set_xlabel(f"one training step on {device} (ms)")
    axes.set_title("where the step's time goes", fontsize=10)
    # Outside the axes, below them (constrained layout makes room): never over the bar.
    axes.figure.legend(
        *axes.get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=8, frameon=False
    )


def _plot_memory_limit(axes, facts, limited: bool) -> None:
    axes.barh(0, facts.capacity_mib, color="#e5e5e5", height=0.5)
    axes.barh(0, facts.peak_mib, color=MEMORY_COLOR, height=0.5,
              edgecolor="black" if limited else "white", linewidth=2.5 if limited else 0.5,
              hatch="//" if limited else None)  # fmt: skip
    from workbench.config import MEMORY_LIMIT

    # The peak named at its bar's end: a few MiB of a machine's RAM is a bar too thin to see.
    inside = facts.peak_mib > 0.6 * facts.capacity_mib
    axes.text(facts.peak_mib, 0, f" peak {_mib(facts.peak_mib)} MiB " if inside else f" ◂ peak {_mib(facts.peak_mib)} MiB",
              va="center", ha="right" if inside else "left", fontsize=8, color="white" if inside else "black")  # fmt: skip
    limit = MEMORY_LIMIT * facts.capacity_mib
    axes.axvline(limit, color="#c44e52", linestyle="--", linewidth=1)
    axes.text(limit, 0.3, f" limit ({100 * MEMORY_LIMIT:.0f}%)", color="#c44e52", fontsize=8, ha="right")
    axes.set_ylim(-0.5, 0.5)
    axes.set_yticks([])
    # past the capacity when the peak is (advise measures a baseline over memory_cap_mb): drawn whole
    axes.set_xlim(0, max(facts.capacity_mib, facts.peak_mib) * 1.02)
    if facts.peak_mib > facts.capacity_mib:
        axes.axvline(facts.capacity_mib, color="black", linewidth=1)
        axes.text(facts.capacity_mib, 0.3, "capacity ", fontsize=8, ha="right")
    axes.set_xlabel("MiB")
    share = 100 * facts.peak_mib / facts.capacity_mib
    axes.set_title(
        f"peak {_mib(facts.peak_mib)} of {facts.capacity_mib:,.0f} MiB ({_percent(share)})\n{facts.capacity_source}",
        fontsize=9,
    )


def _tune_title(tune: dict, best: str | None) -> str:
    """The winner, or why there is none (wb.tune's "undecided": one block, or within the noise)."""
    if best:
        return f"best: {best}"
    if (tune.get("undecided") or "").startswith("measured in one block"):
        return "no winner: the fastest was measured in one block only"
    return "no combination was measurably faster than the baseline"


def plot_tune(results, path=None) -> ResultsFigure:
    """The tuner's search: every candidate measured, its speedup and interval in each round it
    reached (later rounds, with more blocks, darker), the winner marked, 1 (the baseline) drawn."""
    tune = results.record["tune"]
    measured = [c for c in tune["candidates"] if c["history"]]
    # Those that went furthest on top, then by their last speedup.
    measured.sort(key=lambda c: (len(c["history"]), c["speedup"] or 0.0))
    rounds = tune["rounds"]
    shades = [_blue(0.35 + 0.65 * (r + 1) / len(rounds)) for r in range(len(rounds))]
    figure = ResultsFigure(figsize=(10, 1.8 + 0.36 * max(len(measured), 2)), layout="constrained")
    axes = figure.subplots()
    best = (tune.get("best") or {}).get("name")
    # Each round's blocks as measured: a round cut by the budget measured fewer than it planned.
    measured_blocks: dict[int, int] = {}
    for candidate in measured:
        for entry in candidate["history"]:
            if entry.get("blocks") is not None:
                index = entry["round"] - 1
                measured_blocks[index] = max(measured_blocks.get(index, 0), entry["blocks"])
    lows, highs, shown = [1.0], [1.0], set()
    for y, candidate in enumerate(measured):
        for step, entry in enumerate(candidate["history"]):
            if entry["speedup"] is None:
                continue
            offset = (step - (len(candidate["history"]) - 1) / 2) * 0.2
            low, high = entry["speedup_low"], entry["speedup_high"]
            index = entry["round"] - 1  # rounds are numbered from 1
            label = None
            if index not in shown:
                shown.add(index)
                planned = rounds[index]["blocks"]
                blocks = measured_blocks.get(index, planned)
                of = f" of {planned}" if blocks < planned else ""
                label = f"round {index + 1}: {blocks}{of} block{'s' * (max(blocks, planned) != 1)}"
            axes.errorbar(entry["speedup"], y + offset, xerr=[[entry["speedup"] - low], [high - entry["speedup"]]],
                          fmt="o", color=shades[index], markersize=5, capsize=2, linewidth=1.2, label=label)  # fmt: skip
            lows.append(low)
            highs.append(high)
    _label_candidates(axes, measured, best)
    band = _final_noise_band(measured, len(rounds))
    if band is not None:  # what the title's verdict was judged against
        axes.axvspan(*band, color="#d9d9d9", alpha=0.6, zorder=0, label=f"noise band in round {len(rounds)}")
        lows.append(band[0])
        highs.append(band[1])
    axes.axvline(1.0, color="black", linewidth=1, linestyle="--")
    axes.set_xscale("log")
    readable_log_ticks(axes, lows, highs)
    axes.set_xlabel("speedup over the baseline (95% interval; log scale; dashed: the baseline)")
    axes.set_ylim(-0.6, len(measured) - 0.4)
    figure.legend(
        loc="outside lower center", ncol=max(len(shown) + (band is not None), 1), fontsize=8, frameon=False
    )
    title = _tune_title(tune, best)
    axes.set_title(
        f"{title}\n{len(measured)} candidates measured in {len(rounds)} rounds, "
        f"{tune['spent_s']:.0f} s of a {tune['budget_s']:.0f} s budget",
        fontsize=10,
    )
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure


def _label_candidates(axes, measured: list[dict], best: str | None) -> None:
    """Each row named by its candidate: the winner in bold, one that left greyed, with its round."""
    labels = []
    for candidate in measured:
        label = candidate["name"]
        if candidate["name"] == best:
            label = f"best: {label}"
        elif candidate["dropped_in_round"]:
            label += f"  (out after round {candidate['dropped_in_round']})"
        labels.append(label)
    axes.set_yticks(range(len(measured)), labels, fontsize=8)
    for tick, candidate in zip(axes.get_yticklabels(), measured, strict=True):
        if candidate["name"] == best:
            tick.set_fontweight("bold")
        elif candidate["dropped"]:
            tick.set_color("#666666")


def _final_noise_band(measured: list[dict], final_round: int) -> tuple[float, float] | None:
    """The control's band in the search's last round (the same for every candidate in it): a
    finalist is the winner only when its whole interval lies above it. None for a search saved
    before rounds kept their band, or one whose last round measured no candidate."""
    for candidate in measured:
        for entry in candidate["history"]:
            if entry["round"] == final_round and entry.get("noise_band"):
                low, high = entry["noise_band"]
                return (low, high) if high > low else None
    return None


def _blue(darkness: float) -> tuple:
    """A blue from light (0) to dark (1)."""
    from matplotlib import colormaps

    return colormaps["Blues"](darkness)
