"""What a running ablation has reported, gathered from its events for the panel's live view
and its status line (process i of n, block, arm, elapsed time, time left)."""

from __future__ import annotations

import statistics
import threading
import time


class LiveRun:
    """Everything a running ablation has reported so far, gathered from its events (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.time()
        self.arms: list[str] = []
        self.loader_arms: list[str] = []  # loader-only twins: a model that does no work, no loss to plot
        self.blocks = 0
        self.processes = 0  # blocks' processes planned (a block's shared one, arms' own ones)
        self.processes_done = 0
        self.process_started: float | None = None  # when the process in flight started
        self.measure_s: float | None = None  # how long that process should take, once its arms warmed up
        # The timed windows of the process in flight: when they began, how many it will run and
        # how many have begun; their pace tells its time left once it runs past its forecast.
        self.windows_started: float | None = None
        self.windows_planned = 0
        self.windows_begun = 0
        self.process_arms = 0
        self.process_s: list[float] = []  # how long each process of this ablation took: the time left
        self.finished: list[dict] = []  # "unit" events: one arm's measurements in one block
        # arm -> [(seconds, samples/s, block, process)]: ``process`` counts the processes started, so
        # a plot never joins readings of two processes (two blocks, or a block run again)
        self.throughput: dict[str, list[tuple[float, float, int, int]]] = {}
        self.processes_started = 0
        self.telemetry: list[dict] = []
        self.current = ""
        self.block = 0  # the block in flight (0-based)
        self.running_arm = ""  # the arm the process in flight works on now
        self.running_phase = ""  # and what it does: startup, warmup, measure 3/10, memory
        self.stage = ""  # the tuner's round, shown before what runs now
        self.slurm: dict | None = None  # with executor="slurm": blocks done, running, pending
        self.state = "idle"  # idle, running, done, stopped, failed
        self.version = 0  # bumped by every event, so the redraw thread knows when to redraw

    def __call__(self, event: dict) -> None:
        with self._lock:
            self.version += 1
            kind = event["type"]
            now = time.time()
            if kind == "plan":
                self._planned(event)
            elif kind == "start":
                self._process_started(event, now)
            elif kind == "phase":
                self._phase(event, now)
            elif kind == "progress":
                point = (now - self.started, event["samples_per_s"], event["block"], self.processes_started)
                self.throughput.setdefault(event["arm"], []).append(point)
            elif kind == "unit":
                self.finished.append(event)
            elif kind == "process_done":
                self.processes_done += 1
                if self.process_started is not None:
                    self.process_s.append(now - self.process_started)
                self.process_started, self.running_arm, self.running_phase = None, "", ""
            elif kind == "slurm":  # blocks as Slurm jobs: how many are done, running, pending
                self.slurm = {key: event[key] for key in ("done", "running", "pending")}
            elif kind == "telemetry":
                self.telemetry.append(event)
            elif kind in ("done", "stopped"):
                self.state = kind
            elif kind == "tune_round":
                # Each round is a new ablation of other arms: its throughput lines start afresh.
                self.throughput, self.finished, self.processes_done, self.slurm = {}, [], 0, None
                count = len(event["candidates"])
                self.stage = (
                    f"tuning, round {event['round']}: {count} candidate{'s' * (count != 1)} x "
                    f"{event['blocks']} block{'s' * (event['blocks'] != 1)}"
                )

    def _planned(self, event: dict) -> None:
        self.arms = [arm["name"] for arm in event["arms"] if not arm["unavailable"]]
        self.loader_arms = [arm["name"] for arm in event["arms"] if arm.get("kind") == "loader"]
        self.blocks = event.get("blocks", 0)
        self.processes = event["processes"]
        self.processes_done = event["processes"] - event["remaining"]
        self.process_s = []  # a tuner's round plans other arms: earlier rounds' processes say little
        self.state = "running"

    def _process_started(self, event: dict, now: float) -> None:
        self.processes_started += 1
        self.process_started, self.measure_s = now, None
        self.windows_started, self.windows_planned, self.windows_begun = None, 0, 0
        self.process_arms = len(event.get("arms", ()))
        self.block = event["block"]
        alone = f", {event['arms'][0]} in its own process" if event["process"] == "own" else ""
        self.current = f"block {event['block'] + 1}{alone}: starting"

    def _phase(self, event: dict, now: float) -> None:
        if "arm" not in event:  # the process's arms are warm: how long their timed windows should take
            expected = event.get("expected_s") or {}
            if expected and self.process_started is not None:
                self.measure_s = now - self.process_started + sum(expected.values())
            self.windows_started = now
            self.windows_planned = event.get("rounds", 0) * self.process_arms
            return
        if event.get("phase") == "measure":
            self.windows_begun += 1
        round_text = f" {event['round']}/{event['of']}" if event.get("phase") == "measure" else ""
        self.running_arm, self.running_phase = event["arm"], f"{event['phase']}{round_text}"
        self.current = f"block {event['block'] + 1}: {event['arm']}: {self.running_phase}"

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "started": self.started,
                "now": time.time(),
                "arms": list(self.arms),
                "loader_arms": list(self.loader_arms),
                "blocks": self.blocks,
                "block": self.block,
                "processes": self.processes,
                "processes_done": self.processes_done,
                "process_started": self.process_started,
                "process_s": list(self.process_s),
                "measure_s": self.measure_s,
                "windows": (self.windows_started, self.windows_begun, self.windows_planned),
                "finished": list(self.finished),
                "throughput": {arm: list(points) for arm, points in self.throughput.items()},
                "telemetry": list(self.telemetry),
                "current": f"{self.stage}; {self.current}" if self.stage else self.current,
                "running_arm": self.running_arm,
                "running_phase": self.running_phase,
                "stage": self.stage,
                "slurm": dict(self.slurm) if self.slurm else None,
                "state": self.state,
            }


def time_left_s(snapshot: dict) -> float | None:
    """Seconds until the last planned process ends: the finished processes' mean duration for
    each one still to run, less what the one in flight has done; before any process finished,
    the one in flight's own forecast (its start-up so far plus its arms' expected windows).
    A process past its forecast is given the time its remaining windows take at the pace of
    those it has run, and, while it is the first, the processes after it as long as it takes.
    None until there is a forecast."""
    per_process = statistics.fmean(snapshot["process_s"]) if snapshot["process_s"] else snapshot["measure_s"]
    if per_process is None:
        return None
    to_run = max(snapshot["processes"] - snapshot["processes_done"], 0)
    if snapshot["process_started"] is None or to_run == 0:
        return per_process * to_run
    in_flight_s = snapshot["now"] - snapshot["process_started"]
    if in_flight_s <= per_process:
        return per_process - in_flight_s + per_process * (to_run - 1)
    this_left = _windows_left_s(snapshot)
    later = per_process if snapshot["process_s"] else in_flight_s + this_left
    return this_left + later * (to_run - 1)


def _windows_left_s(snapshot: dict) -> float:
    """The time the process in flight needs for the windows it has not finished, at the pace
    of those it has (0 before two windows have begun: nothing to go by yet)."""
    started, begun, planned = snapshot.get("windows", (None, 0, 0))
    if started is None or begun < 2:
        return 0.0
    per_window = (snapshot["now"] - started) / (begun - 1)  # the windows before the one running
    return per_window * max(planned - begun + 1, 0)


def progress_line(snapshot: dict) -> str:
    """The status line while a run goes: which process of how many, the block and the arm in it,
    the time spent and the time left."""
    done, in_flight = snapshot["processes_done"], snapshot["process_started"] is not None
    planned = max(snapshot["processes"], done + in_flight)  # an arm moved to its own process adds one
    parts = [snapshot["stage"]] if snapshot["stage"] else []
    if snapshot.get("slurm"):  # the jobs' own progress stays on their nodes: count blocks, not processes
        jobs = snapshot["slurm"]
        parts.append(
            f"Slurm blocks: {jobs['done']} done, {jobs['running']} running, {jobs['pending']} pending"
        )
        parts.append(f"{_clock(snapshot['now'] - snapshot['started'])} elapsed")
        return " · ".join(parts)
    if in_flight:
        parts.append(f"process {done + 1} of {planned}")
        if snapshot["blocks"]:
            parts.append(f"block {snapshot['block'] + 1} of {snapshot['blocks']}")
        arm, phase = snapshot["running_arm"], snapshot["running_phase"]
        parts.append(f"now: {arm}, {phase}" if arm else "starting")
    else:
        parts.append(f"{done} of {planned} processes finished")
    parts.append(f"{_clock(snapshot['now'] - snapshot['started'])} elapsed")
    left = time_left_s(snapshot)
    parts.append(
        "time left: known once the arms have warmed up" if left is None else f"about {_clock(left)} left"
    )
    return " · ".join(parts)


def _clock(seconds: float) -> str:
    """12:05 (minutes:seconds), or 1:02:05 past an hour."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
