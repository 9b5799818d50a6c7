"""Data-parallel arms: the process group, the DDP wrapper, measured communication, a simulated link.

An arm with ``world_size=N`` runs as N rank processes (see workbench.process), each a new
worker process (forked from the run's warm template, or ``python -m workbench.worker``) that
joins one process group: gloo on CPU, NCCL on CUDA.
Every arm of such an ablation, the baseline included, trains under DistributedDataParallel,
so arms differ only in their techniques.

Communication is measured, not computed from theory. DDP hands each gradient bucket to a
communication hook; workbench always registers one (PyTorch's own ``allreduce_hook`` when no
compression is asked for, the equivalent of DDP's built-in allreduce) and wraps it in a
:class:`CommMeter`. While the hook runs, the meter counts the bytes this rank contributes to
every collective the hook calls (``dist.all_reduce``/``all_gather``/``broadcast``/...): the
payload after compression, and for a gather this rank's own part, not everyone's. It also times
each bucket from the hook call (its gradients are ready) to the completion of its future.

Exposed and hidden communication. DDP calls a bucket's hook as soon as the bucket's gradients
are ready, and waits for every bucket at the end of backward. The last bucket of a backward pass
is ready when the gradient computation ends, so communication before that moment ran while
backward still computed (hidden), and communication after it is time the step waits (exposed).
The meter marks the start of each forward (one per backward pass, micro-batches included) to
group the buckets by pass.

The simulated link is a labelled simulation. One machine cannot show a slow network, so when
``link`` is given, each bucket's future completes only after an extra delay of
``latency + wire_bytes / bandwidth``, where ``wire_bytes`` is what its collectives move per
rank with ring algorithms: 2 (N-1)/N times the payload for an all-reduce, N-1 times each
rank's part for an all-gather. DDP waits for those futures at the end of backward, as it waits
for a real slow network. The hierarchical hook charges the link itself, for its inter-node
traffic only (workbench.comm_hooks).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import inspect
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from workbench.config import Link, started_by_torchrun

# The model is wrapped in DDP after every technique that changes the model (order below this)
# and before those that must see the wrapped model (compile, order 90).
DDP_ORDER = 85
COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Rank:
    """Where this process sits in its job, read from the environment torchrun also uses."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Rank:
        return cls(
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)),
        )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def local_world_size(self) -> int:
        return ranks_on_this_machine(self.world_size)


def ranks_on_this_machine(world_size: int) -> int:
    """torchrun's LOCAL_WORLD_SIZE, else every rank (workbench starts them all here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(rank: Rank, device: torch.device, timeout_s: float) -> None:
    """Join the arm's process group; a peer that dies makes collectives fail within timeout_s."""
    dist.init_process_group(
        backend_for(device),
        rank=rank.rank,
        world_size=rank.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


@dataclass
class CommSettings:
    """What the ddp_compression technique asks of the DDP wrapper (defaults: plain allreduce)."""

    hook: str = "none"
    powersgd_rank: int = 1
    start_iter: int = 2
    warm_start: bool = True
    density: float = 0.01  # topk: the share of entries sent
    int8_scale: str = "bucket"  # int8: one scale per bucket or per tensor
    ranks_per_node: int = 2  # hierarchical: ranks per simulated node
    bucket_cap_mb: float | None = None  # None: DDP's default, a first bucket of 1 MB, then 25 MB
    gradient_as_bucket_view: bool = False  # gradients live in DDP's buckets: no copy, less memory
    find_unused_parameters: bool = False  # the run's setting (RunConfig), for every arm alike
    # Under grad_accum, communicate once per optimizer step. Off unless ddp_compression turns it
    # on: plain DDP all-reduces after every micro-batch, which is what the baseline measures.
    no_sync: bool = False
    notes: list[str] = field(default_factory=list)


class CommMeter:
    """Counts and times what communication hooks send; delays it over a simulated link.

    Counting is process-wide while ``enabled``: a hook may issue collectives from a future's
    callback on another thread (PowerSGD all-reduces Q only after P arrives), and every
    Python-level collective in a training process comes from a hook (DDP's own all-reduce is
    C++, and is replaced by a hook here anyway). The link delay of a bucket covers the wire
    bytes issued since the previous bucket completed: per step, the delays add up to latency x
    buckets + wire bytes / bandwidth, whatever the order in which buckets finish.
    """

    def __init__(self, world_size: int, link: Link | None = None):
        self.world_size = world_size
        self.link = link
        self.enabled = True
        self._lock = threading.Lock()
        self._issued = 0  # bytes handed to collectives, not yet attributed to a finished bucket
        self._issued_wire = 0.0  # what those collectives move per rank, for the simulated link
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.payload_bytes = 0
            # What the collectives send per rank with ring algorithms, with or without a link:
            # a gather's (N-1) parts can outweigh an all-reduce of the uncompressed payload.
            self.wire_bytes = 0.0
            self.wire_bytes_charged = 0.0  # what the simulated link was charged for
            self.buckets = 0
            self.intervals: list[tuple[float, float]] = []  # per bucket: (ready, done)
            self.pass_starts: list[float] = []  # when each forward began (one per backward pass)

    def install(self) -> None:
        """Wrap torch.distributed's collectives so that the bytes they are given are counted."""
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None or getattr(original, "_workbench_counted", False):
                continue
            setattr(dist, name, self._counting(name, original))

    def _counting(self, name: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self.enabled:
                given = signature.bind(*args, **kwargs).arguments
                contributed, wire = _bytes_of(name, given)
                with self._lock:
                    self._issued += contributed
                    self._issued_wire += wire
            return original(*args, **kwargs)

        counted._workbench_counted = True
        return counted

    def mark_pass(self) -> None:
        """A forward begins: the buckets ready from now on belong to its backward pass."""
        with self._lock:
            self.pass_starts.append(time.perf_counter())

    def link_delay(self, wire_bytes: float) -> None:
        """Wait as the simulated link would for ``wire_bytes`` (a hook that charges it itself)."""
        if self.link is not None:
            time.sleep(self.link.delay_s(wire_bytes))
            with self._lock:
                self.wire_bytes_charged += wire_bytes

    def wrap(self, hook: Callable) -> Callable:
        """A DDP comm hook that runs ``hook`` and times its bucket until the result is ready."""
        charges_link_itself = getattr(hook, "charges_link_itself", False)

        def measured(state, bucket):
            started = time.perf_counter()

            def done(fut):
                with self._lock:
                    sent, self._issued = self._issued, 0
                    wire, self._issued_wire = self._issued_wire, 0.0
                if self.link is not None and not charges_link_itself:
                    time.sleep(self.link.delay_s(wire))  # the simulated link
                    with self._lock:
                        self.wire_bytes_charged += wire
                with self._lock:
                    self.payload_bytes += sent
                    self.wire_bytes += wire
                    self.buckets += 1
                    self.intervals.append((started, time.perf_counter()))
                return fut.value()

            return hook(state, bucket).then(done)

        return measured

    def busy_s(self) -> float:
        """Time during which at least one bucket was in flight (overlapping buckets count once)."""
        with self._lock:
            spans = sorted(self.intervals)
        return _union_s(spans)

    def exposed_s(self) -> float | None:
        """Communication time after the gradient computation of its backward pass ended.

        Per pass, the last bucket's hook call marks the end of the gradient computation (DDP
        calls each hook when its bucket is ready); what is still in flight after it, the step
        waits for. None when no pass was marked (a compiled model that skipped the marker).
        """
        with self._lock:
            spans, marks = sorted(self.intervals), sorted(self.pass_starts)
        if not spans or not marks:
            return None if spans else 0.0
        passes: dict[int, list[tuple[float, float]]] = {}
        for start, stop in spans:
            index = max(bisect.bisect_right(marks, start) - 1, 0)  # the last forward before it
            passes.setdefault(index, []).append((start, stop))
        exposed = 0.0
        for buckets in passes.values():
            ready = max(start for start, _ in buckets)  # the gradient computation is over
            exposed += max(max(stop for _, stop in buckets) - ready, 0.0)
        return exposed


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of sorted (start, stop) spans."""
    total, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _bytes_of(name: str, given: dict) -> tuple[int, float]:
    """(bytes this rank contributes, bytes it sends with a ring algorithm) for one collective."""

    def size(tensors) -> int:
        tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    members = dist.get_world_size(given.get("group"))
    share = (members - 1) / members
    if name == "all_reduce":
        payload = size(given["tensor"])
        return payload, 2 * share * payload
    if name in ("all_gather", "all_gather_into_tensor"):
        payload = size(given.get("tensor", given.get("input_tensor")))
        return payload, (members - 1) * payload
    if name == "reduce_scatter":
        payload = size(given["input_list"])
        return payload, share * payload
    if name == "broadcast" and given.get("src") != dist.get_rank():
        return 0, 0.0  # receiving
    payload = size(given["tensor"])  # reduce, and the broadcast's source
    return payload, float(payload)


def comm_hook(
    settings: CommSettings, meter: CommMeter | None = None, process_group=None
) -> tuple[Callable, Any]:
    """The (hook, state) pair DDP registers for ``settings.hook``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    from workbench import comm_hooks

    if settings.hook == "none":
        return default_hooks.allreduce_hook, process_group
    if settings.hook == "fp16":
        return default_hooks.fp16_compress_hook, process_group
    if settings.hook == "bf16":
        return default_hooks.bf16_compress_hook, process_group
    if settings.hook == "topk":
        return comm_hooks.topk_hook, comm_hooks.TopKState(settings.density, process_group)
    if settings.hook == "int8":
        return comm_hooks.int8_hook, comm_hooks.Int8State(settings.int8_scale, process_group)
    if settings.hook == "hierarchical":
        delay = meter.link_delay if meter is not None else None
        return comm_hooks.hierarchical_hook, comm_hooks.HierarchicalState(settings.ranks_per_node, delay)
    state = powersgd.PowerSGDState(
        process_group=process_group,
        matrix_approximation_rank=settings.powersgd_rank,
        start_powerSGD_iter=settings.start_iter,
        warm_start=settings.warm_start,
        use_error_feedback=True,
    )
    if settings.hook == "batched_powersgd" and _needs_single_matrix_fix(powersgd):
        settings.notes.append(
            "this PyTorch's batched_powerSGD_hook hands _orthogonalize a single matrix, which it rejects; "
            "workbench passes it as a batch of one"
        )
    hook = powersgd.powerSGD_hook if settings.hook == "powersgd" else powersgd.batched_powerSGD_hook
    return hook, state


def _needs_single_matrix_fix(powersgd) -> bool:
    """Work around a PyTorch bug (seen in 2.13): batched PowerSGD fails on a 2-D matrix.

    ``_orthogonalize`` asserts a batch of matrices (3-D), while ``batched_powerSGD_hook`` gives
    it one (2-D). Viewing the matrix as a batch of one shares its storage, so the in-place
    orthogonalization still lands in the hook's tensor. Returns True when the fix was needed.
    """
    original = powersgd._orthogonalize
    if getattr(original, "_workbench_fix", False):
        return True
    try:
        original(torch.ones(2, 1))
        return False
    except AssertionError:
        pass

    def orthogonalize(matrices, epsilon=0):
        return original(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)

    orthogonalize._workbench_fix = True
    powersgd._orthogonalize = orthogonalize
    return True


def wrap_ddp(model: torch.nn.Module, device: torch.device, settings: CommSettings, meter: CommMeter):
    """Wrap ``model`` in DDP with the measured hook; return the wrapped model."""
    from torch.nn.parallel import DistributedDataParallel

    options: dict[str, Any] = {
        "gradient_as_bucket_view": settings.gradient_as_bucket_view,
        "find_unused_parameters": settings.find_unused_parameters,
    }
    if settings.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = settings.bucket_cap_mb
    if device.type == "cuda":
        options["device_ids"] = [device.index if device.index is not None else torch.cuda.current_device()]
    wrapped = DistributedDataParallel(model, **options)
    hook, state = comm_hook(settings, meter)
    wrapped.register_comm_hook(state, meter.wrap(hook))
    # Each forward starts a backward pass's buckets: the meter tells hidden from exposed by it.
    wrapped.register_forward_pre_hook(lambda module, args: meter.mark_pass())
    return wrapped


def parameter_mib(model: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20


def no_sync_context(model: torch.nn.Module, settings: CommSettings | None) -> Callable[[], Any]:
    """``model.no_sync`` when gradients should stay local (not the last micro-batch)."""
    if settings is not None and settings.no_sync and hasattr(model, "no_sync"):
        return model.no_sync
    return contextlib.nullcontext


def gather_to_rank0(record: dict, rank: Rank, device: torch.device) -> list[dict] | None:
    """Every rank's ``record`` (JSON-serializable), on rank 0; None elsewhere.

    Records travel as JSON bytes in tensors, never as pickles (torch's gather_object pickles).
    """
    payload = torch.tensor(list(json.dumps(record).encode()), dtype=torch.uint8)
    on = device if device.type == "cuda" else torch.device("cpu")
    length = torch.tensor([payload.numel()], device=on)
    lengths = [torch.zeros_like(length) for _ in range(rank.world_size)]
    dist.all_gather(lengths, length)
    longest = int(max(int(n) for n in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8, device=on)
    padded[: payload.numel()] = payload.to(on)
    everyone = [torch.zeros_like(padded) for _ in range(rank.world_size)]
    dist.all_gather(everyone, padded)
    if rank.rank != 0:
        return None
    return [
        json.loads(bytes(t[: int(n)].cpu().tolist()).decode()) for t, n in zip(everyone, lengths, strict=True)
    ]


class Torchrun:
    """The ablation's parent processes, when ``torchrun`` started them (one per rank).

    Under torchrun every parent plans the same ablation and walks the same schedule; for
    each arm and block it starts one fresh worker for its own rank, and the workers of all nodes meet
    on a port that rank 0 chose and broadcast. The parents stay in lockstep through a gloo
    "control" group of their own: every node's record of each process, gathered so that all keep
    rank 0's (and skip the same later blocks), and a barrier after it. Only rank 0 keeps results
    and prints progress.
    """

    def __init__(self, rank: Rank):
        self.rank = rank
        self.master_addr = os.environ["MASTER_ADDR"]

    @classmethod
    def detect(cls) -> Torchrun | None:
        rank = Rank.from_env()
        if started_by_torchrun() and rank.distributed:
            return cls(rank)
        return None

    def start(self, timeout_s: float) -> None:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _broadcast(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(tensor, src=0)
        return int(tensor.item())

    def resuming(self, finished_units: int) -> bool:
        """Whether rank 0 found finished units to resume (the others keep nothing to resume)."""
        return self._broadcast(finished_units if self.rank.rank == 0 else 0) > 0

    def unit_port(self) -> int:
        """A port for the next unit's process group, chosen on rank 0's machine."""
        return self._broadcast(free_port() if self.rank.rank == 0 else 0)

    def gather(self, record: dict) -> list[dict]:
        """Every rank's record of a process (its units, the arms it moved), in rank order, on every
        rank; then wait for all of them. As JSON bytes: nothing is unpickled."""
        payload = torch.frombuffer(bytearray(json.dumps(record, default=str).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.rank.world_size)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64))
        longest = int(max(size.item() for size in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(payload)] = payload
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
        dist.all_gather(gathered, padded)
        dist.barrier()
        return [
            json.loads(data[: int(size.item())].numpy().tobytes().decode())
            for data, size in zip(gathered, sizes, strict=True)
        ]
