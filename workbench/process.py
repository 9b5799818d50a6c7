"""Run one block (a BlockSpec) in a fresh process (see workbench.worker) and collect its answer.

The process is started as ``python -m workbench.worker``, or forked from the run's warm
template (workbench.template), which has imported torch already; it is a new process either way.

The child runs in its own session (process group), so that a timeout, a Stop or Ctrl-C
can end it together with its DataLoader workers, leaving no orphans. A data-parallel block
runs as several rank processes, each leading its own session: a rank that raises or dies
ends the block within a few seconds, with a reason that names the rank. Its messages are
JSON lines; its log (stderr and prints) goes to a file whose tail explains a crash.

``timeout_s`` limits each arm, not the block: the worker says which arm it is working on
(every ``phase`` message names it), the time is added up per arm, and the arm that passes
the limit is named in the answer, so the caller can run the block again without it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from workbench.distributed import free_port
from workbench.template import ForkedWorker, WarmTemplate

KILL_GRACE_S = 3.0
POLL_S = 0.5
DEAD_RANK_GRACE_S = 5.0  # after a rank dies, how long the others get to report what they saw
RANK0_REPORT_S = 30.0  # after a rank exits cleanly, how long rank 0 may take to send the result
EXIT_GRACE_S = 30.0  # after the result arrives, how long the processes may take to exit


class Interrupted(Exception):
    """The run was stopped (Stop button or Ctrl-C) while a block was in flight."""


STARTUP_LIMIT_S = 900.0  # building and warming up one arm (the first step may compile for minutes)
MEASURE_MARGIN = 10.0  # the timed windows may take this many times what the warm-up predicts
MEASURE_FLOOR_S = 120.0  # ...and never less than this


class ArmTimer:
    """Time spent on each arm of a block, from the worker's messages; which arm is in flight.

    With ``timeout_s`` given, each arm gets that long in all. Without, the limit is derived:
    STARTUP_LIMIT_S for building and warming up, then, once the worker reports how long the
    timed windows should take (from the measured warm-up steps), that time x MEASURE_MARGIN,
    at least MEASURE_FLOOR_S, on top of what the arm has spent so far. A deadlocked arm is
    then ended after minutes, not the half hour a fixed limit would need to allow compilers.
    """

    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self.limits: dict[str | None, float] = {}
        self.predicted: dict[str, float] = {}  # what the warm-up predicted for each arm's timed steps
        self.spent: dict[str, float] = {}
        self.current: str | None = None
        self.since = time.monotonic()

    def switch(self, arm: str | None) -> None:
        now = time.monotonic()
        if self.current is not None:
            self.spent[self.current] = self.spent.get(self.current, 0.0) + now - self.since
        self.current, self.since = arm, now

    def expect(self, expected_s: dict[str, float]) -> None:
        """The worker's estimate of each arm's timed windows, in seconds, from its warm-up."""
        if self.timeout_s is not None:
            return
        self.switch(self.current)  # bring the spent times up to now
        for arm, seconds in expected_s.items():
            self.predicted[arm] = seconds
            self.limits[arm] = self.spent.get(arm, 0.0) + max(MEASURE_FLOOR_S, MEASURE_MARGIN * seconds)

    def limit(self, arm: str | None) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return self.limits.get(arm, STARTUP_LIMIT_S)

    def overdue(self) -> bool:
        """The arm in flight (or, before the first arm, the process's start) passed its limit."""
        spent = self.spent.get(self.current, 0.0) if self.current is not None else 0.0
        return spent + time.monotonic() - self.since > self.limit(self.current)

    def describe(self) -> str:
        limit = self.limit(self.current)
        if self.timeout_s is not None:
            return f"timed out after {limit:.0f} s (timeout_s)"
        if self.current in self.limits:
            predicted = self.predicted[self.current]
            if MEASURE_MARGIN * predicted < MEASURE_FLOOR_S:  # a hang in a fast arm: the floor ended it
                return (
                    f"timed out after {limit:.0f} s: its timed steps get at least {MEASURE_FLOOR_S:.0f} s, "
                    f"though its warm-up steps predicted {predicted:.2g} s for them "
                    "(pass timeout_s to set the limit yourself)"
                )
            return (
                f"timed out after {limit:.0f} s: {MEASURE_MARGIN:.0f}x what its warm-up steps predicted "
                "for its timed steps (pass timeout_s to set the limit yourself)"
            )
        return (
            f"timed out after {limit:.0f} s while starting or warming up "
            "(pass timeout_s to set the limit yourself)"
        )


def _serialize(spec) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps(spec)
    except Exception as error:
        raise ValueError(
            f"the model, data or loss function cannot be sent to the arm's process ({error}); "
            "pass a zero-argument callable that builds it instead of the object itself"
        ) from error


def _end_process_group(process: subprocess.Popen) -> None:
    """SIGTERM the child's whole process group; SIGKILL it if it has not exited in time."""
    _signal_group(process, signal.SIGTERM)
    try:
        process.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
        process.wait(timeout=KILL_GRACE_S)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _where_the_ranks_hung(processes: list[subprocess.Popen], reason: str) -> dict:
    """A timed-out arm of several ranks: ``reason`` with the ranks' logs that show where their threads
    were when they were ended (faulthandler writes each thread's stack on SIGTERM), and the top of
    those stacks; nothing to add where no log holds one.
    It said "the arm's process was ended", naming no rank and no log, while rank 1's log held the
    line where it hung."""
    dumps = {}
    for rank, process in enumerate(processes):
        try:
            lines = process.log_path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        starts = [i for i, line in enumerate(lines) if line.startswith("Current thread ")]
        if starts:  # the thread that took the signal: the main one, where the step runs
            dumps[rank] = "\n".join(lines[starts[-1] : starts[-1] + STACK_LINES])
    if not dumps:
        return {}
    logs = ", ".join(f"rank {rank}'s ({processes[rank].log_path.name})" for rank in dumps)
    return {  # every rank's: the one that hung is the one not waiting in backward for the others
        "reason": f"{reason}; where their threads were is in the logs of {logs}",
        "traceback": "\n".join(f"rank {rank}:\n{stack}" for rank, stack in dumps.items()),
    }


STACK_LINES = 12  # of a rank's stack, most recent call first: the user's line is near the top


def run_in_fresh_process(
    spec,
    *,
    log_path: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
    on_message: Callable[[dict], None] = lambda message: None,
    should_stop: Callable[[], bool] = lambda: False,
    world_size: int = 1,
    only_rank: tuple[int, int, str, int] | None = None,
    template: WarmTemplate | None = None,
) -> dict:
    """Run the BlockSpec ``spec`` in ``python -m workbench.worker``; return its result or error (a dict).

    With ``world_size`` N > 1 it starts N rank processes that form one process group on a free
    port of 127.0.0.1; rank 0's messages and result are the unit's. The returned dict has
    ``type`` ``"result"`` (the measurements) or ``"error"`` (with ``status`` ``failed`` or
    ``oom``, a one-line ``reason``, and ``arm``: the arm in flight, or None). Raises Interrupted when ``should_stop()`` turns true
    or on KeyboardInterrupt, after ending every rank.

    ``only_rank=(rank, local_rank, master_addr, master_port)`` starts just that rank, which
    meets the others (started by other parents, under torchrun) at the given address.
    With a ``template`` (workbench.template), each rank is forked from it instead of starting
    a new interpreter; everything else is the same.
    """
    payload = _serialize(spec)

    def run() -> dict:
        return _run_ranks(
            payload, log_path, timeout_s, env, on_message, should_stop, world_size, only_rank, template
        )

    answer = run()
    if (
        world_size > 1
        and only_rank is None
        and answer["type"] == "error"
        and "address already in use" in answer["reason"].lower()
    ):
        # Another program took the port between our probe and rank 0's bind: probe again, once.
        answer = run()
    return answer


# What torchrun (or another launcher) tells a process of its place in a process group.
RANK_VARIABLES = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
     "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME"}
)  # fmt: skip


def rank_log(log_path: Path, rank: int) -> Path:
    return log_path if rank == 0 else log_path.with_name(f"{log_path.stem}.rank{rank}{log_path.suffix}")


def _start_ranks(
    payload: bytes,
    log_path: Path,
    env: dict[str, str] | None,
    world_size: int,
    only_rank=None,
    template: WarmTemplate | None = None,
):
    header = json.dumps({"sys_path": sys.path}).encode() + b"\n"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # Under torchrun the parent's environment says to use torchrun's own store; a unit's ranks
    # form a fresh group of their own, so they must not inherit that. A one-rank process takes no
    # rank from its parent either: a job launcher's RANK/WORLD_SIZE/MASTER_* (a Kubeflow pod's,
    # without torchrun) made every arm a rank of a group that never formed, and hang or fail.
    inherited = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TORCHELASTIC_") and not (world_size == 1 and k in RANK_VARIABLES)
    }
    common = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
    ranks = [(rank, rank) for rank in range(world_size)]  # (global rank, local rank)
    if world_size > 1:
        address, port = "127.0.0.1", free_port()
        if only_rank is not None:
            rank, local_rank, address, port = only_rank
            ranks = [(rank, local_rank)]
        common.update(MASTER_ADDR=address, MASTER_PORT=str(port), WORLD_SIZE=str(world_size))
        if only_rank is None:
            common["LOCAL_WORLD_SIZE"] = str(world_size)
    processes: list[subprocess.Popen | ForkedWorker] = []
    for rank, local_rank in ranks:
        rank_env = {**common, "RANK": str(rank), "LOCAL_RANK": str(local_rank)} if world_size > 1 else common
        # Each rank leads its own session (a process group cannot span sessions), so that one
        # killpg per rank ends it together with its DataLoader workers.
        rank_log_path = rank_log(log_path, rank)
        if template is not None:  # forked from the run's warm template, in a session of its own
            process = template.spawn(rank_env, rank_log_path)
        else:
            with open(rank_log_path, "wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", "workbench.worker"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=rank_env,
                    start_new_session=True,
                )
        process.log_path = rank_log_path  # named by global rank; under torchrun, index 0 may not be rank 0
        processes.append(process)
        try:
            process.stdin.write(header + payload)
            process.stdin.close()
        except BrokenPipeError:
            pass  # the child died while starting; its exit code and log say why
    return processes


def _run_ranks(
    payload, log_path, timeout_s, env, on_message, should_stop, world_size, only_rank=None, template=None
) -> dict:
    oom_kills_before = kernel_oom_kills()
    processes = _start_ranks(payload, log_path, env, world_size, only_rank, template)
    watch = _RankWatch(processes, ArmTimer(timeout_s), on_message)
    try:
        watch.follow(should_stop)
    except KeyboardInterrupt:
        watch.stopped = True
        raise Interrupted from None
    finally:
        watch.end_processes()
    if watch.answer is not None and watch.timed_out and len(processes) > 1:
        return {**watch.answer, **_where_the_ranks_hung(processes, watch.answer["reason"])}
    if watch.answer is not None:
        return watch.answer
    # The arm in flight when the block died is the likely cause; the worker names it when it knows.
    return {"arm": watch.timer.current, **_failure(processes, watch.rank_errors, oom_kills_before)}


class _RankWatch:
    """Follows a block's processes (one per rank) until rank 0 answers, a limit passes or a rank dies.

    Watches rank by rank only when this parent started them all; under torchrun it has one.
    """

    def __init__(self, processes: list[subprocess.Popen], timer: ArmTimer, on_message: Callable):
        self.processes, self.timer, self.on_message = processes, timer, on_message
        self.messages: queue.Queue = queue.Queue()
        self.readers = [
            threading.Thread(target=self._read_messages, args=(rank, process), daemon=True)
            for rank, process in enumerate(processes)
        ]
        for reader in self.readers:
            reader.start()
        self.answer: dict | None = None
        self.rank_errors: dict[int, dict] = {}
        self.dead_since: float | None = None  # when a rank was first seen dead without rank 0 finishing
        self.finished_since: float | None = None  # when a rank was first seen to exit cleanly
        self.answered_at: float | None = None
        self.open_channels = len(processes)
        self.stopped = False  # True when we end the children ourselves: timeout, Stop, Ctrl-C, a dead rank
        self.timed_out = False

    def _read_messages(self, rank: int, process: subprocess.Popen) -> None:
        for line in process.stdout:
            try:
                self.messages.put((rank, json.loads(line)))
            except ValueError:  # JSONDecodeError, UnicodeDecodeError: a library wrote to stdout
                continue  # not ours: the message channel only carries JSON lines
        self.messages.put((rank, None))

    def follow(self, should_stop: Callable[[], bool]) -> None:
        while self.open_channels:
            if should_stop():
                self.stopped = True
                raise Interrupted
            if self._waiting_cannot_help():
                break
            try:
                # Waiting blocks; the timeout only bounds how late a Stop or a timeout is noticed,
                # and waking rarely keeps this process off the cores the arm is measured on.
                rank, message = self.messages.get(timeout=POLL_S)
            except queue.Empty:
                continue
            self._take(rank, message)

    def _take(self, rank: int, message: dict | None) -> None:
        if message is None:
            self.open_channels -= 1
        elif message.get("type") == "error":
            self.rank_errors.setdefault(rank, message)
        elif rank == 0 and message.get("type") == "result":
            self.answer, self.answered_at = message, time.monotonic()
            self.timer.switch(None)
        elif rank == 0:
            if message.get("type") == "phase":
                self.timer.switch(message.get("arm"))
                if message.get("expected_s"):
                    self.timer.expect(message["expected_s"])
            self.on_message(message)

    def _waiting_cannot_help(self) -> bool:
        """Overdue, answered but not exiting, or a rank lost: stop following."""
        if self.answer is None and self.timer.overdue():
            self.stopped = self.timed_out = True
            ended = (
                "process was" if len(self.processes) == 1 else f"{len(self.processes)} rank processes were"
            )
            self.answer = {
                "type": "error",
                "status": "failed",
                "reason": f"{self.timer.describe()}; the arm's {ended} ended",
                "arm": self.timer.current,
            }
            return True
        if self.answered_at is not None and time.monotonic() - self.answered_at > EXIT_GRACE_S:
            return True  # the result is in; a rank that does not exit is ended afterwards
        return len(self.processes) > 1 and self.answer is None and self._a_rank_is_lost()

    def _a_rank_is_lost(self) -> bool:
        codes = [p.poll() for p in self.processes]
        now = time.monotonic()
        if self.dead_since is None and any(code not in (None, 0) for code in codes):
            self.dead_since = now
        # Give the surviving ranks a moment to report the error they saw, then end them.
        if self.dead_since is not None and now - self.dead_since > DEAD_RANK_GRACE_S:
            self.stopped = True
            return True
        # Ranks finish together (the last step ends in an all-reduce); one that finished
        # long before rank 0 reported means rank 0 is stuck.
        finished = [r for r, code in enumerate(codes) if code == 0]
        if finished and self.finished_since is None:
            self.finished_since = now
        if self.finished_since is not None and now - self.finished_since > RANK0_REPORT_S:
            self.stopped = True
            self.answer = {
                "type": "error",
                "status": "failed",
                "reason": f"rank {finished[0]} finished, but rank 0 did not report within "
                f"{RANK0_REPORT_S:.0f} s; the ranks were ended",
            }
            return True
        return False

    def end_processes(self) -> None:
        """Let the processes exit, or end them; no rank or DataLoader worker outlives its arm."""
        if not self.stopped:
            try:
                for process in self.processes:
                    process.wait(timeout=EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                self.stopped = True
        if self.stopped:
            for process in self.processes:
                _signal_group(process, signal.SIGTERM)
            for process in self.processes:
                _end_process_group(process)
        for process in self.processes:
            _signal_group(process, signal.SIGKILL)
        for process in self.processes:
            try:
                process.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        for reader in self.readers:
            reader.join(timeout=5)


OOM_KILL_COUNTERS = ("/sys/fs/cgroup/memory.events", "/proc/vmstat")  # this cgroup's, then the machine's


def kernel_oom_kills() -> dict[str, int]:
    """The kernel's counts of processes its out-of-memory killer ended (``oom_kill`` lines), per
    file that can be read here: the evidence that a SIGKILL was for memory. Empty when none can."""
    counts = {}
    for path in OOM_KILL_COUNTERS:
        try:
            with open(path) as file:
                for line in file:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        counts[path] = int(value)
        except (OSError, ValueError):
            continue
    return counts


def _killed_by(code: int, oom_kills_before: dict[str, int]) -> tuple[str, str]:
    """(status, how) for a rank that a signal ended: ``oom`` only with the kernel's word for it."""
    try:
        name = signal.Signals(-code).name
    except ValueError:  # a real-time or unnamed signal
        name = "unnamed"
    if code != -signal.SIGKILL:
        return "failed", f"was killed by signal {-code} ({name})"
    after = kernel_oom_kills()
    rose = [path for path in after if after[path] > oom_kills_before.get(path, after[path])]
    if rose:
        return "oom", f"was killed by the kernel's out-of-memory killer (oom_kill count rose in {rose[0]})"
    evidence = "did not change" if after else "cannot be read here"
    return "failed", f"was killed by signal 9 (SIGKILL); the kernel's out-of-memory kill count {evidence}"


def _failure(
    processes: list[subprocess.Popen], rank_errors: dict[int, dict], oom_kills_before: dict[str, int]
) -> dict:
    """Why a unit ended without a result, naming the rank that failed first."""
    single = len(processes) == 1
    # A rank that died on its own (a crash, a kill) is the cause; the others' errors are its echo.
    dead = [r for r, p in enumerate(processes) if p.returncode not in (0, None) and r not in rank_errors]
    who = "the arm's process" if single else None
    if dead and not single:
        rank = dead[0]
        code = processes[rank].returncode
        status, how = (
            _killed_by(code, oom_kills_before) if code < 0 else ("failed", f"exited with code {code}")
        )
        return {
            "type": "error",
            "status": status,
            "signal": -code if code < 0 else None,
            "reason": f"rank {rank} of {len(processes)} {how} without a result; the other ranks were ended",
            "traceback": _log_tail(processes[rank].log_path),
            "rank": rank,  # whose log the unit points to
        }
    if rank_errors:
        rank = first_cause(rank_errors)
        error = rank_errors[rank]
        prefix = "" if single else f"rank {rank} of {len(processes)}: "
        return {**error, "reason": prefix + error["reason"], "rank": rank}
    code = processes[0].returncode
    tail = _log_tail(processes[0].log_path)
    status, how = (
        _killed_by(code, oom_kills_before) if code and code < 0 else ("failed", f"exited with code {code}")
    )
    return {
        "type": "error",
        "status": status,
        "signal": -code if code and code < 0 else None,
        "reason": f"{who or 'rank 0'} {how} without a result",
        "traceback": tail,
    }


def first_cause(rank_errors: dict[int, dict]) -> int:
    """The rank whose error is not a collective failing because a peer went away."""
    echoes = ("connection closed by peer", "connection reset", "broken pipe", "timed out", "timeout",
              "remote worker crashing")  # fmt: skip
    for rank, error in sorted(rank_errors.items()):
        if not any(echo in error.get("reason", "").lower() for echo in echoes):
            return rank
    return min(rank_errors)
