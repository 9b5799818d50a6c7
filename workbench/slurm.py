"""Blocks as Slurm jobs, through submitit: ``ablate(..., executor="slurm")`` (and ``tune``).

Why one block per job. Two nodes of one cluster differ by several percent in speed, more when
they are of different kinds. A split by arm (arm A on node 1, arm B on node 2) would measure
the nodes. A block already holds every arm, side by side in one process, and each speedup is
computed inside its block (workbench.stats), so a job that runs one whole block on one node
lets the node's speed cancel in every ratio: the node is a blocking factor, like a process.

How a block travels.
  * The submitting process (ablate's, here) submits one job per block that is not done yet,
    with ``submitit.SlurmExecutor``; its files (the pickled function and arguments, sbatch
    scripts, logs) go to ``out/slurm/jobs``.
  * The job runs ``run_block`` (ablation's ``run_slurm_block``): an ordinary local ablation of
    that one block, with its own warm template and worker processes, into a folder of its own
    inside the results folder, ``out/slurm/b{block}-a{attempt}`` (on the filesystem the nodes
    share with the submitting machine, as Slurm users expect).
  * When that folder's results say they are complete, ``merge`` copies its processes' records
    into the run's ``units/``, exactly like a local block's, so the progress bar, the panel,
    ``Results`` and ``resume`` see a block arrive. Results travel only as those JSON files:
    submitit's pickles are its transport, and its result pickle is never read.

Failures. A job that ends without complete results (failed, out of time, preempted, cancelled
by someone else, its node lost) is recorded in ``out/slurm/state.json`` with Slurm's state and
reason and the end of its log, and its block is submitted again, into a fresh attempt folder,
up to ``retries`` times; the failed attempt's folder stays on disk (its partial measurements
came from a node that did not finish the block, so they are not mixed into the results).
Past the retries the block's arms are recorded as failed, with the reason, and the rest goes on.

Resume. ``state.json`` is rewritten at every change, so a rerun with the same ``out`` (even
after the submitting process was killed) merges the attempts that completed meanwhile,
follows the jobs that still run, and submits only the blocks that have neither.

Stop. Ctrl-C, or the panel's Stop, cancels (``scancel``) the jobs this run submitted that have
not ended, by their job IDs, and no others. Those cancellations do not count as retries.

Safety. ``out/slurm`` is created private to the user (mode 0700): it holds pickles, and a
pickle is code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.config import SlurmOptions
from workbench.optional import install_hint, missing
from workbench.progress import Progress
from workbench.results_folder import ResultsFolder, write_json_atomic
from workbench.telemetry import usable_cores

POLL_S = 2.0  # how often the submitting process asks Slurm about its jobs
SLURM_TIMEOUT_S = 60.0  # one squeue / scontrol / scancel call; a slow controller is waited for
VANISHED_AFTER = 3  # polls before a job Slurm forgot, or one completed without its results, counts as ended
# squeue silent (a controller down or unreachable): said after SILENT_WARN_S, again every
# SILENT_REPEAT_S, and the run ends after SILENT_GIVE_UP_S, leaving its jobs for a rerun to follow.
SILENT_WARN_S, SILENT_REPEAT_S, SILENT_GIVE_UP_S = 60.0, 300.0, 1800.0


class SlurmSilent(ValueError):
    """Slurm did not answer for SILENT_GIVE_UP_S: the run ends, and its jobs are left to a rerun."""


LIVE = frozenset(
    "PENDING CONFIGURING RUNNING COMPLETING REQUEUED REQUEUE_HOLD REQUEUE_FED RESIZING SUSPENDED "
    "STOPPED SIGNALING STAGE_OUT RESV_DEL_HOLD".split()
)
FOLDER = "slurm"


def attempt_folder(block: int, attempt: int) -> str:
    """Where a block's attempt writes its local run, relative to the results folder."""
    return f"{FOLDER}/b{block}-a{attempt}"


def job_gpus(options: SlurmOptions, world_size: int, device: str) -> int:
    """GPUs each job asks for: as set, or (auto) one per rank on CUDA, so that a DDP arm starts
    its ranks inside its job, on one node, as torchrun would; none on CPU."""
    if options.gpus_per_job is not None:
        return options.gpus_per_job
    return world_size if device.startswith("cuda") else 0


def check_cluster() -> None:
    """One clear error when this machine cannot submit Slurm jobs (before anything starts)."""
    reason = missing("submitit", install_hint("submitit"))
    if reason:
        raise ValueError(f"executor='slurm' submits through submitit, which is missing: {reason}")
    for command in ("sbatch", "squeue", "scancel"):
        if shutil.which(command) is None:
            raise ValueError(
                f"executor='slurm' needs Slurm's {command}, which is not on this machine's PATH: run from a "
                "machine that can submit jobs (a login node), or use executor='local'"
            )


@dataclass
class JobState:
    state: str  # Slurm's: PENDING, RUNNING, COMPLETED, FAILED, TIMEOUT, PREEMPTED, CANCELLED, ...
    reason: str  # squeue's %r: why pending, or why it ended (NonZeroExitCode, ...)
    node: str


def ask_squeue(job_ids: list[str]) -> tuple[dict[str, JobState] | None, str]:
    """What Slurm says about these jobs now (a job it has forgotten is absent), and ""; or, when
    Slurm did not answer, None and why, in squeue's own words."""
    if not job_ids:
        return {}, ""
    try:
        answer = subprocess.run(
            ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%T|%r|%N"],
            capture_output=True,
            text=True,
            timeout=SLURM_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return None, f"squeue took more than {SLURM_TIMEOUT_S:.0f} s"
    except OSError as error:
        return None, f"squeue could not run: {error.strerror or error}"
    if answer.returncode != 0:
        # squeue refuses a list in which it knows no job at all: every one of them is forgotten.
        if "Invalid job id" in answer.stderr:
            return {}, ""
        said = " ".join(answer.stderr.split())[:200] or f"exit status {answer.returncode}"
        return None, f"squeue: {said}"
    states = {}
    for line in answer.stdout.splitlines():
        job_id, state, reason, node = (line.split("|") + ["", "", ""])[:4]
        states[job_id.strip()] = JobState(
            state.strip().split()[0] if state.strip() else "", reason.strip(), node.strip()
        )
    return states, ""


def exit_code(job_id: str) -> str:
    """The job's exit code as scontrol says it (``1:0``: exit status 1, no signal), or ""."""
    try:
        answer = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                                timeout=SLURM_TIMEOUT_S)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    for word in answer.stdout.split():
        if word.startswith("ExitCode="):
            return word.partition("=")[2]
    return ""


def cancel(job_ids: list[str]) -> None:
    """scancel exactly these jobs (this run's), never a user's or a partition's."""
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=SLURM_TIMEOUT_S, check=False)


def _log_tail(path: Path, lines: int = 4) -> str:
    """The last lines of a job's log worth reading (a traceback's last frames and its error),
    joined by " | "; Python's ^^^^ markers under a line are left out."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    kept = [line.strip() for line in text if line.strip() and set(line.strip()) - set("^~")]
    return " | ".join(kept[-lines:])


def complete_results(folder: Path) -> bool:
    """Whether the attempt folder holds a finished local run (its results.json says complete)."""
    try:
        return bool(json.loads((folder / "results.json").read_text()).get("complete"))
    except (OSError, ValueError, AttributeError):
        return False


class SlurmBlocks:
    """Submits a run's blocks as Slurm jobs, follows them, retries them, and merges each one
    that completes (see the module docstring).

    ``run_block(folder, block)`` is what each job runs (ablation's local run of one block),
    ``merge(block, folder, attempt)`` takes a completed attempt's records into the run, and
    ``give_up(block, reason)`` records the block's arms as failed.
    """

    def __init__(
        self,
        options: SlurmOptions,
        gpus: int,
        files: ResultsFolder,
        blocks: list[int],
        run_block: Callable[[str, int], Any],
        merge: Callable[[int, Path, dict], None],
        give_up: Callable[[int, str], None],
        on_event: Callable[[dict], None],
        stop: threading.Event | None,
        bar: Progress,
    ):
        self.options, self.gpus, self.files = options, gpus, files
        self.todo = list(blocks)  # blocks not merged yet
        self.run_block, self.merge, self.give_up = run_block, merge, give_up
        self.on_event, self.stop, self.bar = on_event, stop, bar
        self.root = files.path / FOLDER
        self.root.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)  # mkdir's mode passes through the umask; this does not
        self.state_file = files.file(f"{FOLDER}/state.json")
        self.attempts: list[dict] = self._read_state()
        self.unseen: dict[str, int] = {}  # job ID -> polls in a row that Slurm did not know it
        self.silent_since: float | None = None  # since when squeue has not answered (time.monotonic)
        self.silence_said_at: float | None = None
        self.executor = None

    # --- state ------------------------------------------------------------------------------

    def _read_state(self) -> list[dict]:
        try:
            return json.loads(self.state_file.read_text())["attempts"]
        except FileNotFoundError:
            return []
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"{self.state_file} is unreadable ({error}); pass overwrite=True to start afresh"
            ) from None

    def _save_state(self) -> None:
        write_json_atomic(self.state_file, {"attempts": self.attempts})

    def _latest(self, block: int) -> dict | None:
        mine = [a for a in self.attempts if a["block"] == block]
        return mine[-1] if mine else None

    def _counted(self, block: int) -> int:
        """Attempts that count against ``retries``: not the ones this run cancelled itself."""
        return sum(1 for a in self.attempts if a["block"] == block and not a.get("cancelled_by_run"))

    # --- submitting -------------------------------------------------------------------------

    def _make_executor(self):
        import submitit

        jobs = self.root / "jobs"
        jobs.mkdir(mode=0o700, exist_ok=True)
        self.files.tree(f"{FOLDER}/jobs")  # submitit's files: all of them workbench's
        # max_num_timeout=0: a job out of time is not requeued by submitit; it is retried here,
        # as a fresh attempt, and counted.
        executor = submitit.SlurmExecutor(folder=jobs, max_num_timeout=0)
        options = self.options
        parameters: dict[str, Any] = {
            "time": options.time_min,
            "nodes": 1,
            "ntasks_per_node": 1,  # the job starts the block's processes (and a DDP arm's ranks) itself
            "cpus_per_task": options.cpus_per_job or usable_cores(),
            "additional_parameters": options.sbatch_extra(),
        }
        if self.gpus:
            parameters["gpus_per_node"] = self.gpus
        for name in ("partition", "account", "constraint"):
            if getattr(options, name):
                parameters[name] = getattr(options, name)
        executor.update_parameters(**parameters)
        return executor

    def _submit(self, block: int) -> None:
        if self.executor is None:
            self.executor = self._make_executor()
        number = 1 + sum(1 for a in self.attempts if a["block"] == block)
        relative = attempt_folder(block, number)
        # Absolute: out may be relative (--out run), the job's working folder need not be this
        # one (sbatch --chdir), and submitit gives its log paths absolute.
        folder = self.files.nest(relative).resolve()
        self.executor.update_parameters(job_name=f"workbench-b{block}")
        try:
            job = self.executor.submit(self.run_block, str(folder), block)
        except Exception as error:  # submitit's FailedJobError: sbatch said no (a partition, a limit)
            raise ValueError(
                f"slurm: sbatch refused block {block + 1}'s job: {_first_error_line(error)}"
            ) from None
        attempt = {
            "block": block,
            "attempt": number,
            "job_id": str(job.job_id),
            "folder": relative,
            "log": str(job.paths.stderr.resolve().relative_to(self.files.path.resolve())),
            "state": "SUBMITTED",
            "reason": "",
            "node": "",
            "submitted": time.time(),
            "ended": None,
            "cancelled_by_run": False,
        }
        self.attempts.append(attempt)
        self._save_state()

    # --- following --------------------------------------------------------------------------

    def run(self) -> None:
        """Until every block is merged or given up; on Ctrl-C or stop, cancel this run's jobs and re-raise."""
        stop = self.stop or threading.Event()  # never set: only Ctrl-C ends the wait
        try:
            self._poll()  # first what an earlier, interrupted run left: merged, running or ended
            while self.todo:
                if stop.wait(POLL_S):
                    raise KeyboardInterrupt
                self._poll()
        except SlurmSilent:  # scancel would go unheard too: the jobs are left for a rerun to follow
            raise
        except BaseException:
            self._cancel_own()
            raise

    def _poll(self) -> None:
        live = [a["job_id"] for a in self.attempts if a["block"] in self.todo and a["ended"] is None]
        states, why = ask_squeue(live)
        self._heard(states is not None, why)
        for block in list(self.todo):
            # A poll can submit hundreds of jobs (sbatch takes about 0.2 s each): a Stop pressed
            # meanwhile ends it here, not after the last submission.
            if self.stop is not None and self.stop.is_set():
                raise KeyboardInterrupt
            attempt = self._latest(block)
            if attempt is None:
                self._submit(block)
            elif complete_results(self.files.path / attempt["folder"]):
                self._merged(block, attempt)
            elif attempt["ended"] is None and states is not None:
                self._follow(block, attempt, states.get(attempt["job_id"]))
            elif attempt["ended"] is not None:
                self._retry_or_give_up(block, attempt)
        self._report()

    def _heard(self, answered: bool, why: str) -> None:
        """Whether Slurm answered this poll. A silence is said while it lasts, with squeue's own
        words (the run would otherwise wait without a word), and ends the run after SILENT_GIVE_UP_S."""
        now = time.monotonic()
        if answered:
            if self.silence_said_at is not None:
                self.bar.note("slurm: squeue answers again; following this run's jobs")
            self.silent_since = self.silence_said_at = None
            return
        if self.silent_since is None:
            self.silent_since = now
        silent_s = now - self.silent_since
        if silent_s >= SILENT_GIVE_UP_S:
            raise SlurmSilent(
                f"slurm: squeue has not answered for {silent_s / 60:.0f} min ({why}); this run's jobs are "
                "left as they are: run the same command again once Slurm answers, to follow them and resume"
            )
        if silent_s >= SILENT_WARN_S and (
            self.silence_said_at is None or now - self.silence_said_at >= SILENT_REPEAT_S
        ):
            self.silence_said_at = now
            self.bar.note(
                f"slurm: squeue has not answered for {silent_s:.0f} s ({why}); still waiting, for up to "
                f"{SILENT_GIVE_UP_S / 60:.0f} min. Ctrl-C cancels this run's jobs; the same command resumes"
            )

    def _follow(self, block: int, attempt: dict, seen: JobState | None) -> None:
        if seen is None:  # Slurm forgot the job (it ended a while ago), or has not listed it yet
            self.unseen[attempt["job_id"]] = self.unseen.get(attempt["job_id"], 0) + 1
            if self.unseen[attempt["job_id"]] < VANISHED_AFTER:
                return
            seen = JobState("ENDED", "Slurm no longer knows the job", attempt["node"])
        self.unseen.pop(attempt["job_id"], None)
        if (seen.state, seen.node) != (attempt["state"], attempt["node"]):
            attempt.update(state=seen.state, node=seen.node or attempt["node"])
            self._save_state()
        if seen.state in LIVE:
            if seen.state == "PENDING":
                attempt["reason"] = seen.reason
            return
        # Ended. COMPLETED with complete results was merged above. On a network filesystem the
        # job's last writes can reach this machine a little after Slurm says it completed, so
        # a completed job without complete results is looked at for a few more polls first.
        if seen.state == "COMPLETED" and not self._waited_for_files(attempt):
            return
        code = exit_code(attempt["job_id"])
        why = seen.state + (f" ({seen.reason})" if seen.reason not in ("", "None") else "")
        why += f", exit code {code}" if code and code != "0:0" else ""
        tail = _log_tail(self.files.path / attempt["log"])
        if seen.state == "COMPLETED":
            why = "COMPLETED without complete results"
        attempt.update(ended=time.time(), reason=why + (f"; its log ends: {tail}" if tail else ""))
        self._save_state()
        self._retry_or_give_up(block, attempt)

    def _waited_for_files(self, attempt: dict) -> bool:
        key = f"{attempt['job_id']}:files"
        self.unseen[key] = self.unseen.get(key, 0) + 1
        return self.unseen[key] >= VANISHED_AFTER

    def _retry_or_give_up(self, block: int, attempt: dict) -> None:
        if self._counted(block) <= self.options.retries:
            self.on_event(
                {
                    "type": "slurm_retry",
                    "block": block,
                    "job_id": attempt["job_id"],
                    "reason": attempt["reason"],
                }
            )
            self._submit(block)
        else:
            self.todo.remove(block)
            self.give_up(
                block, f"its Slurm job failed {self._counted(block)} times; the last: {attempt['reason']}"
            )
            self.bar.advance()

    def _merged(self, block: int, attempt: dict) -> None:
        if attempt["ended"] is None:
            attempt["ended"] = time.time()
        attempt.update(state="MERGED", reason="")
        self._save_state()
        self.todo.remove(block)
        self.merge(block, self.files.path / attempt["folder"], attempt)
        self.bar.advance()

    def _report(self) -> None:
        """Blocks done, running and pending: on the bar and as an event for the panel."""
        latest = [self._latest(block) for block in self.todo]
        running = sum(
            1 for a in latest if a is not None and a["state"] in ("RUNNING", "COMPLETING", "CONFIGURING")
        )
        pending = len(self.todo) - running
        done = sum(1 for a in self.attempts if a["state"] == "MERGED")
        jobs = ", ".join(  # a pending job's reason too: ReqNodeNotAvail is no ordinary queue
            f"b{a['block']}: {a['job_id']} {a['state'].lower()}"
            + (f" ({a['reason']})" if a["state"] == "PENDING" and a.get("reason") else "")
            for a in latest
            if a is not None
        )
        self.bar.show(f"Slurm: {done} done, {running} running, {pending} pending ({jobs})")
        self.on_event({"type": "slurm", "done": done, "running": running, "pending": pending,
                       "jobs": [dict(a) for a in latest if a is not None]})  # fmt: skip

    def _cancel_own(self) -> None:
        """scancel this run's jobs that have not ended (and only those); recorded as cancelled by the run."""
        own = [a for a in self.attempts if a["ended"] is None and a["state"] != "MERGED"]
        cancel([a["job_id"] for a in own])
        for attempt in own:
            attempt.update(state="CANCELLED", reason="cancelled by this run (Ctrl-C or Stop)", ended=time.time(),
                           cancelled_by_run=True)  # fmt: skip
        if own:
            self._save_state()


def _first_error_line(error: Exception) -> str:
    """sbatch's complaints from a submission error, in one line (submitit wraps them in several)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = [line.removeprefix("sbatch: error:").strip() for line in lines if "error" in line.lower()]
    return "; ".join(said) if said else (lines or [type(error).__name__])[-1]
