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
from workbench.distributed import (
    DDP_ORDER,
    CommMeter,
    CommSettings,
    Rank,
    gather_to_rank0,
    init_process_group,
    wrap_ddp,
)
from workbench.loop import Trainer, TrainSetup, default_loss, make_optimizer
from workbench.mfu import compute_dtype, count_flops
from workbench.models import NoOpModel, build_model, noop_loss
from workbench.telemetry import CpuUsage, PeakMemory, StepClock, nvml_indices, usable_cores


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
    link: Any = None  # a workbench.distributed.Link: the simulated network, for DDP arms
    comm_timeout_s: float = 120.0  # a collective waiting longer than this for a dead peer fails


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


def _apply_techniques(spec: UnitSpec, setup: TrainSetup, rank: Rank, meter: CommMeter | None) -> list[str]:
    """Apply each technique in order; with several ranks, wrap the model in DDP at DDP_ORDER."""
    notes, wrapped = [], not rank.distributed
    for technique, config in spec.techniques:
        if not wrapped and technique.order > DDP_ORDER:
            setup.model, wrapped = wrap_ddp(setup.model, setup.device, setup.comm, meter), True
        notes.append(technique.apply(setup, config))
    if not wrapped:
        setup.model = wrap_ddp(setup.model, setup.device, setup.comm, meter)
    if rank.distributed:
        notes += setup.comm.notes  # what the DDP wrapper had to adapt, said once
    if rank.distributed and setup.device.type == "cpu":
        notes.append(f"{torch.get_num_threads()} CPU thread(s) per rank")
    if rank.distributed and spec.link is not None:
        notes.append(
            spec.link.describe() + " (a simulation: each bucket is delayed by latency + bytes/bandwidth)"
        )
    return notes


def run_unit(spec: UnitSpec, emit: Callable[[dict], None] = lambda message: None) -> dict:
    """Build, warm up, then time ``spec.steps`` optimizer steps. Returns JSON-ready numbers.

    With several ranks (RANK/WORLD_SIZE in the environment) every rank runs this, under DDP,
    on its own shard of the data; rank 0 returns the measurements of all of them.
    """
    rank = Rank.from_env()
    device = torch.device(spec.device)
    if rank.distributed and device.type == "cuda":
        device = torch.device("cuda", rank.local_rank)
        torch.cuda.set_device(device)
    if rank.distributed and device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one machine share its cores: each would otherwise start one thread per core,
        # and the oversubscribed cores would time-slice between ranks (noise, not a measurement).
        local = int(os.environ.get("LOCAL_WORLD_SIZE", rank.world_size))
        torch.set_num_threads(max(1, usable_cores() // local))
    _initialize_runtime(device)
    meter = None
    if rank.distributed:
        init_process_group(rank, device, spec.comm_timeout_s)
        meter = CommMeter(rank.world_size, spec.link)
        meter.install()
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
        rank=rank.rank,
        world_size=rank.world_size,
        comm=CommSettings() if rank.distributed else None,
    )
    notes = _apply_techniques(spec, setup, rank, meter)
    if spec.loader_only:
        notes.insert(0, "loader only: a no-op model, so this is the rate the input pipeline can feed")
    if spec.data.images is not None and spec.data.images.skipped:
        notes.append(spec.data.images.note())

    with setup.settings:
        if setup.make_batches is not None:  # an input pipeline that replaces the DataLoader (dali)
            batches = setup.make_batches(spec.data, spec.batch_size, spec.seed)
        else:
            batches = endless_batches(
                spec.data, spec.batch_size, spec.seed, setup.loader_options, rank.rank, rank.world_size
            )
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
        if meter is not None:
            meter.reset()  # count the timed window's communication only
        window_start = time.time()
        wall_s = timed_window(trainer, clock, spec.steps, losses, emit, spec.progress_interval_s)
        window_end = time.time()
        comm = {}
        if meter is not None:
            meter.enabled = False  # what follows (gathering the results) is the harness's, not a hook's
            comm = _comm_record(meter, spec.steps)
        clock.resolve()
        cpu_percent = cpu.percent()
        rss_mib = memory.rss_growth_mib()
        samples = trainer.samples_seen - samples_before
        loss_values = torch.stack(losses).float().cpu().tolist()
        # After the clock stopped: on CPU this runs one more (profiled) step to find peak tensor memory.
        peak_mib = memory.tensor_peak_mib(
            lambda: trainer.step(StepClock(device)), trainer.model, trainer.optimizer
        )
        flops = {} if spec.loader_only else _count_flops(spec, trainer, setup, notes)

    result = {
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
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        # NVML's numbering of the GPUs this run used, to pick their samples out of the telemetry.
        "nvml_gpus": nvml_indices(device, rank.world_size) if device.type == "cuda" else [],
        **flops,
        **comm,
    }
    if rank.distributed:
        result = _gather_ranks(result, rank, device)
        # Keep the distributed run's objects alive past this return: tearing down DDP's reducer
        # and gloo's state can block in their destructors (seen about once in 30 runs here),
        # before the result is sent. main() reports, then leaves with os._exit.
        _KEEP_ALIVE.append((trainer, setup, batches, meter))
    return result


_KEEP_ALIVE: list = []


def _count_flops(spec: UnitSpec, trainer: Trainer, setup: TrainSetup, notes: list[str]) -> dict:
    """FLOPs per sample of the model on a real batch's shapes (see workbench.mfu), after the window."""
    inputs, targets = next(trainer.batches)
    try:
        flops = count_flops(
            lambda: build_model(spec.model, spec.data.spec), inputs, targets, spec.loss_fn or default_loss
        )
    except Exception as error:  # a model or loss that cannot run on meta tensors: no MFU, said why
        notes.append(f"FLOPs not counted ({type(error).__name__}: {error}); no tflops or MFU")
        return {}
    return {
        "flops_per_sample": flops / len(targets),
        "compute_dtype": compute_dtype(trainer.model, setup.autocast_dtype),
    }


def _comm_record(meter: CommMeter, steps: int) -> dict:
    return {
        "comm_bytes_per_step": meter.payload_bytes / steps,
        "comm_ms_per_step": 1e3 * meter.busy_s() / steps,
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
        "comm_ms_per_step",
        "buckets_per_step",
    )
    everyone = gather_to_rank0({key: result[key] for key in keys}, rank, device)
    dist.barrier()  # every rank has everything; the process group ends with the process
    if everyone is None:
        return result
    # The ranks step in lockstep (every step ends in an all-reduce), so the job's throughput is
    # all samples over the slowest rank's window.
    aggregate = sum(r["samples"] for r in everyone) / max(r["wall_s"] for r in everyone)
    return {
        **result,
        "world_size": rank.world_size,
        "per_rank": everyone,
        "samples_per_s": aggregate,
        "samples": sum(r["samples"] for r in everyone),
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


def _die_with_parent() -> None:
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
    _die_with_parent()

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
        if _KEEP_ALIVE:  # a distributed run: skip the teardown that can block (see run_unit)
            sys.stderr.flush()
            os._exit(0)
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
