"""grad_accum: gradient accumulation over micro-batches.

What it does
    Splits each batch into ``steps`` micro-batches, runs forward and backward on each,
    lets the gradients add up, and updates the weights once. Each micro-batch's loss is
    weighted by its share of the batch (1/k when it divides evenly), so the update equals
    the full batch's: the effective batch and the maths are unchanged.

When it helps
    Memory: activations are held for one micro-batch at a time, so a batch that does not
    fit can still be trained (the ByteTrending overview "Accelerate Model Training", 2025,
    describes it as simulating a larger batch than memory allows). In data-parallel
    training, with ddp_compression's ``no_sync`` (on by default there), it also cuts communication
    to once per accumulation window (the Baidu AIAK-Training write-up lists lower
    communication frequency among its levers); plain DDP all-reduces after every micro-batch.

When it hurts
    Throughput: k smaller forward/backward passes keep the device less busy than one
    large one, and each pays the per-launch overhead again. Expect a slowdown on a single
    device; the payoff is memory (``peak_mem_mb``), not speed. Layers that look across
    the batch (BatchNorm) see smaller batches, so their statistics differ slightly.

Settings
    ``steps``: micro-batches per optimizer step (default 4; at most the batch size).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from workbench.config import check_int
from workbench.data import batch_size_of, not_leading_with_samples, tensors_of
from workbench.techniques.base import Context, Technique


@dataclass(frozen=True)
class GradAccumConfig:
    steps: int = 4

    def __post_init__(self) -> None:
        check_int("grad_accum", "steps", self.steps, 1)


@dataclass(frozen=True)
class MicroBatches:
    """The train step's split hook under grad_accum: ``parts`` micro-batches per batch.

    Each comes with its share of the batch; weighting each micro-batch's mean loss by its
    share makes the accumulated gradient equal the full batch's, even when the batch does not
    divide evenly (tensor_split makes the first parts one sample larger).
    """

    parts: int

    def __call__(
        self, inputs: Any, targets: torch.Tensor | None
    ) -> list[tuple[Any, torch.Tensor | None, float]]:
        size = batch_size_of(inputs, targets)
        leading = not_leading_with_samples(inputs, targets)
        if leading:  # split along its first dimension, a time-major sequence would be cut in time
            raise ValueError(f"grad_accum {cuts_in_time(size, leading)}")
        input_parts = _split(inputs, self.parts)
        # A dict batch (a model that computes its own loss) carries its labels among the inputs.
        target_parts = targets.tensor_split(self.parts) if targets is not None else [None] * self.parts
        return [
            (part_inputs, part_targets, batch_size_of(part_inputs, part_targets) / size)
            for part_inputs, part_targets in zip(input_parts, target_parts, strict=True)
        ]


def cuts_in_time(size: int, leading: list[tuple[int, ...]]) -> str:
    """Why batches whose inputs do not lead with their samples cannot be split (after "grad_accum")."""
    return (
        f"splits a batch along the first dimension, but this batch has {size} samples and inputs of "
        f"shape {', '.join(map(str, leading))}, which do not lead with them (time-major inputs?): give "
        "batch-first inputs, or leave grad_accum out"
    )


def _split(inputs: Any, parts: int) -> list:
    """``parts`` micro-batches of ``inputs`` along the first dimension, the structure kept."""
    if isinstance(inputs, torch.Tensor):
        return list(inputs.tensor_split(parts))
    if isinstance(inputs, Mapping):  # each tensor split; anything else (a flag, a string) repeated
        columns = {
            key: _split(value, parts) if _splittable(value) else [value] * parts
            for key, value in inputs.items()
        }
        return [{key: column[index] for key, column in columns.items()} for index in range(parts)]
    if isinstance(inputs, (tuple, list)):
        columns = [_split(x, parts) if _splittable(x) else [x] * parts for x in inputs]  # as a dict's
        return [type(inputs)(chunk) for chunk in zip(*columns, strict=True)]
    raise TypeError(f"grad_accum cannot split inputs of type {type(inputs).__name__} into micro-batches")


def _splittable(value: Any) -> bool:
    """Whether ``value`` holds per-sample rows to split: a 0-d tensor, a number or a flag is repeated."""
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    return isinstance(value, (Mapping, tuple, list)) and bool(tensors_of(value))


class GradAccum(Technique):
    name = "grad_accum"
    summary = "split each batch into k micro-batches; same effective batch, less activation memory"
    order = 50
    group = "memory"
    tune_space = {"steps": (2, 4)}  # more micro-batches: less memory, more launches
    Config = GradAccumConfig

    def validate(self, ctx: Context, config: GradAccumConfig) -> None:
        if config.steps > ctx.batch_size:
            raise ValueError(
                f"grad_accum: steps={config.steps} exceeds batch_size={ctx.batch_size}; "
                "every micro-batch needs at least one sample"
            )

    def check(self, ctx: Context, config: GradAccumConfig) -> str | None:
        # ready-made batches, read before any arm runs (workbench's own batches lead with samples)
        if ctx.not_leading_with_samples:
            return cuts_in_time(ctx.batch_size, ctx.not_leading_with_samples)
        return None

    def apply(self, setup, config: GradAccumConfig) -> str:
        setup.split_batch = MicroBatches(config.steps)
        note = f"{config.steps} micro-batches per optimizer step"
        if setup.world_size > 1 and config.steps > 1:  # its communication column doubled, unexplained
            note += (
                f"; under DDP each micro-batch's backward all-reduces, {config.steps}x the baseline's "
                "communication, unless ddp_compression's no_sync (on by default) keeps all but the last local"
            )
        return note


TECHNIQUE = GradAccum()
