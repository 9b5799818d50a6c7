"""The results folder: overwrite removes only what workbench wrote, and one run at a time holds it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import workbench as wb
from workbench.results_folder import LOCK, MANIFEST, FolderInUse, ResultsFolder

TINY = {"model": "mlp", "techniques": {"amp": True}, "steps": 4, "warmup": 1, "blocks": 1, "progress": False}


def test_a_run_enters_every_file_it_writes_in_the_manifest(tmp_path):
    out = tmp_path / "run"
    wb.ablate(**TINY, out=out)
    manifest = set(json.loads((out / MANIFEST).read_text())["files"])
    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {MANIFEST, LOCK}
    assert written == manifest
    # ablate(out=...) saves what the CLI saves: the tables and the plot beside results.json
    assert {"plan.json", "results.json", "table.csv", "losses.csv", "telemetry.csv", "plot.png"} <= manifest
    assert any(name.startswith("units/") for name in manifest) and any(
        name.startswith("logs/") for name in manifest
    )


@pytest.mark.slow  # a real ablation in fresh processes
def test_overwrite_keeps_the_users_files_and_refuses_naming_them(tmp_path):
    out = tmp_path / "run"
    wb.ablate(**TINY, out=out)
    (out / "my-analysis.ipynb").write_text("the user's work")
    (out / "logs" / "my-notes.txt").write_text("also the user's")
    with pytest.raises(ValueError, match=r"did not write.*logs/my-notes\.txt, my-analysis\.ipynb"):
        wb.ablate(**{**TINY, "steps": 5}, out=out, overwrite=True)
    assert (out / "my-analysis.ipynb").read_text() == "the user's work"
    assert (out / "logs" / "my-notes.txt").read_text() == "also the user's"
    assert json.loads((out / "plan.json").read_text())["settings"]["steps"] == 4  # nothing was removed

    (out / "my-analysis.ipynb").unlink()
    (out / "logs" / "my-notes.txt").unlink()
    again = wb.ablate(**{**TINY, "steps": 5}, out=out, overwrite=True)
    assert again.complete and json.loads((out / "plan.json").read_text())["settings"]["steps"] == 5


def test_overwrite_refuses_a_folder_without_a_manifest(tmp_path):
    """Results from before the manifest, or a folder someone made to look like one: hands off."""
    out = tmp_path / "old"
    out.mkdir()
    (out / "plan.json").write_text("{}")
    (out / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="did not write"):
        wb.ablate(**TINY, out=out, overwrite=True)
    assert (out / "plan.json").exists() and (out / "results.json").exists()


def test_clear_removes_only_listed_files_and_the_folders_they_emptied(tmp_path):
    folder = ResultsFolder(tmp_path / "f")
    folder.file("units/b0.json").parent.mkdir(parents=True)
    (tmp_path / "f" / "units" / "b0.json").write_text("{}")
    (tmp_path / "f" / "units" / "b0.json1234.tmp").write_text("half")  # a write cut short
    folder.file("results.json").write_text("{}")
    (tmp_path / "f" / "empty-of-users").mkdir()  # the user's empty folder stays
    ResultsFolder(tmp_path / "f").clear()  # a later run, reading the manifest from disk
    left = sorted(p.relative_to(tmp_path / "f").as_posix() for p in (tmp_path / "f").rglob("*"))
    assert left == [MANIFEST, "empty-of-users"]


HOLD = """
import sys, time
from workbench.results_folder import ResultsFolder
folder = ResultsFolder(sys.argv[1])
folder.lock()
print("locked", flush=True)
time.sleep(120)
"""


def _holder(folder) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLD), str(folder)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "locked"
    return process


def test_a_second_run_fails_at_once_naming_the_first(tmp_path):
    out = tmp_path / "shared"
    holder = _holder(out)
    try:
        started = time.monotonic()
        with pytest.raises(FolderInUse, match=rf"in use by another workbench run \(process {holder.pid} on "):
            wb.ablate(**TINY, out=out)
        assert time.monotonic() - started < 60  # at once: it does not wait for the lock
        with pytest.raises(FolderInUse):  # overwrite is no way around it
            wb.ablate(**TINY, out=out, overwrite=True)
        assert not (out / "plan.json").exists()
    finally:
        holder.kill()
        holder.wait()


def test_the_cli_says_so_in_one_line_and_exits_2(tmp_path):
    out = tmp_path / "shared"
    holder = _holder(out)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "workbench.cli", "ablate", "--model", "mlp", "--steps", "4", "--blocks", "1",
             "--out", str(out), "--no-progress"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 2
    assert f"process {holder.pid}" in done.stderr and "Traceback" not in done.stderr


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path, capsys):
    out = tmp_path / "orphaned"
    holder = _holder(out)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert json.loads((out / LOCK).read_text())["pid"] == holder.pid  # the dead run's lock file is there
    results = wb.ablate(**TINY, out=out)
    assert results.complete
    assert (
        f"took over the lock that an earlier run left in {out} (process {holder.pid}"
        in capsys.readouterr().err
    )
    assert (out / LOCK).read_text() == ""  # and released when this run ended


def test_out_that_is_a_file_is_bad_input(tmp_path):
    a_file = tmp_path / "results.txt"
    a_file.write_text("not a folder")
    with pytest.raises(ValueError, match="is a file"):
        wb.ablate(**TINY, out=a_file)
    assert a_file.read_text() == "not a folder"
