"""One repeat of one arm, run in a fresh Python process: ``python -m workbench.worker``.

This is the isolation mechanism. Every (arm, repeat) starts from a new interpreter, so
nothing one arm did can leak into the next: not compiled-code caches (TorchDynamo's are
per process), not the caching allocator's pools, not RNG state, not cuDNN/TF32 flags,
not monkey-patched modules. Every arm seeds the same RNGs the same way, so every arm
starts from the same weights and sees the same batches.

The parent sends one JSON line (its ``sys.path``) and then the cloudpickled UnitSpec on
stdin. The worker answers with JSON lines on its stdout (progress, then one result or
error); whatever the user's code prints goes to stderr, which the parent keeps as a log.
Results therefore never travel as pickles.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from workbench.data import DataSource, endless_batches
from workbench.devices import synchronize
from workbench.loop import Trainer, TrainSetup, default_loss, make_optimizer
from workbench.models import NoOpModel, build_model, noop_loss
from workbench.telemetry import CpuUsage, PeakMemory, StepClock


@dataclass
class UnitSpec:
    """Everything one arm's process needs to train and time one repeat."""

    model: Any  # a built-in name or a zero-argument factory
    data: DataSource
    loss_fn: Callable | None
    techniques: list[tuple[Any, Any]]  # (Technique, config), already in composition order
    steps: int
    warmup: int
    batch_size: int
    device: str
    seed: int
    optimizer: str = "adamw"
    lr: float = 1e-3
    progress_interval_s: float = 0.5
    labels: dict[str, Any] = field(default_factory=dict)  # arm name and repeat, for messages
    loader_only: bool = False  # time the input pipeline alone, with a model that does no work


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def _initialize_runtime(device: torch.device) -> None:
    """Pay PyTorch's one-off, per-process costs before any clock or memory baseline starts.

    The first optimizer step imports torch._dynamo (about 1 s and 70 MiB here), and the
    first backward starts the autograd engine and thread pools. Every arm pays this equally
    and none of it is the technique's doing, so it counts neither in startup_s nor in memory.
    """
    import torch._dynamo  # noqa: F401  (imported lazily by torch.optim otherwise)

    weight = torch.zeros(8, 8, device=device, requires_grad=True)
    (weight @ weight).sum().backward()
    torch.optim.SGD([weight], lr=0.1).step()


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


def run_unit(spec: UnitSpec, emit: Callable[[dict], None] = lambda message: None) -> dict:
    """Build, warm up, then time ``spec.steps`` optimizer steps. Returns JSON-ready numbers."""
    device = torch.device(spec.device)
    _initialize_runtime(device)
    started = time.perf_counter()
    _seed_everything(spec.seed)
    memory = PeakMemory(device)
    memory.mark_before_model()

    emit({"type": "phase", "phase": "startup"})
    if spec.loader_only:
        model, loss_fn = NoOpModel().to(device), noop_loss
    else:
        model, loss_fn = build_model(spec.model, spec.data.spec).to(device), spec.loss_fn or default_loss
    setup = TrainSetup(
        model=model,
        device=device,
        loss_fn=loss_fn,
        make_optimizer=make_optimizer(spec.optimizer, spec.lr),
    )
    notes = [technique.apply(setup, config) for technique, config in spec.techniques]
    if spec.loader_only:
        notes.insert(0, "loader only: a no-op model, so this is the rate the input pipeline can feed")
    if spec.data.images is not None and spec.data.images.skipped:
        notes.append(spec.data.images.note())

    with setup.settings:
        if setup.make_batches is not None:  # an input pipeline that replaces the DataLoader (dali)
            batches = setup.make_batches(spec.data, spec.batch_size, spec.seed)
        else:
            batches = endless_batches(spec.data, spec.batch_size, spec.seed, setup.loader_options)
        trainer = Trainer(setup, batches)
        losses = []

        emit({"type": "phase", "phase": "warmup"})
        warmup_clock = StepClock(device)
        for index in range(spec.warmup):
            losses.append(trainer.step(warmup_clock))
            if index == 0:  # the first step pays for compilation, allocation and autotuning
                synchronize(device)
                startup_s = time.perf_counter() - started
                emit({"type": "phase", "phase": "warmup", "startup_s": startup_s})

        emit({"type": "phase", "phase": "measure"})
        clock, cpu = StepClock(device), CpuUsage()
        samples_before = trainer.samples_seen
        memory.begin_window()
        cpu.begin()
        window_start = time.time()
        wall_s = timed_window(trainer, clock, spec.steps, losses, emit, spec.progress_interval_s)
        window_end = time.time()
        clock.resolve()
        cpu_percent = cpu.percent()
        rss_mib = memory.rss_growth_mib()
        samples = trainer.samples_seen - samples_before
        loss_values = torch.stack(losses).float().cpu().tolist()
        # After the clock stopped: on CPU this runs one more (profiled) step to find peak tensor memory.
        peak_mib = memory.tensor_peak_mib(
            lambda: trainer.step(StepClock(device)), trainer.model, trainer.optimizer
        )

    return {
        "startup_s": startup_s,
        "wall_s": wall_s,
        "steps": spec.steps,
        "samples": samples,
        "samples_per_s": samples / wall_s,
        "step_s": clock.step_s,
        "phase_ms": clock.phase_ms_per_step(),
        "peak_mem_mib": peak_mib,
        "memory_method": memory.method,
        "peak_rss_mib": rss_mib,
        "rss_method": memory.rss_method,
        "cpu_util_pct": cpu_percent,
        "losses": loss_values,
        "warmup": spec.warmup,
        "notes": notes,
        "window_start": window_start,
        "window_end": window_end,
        "torch_threads": torch.get_num_threads(),
    }


def classify_error(error: BaseException) -> str:
    """``oom`` for out-of-memory errors on any device, ``failed`` for everything else."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return "oom"
    text = str(error).lower()
    if isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text):
        return "oom"
    return "failed"


def one_line(error: BaseException, limit: int = 400) -> str:
    text = " ".join(str(error).split()) or "(no message)"
    text = f"{type(error).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main() -> int:
    import cloudpickle

    messages = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the user's prints go to the log (stderr), never into the message channel

    def emit(message: dict) -> None:
        messages.write(json.dumps(message) + "\n")
        messages.flush()

    try:
        header = json.loads(sys.stdin.buffer.readline())
        sys.path[:] = header["sys_path"]  # so factories pickled by reference import as in the parent
        spec = cloudpickle.loads(sys.stdin.buffer.read())  # code from our own parent, not results
        emit({"type": "result", **run_unit(spec, emit)})
        return 0
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
