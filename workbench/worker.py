"""A block in a fresh Python process: ``python -m workbench.worker``.

A block is the unit of measurement (see workbench.block): one process that builds every arm
it is given, warms each up, then runs them interleaved in timed windows, round after round.
Most ablations run one block per repeat with all their arms inside; an arm that cannot share
a process (see ``Technique.own_process``) runs as a block of one, and so does every arm of a
data-parallel ablation, whose ranks are processes of their own.

Fresh processes keep blocks apart: nothing one block did can leak into the next, not
compiled-code caches, not the caching allocator's pools, not flags or monkey-patches.
Inside a block, each arm keeps its own random state and process-wide switches, and an arm
that leaves process-wide state changed is caught and moved to a process of its own
(workbench.process_state).

The parent sends one JSON line (its ``sys.path``) and then the cloudpickled BlockSpec on
stdin. The worker answers with JSON lines on its stdout (progress, then one result or
error); whatever the user's code prints goes to stderr, which the parent keeps as a log.
Results therefore never travel as pickles.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.block import ArmSpec, BlockArm, MemoryCapExceeded
from workbench.config import RunConfig
from workbench.core_sync import MIN_REPEATS, fork_join_us, repeats_for
from workbench.data import DataSource, loader_worker_error
from workbench.distributed import CommMeter, Rank, gather_to_rank0, init_process_group
from workbench.environment import cpu_model
from workbench.heap import hold_heap_steady
from workbench.process_state import differences, fingerprint
from workbench.profiling import TraceFile
from workbench.telemetry import ProcessRss, nvml_indices, threads_per_rank, usable_cores


@dataclass
class BlockSpec:
    """Everything one block's process needs: the arms, and the run's settings, as ablate() checked them."""

    model: Any  # a built-in name or a zero-argument factory
    data: DataSource
    loss_fn: Callable | None
    arms: list[ArmSpec]
    run: RunConfig  # its device resolved: "cpu" or "cuda:N", never "auto"
    block: int = 0  # which block this is; with the run's seed, it seeds the order of the arms
    rewarm: int | None = None  # untimed steps before each window; None: see choose_rewarm
    progress_interval_s: float = 0.5
    trace_owner: str | None = None  # the results folder whose traces these are (profiling.TraceFile)

    @property
    def comm_timeout_s(self) -> float:
        """A collective waiting longer than this for a dead peer fails (the arm's limit, at most 2 min)."""
        return min(120.0, self.run.timeout_s or 120.0)


WINDOW_TARGET_S = 0.005  # how long a window lasts when rounds are chosen from the step time
LONE_ARM_ROUNDS = 10  # windows of an arm alone in its process


def slug(text: str) -> str:
    """``text`` as part of a file name: "baseline (control)" -> "baseline_control"."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def trace_file_name(block: int, arm: str, rank: int | None = None) -> str:
    """The profiler trace's file name for ``arm`` in ``block`` (``rank``: under DDP), in trace_dir;
    its arm part spelled as the arm's own process's files are (``arms.Job.key``)."""
    return f"b{block}-{slug(arm)}" + (f"-rank{rank}" if rank is not None else "") + ".json"


def window_steps(steps: int, rounds: int) -> list[int]:
    """The steps of each round's window: ``steps`` split into ``rounds`` as evenly as whole steps allow."""
    base, extra = divmod(steps, rounds)
    return [base + (1 if r < extra else 0) for r in range(rounds)]


def choose_rounds(steps: int, step_s: float) -> int:
    """Rounds such that each window lasts about WINDOW_TARGET_S (at least one step per window).

    This machine's speed wanders within a fraction of a second, and only arms measured close
    together in time share the same speed. For mlp (4 ms steps), the A/A ratio of one block
    spread by 1.3% with windows of one step, 3.7% with windows of 4 and 7.0% with windows of
    50 (BENCHMARKS.md, "Windows and rounds"): the shorter, the better, down to one step.
    """
    per_window = max(1, round(WINDOW_TARGET_S / step_s)) if step_s > 0 else steps
    return max(1, min(steps, math.ceil(steps / per_window)))


REWARM_BELOW_S = 0.010  # steps shorter than this get an untimed re-warm step before each window


def choose_rewarm(arms: int, step_s: float) -> int:
    """Untimed steps before each window: 1 for short steps beside other arms, else 0.

    Between two windows of an arm the other arms fill the caches with their own weights and
    activations, and the first step back pays to reload them: 5-9% of a 5 ms mlp step here,
    within the noise for 40-130 ms steps (resnet-mini, gpt-mini; BENCHMARKS.md). A real job
    never pays it, so short steps get one untimed step first; for long steps the reload is a
    sliver of the step and a re-warm step would double the run's cost. Alone in a process,
    nothing evicts the arm's data.
    """
    return 1 if arms > 1 and 0 < step_s < REWARM_BELOW_S else 0


class SharedStateChanged(Exception):
    """An arm left process-wide state changed: the block cannot go on measuring the others."""

    def __init__(self, arm: str, changes: list[str]):
        self.arm, self.changes = arm, changes
        super().__init__(
            f"{arm} changed process-wide state and did not restore it ({'; '.join(changes)}), so it "
            "cannot share a process with other arms"
        )


def _initialize_runtime(device: torch.device) -> None:
    """Pay PyTorch's one-off, per-process costs before any clock or memory baseline starts.

    The first optimizer step imports torch._dynamo (about 1 s and 70 MiB here), and the
    first backward starts the autograd engine and thread pools. Every arm pays this equally
    and none of it is the technique's doing, so it counts neither in startup_s nor in memory.
    """
    import torch._dynamo  # (imported lazily by torch.optim otherwise)

    # The first torch.compile in a process patches nn.Module.__init__ once, for good (TorchDynamo
    # tags new modules). Done here, it belongs to every block's starting state, not to the arm
    # that happens to compile first.
    install = getattr(torch._dynamo.mutation_guard, "install_generation_tagging_init", None)
    if install is not None:
        install()

    weight = torch.zeros(8, 8, device=device, requires_grad=True)
    (weight @ weight).sum().backward()
    torch.optim.SGD([weight], lr=0.1).step()


def _process_setup(spec: BlockSpec) -> tuple[Rank, torch.device, CommMeter | None, str]:
    """This process's rank and device; with several ranks, the process group and its meter; what
    was done to its C heap (workbench.heap)."""
    rank = Rank.from_env()
    device = torch.device(spec.run.device)
    if rank.distributed and len(spec.arms) != 1:
        raise ValueError("a data-parallel block holds exactly one arm")
    if rank.distributed and device.type == "cuda":
        device = torch.device("cuda", rank.local_rank)
        torch.cuda.set_device(device)
    if rank.distributed and device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one machine share its cores: each would otherwise start one thread per core,
        # and the oversubscribed cores would time-slice between ranks (noise, not a measurement).
        torch.set_num_threads(threads_per_rank(rank.local_world_size))
    if spec.run.threads is not None:  # the run's own choice comes before either default
        torch.set_num_threads(spec.run.threads)
    heap = hold_heap_steady(spec.run.heap)  # before the first tensor of any arm (workbench.heap)
    _initialize_runtime(device)
    meter = None
    if rank.distributed:
        init_process_group(rank, device, spec.comm_timeout_s)
        meter = CommMeter(rank.world_size, spec.run.link)
        meter.install()
    return rank, device, meter, heap


def run_block(spec: BlockSpec, emit: Callable[[dict], None] = lambda message: None) -> dict:
    """Build and warm up every arm, run them interleaved, round after round, then measure.

    Returns ``{"arms": {name: measurements}, "failures": {name: error}, "block": {...}}``,
    JSON-ready. An arm that raises is recorded in ``failures`` (and announced at once with an
    ``arm_error`` message) and the others go on. An arm that leaves process-wide state
    changed raises SharedStateChanged: the others cannot be trusted beside it.
    With several ranks (RANK/WORLD_SIZE in the environment) every rank runs this, under DDP,
    on its own shard of the data; rank 0 returns the measurements of all of them.
    """
    block = _Block(spec, emit)
    block.build_and_warm_up()
    block.choose_windows()
    block.run_rounds()
    return {"arms": block.measure(), "failures": block.failures, "block": block.record()}


class _Block:
    """One block's arms and what happened to them, phase by phase (see run_block)."""

    def __init__(self, spec: BlockSpec, emit: Callable[[dict], None]):
        self.spec, self.run, self.emit = spec, spec.run, emit
        self.rank, self.device, self.meter, self.heap = _process_setup(spec)
        self.pristine = fingerprint()
        self.rss = ProcessRss()
        self.rss.mark_before_models()
        # One generator for this block's orders: reproducible from (seed, block), different per block.
        self.order_rng = np.random.default_rng([spec.run.seed, spec.block])
        self.failures: dict[str, dict] = {}
        self.arms = [
            BlockArm(
                arm_spec,
                model=spec.model,
                data=spec.data,
                loss_fn=spec.loss_fn,
                run=spec.run,
                device=self.device,
                rank=self.rank,
                meter=self.meter,
                shared=len(spec.arms) > 1,
            )
            for arm_spec in spec.arms
        ]
        self.build_order: list[BlockArm] = []
        self.orders: list[list[str]] = []  # each round's order of the arms
        self.typical_s = 0.0  # the median warm-up step: what windows are sized from
        self.rounds, self.rewarm = 0, 0
        self.reported: dict[str, float] = {}  # arm -> when its last progress message went out
        self.comm: dict = {}
        self.rss_mib: float | None = None
        self.core_sync_us: list[float] = []  # the fork-join probe after each round (workbench.core_sync)
        self._probe_us: float | None = None  # the last probe: sizes the next one (None: not probed)

    def _running(self) -> list[BlockArm]:
        return [arm for arm in self.arms if arm.name not in self.failures]

    def _fail(self, arm: BlockArm, error: BaseException) -> None:
        if self.rank.distributed:  # the other ranks wait in collectives: end the whole job, loudly
            raise error
        self.failures[arm.name] = {
            "status": classify_error(error),
            "reason": one_line(error),
            "traceback": traceback.format_exc(),
            # over the cap, not out of memory: its own peak, which it needs in any process
            **({"over_cap_peak_mib": error.peak_mib} if isinstance(error, MemoryCapExceeded) else {}),
        }
        self.emit({"type": "arm_error", "arm": arm.name, **self.failures[arm.name]})
        arm.release()

    def _check_state(self, arm: BlockArm) -> None:
        if len(self.arms) == 1:  # alone in its process: there is nobody to contaminate
            return
        changes = differences(self.pristine, fingerprint())
        if changes:
            raise SharedStateChanged(arm.name, changes)

    def build_and_warm_up(self) -> None:
        """Each arm built and warmed up in turn, in a random order (no arm always goes first)."""
        self.build_order = [self.arms[i] for i in self.order_rng.permutation(len(self.arms))]
        for arm in self.build_order:
            self.emit({"type": "phase", "arm": arm.name, "phase": "startup"})
            try:
                arm.build()
                arm.warm_up(self.run.warmup, self.emit)
                arm.refuse_if_over_the_cap()
            except Exception as error:
                self._fail(arm, error)
            self._check_state(arm)

    def choose_windows(self) -> None:
        """Rounds and re-warm steps, from the warm-up's step time unless the run fixed them."""
        warmed = [arm.warmup_step_s for arm in self._running() if arm.warmup_step_s]
        self.typical_s = float(np.median(warmed)) if warmed else 0.0
        rounds, rewarm, steps = self.run.rounds, self.spec.rewarm, self.run.steps
        if rewarm is None:
            rewarm = choose_rewarm(len(self.arms), self.typical_s)
        if rounds is None and len(self.arms) == 1:
            # Alone, nothing is interleaved: windows only chunk the steps (for the spread inside the
            # block). Not from the step time, so that every rank of a data-parallel arm agrees.
            rounds = min(steps, LONE_ARM_ROUNDS)
        elif rounds is None:
            rounds = choose_rounds(steps, self.typical_s)
        self.rounds, self.rewarm = rounds, rewarm
        # How long each arm's timed windows should take, from its warm-up: the parent's time limit.
        expected_s = {
            arm.name: arm.warmup_step_s * (steps + rewarm * rounds)
            for arm in self._running()
            if arm.warmup_step_s
        }
        self.emit({"type": "phase", "phase": "measure", "rounds": rounds, "expected_s": expected_s})

    def run_rounds(self) -> None:
        """Every round runs each arm's window once, in a fresh random order."""
        if self.device.type == "cpu":  # the probe's tensors, allocated before the resident set is watched
            self._probe_us = fork_join_us(repeats=MIN_REPEATS)
        self.rss.begin_windows()
        if self.meter is not None:
            self.meter.reset()  # count the timed windows' communication only
        for round_index, steps in enumerate(window_steps(self.run.steps, self.rounds)):
            running = self._running()
            order = [running[i] for i in self.order_rng.permutation(len(running))]
            self.orders.append([arm.name for arm in order])
            round_started = time.perf_counter()
            for arm in order:
                self._run_window(arm, round_index, steps)
            self._probe_cores(time.perf_counter() - round_started)
        self.comm = _comm_record(self.meter, self.run.steps) if self.meter is not None else {}
        self.rss_mib = self.rss.growth_mib()

    def _probe_cores(self, round_s: float) -> None:
        """Between rounds, outside every window: how fast the CPU threads work together now.

        Only where the arms compute on the CPU with several threads; a state change there can
        move a speedup beyond what pairing cancels (workbench.core_sync). The probe takes about
        1% of the round it follows, so short rounds (mlp's) do not pay more than long ones."""
        if self._probe_us is not None:  # set before the first round, on the CPU with several threads
            probe = fork_join_us(repeats_for(round_s, self._probe_us))
            if probe is not None:
                self.core_sync_us.append(probe)
                self._probe_us = probe

    def _run_window(self, arm: BlockArm, round_index: int, steps: int) -> None:
        self.emit(
            {
                "type": "phase",
                "arm": arm.name,
                "phase": "measure",
                "round": round_index + 1,
                "of": self.rounds,
            }
        )

        def relay(message: dict) -> None:
            self.emit({**message, "arm": arm.name, "round": round_index + 1})

        interval_s = self.spec.progress_interval_s
        try:
            arm.run_window(steps, round_index, relay, interval_s, self.rewarm)
        except Exception as error:
            self._fail(arm, error)
        self._check_state(arm)
        if (
            arm.name not in self.failures
            and time.monotonic() - self.reported.get(arm.name, 0.0) >= interval_s
        ):
            self.reported[arm.name] = time.monotonic()  # windows are short: report one now and then
            window = arm.windows[-1]
            relay(
                {
                    "type": "progress",
                    "step": sum(w["steps"] for w in arm.windows),
                    "of": self.run.steps,
                    "loss": float(arm.losses[-1]),
                    "samples_per_s": window["samples"] / window["wall_s"],
                }
            )

    def measure(self) -> dict[str, dict]:
        """Each arm's measurements (an arm that fails here joins ``failures``)."""
        measured: dict[str, dict] = {}
        flop_counts: dict = {}  # the arms share the model: count its FLOPs once per batch shape
        for arm in self._running():
            try:
                result = arm.finish(self.emit, flop_counts)
                if self.run.profile_steps:
                    # said: the advisor's profile and half-batch steps take seconds, shown as "memory"
                    self.emit({"type": "phase", "arm": arm.name, "phase": "profile"})
                    result["profile"] = arm.profile(self._trace_file(arm))
            except Exception as error:
                self._fail(arm, error)
                continue
            self._check_state(arm)
            on_cuda = self.device.type == "cuda"
            result["nvml_gpus"] = nvml_indices(self.device, self.rank.world_size) if on_cuda else []
            result["warmup"] = self.run.warmup
            if len(self.arms) == 1:  # a process of its own: its resident set is the arm's
                result.update(peak_rss_mib=self.rss_mib, rss_method=self.rss.method)
            else:
                result.update(peak_rss_mib=None, rss_method="process-wide: not split between a block's arms")
            measured[arm.name] = {**result, **self.comm}
        if self.rank.distributed and measured:
            (name,) = measured
            measured[name] = _gather_ranks(measured[name], self.rank, self.device)
            # Keep the distributed run's objects alive past this return: tearing down DDP's reducer
            # and gloo's state can block in their destructors (seen about once in 30 runs here),
            # before the result is sent. main() reports, then leaves with os._exit.
            _KEEP_ALIVE.append((self.arms, self.meter))
        return measured

    def _trace_file(self, arm: BlockArm) -> TraceFile | None:
        if self.run.trace_dir is None:
            return None
        rank = self.rank.rank if self.rank.distributed else None
        path = Path(self.run.trace_dir).expanduser() / trace_file_name(self.spec.block, arm.name, rank)
        return TraceFile(path, self.spec.trace_owner)

    def record(self) -> dict:
        """How the block ran: its arms, orders, windows and process."""
        return {
            "block": self.spec.block,
            "arms": [arm.name for arm in self.arms],
            "build_order": [arm.name for arm in self.build_order],
            "rounds": self.rounds,
            "rounds_chosen": self.run.rounds is None,  # from the warm-up's step time (choose_rounds)
            "warmup_step_ms": 1e3 * self.typical_s,
            "window_steps": window_steps(self.run.steps, self.rounds),
            "warmup": self.run.warmup,
            "rewarm": self.rewarm,
            "order": self.orders,
            "pid": os.getpid(),
            # Where it ran: blocks on different nodes or kinds of device are told apart in the results.
            "host": socket.gethostname(),
            "device_name": torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda"
            else cpu_model(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "rss_growth_mib": self.rss_mib,
            "rss_method": self.rss.method,
            "torch_threads": torch.get_num_threads(),
            # With torch_threads, whether the threads had cores of their own (results warn if not).
            "usable_cores": usable_cores(),
            "ranks_here": self.rank.local_world_size,
            "device_type": self.device.type,
            "heap": self.heap,
            "core_sync_us": self.core_sync_us,
        }


_KEEP_ALIVE: list = []


def _comm_record(meter: CommMeter, steps: int) -> dict:
    exposed = meter.exposed_s()
    return {
        "comm_bytes_per_step": meter.payload_bytes / steps,
        "wire_bytes_per_step": meter.wire_bytes / steps,
        "comm_ms_per_step": 1e3 * meter.busy_s() / steps,
        # The part of it the step waited for, after the gradient computation ended (None: unknown).
        "comm_exposed_ms_per_step": None if exposed is None else 1e3 * exposed / steps,
        "link_bytes_per_step": meter.wire_bytes_charged / steps if meter.link is not None else None,
        "buckets_per_step": meter.buckets / steps,
    }


def _gather_ranks(result: dict, rank: Rank, device: torch.device) -> dict:
    """On rank 0: its own result, plus every rank's throughput and the aggregate."""
    import torch.distributed as dist

    keys = (
        "samples",
        "wall_s",
        "samples_per_s",
        "comm_bytes_per_step",
        "wire_bytes_per_step",
        "comm_ms_per_step",
        "comm_exposed_ms_per_step",
        "link_bytes_per_step",
        "buckets_per_step",
    )
    everyone = gather_to_rank0({key: result[key] for key in keys}, rank, device)
    dist.barrier()  # every rank has everything; the process group ends with the process
    return result if everyone is None else all_ranks(result, everyone)


def all_ranks(result: dict, everyone: list[dict]) -> dict:
    """Rank 0's result with the job's figures: its throughput over every rank, and the bytes a rank
    hands to collectives as their mean over the ranks, not rank 0's. Hooks that send unequally
    (hierarchical: a node's leader reduces, all-reduces and broadcasts, the others send once) made
    rank 0, always a leader, read as if the hook tripled the traffic."""
    # The ranks step in lockstep (every step ends in an all-reduce), so the job's throughput is
    # all samples over the slowest rank's window.
    aggregate = sum(r["samples"] for r in everyone) / max(r["wall_s"] for r in everyone)
    return {
        **result,
        "world_size": len(everyone),
        "per_rank": everyone,
        "samples_per_s": aggregate,
        "samples": sum(r["samples"] for r in everyone),
        "comm_bytes_per_step": float(np.mean([r["comm_bytes_per_step"] for r in everyone])),
        # a rank of an older workbench (another node) sends no such figure: the mean of those that do
        "wire_bytes_per_step": _mean_of_known([r.get("wire_bytes_per_step") for r in everyone]),
    }


def _mean_of_known(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return float(np.mean(known)) if known else None


def classify_error(error: BaseException) -> str:
    """``oom`` for out-of-memory errors on any device, ``failed`` for everything else."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return "oom"
    text = str(error).lower()
    if isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text):
        return "oom"
    return "failed"


def one_line(error: BaseException, limit: int = 400) -> str:
    text = (
        loader_worker_error(error)
        or f"{type(error).__name__}: {' '.join(str(error).split()) or '(no message)'}"
    )
    return text if len(text) <= limit else text[: limit - 3] + "..."


def die_with_parent() -> None:
    """On Linux, get SIGTERM when the ablation process dies, even by SIGKILL: no orphaned arms."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    import faulthandler
    import signal

    import cloudpickle

    # A unit that is ended (timeout, Stop, a stuck rank) leaves every thread's stack in its log.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    die_with_parent()

    messages = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the user's prints go to the log (stderr), never into the message channel

    def emit(message: dict) -> None:
        messages.write(json.dumps(message) + "\n")
        messages.flush()

    try:
        header = json.loads(sys.stdin.buffer.readline())
        sys.path[:] = header["sys_path"]  # so factories pickled by reference import as in the parent
        spec = cloudpickle.loads(sys.stdin.buffer.read())  # code from our own parent, not results
        emit({"type": "result", **run_block(spec, emit)})
        # Everything is reported: skip the interpreter's teardown of torch (half a second here), and
        # for a distributed run the DDP/gloo teardown that can block (see run_block). The parent
        # ends the process group, DataLoader workers included.
        sys.stderr.flush()
        os._exit(0)
    except SharedStateChanged as error:
        emit(
            {
                "type": "error",
                "status": "failed",
                "reason": one_line(error),
                "arm": error.arm,
                "shared_state": error.changes,
                "traceback": traceback.format_exc(),
            }
        )
        return 1
    except BaseException as error:  # report everything, including KeyboardInterrupt
        emit(
            {
                "type": "error",
                "status": classify_error(error),
                "reason": one_line(error),
                "traceback": traceback.format_exc(),
            }
        )
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
