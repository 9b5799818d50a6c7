"""Clocks, memory and utilization: what each arm measures, and how.

Step clock
    Each optimizer step is split into phases: ``data`` (waiting for the next batch and
    copying it to the device), ``forward``, ``backward`` and ``optimizer``. On CPU the
    phases are read with ``time.perf_counter`` (eager CPU kernels run synchronously).
    On CUDA, events are recorded on the stream and read once the window is over, so the
    breakdown adds no synchronization inside the step.

Throughput
    Comes from the wall clock around the whole timed window, with the device
    synchronized before each read. The per-phase numbers explain it; they never replace it.

Peak memory (``peak_mem_mb``): the most bytes live tensors held at once during a step.
    CUDA: ``torch.cuda.max_memory_allocated`` over the timed window.
    CPU: the same quantity, measured in one extra step after the timed window (so the
    profiler costs the timing nothing): the peak the CPU allocator reports during that step,
    from the profiler's allocation events, plus the weights, buffers, gradients and optimizer
    state already live when it starts. Compiled graphs are included.

Resident memory (``peak_rss_mb``): what the operating system sees, the growth of the
    process's resident set: the high-water mark (``VmHWM``, reset at the start of the window
    through ``/proc/self/clear_refs``) minus the resident size measured just before the model
    was built (after ``malloc_trim`` returned the free heap pages left by data loading). It includes allocator
    slack: glibc keeps freed blocks, which hides much of what activation checkpointing
    saves (measured here: 9% less RSS where live tensors drop by 41%). It is what the
    out-of-memory killer looks at. DataLoader worker processes are not included. Where the
    high-water mark cannot be reset it falls back to ``ru_maxrss`` (lifetime peak).

Utilization
    CPU time (user + system) of the training process and its live children (DataLoader
    workers) over the window, divided by wall time and by the cores it may use.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# "replay": a captured CUDA graph of the whole compute step (cuda_graphs), which has no inner phases.
PHASES = ("data", "forward", "backward", "optimizer", "replay")


class StepClock:
    """Per-phase time of each step. Call ``start()``, ``lap(phase)`` after each phase, ``stop()``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self.step_s: list[float] = []
        self._events: list[tuple[str, torch.cuda.Event]] = []
        self._last = 0.0
        self._step_start = 0.0

    def start(self) -> None:
        if self.cuda:
            self._events.append(("start", self._record()))
        else:
            self._last = self._step_start = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.cuda:
            self._events.append((phase, self._record()))
        else:
            now = time.perf_counter()
            self.phase_s[phase] += now - self._last
            self._last = now

    def stop(self) -> None:
        if self.cuda:
            self._events.append(("stop", self._record()))
        else:
            self.step_s.append(self._last - self._step_start)

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
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
        self._events.clear()

    def phase_ms_per_step(self) -> dict[str, float]:
        steps = max(len(self.step_s), 1)
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
    """Bytes of the tensors that outlive a step: weights, buffers, gradients, optimizer state."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _profiled_peak_bytes(step: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator handed out during ``step``, read from profiler allocation events."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    peak, pending = 0, list(profiler.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            peak = max(peak, node.typed[1].total_allocated)
    return peak


class PeakMemory:
    """Peak memory of training, in MiB (see the module docstring): tensors, and the process's RSS."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = (
            "cuda.max_memory_allocated" if device.type == "cuda" else "cpu-allocator-peak (profiled step)"
        )
        self.rss_method = "rss-hwm-growth"
        self._base_kb = 0

    def mark_before_model(self) -> None:
        _return_free_heap_to_os()  # as in begin_window, so both readings see a trimmed heap
        self._base_kb = _read_status_kb("VmRSS") or _maxrss_kb()

    def begin_window(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if not _reset_rss_peak():
            self.rss_method = "ru_maxrss-growth (lifetime peak: the high-water mark could not be reset)"

    def rss_growth_mib(self) -> float:
        peak_kb = _read_status_kb("VmHWM") if self.rss_method == "rss-hwm-growth" else None
        return max((peak_kb or _maxrss_kb()) - self._base_kb, 0) / 1024

    def tensor_peak_mib(
        self, step: Callable[[], object], model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> float:
        """CUDA: the window's max_memory_allocated. CPU: one extra, untimed step under the profiler."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        resident = _live_tensor_bytes(model, optimizer)
        try:
            return (resident + _profiled_peak_bytes(step)) / 2**20
        except (ImportError, AttributeError, RuntimeError):  # the profiler's event tree is not public API
            self.method = "rss-hwm-growth (allocator events unavailable in this PyTorch)"
            return self.rss_growth_mib()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity API
        return os.cpu_count() or 1


class CpuUsage:
    """CPU seconds of this process and its live children (DataLoader workers) over a window."""

    def __init__(self):
        import psutil

        self._process = psutil.Process()
        self._start_cpu = 0.0
        self._start_wall = 0.0

    def _cpu_seconds(self) -> float:
        total = 0.0
        for process in [self._process, *self._process.children(recursive=True)]:
            try:
                times = process.cpu_times()
                total += times.user + times.system
            except Exception:  # a worker may exit between listing and reading
                continue
        return total

    def begin(self) -> None:
        self._start_cpu, self._start_wall = self._cpu_seconds(), time.perf_counter()

    def percent(self) -> float:
        """Share of the usable cores kept busy, in percent (100 = every usable core busy)."""
        wall = time.perf_counter() - self._start_wall
        return 100.0 * (self._cpu_seconds() - self._start_cpu) / max(wall, 1e-9) / usable_cores()


class _NvmlReader:
    """GPU utilization, memory, power and SM clock of every visible GPU, through NVML.

    Needs nvidia-ml-py (the ``gpu`` extra) and an NVIDIA driver; otherwise ``available`` is
    False and the sampler records CPU figures only.
    """

    def __init__(self):
        self.available = False
        self.reason = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.available = bool(self._handles)
            self.reason = "" if self.available else "NVML sees no GPU"
        except ImportError:
            self.reason = "nvidia-ml-py is not installed (pip install 'workbench[gpu]')"
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
        try:
            while not self._stop.wait(self.interval_s):
                memory = psutil.virtual_memory()
                sample = {
                    "time": time.time(),
                    "cpu_percent": psutil.cpu_percent(interval=None),
                    "memory_used_mib": (memory.total - memory.available) / 2**20,
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
