"""The README says only what was measured: its sample table and the reading under it come
from the last run recorded in benchmarks/results/quick-preset.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "results" / "quick-preset.json"


@pytest.fixture(scope="module")
def recorded() -> dict[str, dict]:
    run = json.loads(RECORD.read_text())["tables"][-1]
    return {row["arm"]: row for row in run}


@pytest.fixture(scope="module")
def readme_table() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    block = text.split("The quick preset prints a table like this one", 1)[1].split("```", 2)[1]
    rows = {}
    for line in block.strip().splitlines()[1:]:
        arm, rest = re.match(r"\s*(baseline \(control\)|\S+)\s+(.*)", line).groups()
        rows[arm] = rest.split()
    return rows


def test_the_sample_table_is_the_recorded_run(recorded, readme_table):
    assert set(readme_table) == set(recorded)
    for arm, cells in readme_table.items():
        row = recorded[arm]
        status, samples, speedup, low, high = cells[:5]
        assert status == row["status"]
        assert int(samples.replace(",", "")) == round(row["samples_per_s"]), arm
        assert float(speedup) == pytest.approx(row["speedup"], abs=0.006), arm
        assert float(low.strip("[,")) == pytest.approx(row["speedup_low"], abs=0.006), arm
        assert float(high.strip("]")) == pytest.approx(row["speedup_high"], abs=0.006), arm
        step_ms = next(c for c in cells[5:] if c != "*")
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
    wall = json.loads(RECORD.read_text())["wall_s"][-1]
    assert f"The whole run took {wall:.0f} s" in reading
