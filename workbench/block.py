"""One arm inside a block: the process-level unit of measurement.

A block is one worker process that holds several arms side by side. Each arm has its own
model, optimizer, data iterator, technique state and random state (see
workbench.process_state), built the same way a process of its own would build it. The
block warms every arm up, then runs them in windows of a few steps, round after round,
in a fresh random order each round. Whatever makes this process faster or slower than the
next one (where its memory landed, which core it got, what the neighbours were doing)
then touches every arm alike and cancels in their ratio; workbench.worker runs the block,
workbench.stats combines its ratios with those of other blocks.

:class:`BlockArm` is one arm's life in the block: ``build``, ``warm_up``, ``run_window``
(many times, interleaved with the other arms'), and ``finish``, which measures memory and
FLOPs after the clock has stopped and returns the arm's JSON-ready measurements.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workbench.config import OVER_THE_CAP, RunConfig
from workbench.data import (
    batch_size_of,
    endless_batches,
    inputs_and_targets,
    loader_feed,
    map_tensors,
    tensors_of,
)
from workbench.devices import synchronize
from workbench.distributed import DDP_ORDER, CommMeter, CommSettings, Rank, wrap_ddp
from workbench.loop import Trainer, TrainSetup, default_loss, error_line, make_optimizer
from workbench.mfu import compute_dtype, count_flops
from workbench.models import NoOpModel, build_model, noop_loss
from workbench.process_state import ArmRandomState
from workbench.profiling import TraceFile, profile_steps
from workbench.techniques import get_technique
from workbench.telemetry import (
    ArmMemory,
    StepClock,
    WindowCpu,
    cpu_utilization_pct,
)

# The advisor's DataLoader probe (BlockArm._loader_feeds) runs when the step waits for data at
# least this share of the time: below it, workers could not win the advisor's 10% (WORTH_TRYING).
LOADER_PROBE_SHARE = 0.05
BASELINE = "baseline"  # the arm's name (workbench.arms) whose profile the advisor reads


@dataclass
class ArmSpec:
    """One arm of a block: its name and the techniques it applies, in composition order."""

    name: str
    techniques: list[tuple[Any, Any]]  # (Technique, config)
    loader_only: bool = False  # time the input pipeline alone, with a model that does no work


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def timed_window(
    trainer: Trainer,
    clock: StepClock,
    steps: int,
    losses: list,
    emit: Callable[[dict], None] = lambda message: None,
    progress_interval_s: float = 0.5,
) -> float:
    """Run ``steps`` optimizer steps between two synchronized clock reads; return the wall time.

    Per step, the harness adds only the clock's phase marks, a loss kept on the device, and
    one ``perf_counter`` call to throttle progress messages (benchmarks/overhead.py measures
    what that costs against a hand-written loop).
    """
    device = trainer.setup.device
    samples_before = trainer.samples_seen
    synchronize(device)
    t0 = time.perf_counter()
    next_report = t0 + progress_interval_s
    for index in range(steps):
        losses.append(trainer.step(clock))
        now = time.perf_counter()
        if now >= next_report:  # a message costs microseconds, a step may cost less: at most 2 a second
            rate = (trainer.samples_seen - samples_before) / (now - t0)
            emit(
                {
                    "type": "progress",
                    "step": index + 1,
                    "of": steps,
                    "loss": float(losses[-1]),
                    "samples_per_s": rate,
                }
            )
            next_report = now + progress_interval_s
    synchronize(device)
    return time.perf_counter() - t0


class MemoryCapExceeded(MemoryError):
    """An arm's peak passed ``memory_cap_mb``: out of memory on a device of that size. Its peak
    was measured (and is kept): the arm's own, which no other arm of its process changes."""

    def __init__(self, message: str, peak_mib: float):
        super().__init__(message)
        self.peak_mib = peak_mib


class BlockArm:
    """One arm's model, trainer, clocks and measurements inside a block (see the module docstring)."""

    def __init__(
        self,
        spec: ArmSpec,
        *,
        model: Any,
        data: Any,
        loss_fn: Callable | None,
        run: RunConfig,
        device: torch.device,  # the rank's own device (run.device names the first)
        rank: Rank,
        meter: CommMeter | None = None,
        shared: bool = True,
    ):
        self.spec = spec
        self.name = spec.name
        self.model_source, self.data, self.user_loss = model, data, loss_fn
        self.run, self.device, self.rank, self.meter = run, device, rank, meter
        self.shared = shared  # other arms run in this process between this arm's windows
        self.random_state = ArmRandomState(device)
        self.memory = ArmMemory(device)
        self.clock = StepClock(device)
        self.losses: list[torch.Tensor] = []
        self.timed: list[bool] = []  # per step in ``losses``: inside a timed window or not
        self.windows: list[dict] = []
        self.notes: list[str] = []
        self.cpu_seconds = 0.0
        # The wall time across which the CPU seconds were read. The windows' own clock (wall_s)
        # is shorter (it leaves out what lies between the reads and the steps), and a ratio of
        # the two could read more than every core (a DALI arm in notebook 09 read 104%).
        self.cpu_wall_s = 0.0
        self.startup_s = float("nan")
        self.warmup_steps_s: list[float] = []
        self.warmup_step_s = 0.0  # typical warm-up step after the first, in seconds
        self.setup: TrainSetup | None = None
        self.trainer: Trainer | None = None

    # --- life in the block -------------------------------------------------------------

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """This arm's random state and process-wide switches (TF32...), for as long as it runs.

        Alone in its process an arm keeps the generators to itself, so they are not swapped:
        a captured CUDA graph (cuda_graphs) replays with the generator it was captured with.
        """
        if self.shared:
            self.random_state.resume()
        with contextlib.ExitStack() as stack:
            for setting in self.setup.window_settings if self.setup is not None else ():
                stack.enter_context(setting())
            try:
                yield
            finally:
                if self.shared:
                    self.random_state.keep()

    def build(self) -> None:
        """Seed as a fresh process would, build the model, apply the techniques, open the data."""
        self._build_started = time.perf_counter()
        seed_everything(self.run.seed)
        if self.spec.loader_only:
            model, loss_fn = NoOpModel().to(self.device), noop_loss
        else:
            model = build_model(self.model_source, self.data.spec).to(self.device)
            loss_fn = self.user_loss or default_loss
            if isinstance(loss_fn, torch.nn.Module):  # its tensors (a class weight) go where the outputs are
                loss_fn = copy.deepcopy(loss_fn).to(self.device)
        distributed = self.rank.distributed
        setup = TrainSetup(
            model=model,
            device=self.device,
            loss_fn=loss_fn,
            make_optimizer=make_optimizer(self.run.optimizer, self.run.lr),
            rank=self.rank.rank,
            world_size=self.rank.world_size,
            comm=CommSettings(find_unused_parameters=self.run.find_unused_parameters)
            if distributed
            else None,
        )
        self.setup = setup
        self.notes = self._apply_techniques(setup)
        if self.spec.loader_only:
            self.notes.insert(
                0, "loader only: a no-op model, so this is the rate the input pipeline can feed"
            )
        if self.data.images is not None and self.data.images.skipped:
            self.notes.append(self.data.images.note())
        if workers := self.data.loader_workers:
            # its arm runs alone for them (arms.loader_workers_apart), but their CPU is not this process's
            self.notes.append(f"cpu_util_pct leaves out the DataLoader's {workers} worker process(es)")
        data = self.data.for_one_arm()  # a DataLoader's shuffling state is this arm's alone
        with self.active():  # a technique's switches may matter while its pipeline is built
            if setup.make_batches is not None:  # an input pipeline that replaces the DataLoader (dali)
                batches = setup.make_batches(data, self.run.batch_size, self.run.seed)
            else:
                batches = endless_batches(
                    data,
                    self.run.batch_size,
                    self.run.seed,
                    setup.loader_options,
                    self.rank.rank,
                    self.rank.world_size,
                )
            self.trainer = Trainer(setup, batches)
        # random_state.keep() ran on leaving active(): the generators as seeded and used by the build.

    def _apply_techniques(self, setup: TrainSetup) -> list[str]:
        """Apply each technique in order; with several ranks, wrap the model in DDP at DDP_ORDER."""
        notes, wrapped = [], not self.rank.distributed
        for technique, config in self.spec.techniques:
            if not wrapped and technique.order > DDP_ORDER:
                setup.model, wrapped = wrap_ddp(setup.model, setup.device, setup.comm, self.meter), True
            notes.append(technique.apply(setup, config))
        if not wrapped:
            setup.model = wrap_ddp(setup.model, setup.device, setup.comm, self.meter)
        if self.rank.distributed:
            notes += setup.comm.notes  # what the DDP wrapper had to adapt, said once
            if setup.device.type == "cpu":
                notes.append(f"{torch.get_num_threads()} CPU thread(s) per rank")
            if self.run.link is not None:
                notes.append(
                    self.run.link.describe()
                    + " (a simulation: each bucket is delayed by latency + bytes/bandwidth)"
                )
        return notes

    def warm_up(self, steps: int, emit: Callable[[dict], None]) -> None:
        """Untimed steps; the first one pays compilation, allocation and autotuning (startup_s)."""
        clock = StepClock(self.device)
        with self.active():
            for index in range(steps):
                self.losses.append(self.trainer.step(clock))
                self.timed.append(False)
                if index == 0:
                    synchronize(self.device)
                    self.startup_s = time.perf_counter() - self._build_started
                    emit({"type": "phase", "arm": self.name, "phase": "warmup", "startup_s": self.startup_s})
            synchronize(self.device)
        clock.resolve()
        self.warmup_steps_s = clock.step_s
        # The first step pays one-off costs; the others tell how long a step takes (choose_rounds).
        later = clock.step_s[1:] or clock.step_s
        self.warmup_step_s = float(np.median(later)) if later else 0.0

    def run_window(
        self, steps: int, round_index: int, emit: Callable[[dict], None], interval_s: float, rewarm: int = 0
    ) -> None:
        """One timed window of ``steps`` steps, with the arm's memory and CPU time over it.

        ``rewarm`` untimed steps run first: the other arms' windows have filled the CPU caches
        (and on a GPU, its L2) with their own weights and activations, and a real training job,
        which runs one model step after step, does not pay for bringing them back.
        """
        before = len(self.clock.step_s)
        cpu = WindowCpu(workers=bool(self.setup.loader_options.get("num_workers")))
        with self.active():
            untimed = StepClock(self.device)
            for _ in range(rewarm):
                self.losses.append(self.trainer.step(untimed))
                self.timed.append(False)
            samples_before = self.trainer.samples_seen  # after the re-warm: its samples are not timed
            self.memory.window_start()
            # The wall clock read around the CPU clocks, so that the wall span holds the CPU span.
            started = time.time()  # epoch seconds: the sampler's telemetry is on the same clock
            cpu.start()
            wall_s = timed_window(self.trainer, self.clock, steps, self.losses, emit, interval_s)
            self.timed += [True] * steps
            self.cpu_seconds += cpu.seconds()
            ended = time.time()
            self.cpu_wall_s += ended - started
            self.memory.window_end()
        self.clock.resolve()
        self.windows.append(
            {
                "round": round_index,
                "steps": steps,
                "samples": self.trainer.samples_seen - samples_before,
                "wall_s": wall_s,
                "start": started,
                "end": ended,
                "step_s": self.clock.step_s[before:],
            }
        )

    def refuse_if_over_the_cap(self) -> None:
        """After the warm-up, when memory_cap_mb is set: one extra untimed step's peak. An arm over
        the cap fails here, before its windows, instead of after them all (finish checks again, on
        the peak it reports)."""
        if self.run.memory_cap_mb is None:
            return
        trainer = self.trainer

        def untimed_step() -> None:  # a training step like the warm-up's: its loss is kept with theirs
            self.losses.append(trainer.step(StepClock(self.device)))
            self.timed.append(False)

        with self.active():
            peak_mib = self.memory.peak_of_one_step(
                untimed_step, trainer.model, trainer.optimizer, **self._graph_memory()
            )
        self._refuse_over_the_cap(peak_mib)

    def _graph_memory(self) -> dict:
        """What the memory figures need to know of a replayed CUDA graph (ArmMemory's arguments)."""
        graph = self.setup.graph_step
        return {"graphed": graph is not None, "graph_pool_bytes": getattr(graph, "pool_bytes", 0)}

    def _refuse_over_the_cap(self, peak_mib: float | None) -> None:
        cap = self.run.memory_cap_mb
        if cap is not None and peak_mib is not None and peak_mib > cap:
            # three significant digits, as the table shows it, and more if that would not read above the cap
            least = max(0, 2 - math.floor(math.log10(max(peak_mib, 1e-3))))
            shown = next(
                f"{peak_mib:.{d}f}" for d in range(least, least + 4) if float(f"{peak_mib:.{d}f}") > cap
            )
            raise MemoryCapExceeded(
                f"{self.name} needs {shown} MiB at its peak, {OVER_THE_CAP}{cap:g} allows",
                peak_mib,
            )

    def finish(self, emit: Callable[[dict], None], flop_counts: dict | None = None) -> dict:
        """After the clock stopped: memory (one extra, untimed step) and FLOPs. The arm's measurements.

        ``flop_counts`` is shared by the block's arms: they train the same model on the same
        shapes, and the model's FLOPs do not depend on how a technique computes them.
        """
        emit({"type": "phase", "arm": self.name, "phase": "memory"})
        trainer = self.trainer
        with self.active():
            if self.meter is not None:
                self.meter.enabled = False  # what follows is the harness's, not a hook's
            peak_mib, activation_mib = self.memory.measure_step(
                lambda: trainer.step(StepClock(self.device)),
                trainer.model,
                trainer.optimizer,
                **self._graph_memory(),
            )
            flops = (
                {} if self.spec.loader_only else self._count_flops({} if flop_counts is None else flop_counts)
            )
        self._refuse_over_the_cap(peak_mib)
        wall_s = sum(w["wall_s"] for w in self.windows)
        samples = sum(w["samples"] for w in self.windows)
        steps = sum(w["steps"] for w in self.windows)
        return {
            "startup_s": self.startup_s,
            "wall_s": wall_s,
            "steps": steps,
            "samples": samples,
            "samples_per_s": samples / wall_s,
            "step_s": [s for w in self.windows for s in w["step_s"]],
            "windows": self.windows,
            "phase_ms": self.clock.phase_ms_per_step(),
            "warmup_step_s": self.warmup_steps_s,
            "peak_mem_mib": peak_mib,
            "memory_method": self.memory.method,
            "activation_mib": activation_mib,
            "cpu_util_pct": cpu_utilization_pct(self.cpu_seconds, self.cpu_wall_s),
            "losses": torch.stack(self.losses).float().cpu().tolist(),
            "timed": self.timed,
            "notes": self.notes + self.memory.notes,
            "torch_threads": torch.get_num_threads(),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            **flops,
        }

    def profile(self, trace: TraceFile | None) -> dict:
        """After the clock stopped: ``run.profile_steps`` steps under torch.profiler
        (workbench.profiling), then the same number timed at the batch and at half of it, then
        (for data loaded in this process) what DataLoader workers would feed."""
        trainer = self.trainer
        with self.active():
            if self.meter is not None:
                self.meter.enabled = False
            figures = profile_steps(
                lambda: trainer.step(StepClock(self.device)), self.run.profile_steps, self.device, trace
            )
            figures["batch_scaling"] = self._batch_scaling(max(2 * self.run.profile_steps, 20))
        return {**figures, "loader_feeds": self._loader_feeds()}

    def _loader_feeds(self) -> list[dict]:
        """For a step that loads its Dataset in this process and waits for it a notable share of
        the time: what DataLoaders with workers would feed (data.loader_feed), for the advisor.
        Measured after the clock stopped, in this process, so a notebook's kernel never forks.
        Only for the baseline, whose facts the advisor reads: the others would pay seconds each."""
        setup, phases = self.setup, self.clock.phase_ms_per_step()
        waits = phases.get("data", 0.0) / max(sum(phases.values()), 1e-9)
        if (
            self.spec.name != BASELINE
            or not self.data.is_dataset
            or self.data.whole_stream_per_worker  # workers would each read all of it: unavailable
            or setup.make_batches is not None
            or setup.loader_options.get("num_workers")
            or self.rank.distributed
            or self.spec.loader_only
            or waits < LOADER_PROBE_SHARE
        ):
            return []
        feeds = []
        for count in get_technique("dataloader").tune_space["num_workers"]:
            try:
                feeds.append(loader_feed(self.data, self.run.batch_size, self.run.seed, count))
            except Exception as error:  # a Dataset workers cannot load (an open file handle, CUDA tensors)
                return [{"workers": count, "error": error_line(error)}]
        return feeds

    def _batch_scaling(self, steps: int) -> dict:
        """Step times at the arm's batch and at half of it, interleaved step by step.

        Work grows with the batch; what each operation or kernel costs to launch does not. With
        t = fixed + batch x per_sample, the two sizes give ``fixed``, what the step pays whatever
        its batch (the advisor's launch overhead). No profiler runs here: its own cost per operation would count as fixed. Medians, so that
        one slow step does not decide. Two batches are loaded beforehand and taken in turn: the
        time spent loading each would not halve with the half batch cut from it, and would count
        as fixed.
        """
        trainer, original = self.trainer, self.trainer.batches
        loaded = [next(original), next(original)]
        batch = batch_size_of(*inputs_and_targets(loaded[0]))
        if batch < 2:
            return {}
        full = itertools.cycle(loaded)
        halved = itertools.cycle(
            [map_tensors(b, lambda t: t[: batch // 2] if t.dim() and len(t) == batch else t) for b in loaded]
        )
        clocks = {"full": StepClock(self.device), "half": StepClock(self.device)}
        try:
            for index in range(steps + 1):  # the first pair untimed: the half batch's first allocation
                for label, batches in (("full", full), ("half", halved)):
                    trainer.batches = batches
                    trainer.step(clocks[label] if index else StepClock(self.device))
        finally:
            trainer.batches = original
        for clock in clocks.values():
            clock.resolve()
        return {
            "batch": batch,
            "half_batch": batch // 2,
            "step_ms": 1e3 * float(np.median(clocks["full"].step_s)),
            "half_batch_step_ms": 1e3 * float(np.median(clocks["half"].step_s)),
        }

    def _count_flops(self, counted: dict) -> dict:
        """FLOPs per sample of the model on a real batch's shapes (see workbench.mfu)."""
        inputs, targets = inputs_and_targets(next(self.trainer.batches))
        shapes = repr([tuple(tensor.shape) for tensor in tensors_of((inputs, targets))])
        if shapes not in counted:
            try:
                flops = count_flops(
                    lambda: build_model(self.model_source, self.data.spec),
                    inputs,
                    targets,
                    self.user_loss or default_loss,
                )
                counted[shapes] = flops / batch_size_of(inputs, targets)
            except Exception as error:  # a model or loss that cannot run on meta tensors: no MFU, said why
                counted[shapes] = f"FLOPs not counted ({type(error).__name__}: {error}); no tflops or MFU"
        if isinstance(counted[shapes], str):
            self.notes.append(counted[shapes])
            return {}
        return {
            "flops_per_sample": counted[shapes],
            "compute_dtype": compute_dtype(self.trainer.model, self.setup.autocast_dtype),
        }

    def release(self) -> None:
        """Drop the arm's model, optimizer and data (after a failure: give its memory to the others)."""
        self.trainer = self.setup = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
