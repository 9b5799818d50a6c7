"""The README says only what was measured: its sample table and the reading under it come
from the last run recorded in benchmarks/results/quick-preset-trimmed.json, the main job's
latest record (BENCHMARKS.md, "The quick preset")."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "results" / "quick-preset-trimmed.json"


@pytest.fixture(scope="module")
def recorded() -> dict[str, dict]:
    run = json.loads(RECORD.read_text())["tables"][-1]
    return {row["arm"]: row for row in run}


@pytest.fixture(scope="module")
def readme_table() -> dict[str, list[str]]:
    """The sample table's rows by arm; a row whose arm or verdict wraps continues on the next line."""
    text = (ROOT / "README.md").read_text()
    block = text.split("The quick preset prints a table like this one", 1)[1].split("```", 2)[1]
    rows: list[tuple[str, list[str]]] = []
    for line in block.strip().splitlines()[3:]:  # after the two heading lines and the rule
        if line.startswith(" "):  # the rest of a wrapped verdict
            rows[-1][1][0] += " " + line.strip()
        elif not re.search(r"\d", line):  # the rest of a wrapped arm name
            rows[-1] = (f"{rows[-1][0]} {line.strip()}", rows[-1][1])
        else:
            arm, *cells = line.split()
            rows.append((arm, cells))
    return dict(rows)


def test_the_sample_table_is_the_recorded_run(recorded, readme_table):
    assert set(readme_table) == set(recorded)
    for arm, cells in readme_table.items():
        row = recorded[arm]
        figures = [c for c in cells if re.match(r"\[?\d", c)]
        speedup, samples, step_ms = figures[0], *(figures[3:5] if "[" in figures[1] else figures[1:3])
        assert float(speedup.rstrip("×")) == pytest.approx(row["speedup"], abs=0.006), arm
        if "[" in figures[1]:
            low, high = figures[1], figures[2]
            assert float(low.strip("[,")) == pytest.approx(row["speedup_low"], abs=0.006), arm
            assert float(high.strip("]")) == pytest.approx(row["speedup_high"], abs=0.006), arm
        assert int(samples.replace(",", "")) == round(row["samples_per_s"]), arm
        assert float(step_ms) == pytest.approx(row["step_ms"], rel=0.01), arm


def test_the_reading_quotes_the_recorded_speedups(recorded):
    text = (ROOT / "README.md").read_text()
    reading = text.split("Here is how to read that run.", 1)[1].split("![quick preset plot]", 1)[0]
    assert f"bf16 autocast is {recorded['amp']['speedup']:.2f}x faster" in reading
    assert f"channels_last is {recorded['channels_last']['speedup']:.2f}x faster" in reading
    saved = 1 - recorded["amp"]["peak_mem_mb"] / recorded["baseline"]["peak_mem_mb"]
    assert f"holds {100 * saved:.0f}% less tensor memory" in reading
    for arm in ("checkpointing", "grad_accum"):
        assert f"{100 * (1 - recorded[arm]['speedup']):.0f}%" in reading, arm
    control = recorded["baseline (control)"]
    assert f"[{control['speedup_low']:.2f}, {control['speedup_high']:.2f}]" in reading
    wall = json.loads(RECORD.read_text())["wall_s"][-1]
    assert f"The whole run took {wall:.0f} s" in reading


def test_the_plots_paragraph_quotes_the_run_it_shows():
    """docs/quick-preset.png is drawn from docs/quick-preset-results.json; the paragraph above it
    quotes that record, and the record loads as any results file does."""
    import workbench as wb

    shown = wb.load_results(ROOT / "docs" / "quick-preset-results.json")
    text = (ROOT / "README.md").read_text()
    paragraph = text.split("The plot below is that", 1)[1].split("![quick preset plot]", 1)[0]
    rows = shown.table.set_index("arm")
    channels_last, control, amp = rows.loc["channels_last"], rows.loc["baseline (control)"], rows.loc["amp"]
    assert (
        f"{channels_last.speedup:.2f}x [{channels_last.speedup_low:.2f}, {channels_last.speedup_high:.2f}]"
        in paragraph
    )
    assert f"{control.speedup:.2f} [{control.speedup_low:.2f}, {control.speedup_high:.2f}]" in paragraph
    assert f"amp at {amp.speedup:.2f}x, its {amp.step_ms:.0f} ms step" in paragraph
    verdicts = dict(zip(rows.index, rows.verdict, strict=True))
    assert verdicts["channels_last"] == "faster"
    assert {verdicts[arm] for arm in ("checkpointing", "grad_accum", "amp")} == {"slower"}
