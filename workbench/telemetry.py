"""Clocks, memory and utilization: what each arm measures, and how.

Step clock
    Each optimizer step is split into phases: ``data`` (waiting for the next batch and
    copying it to the device), ``forward``, ``backward`` and ``optimizer`` (or ``replay``: a
    captured CUDA graph of the whole compute step). On CPU the
    phases are read with ``time.perf_counter`` (eager CPU kernels run synchronously).
    On CUDA, events are recorded on the stream and read once the window is over, so the
    breakdown adds no synchronization inside the step; as an event costs the CPU about what a
    kernel launch does, the phases are marked on every 8th step only (``CUDA_PHASE_EVERY``),
    while every step still gets its own time.

Windows
    Each timed window (see workbench.block) reads the wall clock around its steps, with the
    device synchronized before each read, and keeps every step's time. How a window's or a
    block's step times become one figure is workbench.stats' business. The per-phase
    numbers explain the step; they never replace it.

Peak memory (``peak_mem_mb``): the most bytes this arm's tensors held at once during a step.
    Several arms may share the process (a block), so it is the arm's own persistent tensors
    (weights, buffers, optimizer state) plus the most a step allocated on top of what was
    live when it began: see :class:`ArmMemory`. CUDA reads the allocator's peak per window;
    CPU runs one extra step after the timed windows under the profiler. Compiled graphs are
    included.

Activation memory (``activation_mb``): the tensors autograd saved for backward in one step,
    read with saved-tensor hooks in that extra step. Checkpointing's saving shows here.

Resident memory (``peak_rss_mb``): what the operating system sees, the growth of the
    process's resident set: the high-water mark (``VmHWM``, reset when the timed windows begin
    through ``/proc/self/clear_refs``) minus the resident size measured just before the models
    were built (after ``malloc_trim`` returned the free heap pages left by data loading). It
    includes allocator slack: glibc keeps freed blocks, which hides much of what activation
    checkpointing saves (measured here: 9% less RSS where live tensors drop by 41%). It is
    what the out-of-memory killer looks at. DataLoader worker processes are not included.
    Where the high-water mark cannot be reset it falls back to ``ru_maxrss`` (lifetime peak).
    It is process-wide, so it cannot be split between the arms of a block: the arm of a
    process of its own reports it, a block reports it once for all its arms.

Utilization
    CPU time (user + system) of the training process and its live children (DataLoader
    workers) over the arm's windows, divided by their wall time and by the cores it may use.
"""

from __future__ import annotations

import math
import os
import resource
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from workbench.config import started_by_torchrun
from workbench.optional import install_hint, missing
from workbench.stats import PHASES

# How often the CUDA clock marks the phases inside a step: every 8th step. Every step still gets
# its own time. Why: on CUDA each mark is an event recorded on the stream, and recording one costs
# the CPU about what a kernel launch costs. On an H100 machine (benchmarks/overhead.py at
# bfbf9f5) the clock's six fresh events a step added 247 us to a 608 us step of a trivial model,
# 6% of mlp's launch-bound step, and a launch-bound arm pays it as well, which pulls every
# speedup toward 1. The phase breakdown is a mean per step, so a regular sample of steps
# estimates it.
CUDA_PHASE_EVERY = 8


class StepClock:
    """Per-phase time of each step. Call ``start()``, ``lap(phase)`` after each phase, ``stop()``.

    On CUDA, three things keep the marks cheap: a step's last lap also ends it, and that event
    begins the next step too (between two steps of a window the harness queues no work);
    events are recorded again once read, not created anew; and the phases are marked on every
    ``phase_every``-th step only (``CUDA_PHASE_EVERY``), the others being one event each.
    ``resolve()`` ends a window: the next step begins with an event of its own, so that time
    spent between windows (other arms' windows) is never a step's.
    """

    def __init__(self, device: torch.device, phase_every: int | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.phase_every = phase_every or (CUDA_PHASE_EVERY if self.cuda else 1)
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self.phase_steps = 0  # steps whose phases were marked: what phase_s adds up
        self.step_s: list[float] = []
        self._steps_started = 0
        self._marking = True  # whether the current step's phases are marked
        self._events: list[tuple[str, torch.cuda.Event]] = []  # since the last resolve()
        self._spare: list[torch.cuda.Event] = []  # events already read, to be recorded again
        self._boundary: torch.cuda.Event | None = None  # the end of the previous step in this window
        self._last = 0.0
        self._step_start = 0.0

    def start(self) -> None:
        self._marking = self._steps_started % self.phase_every == 0
        self._steps_started += 1
        if self.cuda:
            if self._boundary is None:
                self._boundary = self._record()
            self._events.append(("start", self._boundary))
        else:
            self._last = self._step_start = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.cuda:
            if self._marking:
                self._events.append((phase, self._record()))
        else:  # a clock read costs well under a microsecond: the step's end is its last lap
            now = time.perf_counter()
            if self._marking:
                self.phase_s[phase] += now - self._last
            self._last = now

    def stop(self) -> None:
        if self._marking:
            self.phase_steps += 1
        if self.cuda:
            label, latest = self._events[-1]
            # The step's last lap is its end. What little is queued after it (a graphed step's
            # copy of the loss) falls into the next step: a window's steps still add up to it.
            end = latest if label != "start" else self._record()
            self._events.append(("stop", end))
            self._boundary = end
        else:
            self.step_s.append(self._last - self._step_start)

    def _record(self) -> torch.cuda.Event:
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self) -> None:
        """Turn recorded CUDA events into seconds. Call after synchronizing the device."""
        if not self.cuda:
            return
        step_start = previous = None
        for phase, event in self._events:
            if phase == "start":
                step_start = previous = event
            elif phase == "stop":
                self.step_s.append(step_start.elapsed_time(event) / 1e3)
            else:
                self.phase_s[phase] += previous.elapsed_time(event) / 1e3
                previous = event
        read = {id(event): event for _, event in self._events}  # a boundary appears twice
        self._spare.extend(read.values())
        self._events.clear()
        self._boundary = None

    def phase_ms_per_step(self) -> dict[str, float]:
        steps = max(self.phase_steps, 1)
        return {phase: 1e3 * seconds / steps for phase, seconds in self.phase_s.items()}


def _read_status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # "5" resets the peak resident set size (Linux >= 4.0)
        return True
    except OSError:
        return False


def _return_free_heap_to_os() -> None:
    """glibc keeps freed memory mapped; malloc_trim(0) hands whole free pages back.

    Done once, before the model is built, so the RSS baseline is not inflated by free heap
    left over from loading data. Never at the start of the timed window: the steps would
    then pay page faults to get that memory back, and the clock would count them.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc (macOS, musl): nothing to trim this way


def _maxrss_kb() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if os.uname().sysname == "Darwin" else peak  # bytes on macOS, KiB on Linux


def _live_tensor_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors that outlive a step: weights, buffers, gradients, optimizer state.

    The optimizer's own parameters count too: amp's O2 steps float32 masters of the 16-bit
    weights, which the model does not hold (each storage is counted once)."""
    held = [*model.parameters(), *(p for group in optimizer.param_groups for p in group["params"])]
    tensors = [*held, *model.buffers()]
    tensors += [p.grad for p in held if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _gradient_bytes(model: torch.nn.Module) -> int:
    return sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)


def _held_by_graph(pool_bytes: int, model: torch.nn.Module) -> int:
    """What a CUDA graph's private pool holds beyond the gradients, which the resident term counts."""
    return max(0, pool_bytes - _gradient_bytes(model))


def _profiled_peak_bytes(step: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator held during ``step`` beyond what it held when the step began,
    read from profiler allocation events.

    Each event's ``total_allocated`` is a running count that carries over from earlier profiled
    steps in the process (64 MiB kept from one step read as 65 MiB in the next step's 1 MiB), and
    misses what was freed between them: so the count is read from where this step's first event
    found it, not from zero."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    events, pending = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            events.append((node.start_time_ns, node.typed[1].total_allocated, node.typed[1].alloc_size))
    if not events:
        return 0
    _, total, size = min(events)
    began = total - size  # the count before the first allocation (or free) of the step
    return max(0, max(total for _, total, _ in events) - began)


def _saved_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``tensor`` reaches: [start, end). A view of a larger tensor
    (a batch sliced from a dataset held in memory) reaches only its own part."""
    if tensor.numel() == 0:
        return 0, 0
    size = tensor.element_size()
    start = tensor.storage_offset() * size
    reach = 1 + sum(
        (length - 1) * abs(stride) for length, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return start, start + reach * size


def _union_bytes(spans: dict[tuple[int, int], int]) -> int:
    """How many bytes the spans cover together (overlaps counted once)."""
    covered, reached = 0, -1
    for start, end in sorted(spans):
        if end > reached:
            covered += end - max(start, reached)
            reached = end
    return covered


def _saved_activation_bytes(step: Callable[[], object], model: torch.nn.Module) -> int:
    """Peak bytes autograd held for backward during ``step``: the activations, read with saved-tensor hooks.

    Every tensor an operation saves for its backward passes the pack hook; the bytes they
    span in their storages, less the parameters' (weights are saved too, but they are not
    activations), are the activation memory. Spans, not whole storages: a batch sliced from a
    dataset preloaded as one tensor counts as the slice, as a copied batch would, not as the
    whole dataset; and a tensor saved twice, or two views that overlap, count once. A span
    counts from its first save until the last tensor autograd saved on it is released (after
    the backward that used it), so under gradient accumulation each micro-batch's activations
    come and go, and the figure is the most held at once. Inside a checkpointed region
    PyTorch's own hook takes over and keeps nothing, which is exactly the saving this number
    shows.
    """
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live: dict[int, dict[tuple[int, int], int]] = {}  # storage address -> {span: saved tensors}
    held = {"now": 0, "peak": 0}

    def release(address: int, span: tuple[int, int]) -> None:
        spans = live.get(address)
        if spans is None or span not in spans:
            return
        before = _union_bytes(spans)
        spans[span] -= 1
        if spans[span] == 0:
            del spans[span]
        held["now"] -= before - _union_bytes(spans)
        if not spans:
            del live[address]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        try:
            address = tensor.untyped_storage().data_ptr()
            span = _saved_span(tensor)
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
            return tensor
        if address in parameters:
            return tensor
        spans = live.setdefault(address, {})
        before = _union_bytes(spans)
        spans[span] = spans.get(span, 0) + 1
        held["now"] += _union_bytes(spans) - before
        held["peak"] = max(held["peak"], held["now"])
        weakref.finalize(tensor, release, address, span)  # autograd lets go of it after its backward
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return held["peak"]


class ArmMemory:
    """Peak tensor memory of one arm, in MiB, when other arms may share the process.

    Peak = the arm's own persistent tensors (weights, buffers, optimizer state) + the most
    that a step of this arm allocated on top of what was live when the step began (the
    per-window delta). Other arms' tensors are live too, but they are in both terms of the
    delta, so they cancel.
    CUDA: ``memory_allocated`` at each window's start, ``max_memory_allocated`` after it (the
    peak statistics are reset per window), the largest delta over the arm's windows.
    CPU: the allocator keeps no peak, so one extra, untimed step runs under the profiler,
    whose allocation events count only what was allocated while it ran (the delta).
    Activation memory (``activation_mib``) is read in that extra step with saved-tensor hooks.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.method = (
            "cuda.max_memory_allocated per window" if self.cuda else "cpu-allocator-peak (profiled step)"
        )
        self.notes: list[str] = []
        self._window_start_bytes = 0
        self._transient_bytes = 0

    def window_start(self) -> None:
        if self.cuda:
            self._window_start_bytes = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def window_end(self) -> None:
        if self.cuda:
            delta = torch.cuda.max_memory_allocated(self.device) - self._window_start_bytes
            self._transient_bytes = max(self._transient_bytes, delta)

    def measure_step(
        self,
        step: Callable[[], object],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        graphed: bool = False,
        graph_pool_bytes: int = 0,
    ) -> tuple[float, float]:
        """(peak MiB, activation MiB) after the timed windows; runs one extra step (see the class).

        ``graphed``: the step is a replayed CUDA graph, whose private pool (``graph_pool_bytes``:
        activations, gradients, temporaries) is held for the graph's lifetime. Replays allocate
        nothing, so the windows' deltas never see it: it is added whole, less the gradients that
        the resident term already counts (they live in that pool). Without it an H200 run showed
        resnet-mini's graphed arm at 2 MiB against the eager step's 39 MiB.
        """
        resident = _live_tensor_bytes(model, optimizer)
        activation = float("nan")
        if graphed:  # a replayed CUDA graph runs no autograd: there is nothing to hook
            step()
            self.notes.append("activation memory not measured: the step is a replayed CUDA graph")
            held_by_graph = _held_by_graph(graph_pool_bytes, model)
            return (resident + self._transient_bytes + held_by_graph) / 2**20, activation

        def hooked_step() -> None:
            nonlocal activation
            activation = _saved_activation_bytes(step, model) / 2**20

        if self.cuda:
            self._run(hooked_step, step)
            return (resident + self._transient_bytes) / 2**20, activation
        try:
            transient = _profiled_peak_bytes(lambda: self._run(hooked_step, step))
        except (ImportError, AttributeError):  # the profiler's event tree is not public API
            self.method = "not measured (allocator events unavailable in this PyTorch)"
            return float("nan"), activation
        return (resident + transient) / 2**20, activation

    def peak_of_one_step(
        self,
        step: Callable[[], object],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        graphed: bool = False,
        graph_pool_bytes: int = 0,
    ) -> float:
        """Peak MiB of one extra step measured on its own, before the windows (memory_cap_mb's early
        check): as ``measure_step`` counts it (the same arguments), without the activation hooks.
        NaN: not measurable."""
        resident = _live_tensor_bytes(model, optimizer)
        if graphed:
            step()  # a replay allocates nothing: the pool holds the step's memory (measure_step)
            return (resident + _held_by_graph(graph_pool_bytes, model)) / 2**20
        if self.cuda:
            torch.cuda.synchronize(self.device)
            started = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            step()
            torch.cuda.synchronize(self.device)
            return (resident + torch.cuda.max_memory_allocated(self.device) - started) / 2**20
        try:
            return (resident + _profiled_peak_bytes(step)) / 2**20
        except (ImportError, AttributeError):
            return float("nan")

    def _run(self, hooked_step: Callable[[], None], step: Callable[[], object]) -> None:
        try:
            hooked_step()
        except RuntimeError as error:  # e.g. a compiled graph that refuses saved-tensor hooks
            self.notes.append(f"activation memory not measured ({error})")
            step()


class ProcessRss:
    """Growth of the process's resident set (what the OS sees): see the module docstring.

    It is process-wide: in a block, every arm's tensors, caches and allocator slack are in
    it together, so it describes the block, not one arm.
    """

    def __init__(self):
        self.method = "rss-hwm-growth"
        self._base_kb = 0

    def mark_before_models(self) -> None:
        _return_free_heap_to_os()
        self._base_kb = _read_status_kb("VmRSS") or _maxrss_kb()

    def begin_windows(self) -> None:
        if not _reset_rss_peak():
            self.method = "ru_maxrss-growth (lifetime peak: the high-water mark could not be reset)"

    def growth_mib(self) -> float:
        peak_kb = _read_status_kb("VmHWM") if self.method == "rss-hwm-growth" else None
        return max((peak_kb or _maxrss_kb()) - self._base_kb, 0) / 1024


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity API
        return os.cpu_count() or 1


def threads_per_rank(ranks: int) -> int:
    """The intra-op threads each of ``ranks`` CPU ranks on this machine gets by default: the usable
    cores shared out, at least one each (more ranks than cores then oversubscribe them)."""
    return max(1, usable_cores() // ranks)


def cpu_utilization_pct(cpu_seconds: float, wall_s: float) -> float:
    """CPU time over wall time, as a share of the usable cores (100: every core busy), at most 100.

    The cap is for the kernel's bookkeeping, not a rounding of the measurement: a thread that is
    running while its process's CPU clock is read has its time since the last scheduler tick (1
    to 4 ms) left out. Windows of a few milliseconds start and end at such readings, so each
    window's CPU time errs by up to a tick per running thread, either way, and with every core
    busy, a run's sum came to 101-104% of the cores. Anything above 100 is that error.
    """
    return min(100.0, 100.0 * cpu_seconds / max(wall_s, 1e-9) / usable_cores())


def process_cpu_seconds(children: list | None = None, reaped: bool = False) -> float:
    """CPU seconds (user + system) of this process, plus those of ``children`` (psutil.Process list).

    Each process's time is read from its CPU clock, in nanoseconds (os.times() and /proc count
    in 10-ms ticks, coarse beside windows of a few milliseconds); its running threads' latest
    time still lags by up to a scheduler tick (``cpu_utilization_pct``). An arm's windows count
    theirs with ``WindowCpu``, which also follows workers that come and go.
    ``reaped`` adds the time of the children each of these processes has already waited for, so
    that a child that exited still counts (CompetingLoad); that time is known only in ticks.
    """
    total = time.process_time()
    if reaped:
        total += _reaped_children_s()
    return total + sum(_cpu_seconds_of(child, reaped) for child in children or ())


def _cpu_seconds_of(process, reaped: bool) -> float:
    """Another process's CPU seconds (psutil.Process), with its reaped children's if ``reaped``;
    0 for one that exited between listing and reading."""
    try:
        total = _cpu_clock_seconds(process)
        if reaped:
            times = process.cpu_times()
            total += times.children_user + times.children_system
    except Exception:
        return 0.0
    return total


def _cpu_clock_seconds(process) -> float:
    """The CPU seconds of another process (psutil.Process), from its CPU clock on Linux (the clock
    id clock_getcpuclockid(3) gives: the pid, inverted, shifted past the clock's type), in ticks
    elsewhere."""
    try:
        return time.clock_gettime(((~process.pid) << 3) | 2)  # 2: CPUCLOCK_SCHED, the whole process
    except (AttributeError, OSError):  # no clock_gettime (Windows), or not Linux's clock ids
        times = process.cpu_times()
        return times.user + times.system


class WindowCpu:
    """The CPU seconds of this process and its DataLoader workers over one timed window.

    The workers are listed at the window's start and again at its end (about a millisecond each,
    so only for an arm that has workers): a DataLoader without persistent workers starts new ones
    every epoch, which a list made once, at the first window, never saw (an arm doing the same
    work read 24% where its persistent twin read 69%). A worker that exits inside the window is
    counted through its parent, which reaps it: its lifetime, less what the start had counted
    (left out, its whole lifetime was taken off the window, and the figure could go below 0).
    """

    def __init__(self, workers: bool):
        self.workers = workers
        self._start: dict[int, float] = {}
        self._reaped_start = 0.0

    def start(self) -> None:
        self._start = self._read()
        self._reaped_start = _reaped_children_s()

    def seconds(self) -> float:
        """The CPU seconds since ``start``, at least 0."""
        end = self._read()
        total = sum(now - self._start.get(pid, 0.0) for pid, now in end.items())
        gone = self._start.keys() - end.keys()
        if gone:  # exited in the window: reaped by now (their lifetimes), or still to be
            reaped = _reaped_children_s() - self._reaped_start
            total += max(0.0, reaped - sum(self._start[pid] for pid in gone))
        return max(0.0, total)

    def _read(self) -> dict[int, float]:
        times = {os.getpid(): time.process_time()}
        for child in worker_processes() if self.workers else ():
            try:
                times[child.pid] = _cpu_clock_seconds(child)
            except Exception:  # exited between listing and reading
                continue
        return times


def _reaped_children_s() -> float:
    times = os.times()
    return times.children_user + times.children_system


def worker_processes() -> list:
    """This process's live children (DataLoader workers), as psutil.Process objects."""
    import psutil

    return psutil.Process().children(recursive=True)


class _NvmlReader:
    """GPU utilization, memory, power and SM clock of every visible GPU, through NVML.

    Needs nvidia-ml-py (the ``gpu`` extra) and an NVIDIA driver; otherwise ``available`` is
    False and the sampler records CPU figures only.
    """

    def __init__(self):
        self.available = False
        self.reason = missing("pynvml", install_hint("pynvml")) or ""
        if self.reason:  # not installed, or set aside (WORKBENCH_WITHOUT)
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.available = bool(self._handles)
            self.reason = "" if self.available else "NVML sees no GPU"
        except ImportError:
            self.reason = f"nvidia-ml-py is not installed ({install_hint('pynvml')})"
        except Exception as error:  # pynvml.NVMLError: no driver, no device
            self.reason = f"NVML unavailable: {error}"

    def read(self) -> dict:
        sample = {}
        for index, handle in enumerate(self._handles):
            utilization = self._nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            sample[f"gpu{index}_util_percent"] = float(utilization.gpu)
            sample[f"gpu{index}_memory_used_mib"] = memory.used / 2**20
            sample[f"gpu{index}_power_w"] = self._nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
            sample[f"gpu{index}_sm_clock_mhz"] = float(
                self._nvml.nvmlDeviceGetClockInfo(handle, self._nvml.NVML_CLOCK_SM)
            )
        return sample

    def close(self) -> None:
        if self.available:
            self._nvml.nvmlShutdown()


def nvml_indices(device: torch.device, world_size: int = 1) -> list[int]:
    """NVML's indices of the GPUs a run uses: ``device``, or local ranks 0..world_size-1.

    NVML numbers every GPU in the machine and ignores CUDA_VISIBLE_DEVICES, so CUDA device i
    is matched to its NVML twin by PCI address; without NVML the CUDA index is returned.
    """
    cuda_indices = [device.index or 0] if world_size == 1 else list(range(world_size))
    if missing("pynvml"):
        return cuda_indices
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            addresses = {}
            for index in range(pynvml.nvmlDeviceGetCount()):
                pci = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
                addresses[(pci.domain, pci.bus, pci.device)] = index
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # nvidia-ml-py missing or NVML unusable: keep CUDA's numbering
        return cuda_indices
    found = []
    for index in cuda_indices:
        props = torch.cuda.get_device_properties(index)
        address = tuple(getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device"))
        found.append(addresses.get(address, index))
    return found


class CompetingLoad:
    """What the rest of the machine does while the run measures: the CPU that processes outside
    this run's process tree use (in cores), the 1-minute load average, and the CPU clock.

    The run's own CPU time is that of this process and its live descendants (under torchrun,
    of the agent that started every local rank, and its descendants), each with the
    time of the children it has reaped (``process_cpu_seconds(..., reaped=True)``), so a worker
    that exits between two readings is still counted, through its parent. Another program on the machine slows the
    arms unevenly and widens every interval; ``others_cpu_cores`` says how much of it there was.
    """

    def __init__(self):
        import psutil

        self._psutil = psutil
        # Under torchrun the run is every local rank: their agent's tree, not this rank's alone
        # (the other rank's core was warned about as another program's).
        self._agent = psutil.Process().parent() if started_by_torchrun() else None
        self._last = (time.monotonic(), self._machine_busy_s(), self._run_cpu_s(), self._steal_s())

    def _machine_busy_s(self) -> float:
        times = self._psutil.cpu_times()
        return sum(times) - times.idle - getattr(times, "iowait", 0.0)

    def _run_cpu_s(self) -> float:
        if self._agent is None:
            return process_cpu_seconds(worker_processes(), reaped=True)
        try:
            tree = [self._agent, *self._agent.children(recursive=True)]
        except self._psutil.Error:  # the agent is gone: this rank is about to be ended too
            return process_cpu_seconds(worker_processes(), reaped=True)
        return sum(_cpu_seconds_of(process, reaped=True) for process in tree)

    def _steal_s(self) -> float:
        # In a virtual machine, the time the hypervisor gave this machine's CPUs to other guests:
        # load that no process here shows. It is part of "busy" above, so of others_cpu_cores.
        return float(getattr(self._psutil.cpu_times(), "steal", 0.0))

    def read(self) -> dict:
        now, busy, run, steal = time.monotonic(), self._machine_busy_s(), self._run_cpu_s(), self._steal_s()
        last_now, last_busy, last_run, last_steal = self._last
        self._last = (now, busy, run, steal)
        elapsed = max(now - last_now, 1e-6)
        reading = {
            "others_cpu_cores": max(0.0, (busy - last_busy) - (run - last_run)) / elapsed,
            "steal_cpu_cores": max(0.0, steal - last_steal) / elapsed,
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan,
        }
        try:
            frequency = self._psutil.cpu_freq()
            if frequency is not None and frequency.current:
                reading["cpu_mhz"] = float(frequency.current)
        except (OSError, NotImplementedError, AttributeError):
            pass  # no cpufreq here (many VMs): the column stays empty
        return reading


LOAD_WARN_CORES = 0.25  # other processes using this much CPU (median, in cores) is worth a warning


def competing_load(samples: list[dict], cores: int) -> dict:
    """The run's competing load, summarized from the sampler's readings, with a warning when
    it is high enough to matter (empty ``warning`` otherwise)."""
    others = [s["others_cpu_cores"] for s in samples if "others_cpu_cores" in s]
    if not others:
        return {}
    loads = [s["load_avg_1m"] for s in samples if math.isfinite(s.get("load_avg_1m", math.nan))]
    steals = [s["steal_cpu_cores"] for s in samples if "steal_cpu_cores" in s]
    summary = {
        "others_cpu_cores_median": float(np.median(others)),
        "others_cpu_cores_p90": float(np.percentile(others, 90)),
        "load_avg_1m_median": float(np.median(loads)) if loads else math.nan,
        "steal_cpu_cores_p90": float(np.percentile(steals, 90)) if steals else math.nan,
        "cores": cores,
        "warning": "",
    }
    if summary["others_cpu_cores_median"] >= LOAD_WARN_CORES:
        summary["warning"] = (
            f"other processes used {summary['others_cpu_cores_median']:.2f} of this machine's {cores} cores "
            f"(median; {summary['others_cpu_cores_p90']:.2f} at the 90th percentile) while the arms ran: they slow "
            "the arms unevenly and widen every interval. Rerun on a quieter machine, or with more blocks"
        )
        if summary["steal_cpu_cores_p90"] >= LOAD_WARN_CORES / 2:
            summary["warning"] += (
                f" (up to {summary['steal_cpu_cores_p90']:.2f} cores of it was steal time: other virtual "
                "machines on the same host, which no process list here shows)"
            )
    return summary


@dataclass
class Sampler:
    """Background sampler of machine-wide utilization, at ``interval_s`` (1 Hz by default).

    Every sample has ``time``, ``cpu_percent`` and ``memory_used_mib``; with a GPU and
    nvidia-ml-py, also ``gpu<i>_util_percent``, ``gpu<i>_memory_used_mib``, ``gpu<i>_power_w``
    and ``gpu<i>_sm_clock_mhz``. It runs in a daemon thread of the process that drives the
    ablation, so it never competes with the measured arm for the GIL, and it wakes once a
    second, so it takes next to no CPU from it. Samples are plain dicts, stored with the
    results (``Results.telemetry``, ``telemetry.csv``); ``on_sample`` sees each one as it
    is taken (the notebook panel plots them live).
    """

    interval_s: float = 1.0
    on_sample: Callable[[dict], None] | None = None
    gpu: bool = True
    samples: list[dict] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _sample_forever(self) -> None:
        import psutil

        nvml = _NvmlReader() if self.gpu else None
        psutil.cpu_percent(interval=None)  # the first reading only primes the counter
        load = CompetingLoad()
        try:
            # A fixed cadence: the time a reading takes (NVML, psutil) does not stretch the
            # interval, so 1 Hz stays 1 Hz over a long run. A sampler that fell behind (a
            # starved thread) skips ahead rather than catching up in a burst.
            due = time.monotonic() + self.interval_s
            while not self._stop.wait(max(0.0, due - time.monotonic())):
                due += self.interval_s
                if due < time.monotonic():
                    due = time.monotonic() + self.interval_s
                memory = psutil.virtual_memory()
                sample = {
                    "time": time.time(),
                    "cpu_percent": psutil.cpu_percent(interval=None),
                    "memory_used_mib": (memory.total - memory.available) / 2**20,
                    **load.read(),
                }
                if nvml is not None and nvml.available:
                    sample.update(nvml.read())
                self.samples.append(sample)
                if self.on_sample is not None:
                    self.on_sample(sample)
        finally:
            if nvml is not None:
                nvml.close()

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._sample_forever, name="workbench-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return self.samples
