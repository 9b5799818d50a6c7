"""Kernel counts and times of a few training steps, read with ``torch.profiler``.

The step clock (workbench.telemetry) says how long each phase of a step takes; this says
what the step is made of: how many operations Python dispatched, how long each took, how
much of the time went to matrix multiplications and convolutions, and, on CUDA, how many
kernels ran on the GPU and how long the GPU was busy. The advisor (workbench.advisor) reads
these figures to tell a launch-bound step from a compute-bound one.

The profiled steps run after the timed windows and are never part of them: the profiler's
own bookkeeping costs a few microseconds per operation.

Figures, per step:

``ops``
    The operations the step dispatched from Python (``aten::`` operators that no other
    operator called), and ``median_op_us``, their median time from call to return. On a
    GPU each of them launches one or more kernels; on a CPU each runs its own loop.
``op_ms``
    Time inside the dispatched operators, from call to return, against ``profiled_step_ms``
    (the profiled step's wall time): the rest is Python, the autograd engine and the
    optimizer's loop around them.
``op_overhead_ms``
    The part of ``op_ms`` that every operator pays whatever its size: ``no_work_op_us``, the
    time of a one-element add measured on this machine, per dispatched operator (or the
    operator's whole time, if shorter). Small operators are mostly this.
``matmul_conv_ms``
    The part of ``op_ms`` spent in matrix multiplications, attention and convolutions.
``kernels``, ``median_kernel_us``, ``kernel_ms``, ``matmul_conv_kernel_ms`` (CUDA only)
    The same for the kernels the GPU ran: ``kernel_ms`` is the GPU's busy time, the sum of
    its kernels' durations (kernels on one stream do not overlap).
``fp32_matmul_kernel_ms`` (CUDA only)
    Matrix-multiplication kernels whose names say they ran in single precision without
    Tensor Cores (``sgemm`` and no ``tf32``/``xmma``/``hmma``/``bf16``/``f16`` in the name).
    A name is a hint, not a guarantee; the figure says where TF32 or AMP could help.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType

from workbench.devices import synchronize

MATMUL_OR_CONV = re.compile(r"mm|matmul|linear|conv|gemm|attention|scaled_dot_product", re.IGNORECASE)
TENSOR_CORE_HINTS = re.compile(r"tf32|xmma|hmma|bf16|f16|tensorop|cutlass.*(?:h|bf)16", re.IGNORECASE)


@dataclass(frozen=True)
class TraceFile:
    """Where an arm's profiler trace goes, and the results folder of the run that writes it
    (None for a run that keeps none): the trace carries it, so that a later run can tell its own
    traces, which it may replace, from another run's or the user's files, which it must not."""

    path: Path
    owner: str | None = None


# The first key of every trace workbench writes: {"workbench_trace": {"out": owner}, ...}
TRACE_MARK = "workbench_trace"


def profile_steps(
    step: Callable[[], object], steps: int, device: torch.device, trace: TraceFile | None = None
) -> dict:
    """Run ``steps`` calls of ``step`` under the profiler; the figures per step (see the module)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    with profile(activities=activities) as profiler:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall_s = time.perf_counter() - started
    if trace is not None:
        export_trace(profiler, trace)
    figures = summarize_events(profiler.events(), steps, no_work_op_us())
    return {"profiled_step_ms": 1e3 * wall_s / steps, **figures}


def export_trace(profiler, trace: TraceFile) -> None:
    """The profiler's Chrome trace, with workbench's mark put first (read by ``trace_owner``).

    Written beside its place and moved there whole, so that a trace is never half written; the
    mark goes in as text, since a trace can be hundreds of MB that parsing would hold in memory."""
    trace.path.parent.mkdir(parents=True, exist_ok=True)
    exported = trace.path.with_name(f"{trace.path.name}.{os.getpid()}.export.tmp")
    marked = trace.path.with_name(f"{trace.path.name}.{os.getpid()}.tmp")
    try:
        profiler.export_chrome_trace(str(exported))
        mark = json.dumps({TRACE_MARK: {"out": trace.owner}})[1:-1].encode()  # "workbench_trace": {...}
        with open(exported, "rb") as source, open(marked, "wb") as target:
            head = source.read(4096)
            opened = head.index(b"{") + 1
            empty = head[opened:].lstrip().startswith(b"}")
            target.write(head[:opened] + mark + (b"" if empty else b",") + head[opened:])
            shutil.copyfileobj(source, target)
        os.replace(marked, trace.path)
    finally:
        exported.unlink(missing_ok=True)
        marked.unlink(missing_ok=True)


def trace_owner(path: Path) -> tuple[bool, str | None]:
    """Whether workbench wrote the trace at ``path``, and for which results folder (None: a run
    that kept none), from the mark ``export_trace`` put first in it."""
    with open(path, "rb") as file:
        head = file.read(8192).decode("utf-8", errors="replace")
    found = re.match(r'\s*\{\s*"' + TRACE_MARK + r'"\s*:\s*', head)
    if found is None:
        return False, None
    try:
        mark, _ = json.JSONDecoder().raw_decode(head, found.end())
    except ValueError:
        return False, None
    return (True, mark.get("out")) if isinstance(mark, dict) else (False, None)


def no_work_op_us() -> float:
    """How long, inside the profiler, an operator takes that has almost nothing to compute.

    A one-element add on this machine: the dispatcher, the output's allocation, the
    bookkeeping. Every operator pays about this much whatever its size; the advisor counts
    it as overhead, not work.
    """
    from torch.profiler import ProfilerActivity, profile

    tiny = torch.zeros(1)
    for _ in range(50):
        tiny.add(1)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(200):
            tiny.add(1)
    times = [e.cpu_time_total for e in profiler.events() if e.name == "aten::add"]
    return statistics.median(times) if times else 0.0


def summarize_events(events, steps: int, no_work_us: float = 0.0) -> dict:
    """Per-step figures from the profiler's events (separate from profile_steps, to be testable)."""
    operators = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    dispatched = [e.cpu_time_total for e in operators if not _called_by_an_operator(e)]
    figures = {
        "profiled_steps": steps,
        "ops": len(dispatched) / steps,
        "median_op_us": statistics.median(dispatched) if dispatched else None,
        "op_ms": sum(dispatched) / steps / 1e3,
        "no_work_op_us": no_work_us,
        "op_overhead_ms": sum(min(t, no_work_us) for t in dispatched) / steps / 1e3,
        "matmul_conv_ms": sum(e.self_cpu_time_total for e in operators if MATMUL_OR_CONV.search(e.name))
        / steps
        / 1e3,
    }
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    if kernels:
        durations = [e.time_range.elapsed_us() for e in kernels]
        matmul = [e for e in kernels if MATMUL_OR_CONV.search(e.name)]
        fp32 = [e for e in matmul if "sgemm" in e.name.lower() and not TENSOR_CORE_HINTS.search(e.name)]
        figures.update(
            kernels=len(kernels) / steps,
            median_kernel_us=statistics.median(durations),
            kernel_ms=sum(durations) / steps / 1e3,
            matmul_conv_kernel_ms=sum(e.time_range.elapsed_us() for e in matmul) / steps / 1e3,
            fp32_matmul_kernel_ms=sum(e.time_range.elapsed_us() for e in fp32) / steps / 1e3,
        )
    return figures


def _called_by_an_operator(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False
