"""The one train step. Techniques never branch it: they set fields of a TrainSetup, and
every field degrades to a no-op when its technique is off (no autocast, a disabled
GradScaler, one micro-batch, no input transform).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench.distributed import no_sync_context
from workbench.telemetry import StepClock


def default_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy; sequence outputs (batch, time, classes) are flattened first."""
    if outputs.dim() > 2:
        return F.cross_entropy(outputs.flatten(0, -2), targets.flatten())
    return F.cross_entropy(outputs, targets)


def make_optimizer(name: str, lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=lr)


@dataclass
class TrainSetup:
    """Everything the train step needs. Techniques edit it in their ``order``."""

    model: nn.Module
    device: torch.device
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    make_optimizer: Callable[[Any], torch.optim.Optimizer]
    loader_options: dict[str, Any] = field(default_factory=dict)  # DataLoader keyword arguments
    autocast_dtype: torch.dtype | None = None
    grad_scaler: bool = False
    micro_batches: int = 1
    input_transforms: list[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    # An input pipeline that replaces the DataLoader (dali): (source, batch_size, seed) -> batches.
    make_batches: Callable[[Any, int, int], Iterator] | None = None
    # Data-parallel arms: this process's rank, and how DDP communicates (ddp_compression edits it).
    rank: int = 0
    world_size: int = 1
    comm: Any = None  # a workbench.distributed.CommSettings when world_size > 1
    # cuda_graphs: runs the compute step (trainer.compute) as a captured CUDA graph, replayed.
    graph_step: Callable[[Trainer, Any, torch.Tensor, StepClock], torch.Tensor] | None = None
    autocast_cache: bool = True  # autocast's weight-cast cache must be off inside graph capture
    # Process-wide switches a technique flips (TF32): context managers entered around each of
    # this arm's windows (warm-up, timed windows, the memory step) and left after it, so that
    # other arms sharing the process never run under them.
    window_settings: list[Callable[[], contextlib.AbstractContextManager]] = field(default_factory=list)


def split_batch(inputs: Any, targets: torch.Tensor, parts: int):
    """Yield (inputs, targets, share) micro-batches; ``share`` is each one's fraction of the batch.

    Weighting each micro-batch's mean loss by its share makes the accumulated gradient
    equal the full batch's gradient, even when the batch does not divide evenly.
    """
    if parts == 1:
        yield inputs, targets, 1.0
        return
    size = len(targets)
    input_chunks = _split(inputs, parts)
    for micro_inputs, micro_targets in zip(input_chunks, targets.tensor_split(parts), strict=True):
        yield micro_inputs, micro_targets, len(micro_targets) / size


def _split(inputs: Any, parts: int) -> list:
    if isinstance(inputs, torch.Tensor):
        return list(inputs.tensor_split(parts))
    if isinstance(inputs, (tuple, list)):
        return [type(inputs)(chunk) for chunk in zip(*(_split(x, parts) for x in inputs), strict=True)]
    raise TypeError(f"cannot split inputs of type {type(inputs).__name__} into micro-batches")


def to_device(value: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device, non_blocking) for v in value)
    return value


class Trainer:
    def __init__(self, setup: TrainSetup, batches: Iterator):
        self.setup = setup
        self.model = setup.model
        self.batches = batches
        self.optimizer = setup.make_optimizer(self.model.parameters())
        self.scaler = torch.amp.GradScaler(setup.device.type, enabled=setup.grad_scaler)
        dtype = setup.autocast_dtype
        self.autocast = (
            (lambda: torch.autocast(setup.device.type, dtype=dtype, cache_enabled=setup.autocast_cache))
            if dtype
            else contextlib.nullcontext
        )
        # Pinned host memory is what lets a host-to-device copy run asynchronously.
        self.non_blocking = bool(setup.loader_options.get("pin_memory")) and setup.device.type == "cuda"
        self.keep_gradients_local = no_sync_context(self.model, setup.comm)
        self.samples_seen = 0
        self.model.train()

    def next_batch(self) -> tuple[Any, torch.Tensor]:
        inputs, targets = next(self.batches)
        self.samples_seen += len(targets)
        inputs = to_device(inputs, self.setup.device, self.non_blocking)
        targets = to_device(targets, self.setup.device, self.non_blocking)
        for transform in self.setup.input_transforms:
            inputs = transform(inputs)
        return inputs, targets

    def step(self, clock: StepClock) -> torch.Tensor:
        """One optimizer step over one batch (split into micro-batches under grad_accum)."""
        clock.start()
        inputs, targets = self.next_batch()
        clock.lap("data")
        if self.setup.graph_step is not None:
            step_loss = self.setup.graph_step(self, inputs, targets, clock)  # one replay of compute()
        else:
            step_loss = self.compute(inputs, targets, clock)
        clock.stop()
        return step_loss

    def compute(self, inputs: Any, targets: torch.Tensor, clock: StepClock) -> torch.Tensor:
        """Forward, backward and the optimizer step: everything in a step after the data arrives."""
        step_loss = None
        micro_batches = split_batch(inputs, targets, self.setup.micro_batches)
        for index, (micro_inputs, micro_targets, share) in enumerate(micro_batches):
            last = index == self.setup.micro_batches - 1
            # DDP with no_sync keeps the gradients of all but the last micro-batch local.
            with contextlib.nullcontext() if last else self.keep_gradients_local():
                with self.autocast():
                    loss = self.setup.loss_fn(self.model(micro_inputs), micro_targets)
                if share != 1.0:
                    loss = loss * share  # grad_accum: weight each micro-batch by its share of the batch
                clock.lap("forward")
                self.scaler.scale(loss).backward()  # gradients add up across micro-batches
                clock.lap("backward")
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
        self.scaler.step(self.optimizer)  # unscales first; skips the step if gradients overflowed
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        clock.lap("optimizer")
        return step_loss
