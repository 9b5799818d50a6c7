"""The results folder: overwrite removes only what workbench wrote, and one run at a time holds it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import workbench as wb
from workbench.ablation import check_before_run
from workbench.results_folder import LOCK, MANIFEST, TAKEOVER, FolderInUse, ResultsFolder

TINY = {"model": "mlp", "techniques": {"amp": True}, "steps": 4, "warmup": 1, "blocks": 1, "progress": False}


def test_a_run_enters_every_file_it_writes_in_the_manifest(tmp_path):
    out = tmp_path / "run"
    results = wb.ablate(**TINY, out=out)
    stored = [row["verdict"] for row in json.loads((out / "results.json").read_text())["table"]]
    assert stored == list(results.table.verdict) and None not in stored  # as shown, for its readers
    manifest = set(json.loads((out / MANIFEST).read_text())["files"])
    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {MANIFEST, LOCK}
    assert written == manifest
    # ablate(out=...) saves what the CLI saves: the tables and the plot beside results.json
    assert {"plan.json", "results.json", "table.csv", "losses.csv", "telemetry.csv", "plot.png"} <= manifest
    assert any(name.startswith("units/") for name in manifest) and any(
        name.startswith("logs/") for name in manifest
    )


def test_a_file_another_workbench_process_entered_meanwhile_stays_in_the_manifest(tmp_path):
    """``workbench report`` while the run goes on enters report.html; the run's next entry must
    not drop it (overwrite would then refuse the folder for a file workbench wrote itself)."""
    run, report = ResultsFolder(tmp_path), ResultsFolder(tmp_path)  # two processes' views
    run.file("results.json").write_text("{}")
    report.file("report.html").write_text("<html>")
    run.file("table.csv").write_text("")
    assert set(json.loads((tmp_path / MANIFEST).read_text())["files"]) == {
        "results.json",
        "report.html",
        "table.csv",
    }
    ResultsFolder(tmp_path).clear()
    assert not [p for p in tmp_path.iterdir() if p.name != MANIFEST]


def test_traces_written_inside_out_are_workbenchs_own(tmp_path):
    """trace_dir inside out: overwrite removes the traces, rather than refusing them as a stranger's."""
    out = tmp_path / "run"
    traced = {
        **TINY,
        "techniques": {},
        "control": False,
        "profile_steps": 1,
        "trace_dir": str(out / "traces"),
    }
    wb.ablate(**traced, out=out)
    assert sorted(p.name for p in (out / "traces").iterdir()) == ["b0-baseline.json"]
    # A trace an older workbench wrote has no mark: the manifest vouches for it
    (out / "traces" / "b0-baseline.json").write_text('{"traceEvents": []}')
    wb.ablate(**{**traced, "steps": 5}, out=out, overwrite=True)
    assert not (
        set(json.loads((out / MANIFEST).read_text())["files"])
        ^ {
            p.relative_to(out).as_posix()
            for p in out.rglob("*")
            if p.is_file() and p.name not in (MANIFEST, LOCK)
        }
    )


def test_a_trace_dir_outside_out_replaces_only_this_runs_own_traces(tmp_path):
    """A user's file, or another run's trace, where a trace would go is refused before anything
    runs; the same run (a resume, an overwrite) replaces its own."""
    traces, first, second = tmp_path / "traces", tmp_path / "first", tmp_path / "second"
    traces.mkdir()
    traced = {**TINY, "techniques": {}, "control": False, "profile_steps": 1, "trace_dir": str(traces)}
    trace = traces / "b0-baseline.json"
    trace.write_text('{"my": "precious trace"}')
    with pytest.raises(
        ValueError, match=r"holds b0-baseline.json \(workbench did not write it\), which this run"
    ):
        wb.ablate(**traced, out=first)
    assert trace.read_text() == '{"my": "precious trace"}' and not first.exists()
    trace.unlink()
    wb.ablate(**traced, out=first)
    written = trace.read_bytes()
    record = json.loads(written)  # still a Chrome trace, marked as the run's in first
    assert record["workbench_trace"] == {"out": str(first.resolve())} and record["traceEvents"]
    with pytest.raises(ValueError, match=r"holds b0-baseline.json \(the trace of the run in '.*first'\)"):
        wb.ablate(**traced, out=second)
    assert trace.read_bytes() == written
    wb.ablate(**{**traced, "steps": 5}, out=first, overwrite=True)
    assert trace.read_bytes() != written
    assert sorted(p.name for p in traces.iterdir()) == ["b0-baseline.json"]  # no temporary file left


def test_a_folder_another_run_made_for_its_own_runs_is_theirs_alone(tmp_path):
    """A search's round: any other run there took the round's place (with overwrite), or was told
    to pass overwrite; and a stopped round pointed at its own folder, which its search refuses."""
    from workbench.ablation import _Runner
    from workbench.config import RunConfig

    search = ResultsFolder(tmp_path / "search")
    search.path.mkdir()
    room = search.nest("round-1")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"is where the workbench run in '.*search' keeps its own runs"):
            wb.ablate(**TINY, out=room, overwrite=overwrite)
        with pytest.raises(ValueError, match=r"keeps its own runs"):
            check_before_run({**TINY, "out": room, "overwrite": overwrite})  # the dry run as well
    assert not room.exists()
    round_run = _Runner.__new__(_Runner)  # what a stopped round says, the search's folder named
    round_run.__dict__.update(
        launcher=None, stop=None, kept=True, nested=True, folder=room, done={(0, "block")},
        run_config=RunConfig(), only_block=None,
    )  # fmt: skip
    line = round_run._stopped_line(planned=3)
    assert f"Run the command that started it again, with out={str(search.path)!r}" in line


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    from workbench.ablation import _default_out

    monkeypatch.chdir(tmp_path)
    first, second = _default_out("mlp"), _default_out("mlp")  # well within one second
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name.startswith(first.name) or first.name[:15] != second.name[:15]


def test_json_results_are_as_readable_as_the_other_files(tmp_path):
    """Colleagues on a shared file system who can open plot.png can open results.json too."""
    from workbench.results_folder import write_json_atomic

    write_json_atomic(tmp_path / "results.json", {})
    (tmp_path / "table.csv").write_text("")
    assert (tmp_path / "results.json").stat().st_mode & 0o777 == (
        tmp_path / "table.csv"
    ).stat().st_mode & 0o777


def test_an_ablation_and_a_search_never_share_a_folder(tmp_path):
    """A search into an ablation's folder, or an ablation into a search's, would mix their files
    and replace the other's results.json: refused, naming what is there, unless overwrite."""
    out = tmp_path / "run"
    wb.ablate(**TINY, out=out)
    before = (out / "results.json").read_bytes()
    with pytest.raises(ValueError, match=r"holds other workbench results \(.*plan\.json.*\), not a search's"):
        wb.tune("mlp", budget_s=60, out=out, progress=False)
    assert (out / "results.json").read_bytes() == before and not (out / "tune.json").exists()

    search = tmp_path / "search"
    folder = ResultsFolder(search)
    folder.lock()
    folder.file("tune.json").write_text("{}")
    folder.unlock()
    with pytest.raises(ValueError, match=r"holds other workbench results \(tune\.json\), not an ablation's"):
        wb.ablate(**TINY, out=search)
    assert not (search / "plan.json").exists()


@pytest.mark.slow  # real ablations in fresh processes
def test_a_copy_of_a_runs_files_is_not_that_run_and_its_edits_are_kept(tmp_path):
    """cp -r run/* copy/ leaves the hidden manifest behind: the copy's plan.json is the user's
    file then, not a run to resume into, and its edited table.csv must not be overwritten."""
    run, copy = tmp_path / "run", tmp_path / "copy"
    wb.ablate(**TINY, out=run)
    copy.mkdir()
    for name in ("plan.json", "table.csv", "results.json"):
        (copy / name).write_bytes((run / name).read_bytes())
    (copy / "table.csv").write_text((copy / "table.csv").read_text() + "# my annotations\n")
    with pytest.raises(ValueError, match=r"holds files that workbench did not write there \(plan\.json"):
        wb.ablate(**TINY, out=copy)
    assert (copy / "table.csv").read_text().endswith("# my annotations\n")

    # In the run's own folder the user's notes may sit beside it; a file where the run writes may not.
    (run / "notes.md").write_text("mine")
    assert wb.ablate(**TINY, out=run).complete  # resumed: everything was finished already
    (run / "units" / "stray.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match=r"did not write there \(units/stray\.json\)"):
        wb.ablate(**TINY, out=run)
    (run / "units" / "stray.json").unlink()
    assert (run / "notes.md").read_text() == "mine"


def test_a_run_inside_another_runs_folder_is_refused(tmp_path):
    outer = ResultsFolder(tmp_path / "outer")
    outer.lock()
    outer.file("plan.json").write_text("{}")
    outer.nest("round-1")  # a folder the outer run made for a run of its own: allowed
    outer.unlock()
    with pytest.raises(ValueError, match=r"is inside the workbench results folder .*outer"):
        wb.ablate(**TINY, out=tmp_path / "outer" / "units")
    with pytest.raises(ValueError, match=r"is inside the workbench results folder .*outer"):  # the panel's
        check_before_run({**TINY, "out": tmp_path / "outer" / "units"})
    with pytest.raises(ValueError, match=r"is inside the workbench results folder"):
        wb.tune("mlp", budget_s=60, out=tmp_path / "outer" / "deeper" / "search", progress=False)
    # the outer run's own run enters it (a search's round); see the test below for any other
    ResultsFolder(tmp_path / "outer" / "round-1" / "inner").refuse_inside_another_run(made_for_it=True)
    assert not (tmp_path / "outer" / "units").exists()


def test_a_folder_holding_other_runs_names_them_as_runs_not_as_the_users_files(tmp_path):
    # ``--out runs`` where runs/r1 and runs/old/r0 are runs of their own: their files are workbench
    # results, of other runs, and the refusal says so, apart from the user's own file beside them.
    for run in ("r1", "old/r0"):
        folder = ResultsFolder(tmp_path / "runs" / run)
        folder.lock()
        folder.file("plan.json").write_text("{}")
        block = folder.file("units/b0-block.json")
        block.parent.mkdir()
        block.write_text("{}")
        folder.unlock()
    runs = ResultsFolder(tmp_path / "runs")
    with pytest.raises(
        ValueError, match=r"holds the results of other workbench runs \(r1/, old/r0/\); choose"
    ):
        runs.refuse_foreign_files(resuming=False, writes=())
    (tmp_path / "runs" / "notes.md").write_text("mine")
    with pytest.raises(ValueError) as refused:
        runs.refuse_to_clear_foreign()
    assert (
        "other workbench runs (r1/, old/r0/) and files that workbench did not write there (notes.md)"
        in str(refused.value)
    )
    assert (tmp_path / "runs" / "notes.md").read_text() == "mine"


def test_out_with_a_tilde_means_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    folder = ResultsFolder("~/results")
    assert folder.path == tmp_path / "home" / "results"
    folder.lock()
    assert (tmp_path / "home" / "results").is_dir() and not (tmp_path / "~").exists()
    folder.unlock()


def test_save_refuses_the_users_files_and_other_runs_but_saves_its_own_run_again(tmp_path):
    from workbench.results import load_results

    run = tmp_path / "run"
    results = wb.ablate(**TINY, out=run)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "table.csv").write_text("the user's table")
    with pytest.raises(ValueError, match=r"save: .* holds files that workbench did not write \(table\.csv\)"):
        results.save(mine)
    assert (mine / "table.csv").read_text() == "the user's table"

    copy = results.save(tmp_path / "copy")
    assert results.save(copy) == copy  # the same run, saved again
    other = load_results(run)
    other.record["created"] = "2000-01-01T00:00:00"
    with pytest.raises(ValueError, match="holds another workbench run's results"):
        other.save(copy)
    with pytest.raises(ValueError, match="is inside the workbench results folder"):
        results.save(run / "units")
    assert results.save(run) == run  # its own folder


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
        # The panel's pre-flight, which takes no lock, says the same, not that the other run's
        # files (half written, not yet in its manifest) are the user's.
        (out / "plan.json").write_text("{}")
        from workbench.ablation import check_before_run

        with pytest.raises(FolderInUse, match=rf"in use by another workbench run \(process {holder.pid} on "):
            check_before_run({**TINY, "out": out})
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
    assert not (out / LOCK).exists()  # and released when this run ended


def _lock_file(out, **holder):
    out.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), **holder}
    (out / LOCK).write_text(json.dumps(record))


def test_a_lock_held_from_another_host_is_never_guessed_dead(tmp_path):
    # On a shared filesystem a lock may come from another node, whose processes this one cannot see.
    out = tmp_path / "nfs"
    _lock_file(out, host="node-elsewhere", pid=12345, slurm_job_id="77")
    with pytest.raises(
        FolderInUse, match=r"another host \(process 12345 on node-elsewhere, .*Slurm job 77\)"
    ):
        ResultsFolder(out).lock()
    with pytest.raises(FolderInUse, match=re.escape(f"remove {out / LOCK}")):
        ResultsFolder(out).lock()
    assert json.loads((out / LOCK).read_text())["host"] == "node-elsewhere"  # untouched


def test_a_reused_process_id_does_not_keep_a_lock(tmp_path, capsys):
    # The recorded process started after the lock was taken: it is another program with that ID.
    out = tmp_path / "reused"
    _lock_file(out, pid=os.getpid(), started=time.time() - 3600, since=time.time() - 3600)
    folder = ResultsFolder(out)
    assert "took over the lock" in folder.lock()
    assert json.loads((out / LOCK).read_text())["started"] > time.time() - 3600
    folder.unlock()
    _lock_file(out, pid=os.getpid(), started=time.time())  # this very process: alive
    with pytest.raises(FolderInUse, match=f"process {os.getpid()}"):
        ResultsFolder(out).lock()


def test_an_empty_lock_file_from_an_older_workbench_is_taken_quietly(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    (out / LOCK).write_text("")  # how the flock-based lock ended a clean run
    folder = ResultsFolder(out)
    assert folder.lock() is None
    folder.unlock()
    assert not (out / LOCK).exists()


RACE = """
import sys, time
from workbench.results_folder import FolderInUse, ResultsFolder
time.sleep(float(sys.argv[2]) - time.time())
try:
    ResultsFolder(sys.argv[1]).lock()
    print("won", flush=True)
    time.sleep(5)
except FolderInUse:
    print("lost", flush=True)
"""


def test_of_runs_that_lock_at_once_exactly_one_wins(tmp_path):
    out = tmp_path / "race"
    (out).mkdir()
    (out / LOCK).write_text(json.dumps({"pid": 999999999, "host": socket.gethostname(), "since": 0}))  # stale
    at = time.time() + 3
    racers = [
        subprocess.Popen([sys.executable, "-c", RACE, str(out), str(at)], stdout=subprocess.PIPE, text=True)
        for _ in range(6)
    ]
    said = [racer.communicate(timeout=60)[0].strip() for racer in racers]
    assert sorted(said) == ["lost"] * 5 + ["won"], said


def test_a_run_that_found_the_lock_stale_leaves_alone_the_lock_taken_since(tmp_path):
    # The interleaving behind a rare double win in the race above, made certain: the slow run
    # reads a dead run's lock, and before it removes that lock a faster run takes it over.
    out = tmp_path / "race"
    out.mkdir()
    (out / LOCK).write_text(json.dumps({"pid": 999999999, "host": socket.gethostname(), "since": 0}))
    slow, fast = ResultsFolder(out), ResultsFolder(out)
    read = slow._read_lock

    def read_and_then_lose_the_race():
        seen = read()
        if fast._holder is None:
            assert fast.lock() is not None  # took over the dead run's lock
        return seen

    slow._read_lock = read_and_then_lose_the_race
    with pytest.raises(FolderInUse, match="in use by another workbench run"):
        slow.lock()
    assert json.loads((out / LOCK).read_text()) == fast._holder
    fast.unlock()
    assert sorted(p.name for p in out.iterdir()) == []  # nor is the takeover's side file left


def test_without_flock_a_dead_runs_lock_is_named_for_removal_not_guessed(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    out = tmp_path / "nolocks"
    out.mkdir()
    dead = json.dumps({"pid": 999999999, "host": socket.gethostname(), "since": 0})
    (out / LOCK).write_text(dead)
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(FolderInUse, match=re.escape(f"remove {out / LOCK}")):
        ResultsFolder(out).lock()
    assert (out / LOCK).read_text() == dead
    assert [p.name for p in out.iterdir()] == [LOCK]


def test_a_takeover_file_left_by_a_killed_run_is_workbenchs_own(tmp_path):
    out = tmp_path / "run"
    folder = ResultsFolder(out)
    folder.lock()
    (out / TAKEOVER).write_text("")  # a run killed while it took over a dead run's lock
    assert folder.foreign_files() == []
    folder.unlock()


def test_out_that_is_a_file_is_bad_input(tmp_path):
    a_file = tmp_path / "results.txt"
    a_file.write_text("not a folder")
    with pytest.raises(ValueError, match="is a file"):
        wb.ablate(**TINY, out=a_file)
    assert a_file.read_text() == "not a folder"


def test_unlocking_removes_only_the_empty_folders_that_locking_made(tmp_path):
    """A run refused after it took the lock (a search with nothing that can run) leaves no empty
    folder; a folder that was there before, or that holds anything, stays."""
    made = ResultsFolder(tmp_path / "new" / "deeper" / "run")
    made.lock()
    assert (tmp_path / "new" / "deeper" / "run" / LOCK).exists()
    made.unlock()
    assert not (tmp_path / "new").exists()

    (tmp_path / "mine").mkdir()
    there_before = ResultsFolder(tmp_path / "mine")
    there_before.lock()
    there_before.unlock()
    assert (tmp_path / "mine").is_dir()

    written = ResultsFolder(tmp_path / "parent" / "run")
    written.lock()
    (tmp_path / "parent" / "run" / "notes.txt").write_text("the user's")
    written.unlock()
    assert (tmp_path / "parent" / "run" / "notes.txt").read_text() == "the user's"
