"""What a reader sees in a teaching notebook before running it is its saved outputs. A saved
ipywidgets output (a progress bar, the panel) has no kernel behind it there: JupyterLab shows
its text fallback, a bar stuck at 0%, or an error in its place. So saved notebooks keep the
tables and figures and leave widget outputs and widget state out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def test_there_are_notebooks_to_check():
    assert len(NOTEBOOKS) >= 10


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_a_saved_notebook_holds_no_widget_outputs(path: Path):
    notebook = json.loads(path.read_text())
    stale = [
        index
        for index, cell in enumerate(notebook["cells"])
        if cell["cell_type"] == "code"
        and any(WIDGET_VIEW in output.get("data", {}) for output in cell.get("outputs", []))
    ]
    assert not stale, f"{path.name}: cells {stale} saved a widget output (strip it: it shows as a stale bar)"
    assert "widgets" not in notebook["metadata"], f"{path.name}: saved widget state in its metadata"
