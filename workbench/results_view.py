"""The results as people read them: a verdict per arm, and a few formatted columns.

``Results.table`` keeps every column as a number, for code. This module turns it into what a
reader wants first (is this arm faster, by how much, at what cost?) as an HTML table that fits
a notebook and as aligned text that fits an 80-column terminal. The model is
``torch.utils.benchmark.Compare``: units in the figures, no scientific notation, colour for
the verdict, and the rest of the columns one click away.
"""

from __future__ import annotations

import html
import math
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from workbench.config import OVER_THE_CAP

LOSS_DRIFT = 0.10  # a final loss further than this from the baseline's is called out ...
LOSS_FALL_SHARE = 0.05  # ... when the gap is also more than this share of the baseline's fall in loss
TERMINAL_WIDTH = 80
# Longer words in a text column (an arm named by its settings) are broken; 15 keeps every
# technique's name whole (ddp_compression).
LONGEST_UNBROKEN = 15

# How each verdict looks: its colours in HTML (background, text) and in a terminal (ANSI code).
VERDICT_STYLES = {
    "faster": ("#d8f0dd", "#125c2b", "32"),
    "slower": ("#f8dcdc", "#8a1c1c", "31"),
    "within noise": ("#ececec", "#444444", "90"),
    "reference": ("#e3ebf7", "#1f3d6e", "34"),
    "control": ("#e3ebf7", "#1f3d6e", "34"),
    "not compared": ("#ececec", "#444444", "90"),
    # wb.compare's change between runs
    "better": ("#d8f0dd", "#125c2b", "32"),
    "worse": ("#f8dcdc", "#8a1c1c", "31"),
    "absent": ("#ececec", "#444444", "90"),
}
NOT_OK_STYLE = ("#fdebd0", "#8a4b00", "33")  # failed, unavailable, oom, skipped, diverged, interrupted
VERDICT_LEGEND = (
    "verdict: faster or slower when the arm's whole 95% interval lies outside the control arm's "
    "band (the baseline measured again: where a change that does nothing lands); within noise "
    "otherwise. A speedup reads x [low, high]."
)


@dataclass(frozen=True)
class Column:
    """One column of the reader's table: its heading (with units), and how it aligns."""

    heading: str
    numeric: bool = True


COLUMNS = {
    "arm": Column("arm", numeric=False),
    "verdict": Column("verdict", numeric=False),
    "speedup": Column("speedup [95% interval]"),
    "throughput": Column("samples/s"),
    "step": Column("step ms"),
    "activations": Column("activ. MiB"),
    "loss": Column("loss vs baseline"),
}
MFU_COLUMN = Column("MFU %")
# Shown where memory_cap_mb refused an arm: the peak is what the cap is checked against.
PEAK_COLUMN = Column("peak MiB")
# Shown where ranks communicated (a data-parallel run): what a communication hook changes.
COMM_COLUMN = Column("comm MiB/step")


def shows_peak(table) -> bool:
    """Whether the reader's table has the peak column: some arm was over memory_cap_mb."""
    return bool(table.reason.fillna("").str.contains(OVER_THE_CAP, regex=False).any())


def shows_comm(table) -> bool:
    """Whether the reader's table has the communication column: some arm's ranks communicated."""
    return "comm_mb_per_step" in table and bool(table.comm_mb_per_step.notna().any())


def noise_band(row, table) -> tuple[float, float]:
    """The control arm's interval for this arm's kind of process, widened to hold 1.0 (or 1.0
    alone when there is no measured control): where an arm that changes nothing lands."""
    controls = table[
        (table.role == "control")
        & (table.kind == row.kind)
        & (table.process == row.process)
        & table.speedup_low.notna()
    ]
    if controls.empty:
        return 1.0, 1.0
    return min(1.0, float(controls.speedup_low.min())), max(1.0, float(controls.speedup_high.max()))


def verdict(row, table) -> str:
    """faster, slower or within noise (the interval against the control's band); for the
    baseline "reference", for the control "control"; else the status of an arm that is not ok."""
    if row.status != "ok":
        return row.status
    if row.role == "baseline":
        return "reference"
    if row.role == "control":
        return "control"
    return against_noise(row, table)


def against_noise(row, table) -> str:
    """faster, slower, within noise or not compared: the arm's interval against the control's band
    (also for an arm whose blocks were cut short: the tuner judges what they measured)."""
    if not math.isfinite(row.speedup_low) or not math.isfinite(row.speedup_high):
        return "not compared"
    if row.process != "block" and getattr(row, "speedup_blocks", math.nan) == 1:
        return "not compared"  # two processes' luck, from one pair of them: not in the interval
    band_low, band_high = noise_band(row, table)
    if row.speedup_low > band_high:
        return "faster"
    if row.speedup_high < band_low:
        return "slower"
    return "within noise"


def with_roles(table, arms: list[dict]):
    """``table`` with each arm's role (baseline, control, treatment) from the record's arms."""
    roles = {arm["name"]: arm.get("role", "treatment") for arm in arms}
    return table.assign(role=table.arm.map(lambda name: roles.get(name, "treatment")))


def verdicts(table, arms: list[dict]) -> list[str]:
    """One verdict per row of ``Results.table``, in its order."""
    table = with_roles(table, arms)
    return [verdict(row, table) for row in table.itertuples()]


# --- numbers as people read them -----------------------------------------------------------


def plain_number(value: float, digits: int = 3, smallest: float = 0.0) -> str:
    """``4640.2`` -> "4,640", ``48.21`` -> "48.2", ``0.0004213`` -> "0.000421": never 4.64e+03.
    Below ``smallest`` (but above 0): "<smallest", where smaller figures mean nothing to a reader."""
    if value is None or not math.isfinite(value):
        return "-"
    if 0 < abs(value) < smallest:
        return f"<{smallest:g}"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return np.format_float_positional(value, precision=digits, fractional=False, trim="-")


def times(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.2f}×"


def speedup_text(row) -> str:
    return interval_text(row.speedup, row.speedup_low, row.speedup_high)


def interval_text(point: float, low: float, high: float) -> str:
    """A ratio and its 95% interval as people read them: 1.23× [1.10, 1.37]."""
    if not math.isfinite(point):
        return "-"
    if low == high:  # the baseline against itself
        return times(point)
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"{times(point)} [no interval]"  # one timed step: its notes say why
    return f"{times(point)} [{_interval_end(low)}, {_interval_end(high)}]"


def _interval_end(value: float) -> str:
    """Two decimals, as people read speedups; below 0.01 two significant digits, so that a very
    wide interval's low end (0.000054 from one noisy block) does not read as a speedup of 0.00.
    Past 1000x either way the end says only that: an end of 105924279137559.03 (one block whose
    rounds disagreed) split the table's columns, and its digits mean nothing."""
    if value < 1 / INTERVAL_ENDS_SHOWN:
        return f"<{1 / INTERVAL_ENDS_SHOWN:g}"
    if value > INTERVAL_ENDS_SHOWN:
        return f">{INTERVAL_ENDS_SHOWN:g}"
    return f"{value:.2f}" if value >= 0.01 else plain_number(value, digits=2)


INTERVAL_ENDS_SHOWN = 1000.0  # an interval end beyond 1000x (or below 1/1000) is shown as ">1000"


def loss_drifted(ratio: float | None, gap_of_fall: float | None = math.nan) -> bool:
    """Whether an arm's final loss is off the baseline's: by more than LOSS_DRIFT as a ratio and,
    where the baseline's loss fell during the run, by more than LOSS_FALL_SHARE of that fall
    (``gap_of_fall``: the arm's final loss minus the baseline's, over the baseline's first loss
    minus its final one; NaN where it did not fall, or in records from before it existed).

    Why both: once a run has nearly fitted its data, its last steps' losses are tiny and decided by
    which batches they saw, so their ratio is noise. mlp on digits, 300 steps, bfloat16 autocast
    against float32 over five seeds on the CI VM (benchmarks/loss_parity.py): ratios from 0.01 to
    37, in both directions, with the gap within 2% of the loss's fall from 1.83. A real loss of
    parity moves the gap itself: grad_accum on resnet-mini's BatchNorm, 16-41% of the fall.
    """
    ratio = math.nan if ratio is None else ratio  # None: a figure read back from JSON, which has no NaN
    gap_of_fall = math.nan if gap_of_fall is None else gap_of_fall
    if not math.isfinite(ratio) or abs(ratio - 1.0) <= LOSS_DRIFT:
        return False
    return not (math.isfinite(gap_of_fall) and abs(gap_of_fall) <= LOSS_FALL_SHARE)


def loss_text(row) -> str:
    if not math.isfinite(row.loss_vs_baseline):
        return "-"
    flag = " !" if loss_drifted(row.loss_vs_baseline, getattr(row, "loss_gap_of_fall", math.nan)) else ""
    return times(row.loss_vs_baseline) + flag


@dataclass
class ReaderRow:
    """One arm as the reader's table shows it: formatted cells, its verdict and why it is not ok."""

    cells: dict[str, str]
    verdict: str
    reason: str


def reader_rows(table) -> tuple[list[str], list[ReaderRow]]:
    """The reader's columns (MFU only where measured) and one row per arm of ``Results.table``,
    whose verdict column it shows."""
    columns = list(COLUMNS)
    if shows_peak(table):
        columns.insert(columns.index("activations"), "peak")
    if shows_comm(table):
        columns.insert(columns.index("loss"), "comm")
    if "mfu_pct" in table and table.mfu_pct.notna().any():
        columns.append("mfu")
    rows = []
    for row in table.itertuples():
        cells = {
            "arm": row.arm,
            "verdict": row.verdict,
            "speedup": speedup_text(row),
            "throughput": plain_number(row.samples_per_s),
            "step": plain_number(row.step_ms),
            "peak": plain_number(row.peak_mem_mb),
            "activations": plain_number(row.activation_mb, smallest=0.01),
            "loss": loss_text(row),
            "mfu": plain_number(getattr(row, "mfu_pct", math.nan)),
            "comm": plain_number(getattr(row, "comm_mb_per_step", math.nan), smallest=0.01),
        }
        rows.append(ReaderRow(cells, row.verdict, row.reason if row.status != "ok" else ""))
    return columns, rows


def _heading(column: str) -> Column:
    return {"mfu": MFU_COLUMN, "peak": PEAK_COLUMN, "comm": COMM_COLUMN}.get(column) or COLUMNS[column]


# --- HTML ------------------------------------------------------------------------------------

READER_CSS = """
.wb-results table.wb-reader { border-collapse: collapse; max-width: 100%; font-size: 13px;
  font-variant-numeric: tabular-nums; }
.wb-results .wb-reader th, .wb-results .wb-reader td { padding: 3px 8px; text-align: right;
  white-space: nowrap; border-bottom: 1px solid #e2e2e2; }
.wb-results .wb-reader th { border-bottom: 2px solid #999; vertical-align: bottom; white-space: normal; }
.wb-results .wb-scroll { overflow-x: auto; max-width: 100%; }
.wb-results .wb-reader .wb-text { text-align: left; }
.wb-results .wb-reader td.wb-why-plain { white-space: normal; max-width: 32em; }
.wb-results .wb-reader td.wb-why { white-space: normal; text-align: left; font-style: italic;
  color: #8a4b00; max-width: 40em; }
.wb-results .wb-badge { display: inline-block; padding: 0 6px; border-radius: 3px; font-weight: 600; }
.wb-results .wb-warning { background: #fff4e0; border-left: 4px solid #e69500; padding: 4px 8px;
  margin: 4px 0; max-width: 60em; }
.wb-results .wb-legend { color: #555; font-size: 12px; max-width: 60em; margin: 4px 0; }
.wb-results details table { font-size: 12px; border-collapse: collapse; }
.wb-results details th { text-align: left; vertical-align: bottom; padding: 2px 6px; }
.wb-results details td { vertical-align: top; padding: 2px 6px; white-space: nowrap; }
.wb-results details td.wb-long { max-width: 36em; overflow: hidden; text-overflow: ellipsis; }
.wb-results details td.wb-long:hover { white-space: normal; }
"""


def badge(word: str) -> str:
    background, colour, _ = VERDICT_STYLES.get(word, NOT_OK_STYLE)
    return f'<span class="wb-badge" style="background:{background};color:{colour}">{html.escape(word)}</span>'


def reader_table_html(columns: list[str], rows: list[ReaderRow]) -> str:
    """The reader's table; an arm that is not ok shows its reason across the figures' columns, under
    its figures where it has some (an arm of a stopped run: its finished blocks')."""
    head = "".join(
        f'<th class="{"" if _heading(c).numeric else "wb-text"}">{html.escape(_heading(c).heading)}</th>'
        for c in columns
    )
    body = []
    for row in rows:
        arm = f'<td class="wb-text">{html.escape(row.cells["arm"])}</td><td class="wb-text">{badge(row.verdict)}</td>'
        why = f'<td class="wb-why" colspan="{len(columns) - 2}">{html.escape(row.reason)}</td>'
        if row.reason and row.cells["speedup"] == "-":
            body.append(f"<tr>{arm}{why}</tr>")
            continue
        figures = "".join(f"<td>{html.escape(row.cells[c])}</td>" for c in columns[2:])
        body.append(f"<tr>{arm}{figures}</tr>")
        if row.reason:
            body.append(f"<tr><td></td><td></td>{why}</tr>")
    return f'<table class="wb-reader"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


LONG_CELL = 40  # characters: text longer than this (notes, reasons) is cut to one line, whole on hover


def full_table_html(table) -> str:
    """Every column of ``Results.table``, numbers written out in full, in a scrolling box, one
    line per arm. Long text (an arm's notes, its reason) is cut to one line and shown whole under
    the pointer: squeezed into the last of 45 columns, one note made its row 500 px tall. The
    report lists the notes whole, and Results.table holds them."""
    head = "".join(f"<th>{html.escape(str(column))}</th>" for column in table.columns)
    body = "".join(
        "<tr>" + "".join(map(_full_table_cell, row)) + "</tr>" for row in table.itertuples(index=False)
    )
    return f'<div class="wb-scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _full_table_cell(value) -> str:
    import pandas as pd

    if value is None or value is pd.NA or isinstance(value, (float, np.floating)):
        return f"<td>{'-' if value is None or value is pd.NA else plain_number(float(value))}</td>"
    text = html.escape(str(value))
    if len(text) <= LONG_CELL:
        return f"<td>{text}</td>"
    return f'<td class="wb-long" title="{text}">{text}</td>'  # one line, cut; whole under the pointer


# Without a control arm there is no band but 1.00 itself: the legend says what the verdict then reads.
VERDICT_LEGEND_WITHOUT_CONTROL = (
    "verdict: faster or slower when the arm's whole 95% interval lies above or below 1.00 (no "
    "control arm ran, so there is no measured band of noise around it); within noise otherwise. "
    "A speedup reads x [low, high]."
)


def legend(rows: list[ReaderRow]) -> str:
    """What the reader's table's marks mean: the verdict, and ``!`` where a loss drifted."""
    controlled = any(row.cells["arm"].startswith("baseline (control)") for row in rows)
    verdict = VERDICT_LEGEND if controlled else VERDICT_LEGEND_WITHOUT_CONTROL
    if any(row.cells["loss"].endswith("!") for row in rows):
        return (
            f"{verdict} ! marks a final loss more than {LOSS_DRIFT:.0%} from the baseline's, by more "
            f"than {LOSS_FALL_SHARE:.0%} of how far the baseline's loss fell."
        )
    return verdict


NOISY_BAND_PCT = 3.0  # a control band wider than this either side gets a note on what would narrow it
MOST_BLOCKS_SUGGESTED = 30
# From one block, the fewest blocks worth suggesting: a t-interval's multiplier is 12.7 over 2, 4.3 over 3.
FEWEST_BLOCKS_FOR_SPREAD = 3


def noise_note(table, folder=None) -> str | None:
    """Where the control's band is wider than NOISY_BAND_PCT either side: what it hides, and about
    how many blocks would narrow it, if the blocks spread as this run's did (stats.blocks_for_half_width);
    from one block, that more blocks would measure the spread between processes at all.
    ``folder``: where the run was saved, which a rerun with more blocks adds to. Settings are
    named as the API's keywords (``blocks=9``); the CLI respells them as flags (cli.in_cli_terms)."""
    control = table[table.arm == "baseline (control)"]
    if control.empty:
        return None
    row = control.iloc[0]
    blocks = row.get("speedup_blocks")
    if not (row.get("speedup_low", 0) > 0 and row.get("speedup_high", 0) > 0 and blocks and blocks >= 1):
        return None
    half = 50 * math.log(row.speedup_high / row.speedup_low)
    if half <= NOISY_BAND_PCT:
        return None
    blocks = int(blocks)
    # ±x% is the log half-width: near the percentage either side for a narrow band, but far from it
    # for a wide one ([0.38, 2.31] is -62% and +131%, not ±90.6%), which is then given by its ends.
    if half <= 20:
        note = f"noise: the control's band is ±{half:.1f}% wide, so a change smaller than that reads within noise here. "
    else:
        ends = f"{_interval_end(row.speedup_low)}× to {_interval_end(row.speedup_high)}×"
        note = f"noise: the control's band runs from {ends}, so a change that lands inside it reads within noise here. "
    if blocks == 1:
        needed = FEWEST_BLOCKS_FOR_SPREAD
        note += (
            "It comes from one block's rounds alone, with no spread between processes to go by: more steps "
            f"per block narrow it, and blocks={needed} or more would measure how processes differ too."
        )
    else:
        between, within = row.get("between_block_pct"), row.get("within_block_pct")
        if not math.isfinite(between):
            return None
        needed, what = _blocks_that_would_narrow(between, within, blocks)
        note += (
            f"Its {blocks} blocks spread by {between:.1f}% (each block's own rounds by {within:.1f}%); if "
            f"blocks keep spreading so (a rough guess from {blocks} blocks), {what}."
        )
    if needed is not None and needed > blocks and folder is not None and resumable(folder):
        counted = f"its {blocks} blocks count" if blocks != 1 else "its block counts"
        note += f" Run it again with blocks={needed} and the same out={str(folder)!r}: {counted}."
    return note


def _blocks_that_would_narrow(between: float, within: float, blocks: int) -> tuple[int | None, str]:
    """How many blocks would bring the band to NOISY_BAND_PCT if they spread as these did (None:
    not even MOST_BLOCKS_SUGGESTED), and what to say of it."""
    from workbench.stats import blocks_for_half_width, projected_half_width_pct

    needed = blocks_for_half_width(between, within, NOISY_BAND_PCT, MOST_BLOCKS_SUGGESTED)
    if needed is None:
        return None, (
            f"even blocks={MOST_BLOCKS_SUGGESTED} would leave it about "
            f"±{projected_half_width_pct(between, within, MOST_BLOCKS_SUGGESTED):.1f}%: "
            f"a quieter machine, or fewer threads than cores (threads=1), would narrow it more"
        )
    if needed > blocks:
        return needed, f"blocks={needed} would narrow it to about ±{NOISY_BAND_PCT:.0f}%"
    # the rounds' noise set the band, from few rounds (a wide t): longer blocks narrow it
    return needed, "more steps per block, rather than more blocks, would narrow it"


def resumable(folder) -> bool:
    """Whether ``folder`` holds an ablation that a rerun resumes (its manifest lists its plan), not a
    saved copy of its results or a search."""
    from workbench.results_folder import ResultsFolder

    try:
        return "plan.json" in ResultsFolder(folder).own_files()
    except (OSError, ValueError):  # unreadable, or a damaged manifest: say nothing of resuming
        return False


def results_html(table, warnings: list[str], folder=None) -> str:
    """The notebook's view of ``Results.table``: warnings, the reader's table, its legend, then
    every column behind a "details" toggle."""
    columns, rows = reader_rows(table)
    parts = [f"<style>{READER_CSS}</style>"]
    parts += [f'<p class="wb-warning">{html.escape(warning)}</p>' for warning in warnings]
    parts.append(
        f'<div class="wb-scroll">{reader_table_html(columns, rows)}</div>'
    )  # never wider than the page
    parts.append(f'<p class="wb-legend">{html.escape(legend(rows))}</p>')
    if note := noise_note(table, folder):
        parts.append(f'<p class="wb-legend">{html.escape(note)}</p>')
    parts.append(
        f"<details><summary>All {len(table.columns)} columns (Results.table)</summary>"
        f"{full_table_html(table)}</details>"
    )
    return f'<div class="wb-results">{"".join(parts)}</div>'


# --- text ------------------------------------------------------------------------------------


def use_colour(stream=None) -> bool:
    """ANSI colour only on a terminal, and never with NO_COLOR set (no-color.org)."""
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ


def terminal_width() -> int:
    return min(TERMINAL_WIDTH, shutil.get_terminal_size((TERMINAL_WIDTH, 24)).columns)


def text_table(
    headings: list[str],
    rows: list[list[str]],
    numeric: list[bool],
    width: int = TERMINAL_WIDTH,
    gap: int = 2,
    paint: list[list[str | None]] | None = None,
    spaced: bool = False,
    split_intervals: bool = False,
    notes: list[str] | None = None,
) -> str:
    """Aligned columns within ``width`` characters: text left-aligned, numbers right-aligned,
    and text too long for its column wrapped inside it (the widest text column gives way
    first). ``paint`` holds an ANSI colour code per cell, or None. ``spaced``: a blank line
    between rows when some run over several lines, to show where each one ends.
    ``split_intervals``: a figure with its interval ("1.23× [1.20, 1.26]") may put the interval
    on a line of its own, before a word of text is broken. ``notes``: a line of text per row,
    written under it across the whole width (indented), for what no column could hold."""
    widths = _fit_widths(
        headings, rows, numeric, width - gap * (len(headings) - 1), split_intervals=split_intervals
    )

    def wrap(cell: str, column: int) -> list[str]:
        if numeric[column] and split_intervals and len(cell) > widths[column] and " [" in cell:
            pieces = _interval_pieces(cell)
            # A heading's "[95% interval]" may be wider than a column of no intervals ("—" alone):
            # then its words go on lines of their own.
            for lines in (pieces, [pieces[0], *" ".join(pieces[1:]).split()]):
                if all(len(line) <= widths[column] for line in lines):
                    return lines
        return wrap_cell(cell, widths[column])

    wrapped_rows = [[wrap(cell, i) for i, cell in enumerate(cells)] for cells in [headings, *rows]]
    spaced = spaced and (
        any(max(len(parts) for parts in wrapped) > 1 for wrapped in wrapped_rows[1:]) or any(notes or ())
    )
    lines = []
    for index, wrapped in enumerate(wrapped_rows):
        if spaced and index > 1:
            lines.append("")
        for depth in range(max(len(parts) for parts in wrapped)):
            out = []
            for column, parts in enumerate(wrapped):
                text = parts[depth] if depth < len(parts) else ""
                text = text.rjust(widths[column]) if numeric[column] else text.ljust(widths[column])
                code = paint[index - 1][column] if paint and index and depth == 0 else None
                out.append(f"\033[{code}m{text}\033[0m" if code and text.strip() else text)
            lines.append((" " * gap).join(out).rstrip())
        if notes and index and notes[index - 1]:
            lines += textwrap.wrap(notes[index - 1], width, initial_indent="  ", subsequent_indent="  ")
        if index == 0:
            lines.append((" " * gap).join("-" * w for w in widths))
    return "\n".join(lines)


# Inside a word, a line may end after these: an arm named by its settings, amp[dtype=bfloat16],
# then reads "amp[dtype=" / "bfloat16]" in a narrow column rather than "amp[dtyp" / "e=bfloat" / "16]",
# and a search's candidate, amp+channels_last, after the "+" that joins its techniques.
# A hyphen counts only between letters (gpt-mini, leave-one-out), never a minus sign, a comma
# never between digits ("1,797 images" stays whole, not "1," / "797 images"), and a plus never
# before a digit (an exponent, 1e+05).
_NATURAL_PIECES = re.compile(
    r"(?:[^\[=,]|(?<=\d),(?=\d))*?(?:[\[=]|(?<!\d),|,(?!\d)|\+(?!\d)|(?<=[A-Za-z])-(?=[A-Za-z]))"
    r"|(?:[^\[=,]|(?<=\d),(?=\d))+"
)


def wrap_cell(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters: broken at spaces, then after ``[``,
    ``=``, ``,`` and a hyphen inside a word, and only a piece longer than a line anywhere."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        for index, piece in enumerate(_NATURAL_PIECES.findall(word)):
            joined = f"{line} {piece}" if line and index == 0 else line + piece
            if len(joined) <= width:
                line = joined
                continue
            if line:
                lines.append(line)
            while len(piece) > width:
                lines.append(piece[:width])
                piece = piece[width:]
            line = piece
    return [*lines, line]  # line is empty only when text has no words: then [""]


def _interval_pieces(cell: str) -> list[str]:
    """A figure and its bracketed interval as two lines: "1.23× [1.20, 1.26]" -> "1.23×", "[1.20, 1.26]"."""
    figure, bracket, interval = cell.partition(" [")
    return [figure, bracket.strip() + interval] if bracket else [cell]


def _fit_widths(
    headings: list[str],
    rows: list[list[str]],
    numeric: list[bool],
    room: int,
    break_words: bool = True,
    split_intervals: bool = False,
) -> list[int]:
    """Each column's width: its longest cell, then narrowed (text columns first, the widest
    first; numbers only when text alone cannot make room) until the row fits ``room``.
    Without ``break_words`` the widths may sum past ``room``: no text word is broken.
    With ``split_intervals`` a number column may narrow to its longest figure or interval."""
    longest = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headings)]

    # A column never gets narrower than the longest word of its heading, nor than its whole
    # figures (numbers) or its longest word up to LONGEST_UNBROKEN characters (text).
    def floors_of(split: bool) -> list[int]:
        floor = []
        for i, heading in enumerate(headings):
            cells = [r[i] for r in rows]
            if numeric[i]:
                pieces = [p for c in cells for p in (_interval_pieces(c) if split else [c])]
                shortest = max([len(p) for p in pieces] or [0])
            else:
                shortest = min(LONGEST_UNBROKEN, max([len(w) for c in cells for w in c.split()] or [0]))
            floor.append(max(shortest, *(len(word) for word in heading.split())))
        return floor

    floor = floors_of(split=False)
    widths = list(longest)
    # Text first, then numbers' headings; with ``split_intervals``, then a figure over its interval
    # (before the other columns' headings had wrapped, an interval was split with room to spare);
    # last, text words are broken (a long arm name) rather than overflow.
    passes = [(False, floor), (True, floor)]
    if split_intervals:
        passes.append((True, floors_of(split=True)))
    if break_words:
        passes.append((False, [min(f, 6) for f in floor]))
    for pass_numeric, floors in passes:
        while sum(widths) > room:
            candidates = [
                i for i in range(len(widths)) if numeric[i] == pass_numeric and widths[i] > floors[i]
            ]
            if not candidates:
                break
            widest = max(candidates, key=lambda i: widths[i])
            widths[widest] -= 1
    return widths


def fits_unbroken(
    headings: list[str], rows: list[list[str]], numeric: list[bool], width: int, gap: int = 2
) -> bool:
    """Whether ``text_table`` can lay these columns within ``width`` without breaking a word of text."""
    room = width - gap * (len(headings) - 1)
    return sum(_fit_widths(headings, rows, numeric, room, break_words=False)) <= room


# Where the reader's table is too wide for the terminal, these columns give way, first to
# last, before an arm's name or its verdict is cut inside a word ("refere" / "nce"): the step
# time says again what samples/s says, and all three stay in Results.table.
GIVES_WAY_FIRST = ("step", "mfu", "activations", "peak", "comm")


def _columns_that_fit(columns: list[str], rows: list[ReaderRow], width: int) -> tuple[list[str], list[str]]:
    """``columns`` less those of GIVES_WAY_FIRST it takes, in order, to fit ``width`` with no
    word broken; and the headings of those left out."""
    columns, left_out = list(columns), []
    for column in GIVES_WAY_FIRST:
        headings = [_heading(c).heading for c in columns]
        cells = [[row.cells[c] for c in columns] for row in rows]
        if fits_unbroken(headings, cells, [_heading(c).numeric for c in columns], width):
            break
        if column in columns:
            columns.remove(column)
            left_out.append(_heading(column).heading)
    return columns, left_out


# Where the columns a narrow table leaves out can be read (the CLI names its own: cli.ablate_spelling).
WHERE_ALL_COLUMNS_ARE = "table.csv, Results.table and summary(width=120) show them"
# Where the columns the reader's table never shows are; the CLI says it in its own terms.
WHERE_OTHER_COLUMNS_ARE = "is in Results.table and table.csv"


def results_text(
    table,
    width: int | None = None,
    colour: bool = False,
    folder=None,
    spell: Callable[[str], str] | None = None,
) -> str:
    """The reader's table of ``Results.table`` as aligned text, then its legend. Where it is
    too wide for ``width``, the columns of GIVES_WAY_FIRST are left out, and a line says so.
    ``spell``: rewords the notes under the table before they are wrapped (the CLI's flags for the
    API's keywords)."""
    width = width or TERMINAL_WIDTH
    columns, rows = reader_rows(table)
    columns, left_out = _columns_that_fit(columns, rows, width)
    headings = [_heading(c).heading for c in columns]
    numeric = [_heading(c).numeric for c in columns]
    cells = [[row.cells[c] for c in columns] for row in rows]
    paint = None
    if colour:
        paint = [
            [VERDICT_STYLES.get(row.verdict, NOT_OK_STYLE)[2] if c == "verdict" else None for c in columns]
            for row in rows
        ]
    # Past the columns that give way, an interval takes a line of its own before a word is broken
    # (a 60-column terminal read "referen"/"ce").
    text = text_table(headings, cells, numeric, width, paint=paint, split_intervals=True)
    if left_out:
        said = f"Left out to fit {width} characters: {', '.join(left_out)}; {WHERE_ALL_COLUMNS_ARE}."
        text += "\n" + textwrap.fill(spell(said) if spell else said, width, break_on_hyphens=False)
    text += "\n\n" + textwrap.fill(legend(rows), width)
    if note := noise_note(table, folder):
        text += "\n" + textwrap.fill(spell(note) if spell else note, width, break_on_hyphens=False)
    return text


# --- a search (wb.tune) ----------------------------------------------------------------------

SEARCH_HEADINGS = ["candidate", "rounds", "blocks", "speedup [95% interval]", "loss vs baseline", "outcome"]
SEARCH_NUMERIC = [False, True, True, True, True, False]


def search_rows(tune: dict) -> list[list[str]]:
    """The tuner's candidates as people read them, those that went furthest first, then the
    faster: how far each got, its last speedup with its interval, and what became of it (the
    winner, the runner-up, in the last round, or why it left the search)."""
    fastest = (tune.get("fastest") or {}).get("name")
    runner_up = (tune.get("runner_up") or {}).get("name")
    ordered = sorted(tune["candidates"], key=lambda c: (-c["rounds"], -(c["speedup"] or 0.0)))
    rows = []
    for candidate in ordered:
        figures = {
            key: math.nan if candidate.get(key) is None else float(candidate[key])
            for key in ("speedup", "speedup_low", "speedup_high", "loss_vs_baseline")
        }
        if candidate["name"] == fastest:
            outcome = "best" if tune.get("best") else "the fastest, but no winner (see the verdict)"
        elif candidate["name"] == runner_up:
            outcome = "runner-up"
        else:
            outcome = candidate.get("dropped") or "in the last round"
        speedup = speedup_text(_Figures(**{k: v for k, v in figures.items() if k != "loss_vs_baseline"}))
        rows.append(
            [
                candidate["name"],
                str(candidate["rounds"]),
                "-" if candidate["blocks"] is None else str(candidate["blocks"]),  # not screened: none
                speedup,
                times(figures["loss_vs_baseline"]),
                outcome,
            ]
        )
    return rows + _not_searched_rows(tune.get("excluded") or [])


NOT_SEARCHED_SHOWN = 8  # combinations that could not run, each on its own row; the rest summed up


def _not_searched_rows(excluded: list[dict]) -> list[list[str]]:
    """The combinations the search left out, last: each that cannot run here with its reason (a
    technique a user asked for and never saw measured must say why), then one row for those
    beyond max_candidates, which are only counted."""
    unmeasured = speedup_text(_Figures(math.nan, math.nan, math.nan))

    def row(name: str, outcome: str) -> list[str]:  # no rounds, no blocks, no figures
        return [name, "0", "-", unmeasured, times(math.nan), f"not searched: {outcome}"]

    cannot = [e for e in excluded if not e["why"].startswith("beyond max_candidates")]
    beyond = [e for e in excluded if e["why"].startswith("beyond max_candidates")]
    rows = [row(e["name"], f"cannot run here: {e['why']}") for e in cannot[:NOT_SEARCHED_SHOWN]]
    if len(cannot) > NOT_SEARCHED_SHOWN:
        rows.append(row(f"{len(cannot) - NOT_SEARCHED_SHOWN} more combinations", "cannot run here"))
    if beyond:
        rows.append(row(f"{len(beyond)} more combinations", beyond[0]["why"]))
    return rows


@dataclass(frozen=True)
class _Figures:
    speedup: float
    speedup_low: float
    speedup_high: float


def search_text(tune: dict, verdict: str, width: int | None = None) -> str:
    """A search's candidates as aligned text within ``width`` characters, what became of each
    on a line under it, then the verdict."""
    width = width or TERMINAL_WIDTH
    rows = search_rows(tune)
    table = text_table(
        SEARCH_HEADINGS[:-1],
        [cells[:-1] for cells in rows],
        SEARCH_NUMERIC[:-1],
        width,
        spaced=True,
        split_intervals=True,
        notes=[cells[-1] for cells in rows],
    )
    return f"{table}\n\n{textwrap.fill(verdict, width)}"


def search_html(tune: dict) -> str:
    """A search's candidates as an HTML table, in the reader's table's style; the winner in bold."""
    head = "".join(
        f'<th class="{"" if numeric else "wb-text"}">{html.escape(heading)}</th>'
        for heading, numeric in zip(SEARCH_HEADINGS, SEARCH_NUMERIC, strict=True)
    )
    body = []
    for cells in search_rows(tune):
        weight = ' style="font-weight:600"' if cells[-1] == "best" else ""
        tds = "".join(
            f'<td class="{"" if numeric else "wb-text wb-why-plain"}">{html.escape(cell)}</td>'
            for cell, numeric in zip(cells, SEARCH_NUMERIC, strict=True)
        )
        body.append(f"<tr{weight}>{tds}</tr>")
    table = f'<table class="wb-reader"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
    return f'<div class="wb-results"><style>{READER_CSS}</style>{table}</div>'
