"""executor="slurm" without a cluster: its options, its errors, and what each job asks sbatch for."""

import argparse

import pytest

import workbench as wb
from workbench.cli import _parser, run_settings
from workbench.config import RunConfig, SlurmOptions, as_slurm


def test_slurm_options_from_a_dict_text_and_the_cli_are_one_value():
    given = {"partition": "gpu,debug", "account": "lab", "time_min": 30, "gpus_per_job": 1,
             "cpus_per_job": 8, "constraint": "h100|a100", "extra": "--exclusive --qos=high", "retries": 1}  # fmt: skip
    options = as_slurm(given)
    assert as_slurm(options.as_text()) == options, options.as_text()
    assert RunConfig(**RunConfig(executor="slurm", slurm=given).to_json()).slurm == options
    flags = [f"--slurm-{k.replace('_', '-')}={v}" for k, v in given.items()]
    args = _parser().parse_args(["ablate", "--executor", "slurm", *flags])
    assert RunConfig(**run_settings(args)).slurm == options
    assert options.sbatch_extra() == {"exclusive": True, "qos": "high"}


@pytest.mark.parametrize(
    ("slurm", "message"),
    [
        ({"partiton": "gpu"}, "unknown slurm option 'partiton'.*did you mean 'partition'"),
        ({"time_min": 0}, "time_min must be >= 1"),
        ({"retries": "many"}, "retries must be an integer"),
        ({"gpus_per_job": -1}, "gpus_per_job must be >= 0"),
        ({"extra": "-N 2"}, "extra takes long sbatch options"),
        ({"extra": "--comment='unclosed"}, "extra cannot be read"),
        ("gpu", "write it as key=value"),
        (5, "slurm must be None, a dict"),
    ],
)
def test_bad_slurm_options_say_what_is_valid(slurm, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(executor="slurm", slurm=slurm)


def test_slurm_options_without_the_slurm_executor_are_refused():
    with pytest.raises(ValueError, match="need executor='slurm'"):
        RunConfig(slurm={"partition": "gpu"})
    with pytest.raises(ValueError, match="unknown executor 'kubernetes'; valid executors: local, slurm"):
        RunConfig(executor="kubernetes")


def test_without_submitit_the_error_names_the_install_line(monkeypatch):
    import workbench.slurm as slurm

    monkeypatch.setattr(slurm, "missing", lambda module, install: f"{module} is not installed ({install})")
    with pytest.raises(ValueError, match=r"submitit.*pip install -e \.\[cluster\]"):
        wb.plan("mlp", executor="slurm")


def test_without_sbatch_the_error_says_where_to_run(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="sbatch.*login node"):
        wb.plan("mlp", executor="slurm")


def test_each_job_asks_for_one_node_the_run_s_gpus_and_the_options(tmp_path):
    """What sbatch reads: one node, one task; a DDP arm of 2 ranks on CUDA asks for 2 GPUs."""
    pytest.importorskip("submitit")
    from workbench.results_folder import ResultsFolder
    from workbench.slurm import SlurmBlocks

    options = SlurmOptions(partition="debug", account="lab", time_min=7, cpus_per_job=3, extra="--exclusive")
    blocks = SlurmBlocks(options, 2, ResultsFolder(tmp_path), [], None, None, None, None, None, None)
    script = blocks._make_executor()._make_submission_file_text("true", "0")
    for line in ("--gpus-per-node=2", "--partition=debug", "--account=lab", "--time=7", "--nodes=1",
                 "--ntasks-per-node=1", "--cpus-per-task=3", "--exclusive"):  # fmt: skip
        assert f"#SBATCH {line}" in script, f"{line} missing from:\n{script}"
    assert (tmp_path / "slurm").stat().st_mode & 0o077 == 0, "the job folder holds pickles: private"


def test_the_reproduce_command_spells_the_slurm_flags():
    from workbench.report import reproduce

    config = {
        "model": "mlp",
        "data": "digits",
        "techniques": {},
        **RunConfig(executor="slurm", slurm={"partition": "gpu", "time_min": 30}).to_json(),
    }
    shell, python = reproduce({"config": config, "arms": []})
    assert "--executor slurm --slurm-partition gpu --slurm-time-min 30" in shell
    args = _parser().parse_args(shell.split()[1:])
    assert isinstance(args, argparse.Namespace) and RunConfig(**run_settings(args)).slurm.partition == "gpu"


def test_the_status_line_counts_slurm_blocks_done_running_and_pending():
    from workbench.live_run import LiveRun, progress_line

    live = LiveRun()
    live({"type": "plan", "arms": [], "blocks": 3, "processes": 3, "remaining": 3})
    live({"type": "slurm", "done": 1, "running": 1, "pending": 1, "jobs": []})
    assert "Slurm blocks: 1 done, 1 running, 1 pending" in progress_line(live.snapshot())


def test_a_job_asks_for_one_gpu_per_rank_on_cuda_and_none_on_cpu():
    from workbench.slurm import job_gpus

    assert job_gpus(SlurmOptions(), 4, "cuda:0") == 4  # a DDP arm's ranks, inside one job
    assert job_gpus(SlurmOptions(), 1, "cuda") == 1
    assert job_gpus(SlurmOptions(), 2, "cpu") == 0  # gloo ranks on the node's cores
    assert job_gpus(SlurmOptions(gpus_per_job=8), 2, "cuda") == 8  # as set


def test_a_stop_during_a_long_submission_ends_it_and_cancels_what_was_submitted(tmp_path, monkeypatch):
    """A round of hundreds of blocks is submitted in one poll, at about 0.2 s a job: the panel's
    Stop must end it at the next job, not a minute later, after the last one."""
    pytest.importorskip("submitit")
    import threading

    import workbench.slurm
    from workbench.results_folder import ResultsFolder
    from workbench.slurm import SlurmBlocks

    stop, cancelled = threading.Event(), []
    blocks = SlurmBlocks(SlurmOptions(), 0, ResultsFolder(tmp_path), list(range(300)), None, None, None,
                         lambda event: None, stop, None)  # fmt: skip

    def submit(block: int) -> None:  # sbatch, without a cluster: the attempt as _submit records it
        blocks.attempts.append({"block": block, "job_id": str(1000 + block), "state": "SUBMITTED",
                                "ended": None, "attempt": 1})  # fmt: skip
        if len(blocks.attempts) == 3:
            stop.set()  # Stop pressed while the third job was submitted

    monkeypatch.setattr(blocks, "_submit", submit)
    monkeypatch.setattr(workbench.slurm, "ask_squeue", lambda ids: ({}, ""))
    monkeypatch.setattr(workbench.slurm, "cancel", lambda ids: cancelled.extend(ids))
    with pytest.raises(KeyboardInterrupt):
        blocks.run()
    assert len(blocks.attempts) == 3 and cancelled == ["1000", "1001", "1002"]
    assert all(a["cancelled_by_run"] for a in blocks.attempts)


def test_a_slurm_that_stops_answering_is_said_while_it_lasts_and_ends_the_run_leaving_its_jobs(
    tmp_path, monkeypatch
):
    """squeue failing (a controller down) made the run wait without a word, forever."""
    pytest.importorskip("submitit")
    import workbench.slurm
    from workbench.results_folder import ResultsFolder
    from workbench.slurm import SILENT_GIVE_UP_S, SILENT_REPEAT_S, SILENT_WARN_S, SlurmBlocks, SlurmSilent

    notes, cancelled, clock = [], [], [0.0]
    bar = type("Bar", (), {"note": lambda self, text: notes.append(text), "show": lambda self, text: None})()
    blocks = SlurmBlocks(SlurmOptions(), 0, ResultsFolder(tmp_path), [0], None, None, None,
                         lambda event: None, None, bar)  # fmt: skip
    blocks.attempts.append({"block": 0, "job_id": "1000", "state": "RUNNING", "reason": "", "node": "n1",
                            "ended": None, "attempt": 1, "folder": "slurm/b0-1"})  # fmt: skip
    answers = {"squeue": (None, "squeue: Unable to contact slurm controller (connect failure)")}
    monkeypatch.setattr(workbench.slurm, "ask_squeue", lambda ids: answers["squeue"])
    monkeypatch.setattr(workbench.slurm, "cancel", lambda ids: cancelled.extend(ids))
    monkeypatch.setattr(workbench.slurm.time, "monotonic", lambda: clock[0])
    for clock[0] in (0.0, SILENT_WARN_S - 1):
        blocks._poll()
    assert notes == []  # a poll or two unanswered is no news
    for clock[0] in (SILENT_WARN_S, SILENT_WARN_S + 10, SILENT_WARN_S + SILENT_REPEAT_S):
        blocks._poll()
    assert len(notes) == 2 and "has not answered for 60 s (squeue: Unable to contact slurm" in notes[0]
    answers["squeue"] = ({"1000": workbench.slurm.JobState("RUNNING", "", "n1")}, "")
    blocks._poll()
    assert notes[-1].startswith("slurm: squeue answers again")
    answers["squeue"] = (None, "squeue took more than 60 s")
    clock[0] += 1
    blocks._poll()
    clock[0] += SILENT_GIVE_UP_S
    with pytest.raises(SlurmSilent, match=r"has not answered for 30 min .*run the same command again"):
        blocks.run()
    assert cancelled == [] and blocks.attempts[0]["ended"] is None  # left for the rerun to follow


def test_a_submission_sbatch_refuses_is_one_line_naming_its_complaint(tmp_path, monkeypatch):
    """submitit raises its FailedJobError with sbatch's output in several lines: the run says
    sbatch's complaint, for the block it was submitting, as bad input (nothing ran)."""
    pytest.importorskip("submitit")
    from submitit.core.utils import FailedJobError

    from workbench.results_folder import ResultsFolder
    from workbench.slurm import SlurmBlocks

    blocks = SlurmBlocks(SlurmOptions(partition="gpuu"), 0, ResultsFolder(tmp_path), [0], None, None, None,
                         lambda event: None, None, None)  # fmt: skip
    executor = blocks._make_executor()

    def refuse(*args, **kwargs):
        raise FailedJobError(
            "Job submission failed.\nsbatch: error: invalid partition specified: gpuu\n"
            "sbatch: error: Batch job submission failed: Invalid partition name specified"
        )

    monkeypatch.setattr(executor, "submit", refuse)
    blocks.executor = executor
    with pytest.raises(ValueError) as caught:
        blocks._submit(0)
    assert str(caught.value) == (
        "slurm: sbatch refused block 1's job: invalid partition specified: gpuu; "
        "Batch job submission failed: Invalid partition name specified"
    )
