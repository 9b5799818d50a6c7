"""executor="slurm": blocks as Slurm jobs through submitit, against a real Slurm.

`bash .ci/slurm start` runs a one-node Slurm on this machine (Debian's slurm-wlm and munge);
.ci/run starts it for this tier and stops it afterwards. Without a cluster these tests skip,
unless WORKBENCH_REQUIRE_SLURM is set (as .ci/run sets it), where a missing cluster fails.

On the 2-core test machine every job asks for both cores (cpus_per_job's default: the
submitting machine's cores), so Slurm runs them one at a time and they never disturb each
other's timings. Speed is not the point here; correctness is.
"""

import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import workbench as wb
import workbench.slurm
from workbench.slurm import ask_squeue

pytestmark = pytest.mark.slurm

TESTS = Path(__file__).resolve().parent
SMALL = {"steps": 20, "warmup": 2, "blocks": 2, "device": "cpu", "executor": "slurm", "progress": False}
# How often a submitting process asks Slurm about its jobs: POLL_S (2 s, a courtesy to a shared
# controller) is waited between a job's end and the call seeing it, once or twice in every test.
# No test depends on the cadence, so they poll this one-user cluster four times as often.
POLL_S = 0.5


@pytest.fixture(autouse=True)
def _quick_polls(monkeypatch):
    monkeypatch.setattr(workbench.slurm, "POLL_S", POLL_S)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """A Slurm that answers, with an idle node; or a skip (a failure where .ci/run asks for it)."""
    why = None
    if shutil.which("sbatch") is None:
        why = "Slurm's commands are not installed (bash .ci/slurm start)"
    else:
        answer = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=60)
        if answer.returncode != 0 or not answer.stdout.strip():
            why = f"no Slurm cluster answers (bash .ci/slurm start; export SLURM_CONF=...): {answer.stderr.strip()}"
    if why and os.environ.get("WORKBENCH_REQUIRE_SLURM"):
        pytest.fail(why)
    if why:
        pytest.skip(why)


def _state(out: Path) -> list[dict]:
    try:
        return json.loads((out / "slurm" / "state.json").read_text())["attempts"]
    except (FileNotFoundError, ValueError):
        return []


def _wait_for(condition, timeout_s: float = 180.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def _submitter(out: Path, **settings) -> subprocess.Popen:
    """An ablate() through Slurm in a process of its own, to kill or watch from outside."""
    arguments = {**SMALL, **settings, "out": str(out)}
    code = (
        f"import workbench as wb, workbench.slurm; workbench.slurm.POLL_S = {POLL_S}; "
        f"wb.ablate('mlp', techniques={{}}, **{arguments!r})"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _no_jobs_left(out: Path) -> bool:
    live = ask_squeue([a["job_id"] for a in _state(out)])[0] or {}
    return not any(s.state in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING") for s in live.values())


@pytest.fixture(scope="module")
def amp_on_slurm(tmp_path_factory):
    """Two blocks of the mlp with amp through Slurm, and their results folder: one ablation for
    the tests that only read a finished run (a Slurm block costs some 20 s here, mostly start-up)."""
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("results must come from JSON; submitit's pickles are transport only")

    out = tmp_path_factory.mktemp("amp") / "slurm"
    with pytest.MonkeyPatch.context() as patched:  # the submitting process never unpickles anything
        patched.setattr(workbench.slurm, "POLL_S", POLL_S)
        patched.setattr(pickle, "load", refuse)
        patched.setattr(pickle, "loads", refuse)
        results = wb.ablate("mlp", techniques=["amp"], out=out, **SMALL)
    return results, out


def test_two_blocks_through_slurm_give_the_arms_and_schema_of_a_local_run(tmp_path, amp_on_slurm):
    on_slurm, out = amp_on_slurm
    local = wb.ablate("mlp", techniques=["amp"], out=tmp_path / "local", **{**SMALL, "executor": "local"})
    assert on_slurm.complete and list(on_slurm.table.arm) == list(local.table.arm)
    assert list(on_slurm.table.columns) == list(local.table.columns)
    assert set(on_slurm.record) == set(local.record)
    ok = [u for u in on_slurm.record["units"] if u["status"] == "ok"]
    assert len(ok) == len([u for u in local.record["units"] if u["status"] == "ok"]) == 2 * 3
    assert all((out / u["log"]).is_file() for u in ok), "each unit's log is in the results folder"
    # Each block: one node, one job; recorded where it ran.
    blocks = on_slurm.blocks
    attempts = _state(out)
    assert sorted(blocks.block) == [0, 1] and blocks.host.notna().all() and blocks.device_name.notna().all()
    assert sorted(blocks.slurm_job_id) == sorted(a["job_id"] for a in attempts)
    assert [a["state"] for a in attempts] == ["MERGED", "MERGED"]
    assert local.blocks.slurm_job_id.isna().all()
    mode = stat.S_IMODE((out / "slurm").stat().st_mode)
    assert mode == 0o700, f"the job folder (pickles) must be private; it is {oct(mode)}"
    # Loading the saved results reads JSON only (submitit's result pickles are never opened).
    assert wb.load_results(out).table.equals(on_slurm.table)


def test_a_job_cancelled_by_someone_else_is_recorded_and_its_block_retried(tmp_path):
    out = tmp_path / "run"
    submitter = _submitter(out, blocks=1)
    _wait_for(lambda: _state(out), what="the job's submission")
    first = _state(out)[0]["job_id"]
    _wait_for(lambda: (ask_squeue([first])[0] or {}).get(first) is not None, what="Slurm to list the job")
    subprocess.run(["scancel", first], check=True)
    output, _ = submitter.communicate(timeout=300)
    assert submitter.returncode == 0, output
    attempts = _state(out)
    assert [a["job_id"] for a in attempts][0] == first and len(attempts) == 2
    assert attempts[0]["state"] == "CANCELLED" and "CANCELLED" in attempts[0]["reason"]
    assert not attempts[0]["cancelled_by_run"]
    assert attempts[1]["state"] == "MERGED"
    results = wb.load_results(out)
    assert results.complete and {u["status"] for u in results.record["units"]} == {"ok"}
    assert results.blocks.slurm_job_id.tolist() == [attempts[1]["job_id"]]


def test_a_failing_job_is_retried_then_its_block_is_recorded_as_failed_with_slurms_reason(
    tmp_path, monkeypatch
):
    """A model from a module the nodes cannot import (a common first mistake on a cluster): the
    job fails before its block starts, is submitted again, then its arms are recorded as failed
    with Slurm's state and the end of the job's log, and the call still returns."""
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the jobs cannot import tests/slurm_models.py
    sys.path.insert(0, str(TESTS))
    from slurm_models import dataset, slowed_in_one_job

    out = tmp_path / "run"
    settings = {**SMALL, "blocks": 1, "slurm": {"retries": 1}}
    results = wb.ablate(slowed_in_one_job, data=dataset(), techniques={}, out=out, **settings)
    attempts = _state(out)
    assert [a["state"] for a in attempts] == ["FAILED", "FAILED"], attempts
    assert "exit code 1:0" in attempts[-1]["reason"] and "slurm_models" in attempts[-1]["reason"]
    units = results.record["units"]
    assert {u["status"] for u in units} == {"failed"} and len(units) == 2
    assert "its Slurm job failed 2 times" in units[0]["reason"] and "FAILED" in units[0]["reason"]
    assert results.complete, "a block given up on is recorded, and the run ends"


def test_resume_after_the_submitter_was_killed_submits_only_the_blocks_not_done(tmp_path):
    out = tmp_path / "run"
    submitter = _submitter(out)
    _wait_for(lambda: len(_state(out)) == 2, what="both blocks' submissions")
    submitter.send_signal(signal.SIGKILL)  # no chance to clean up: its jobs go on without it
    submitter.wait(timeout=30)
    block0, block1 = _state(out)
    subprocess.run(["scancel", block1["job_id"]], check=True)  # block 1's job is lost meanwhile
    _wait_for(lambda: _no_jobs_left(out), what="block 0's job to end")
    results = wb.ablate("mlp", techniques={}, out=out, **SMALL)  # the same call again: resume
    attempts = _state(out)
    assert [a["block"] for a in attempts] == [0, 1, 1], "block 0 was done; only block 1 runs again"
    assert attempts[0]["job_id"] == block0["job_id"] and attempts[0]["state"] == "MERGED"
    assert attempts[1]["state"] == "CANCELLED" and attempts[2]["state"] == "MERGED"
    assert results.complete and sorted(results.blocks.block) == [0, 1]
    assert {u["status"] for u in results.record["units"]} == {"ok"}


@pytest.mark.timing
def test_a_slow_node_cancels_in_the_speedups_and_is_warned_about(tmp_path, monkeypatch):
    """One block runs on a 'slow node' (its model sleeps in every step): both of its arms slow
    down alike, so the control's speedup stays near 1, which a split by arm would not give."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("WORKBENCH_TEST_SLOW_FLAG", str(tmp_path / "slow-job"))
    sys.path.insert(0, str(TESTS))
    from slurm_models import dataset, slowed_in_one_job

    results = wb.ablate(slowed_in_one_job, data=dataset(), techniques={}, out=tmp_path / "run", **SMALL)
    speeds = {(u["block"], u["arm"]): u["result"]["samples_per_s"] for u in results.record["units"]}
    slowed = int(
        (tmp_path / "slow-job").read_text() == results.blocks.slurm_job_id[results.blocks.block == 1].item()
    )
    fast = 1 - slowed
    assert speeds[(fast, "baseline")] > 2 * speeds[(slowed, "baseline")], "one block was meant to be slow"
    control = results.table.set_index("arm").loc["baseline (control)"]
    # Within 25%, not 10%: the fast block times only about 150 ms per arm, which the other xdist
    # worker's load moved by 12%; a split by arm would be off by the slow node's factor, over 2.
    assert abs(math.log(control.speedup)) < 0.22, f"blocking should cancel the slow node: {control.speedup}"
    naive = speeds[(fast, "baseline (control)")] / speeds[(slowed, "baseline")]  # arm by node: biased
    assert naive > 2
    warnings = " ".join(results.warnings())
    assert "very different speeds" in warnings and f"block {slowed + 1}" in warnings


def test_ctrl_c_cancels_this_runs_jobs_and_no_others(tmp_path):
    other = subprocess.run(
        ["sbatch", "--parsable", "--begin=now+1hour", "-o", "/dev/null", "--wrap", "true"],
        capture_output=True, text=True, check=True,
    ).stdout.strip().split(";")[0]  # fmt: skip
    out = tmp_path / "run"
    submitter = _submitter(out)
    try:
        _wait_for(lambda: len(_state(out)) == 2, what="both blocks' submissions")
        submitter.send_signal(signal.SIGINT)
        output, _ = submitter.communicate(timeout=120)
        attempts = _state(out)
        assert all(a["state"] in ("CANCELLED", "MERGED") for a in attempts), attempts
        assert any(a["cancelled_by_run"] for a in attempts), output
        mine = ask_squeue([a["job_id"] for a in attempts])[0] or {}
        assert not any(s.state in ("PENDING", "RUNNING") for s in mine.values())
        assert ask_squeue([other])[0][other].state == "PENDING", "someone else's job must be left alone"
    finally:
        subprocess.run(["scancel", other], check=False)
        if submitter.poll() is None:
            submitter.kill()


def test_the_job_folder_is_workbenchs_to_clear_and_never_foreign(tmp_path, amp_on_slurm):
    """submitit's files (scripts, pickles, logs) are owned as a tree: overwrite removes them,
    and they never count as the user's files. On a copy of the shared two-block run's folder
    (every path in its manifests is relative), so that clearing it leaves the original to the
    tests that read it, in whatever order they run."""
    out = tmp_path / "run"
    shutil.copytree(amp_on_slurm[1], out, symlinks=True)
    assert any((out / "slurm" / "jobs").iterdir())
    from workbench.results_folder import ResultsFolder

    assert ResultsFolder(out).foreign_files() == []
    (out / "mine.txt").write_text("the user's")
    with pytest.raises(ValueError, match="mine.txt"):
        ResultsFolder(out).clear()
    (out / "mine.txt").unlink()
    ResultsFolder(out).clear()
    assert not (out / "slurm").exists()


def test_a_ddp_arm_starts_its_ranks_inside_its_job(tmp_path):
    """world_size=2 on CPU: the job runs both gloo ranks of every arm on its node."""
    results = wb.ablate(
        "mlp", techniques={"ddp_compression": {"hook": "fp16"}}, out=tmp_path / "run",
        **{**SMALL, "blocks": 1, "world_size": 2, "control": False},
    )  # fmt: skip
    rows = results.table.set_index("arm")
    assert list(rows.status) == ["ok", "ok"], results.summary()
    assert rows.loc["ddp_compression", "comm_mb_per_step"] > 0  # the ranks communicated


def test_the_panels_stop_cancels_this_runs_jobs(tmp_path):
    import threading

    stop = threading.Event()
    out = tmp_path / "run"
    done = {}
    runner = threading.Thread(
        target=lambda: done.update(results=wb.ablate("mlp", techniques={}, out=out, stop=stop, **SMALL))
    )
    runner.start()
    _wait_for(lambda: len(_state(out)) == 2, what="both blocks' submissions")
    stop.set()
    runner.join(timeout=120)
    assert not runner.is_alive() and not done["results"].complete
    attempts = _state(out)
    assert all(a["state"] in ("CANCELLED", "MERGED") for a in attempts) and any(
        a["cancelled_by_run"] for a in attempts
    )


def test_tune_runs_its_rounds_as_slurm_jobs(tmp_path, monkeypatch):
    """What is checked is the first round's job, so the search is stopped as its second round
    starts (that round's jobs are cancelled at once) instead of running on until its budget is
    spent. A smaller budget_s cannot end it there: the tuner refuses a budget below its
    calibration plus a screening round and a two-block final, 3.5 to 6 times its calibration
    job's wall time (the earlier 45 s was refused on a busy 2-core machine). With the stop, the
    budget only has to pass that check: a larger one adds blocks to the second round, which are
    cancelled before they run, and does not lengthen the test."""
    import threading

    # amp on a CPU can come out clearly slower than the baseline, which ends a search after its
    # screening (judged here, in the submitting process): this test is of the second round's price.
    monkeypatch.setattr("workbench.tuner._clearly_below_the_baseline", lambda figures: False)
    out = tmp_path / "tune"
    stop = threading.Event()
    round_starts: list[tuple[float, dict]] = []

    def after_the_first_round(event: dict) -> None:
        if event["type"] == "tune_round":
            round_starts.append((time.monotonic(), event))
            if event["round"] >= 2:  # rounds are numbered from 1
                stop.set()

    budget_s = 120
    wb.tune(
        "mlp", techniques=["amp"], budget_s=budget_s, out=out, on_event=after_the_first_round, stop=stop,
        **{k: v for k, v in SMALL.items() if k != "blocks"},
    )  # fmt: skip
    rounds = sorted(out.glob("round-*"))
    assert rounds, "the tuner ran no round"
    attempts = _state(rounds[0])
    assert attempts and attempts[0]["state"] == "MERGED", attempts
    # The second round is planned at what a job cost in the first (it was 286 blocks planned at
    # 0.2 s each, the arms' own time, where each job took 6 s: about 25 minutes for a 2-minute budget).
    (first_at, first), (second_at, second) = round_starts[:2]
    per_block_s = (second_at - first_at) / first["blocks"]
    assert second["blocks"] * per_block_s <= budget_s, (second, per_block_s)


def test_your_own_code_from_the_command_line_is_imported_in_the_job(tmp_path):
    """--model/--optimizer module:attribute through Slurm: the job unpickles the factories by
    reference, so it must import the user's module from the folder the command ran in, as the
    console script (whose sys.path lacks that folder) did."""
    from helpers import OWN_JOB

    (tmp_path / "own_job_slurm.py").write_text(OWN_JOB)
    console_script = Path(sys.executable).with_name("workbench")
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [str(console_script), "ablate", "--model", "own_job_slurm:build", "--optimizer", "own_job_slurm:sgd",
         "--data", "own_job_slurm:batches", "--steps", "6", "--warmup", "1", "--blocks", "1", "--executor", "slurm", "--out", "run", "--no-progress"],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "results.json").read_text())
    assert {unit["status"] for unit in record["units"]} == {"ok"}
    assert record["blocks"][0]["slurm_job_id"], "the block ran as a Slurm job"
    named = ("model", "data", "optimizer")
    assert [record["config"][key] for key in named] == [
        "own_job_slurm:build",
        "own_job_slurm:batches",
        "own_job_slurm:sgd",
    ]
