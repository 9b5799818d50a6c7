"""Saved runs side by side: ``wb.compare(a, b, ...)``.

Each run's speedups are against its own baseline, measured inside its own processes, so they
can be set side by side even when the runs come from different days or machines; raw
throughput cannot (fresh processes differ by 10-15% here). The comparison matches arms by
name and gives, for each later run, the ratio of its speedup to the first run's, with an
interval: each run's 95% interval is symmetric in log space, and for independent runs the
half-widths combine in quadrature. That errs wide, never narrow: each half-width already
carries its own run's t quantile for few blocks, so the sum keeps two of them where one,
for the pooled degrees of freedom, would do. At 3 blocks a run the interval is about 1.5
times as wide as a Welch interval on the same figures, at 2 blocks about 3 times. (The
records keep each speedup's interval, not its standard error and degrees of freedom, which
that interval would need: a floored interval's come from the rounds, not the blocks.)
"""

from __future__ import annotations

import html
import math
import os
import textwrap
from pathlib import Path

import numpy as np

from workbench.config import RunConfig
from workbench.core_sync import STATE_RATIO
from workbench.plots import ResultsFigure, first_clause, readable_log_ticks
from workbench.results import Results, load_results, run_identity, settings_from_label
from workbench.results_view import READER_CSS, TERMINAL_WIDTH, badge, interval_text, text_table

# Settings and machine facts that make two runs different jobs (not the same job measured again).
JOB_SETTINGS = ("model", "data", "loss_fn", "device", "world_size", "cpu", "gpus")
# The run settings that do not change what a speedup means (where a trace or the jobs went, how
# its processes started, how long an arm may take): every other one is listed when runs differ,
# and so is each technique's own settings (amp in bfloat16 against amp in float16).
NOT_COMPARED = ("trace_dir", "profile_steps", "timeout_s", "executor", "slurm", "start")


SHORT_RUN_NAME = 10  # a run named longer than this is a letter in the text table's headings


MEASURED = ("ok", "interrupted")  # the statuses whose speedups are compared
TECHNIQUE_SETTINGS = "'s settings"  # a technique's own settings, in differences: "amp's settings"


def compare(*runs: Results | str | os.PathLike, names: list[str] | None = None) -> Comparison:
    """Set saved runs side by side: each is a Results or a results folder (or its results.json).

    The first run is the reference: ``.table`` has one row per arm name found in any run, each
    run's speedup with its interval and verdict, and for each later run the ratio of its
    speedup to the first run's, with an interval and a change (better, worse, within noise).
    ``.plot()`` draws them; in a notebook the comparison shows itself as a table.
    """
    if len(runs) < 2:
        raise ValueError(f"compare needs two runs or more (Results or results folders); got {len(runs)}")
    loaded = [run if isinstance(run, Results) else load_results(run) for run in runs]
    if names is None:
        names = _default_names(loaded)
    elif len(names) != len(loaded):
        raise ValueError(f"compare: {len(names)} names for {len(loaded)} runs; give one name per run")
    if len(set(names)) != len(names):
        raise ValueError(f"compare: the runs' names must differ; got {names}")
    _refuse_a_run_twice(loaded)
    return Comparison(list(names), loaded)


def _refuse_a_run_twice(runs: list[Results]) -> None:
    """The same run given twice (its folder twice, or a saved copy of it beside the original)
    would agree with itself "within noise", inside an interval that counts two measurements'
    noise where there was one: that says nothing about reproducibility, so it is refused."""
    seen: dict[tuple, int] = {}
    for number, run in enumerate(runs, start=1):
        created = run.record.get("created")
        # Its start (to the second), its settings and every arm's measured rate: two runs started
        # in the same second with the same settings still differ in what they measured.
        # (an arm with no rate, unavailable or not run, is None: NaN never equals itself)
        column = run.table["samples_per_s"].round(9) if "samples_per_s" in run.table else ()
        rates = tuple(None if math.isnan(rate) else rate for rate in column)
        identity = (run_identity(run.record), rates)
        if created and identity in seen:
            raise ValueError(
                f"compare: runs {seen[identity]} and {number} are the same run (created {created}); "
                "compare runs measured apart, such as the same job run again"
            )
        seen.setdefault(identity, number)
    _refuse_shared_blocks(runs)  # a copy, resumed since: not the same run, but not measured apart


def _refuse_shared_blocks(runs: list[Results]) -> None:
    """A run and a copy of it resumed with more blocks share their first blocks' measurements: their
    ratio's interval, which assumes two independent runs, would be too narrow a claim."""
    owner: dict[tuple, int] = {}
    for number, run in enumerate(runs, start=1):
        for unit in run.record["units"]:
            result = unit.get("result")
            steps = result.get("step_s") if isinstance(result, dict) else None
            if not steps:
                continue
            measured = (unit["arm"], unit.get("block"), tuple(steps[:STEPS_THAT_IDENTIFY]))
            if owner.setdefault(measured, number) != number:
                raise ValueError(
                    f"compare: runs {owner[measured]} and {number} hold the same measurements (block "
                    f"{unit.get('block', 0) + 1} of {unit['arm']}): one is a copy of the other, perhaps resumed "
                    "with more blocks. Compare runs measured apart, such as the same job run again"
                )


STEPS_THAT_IDENTIFY = 8  # a unit's first step times: two measurements never share them


def _default_names(runs: list[Results]) -> list[str]:
    """Each run's folder name, or "run N"; numbered where two would read the same."""
    names = [run.path.name if run.path is not None else f"run {i + 1}" for i, run in enumerate(runs)]
    if len(set(names)) < len(names):
        names = [f"{name} ({i + 1})" for i, name in enumerate(names)]
    return names


def ratio_interval(first: tuple[float, float, float], later: tuple[float, float, float]):
    """later / first, each (point, low, high): the point ratio and its approximate 95% interval."""
    (a, a_low, a_high), (b, b_low, b_high) = first, later
    if not all(math.isfinite(v) and v > 0 for v in (a, a_low, a_high, b, b_low, b_high)):
        return math.nan, math.nan, math.nan
    half = math.hypot(math.log(a_high / a_low) / 2, math.log(b_high / b_low) / 2)
    ratio = b / a
    return ratio, ratio * math.exp(-half), ratio * math.exp(half)


def change_of(low: float, high: float) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return "not compared"
    if low == high == 1.0:
        return "reference"
    return "better" if low > 1.0 else "worse" if high < 1.0 else "within noise"


def _with_defaults(technique: str, label: str) -> object:
    """A technique's label (``amp(dtype=bfloat16)``) as its settings, defaults filled in; the label
    itself where it does not read so, or the technique is not one of today's."""
    from workbench.techniques import get_technique, settings_of

    settings = settings_from_label(label) if isinstance(label, str) else None
    try:
        defaults = settings_of(get_technique(technique).Config())
    except ValueError:  # a technique this version does not have
        return label
    return label if settings is None else {**defaults, **settings}


def _thread_state_notes(names: list[str], runs: list[Results]) -> list[str]:
    """A note when runs on one kind of CPU found its threads working together at different speeds
    (workbench.core_sync): a run's blocks cancel what that state does to every arm alike, not what
    it does to an arm's gain, so two runs in different states can differ by a few percent in what
    a technique gains, the machine's doing, not the code's. (Different CPUs: ``differences`` says so.)"""
    if len({run.environment.get("cpu") for run in runs}) > 1:
        return []
    typical = [run.core_sync_us for run in runs]
    known = [us for us in typical if us is not None]
    if len(known) < 2 or max(known) <= STATE_RATIO * min(known):
        return []
    said = ", ".join(f"{n} {us:.1f} us" for n, us in zip(names, typical, strict=True) if us is not None)
    return [
        f"The runs' CPU threads worked together at different speeds (the fork-join probe's median: {said}; "
        "workbench.core_sync). On a virtual machine that state is the host's; it can move what a technique "
        "gains by a few percent (channels_last by about 6% and amp by about 4% on the CI VM), so a change of that size "
        "between these runs may be the machine's, not the code's."
    ]


def _stopped_note(name: str, run: Results) -> str:
    finished = len({unit.get("block") for unit in run.record["units"] if unit.get("status") == "ok"})
    planned = run.config.get("blocks")
    if not finished:
        return (
            f"{name} was stopped before any of its {planned} blocks finished: it has no figures to compare."
        )
    return (
        f"{name} was stopped before it finished ({finished} of {planned} blocks): its figures are its finished "
        "blocks', with their wider intervals."
    )


class Comparison:
    """Runs side by side. ``table`` for code; ``plot()``; shows itself in a notebook."""

    def __init__(self, names: list[str], runs: list[Results]):
        self.names, self.runs = names, runs
        self.table = self._build_table()

    def _build_table(self):
        import pandas as pd

        tables = [run.table.set_index("arm") for run in self.runs]
        arms = list(dict.fromkeys(arm for table in tables for arm in table.index))
        rows = []
        for arm in arms:
            row: dict = {"arm": arm}
            figures = []
            for name, table in zip(self.names, tables, strict=True):
                found = table.loc[arm] if arm in table.index else None
                # An arm of a stopped run has the figures of its finished blocks (as `show` says them).
                point = (
                    (found.speedup, found.speedup_low, found.speedup_high)
                    if found is not None and found.status in MEASURED
                    else (math.nan, math.nan, math.nan)
                )
                figures.append(point)
                row[f"{name} speedup"], row[f"{name} low"], row[f"{name} high"] = point
                row[f"{name} verdict"] = "absent" if found is None else found.verdict
                row[f"{name} samples_per_s"] = math.nan if found is None else found.samples_per_s
            for name, point in zip(self.names[1:], figures[1:], strict=True):
                ratio, low, high = ratio_interval(figures[0], point)
                key = f"{name} / {self.names[0]}"
                row[f"{key} ratio"], row[f"{key} low"], row[f"{key} high"] = ratio, low, high
                row[f"{key} change"] = change_of(low, high)
            rows.append(row)
        return pd.DataFrame(rows)

    @property
    def differences(self) -> dict[str, list]:
        """The settings that differ between the runs (model, data, device, batch size...), each
        with every run's value: what to keep in mind before reading a ratio as the code's doing."""
        found = {}
        settings = dict.fromkeys(key for run in self.runs for key in run.config)
        # a setting a run's record lacks (saved before it existed) had its default then
        defaults = RunConfig().to_json()
        for key in settings:
            values = [run.config.get(key, defaults.get(key)) for run in self.runs]
            if key not in (*NOT_COMPARED, "techniques") and any(value != values[0] for value in values[1:]):
                found[key] = values
        found.update(self._technique_differences())
        for key in ("torch", "cpu", "gpus"):
            values = [run.environment.get(key) for run in self.runs]
            if any(value != values[0] for value in values[1:]):
                found[key] = values
        return found

    def warnings(self, short: bool = False) -> list[str]:
        """What to read before the table: runs of different jobs, whose ratios say how a technique's
        gain differs between the jobs rather than that a change made it better or worse; then each
        run's own warnings (a control that failed its A/A check, a busy machine...). ``short``:
        each in a few words, for the plot's title."""
        found = []
        jobs = {key: values for key, values in self.differences.items() if key in JOB_SETTINGS}
        if jobs and short:
            found.append(f"these runs measured different jobs ({', '.join(jobs)})")
        elif jobs:
            said = "; ".join(
                f"{key}: " + ", ".join(f"{n}={v}" for n, v in zip(self.names, values, strict=True))
                for key, values in jobs.items()
            )
            found.append(
                f"these runs measured different jobs ({said}): a ratio says how much more or less a technique "
                "gains in one job than in the other, not that a change made it better or worse"
            )
        for name, run in zip(self.names, self.runs, strict=True):
            for warning in run.warnings(thread_states=False):
                found.append(f"{name}: {first_clause(warning)}" if short else f"run {name}: {warning}")
        return found

    def _technique_differences(self) -> dict[str, list]:
        """A technique in two runs or more with other settings in one: its arm is not the same arm.
        (A technique in one run only is its arm's "absent" in the others.)"""
        chosen = [run.config.get("techniques") or {} for run in self.runs]
        found = {}
        for technique in dict.fromkeys(name for techniques in chosen for name in techniques):
            values = [techniques.get(technique) for techniques in chosen]
            # as settings with the defaults filled in: an older record's label leaves them out
            present = [_with_defaults(technique, value) for value in values if value is not None]
            if len(present) > 1 and any(value != present[0] for value in present[1:]):
                found[technique + TECHNIQUE_SETTINGS] = values
        return found

    def _speedup_cell(self, row, name: str) -> str:
        point, low, high = row[f"{name} speedup"], row[f"{name} low"], row[f"{name} high"]
        if not math.isfinite(point):
            return row[f"{name} verdict"] if row[f"{name} verdict"] != "ok" else "-"
        return interval_text(point, low, high)

    def _ratio_cells(self, row, name: str) -> tuple[str, str]:
        key = f"{name} / {self.names[0]}"
        ratio, low, high = row[f"{key} ratio"], row[f"{key} low"], row[f"{key} high"]
        if not math.isfinite(ratio):
            return "-", row[f"{key} change"]
        return interval_text(ratio, low, high), row[f"{key} change"]

    def _reader(self) -> tuple[list[str], list[list[str]]]:
        """The HTML table's headings and cells: a column per run, and two per later run's ratio."""
        headings = ["arm", *self.names]
        for name in self.names[1:]:
            headings += [f"{name} / {self.names[0]}", "change"]
        rows = []
        for _, row in self.table.iterrows():
            cells = [row["arm"], *(self._speedup_cell(row, name) for name in self.names)]
            for name in self.names[1:]:
                cells += list(self._ratio_cells(row, name))
            rows.append(cells)
        return headings, rows

    def _notes(self) -> list[str]:
        notes = [
            "A run's speedup is over its own baseline [95% interval]; a ratio is the later "
            "run's speedup over the first's, with an approximate 95% interval (the runs' log-space "
            "half-widths combined in quadrature, which errs wide with few blocks)."
        ]
        notes += _thread_state_notes(self.names, self.runs)
        notes += [
            _stopped_note(name, run)
            for name, run in zip(self.names, self.runs, strict=True)
            if not run.complete
        ]
        notes += [
            f"The runs differ in {key}: "
            + ", ".join(
                f"{n}={v}"
                for n, v in zip(self.names, values, strict=True)
                if v is not None or not key.endswith(TECHNIQUE_SETTINGS)  # a run without the technique
            )
            + "."
            for key, values in self.differences.items()
            if key not in JOB_SETTINGS  # those come first, in the warnings
        ]
        return notes

    def _text_labels(self) -> tuple[list[str], list[str]]:
        """The runs' names in the text table's headings, and the key to them (empty if none is needed).

        A run's folder name (20261129-120849-mlp) as a heading, and again in each ratio's, left
        the arms' column a few letters wide and broke words at 80 columns: long names become
        letters, with the key above the table."""
        if max(len(name) for name in self.names) <= SHORT_RUN_NAME:
            return self.names, []
        letters = [chr(ord("A") + i) if i < 26 else f"R{i + 1}" for i in range(len(self.names))]
        key = [f"{letter} = {name}" for letter, name in zip(letters, self.names, strict=True)]
        return letters, ["Runs: " + "; ".join(key) + "."]

    def _text_rows(self, labels: list[str]) -> tuple[list[str], list[list[str]]]:
        """The text table: a line per arm and run, an arm's runs together, a blank line between
        arms. Five columns however many runs: a column per run (and two per ratio) ran past 80
        columns at three runs and broke the arms' names."""
        headings = ["arm", "run", "speedup", f"vs {labels[0]}", "change"]
        rows: list[list[str]] = []
        for _, row in self.table.iterrows():
            if rows:
                rows.append([""] * len(headings))
            for index, (label, name) in enumerate(zip(labels, self.names, strict=True)):
                ratio, change = self._ratio_cells(row, name) if index else ("", "")
                rows.append(
                    [row["arm"] if index == 0 else "", label, self._speedup_cell(row, name), ratio, change]
                )
        return headings, rows

    def text(self, width: int = TERMINAL_WIDTH) -> str:
        """The comparison as aligned text within ``width`` characters, then its notes."""
        labels, key = self._text_labels()
        headings, rows = self._text_rows(labels)
        table = text_table(headings, rows, [False, False, True, True, False], width, split_intervals=True)
        notes = "\n".join(textwrap.fill(note, width, break_on_hyphens=False) for note in self._notes())
        warned = "".join(
            textwrap.fill(f"WARNING: {warning}", width, break_on_hyphens=False) + "\n\n"
            for warning in self.warnings()
        )
        above = "".join(textwrap.fill(line, width, break_on_hyphens=False) + "\n" for line in key)
        return f"{warned}{above}{table}\n\n{notes}"

    def __repr__(self) -> str:
        return f"<workbench Comparison of {len(self.runs)} runs>\n{self.text()}"

    def _repr_html_(self) -> str:
        headings, rows = self._reader()
        changes = range(len(self.names) + 2, len(headings), 2)  # the change columns: words, not figures
        text = {0, *changes}

        def cell(tag: str, index: int, content: str) -> str:
            return (
                f'<{tag} class="wb-text">{content}</{tag}>' if index in text else f"<{tag}>{content}</{tag}>"
            )

        head = "".join(cell("th", i, html.escape(h)) for i, h in enumerate(headings))
        body = [
            "<tr>"
            + "".join(
                cell("td", i, badge(c) if i in changes else html.escape(c)) for i, c in enumerate(cells)
            )
            + "</tr>"
            for cells in rows
        ]
        notes = "".join(f'<p class="wb-legend">{html.escape(note)}</p>' for note in self._notes())
        warned = "".join(f'<p class="wb-warning">{html.escape(warning)}</p>' for warning in self.warnings())
        return (
            f'<div class="wb-results"><style>{READER_CSS}</style>{warned}<table class="wb-reader">'
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{notes}</div>"
        )

    def plot(self, path: str | os.PathLike | None = None) -> ResultsFigure:
        """Each arm's speedup in each run, with its interval, on one log axis; saved to ``path``
        when given."""
        return plot_comparison(self, path)


def plot_comparison(comparison: Comparison, path=None) -> ResultsFigure:
    from matplotlib import colormaps
    from matplotlib.transforms import blended_transform_factory

    table, names = comparison.table, comparison.names
    palette = colormaps["tab10"]
    # The runs' legend, above the axes: one row when the names fit across the figure, else one
    # name a line (a legend wider than the figure crushed the axes and lost its last names, and
    # matplotlib fills several columns top to bottom, which scrambles the runs' order).
    across = len(names) if sum(len(name) + 6 for name in names) <= LEGEND_CHARACTERS else 1
    legend_rows = math.ceil(len(names) / across)
    height = 1.2 + 0.55 * len(table) * max(1, len(names) / 2) + 0.22 * (legend_rows - 1)
    figure = ResultsFigure(figsize=(9, height))
    axes = figure.add_subplot(1, 1, 1)
    step = 0.8 / len(names)
    lows, highs = [], []
    at_the_left = blended_transform_factory(axes.transAxes, axes.transData)
    for index, name in enumerate(names):
        y = np.arange(len(table)) + (index - (len(names) - 1) / 2) * step
        point, low, high = (table[f"{name} {part}"].to_numpy(float) for part in ("speedup", "low", "high"))
        # An arm absent from a run, or not ok in it, has no point there.
        shown = np.isfinite(point) & np.isfinite(low) & np.isfinite(high)
        errors = np.clip([point[shown] - low[shown], high[shown] - point[shown]], 0, None)
        axes.errorbar(point[shown], y[shown], xerr=errors, fmt="o", color=palette(index % 10),
                      capsize=3, label=name)  # fmt: skip
        # Where it has no point, the run says why in its slot ("absent", "failed"), not a blank.
        for row in np.flatnonzero(~shown):
            axes.text(0.01, y[row], f"{_shortened(name)}: {table[f'{name} verdict'].iloc[row]}", transform=at_the_left,
                      fontsize=8, va="center", color=palette(index % 10))  # fmt: skip
        lows += list(low)
        highs += list(high)
    axes.axvline(1.0, color="0.4", linewidth=1)
    axes.set_xscale("log")
    readable_log_ticks(axes, lows, highs)
    axes.set_yticks(np.arange(len(table)), table["arm"])
    # Every row half a row of room each side, first at the top: the last one's label sat on the x axis.
    axes.set_ylim(len(table) - 0.5, -0.5)
    axes.set_xlabel("speedup vs each run's own baseline (95% interval, log scale)")
    axes.grid(axis="x", alpha=0.3)
    # Above the axes, never over the points.
    axes.legend(loc="lower left", bbox_to_anchor=(0.0, 1.01), ncol=across, frameon=False)
    warnings = comparison.warnings(short=True)
    if warnings:  # said on the figure itself, as the results plot does: a plot travels without its notes
        figure.suptitle(textwrap.fill("WARNING: " + "; ".join(warnings), 110), fontsize=9, color="#c44e52")
    figure.tight_layout()
    if path is not None:
        figure.savefig(Path(path), dpi=110)
    return figure


LEGEND_CHARACTERS = 90  # what fits across the 9-inch figure at the legend's size, markers counted


def _shortened(name: str, most: int = 24) -> str:
    """A run's name for a label inside the axes, where a long one ran out of the figure."""
    return name if len(name) <= most else name[: most - 1] + "…"
