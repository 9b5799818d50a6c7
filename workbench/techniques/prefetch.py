"""prefetch: copy the next batches to the GPU on a side CUDA stream while the current step computes.

What it does
    Without it, each step copies its batch from host to device on the compute stream, and the
    step's kernels wait for the copy. The prefetcher keeps ``depth`` batches ahead: as a step
    takes its batch, the next batch's copy starts on a stream of its own, from pinned
    (page-locked) host memory with ``non_blocking=True``, so the DMA engine moves it while the
    GPU computes the current step. The compute stream waits only for the copy of the batch it is
    about to use (a CUDA event), and each prefetched tensor is marked with ``record_stream`` so
    the caching allocator does not hand its memory to another tensor while the compute stream
    may still read it. Batches that are not pinned yet are pinned first (the DataLoader pins them
    itself: this technique turns its ``pin_memory`` on).

When it helps
    When the host-to-device copy is a visible share of the step: large inputs (images, video,
    long sequences) against a short step. Baidu Intelligent Cloud Tech Hub's "How to
    Supercharge AI Model Training" names pinned memory and prefetching that overlaps I/O with
    computation among the data-loading fixes, and the Baidu AIAK-Training suite it describes
    packages "automatic prefetch". Its effect shows as a smaller ``data_ms`` share of the step.

When it hurts
    It overlaps only the copy: a step that waits for the CPU to decode and augment needs
    DataLoader workers (``dataloader``) or DALI instead. Each batch ahead holds device memory,
    and pinned host memory is locked RAM that the rest of the system cannot use or page out. With tiny batches
    the extra stream and event cost more than the copy they hide.

Settings
    ``depth``: batches copied ahead (default 1; the one that matters). Needs a CUDA device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from workbench.config import check_int
from workbench.data import map_tensors, tensors_of
from workbench.techniques.base import Technique


class DevicePrefetcher:
    """Batches from ``batches``, already on ``device``: each copied ``depth`` steps ahead on a side
    stream. Iterate it where the train step iterates its batches."""

    def __init__(self, batches: Iterator, device: torch.device, depth: int):
        self.batches, self.device, self.depth = batches, device, depth
        self.stream = torch.cuda.Stream(device)
        self.ahead: deque[tuple[Any, torch.cuda.Event]] = deque()
        self.copies = 0  # batches copied on the side stream (the effect test counts them)

    def _copy_next(self) -> None:
        batch = next(self.batches)
        # A non_blocking copy from pageable memory is staged through a pinned buffer synchronously.
        pinned = map_tensors(batch, lambda t: t if t.is_pinned() or t.is_cuda else t.pin_memory())
        with torch.cuda.stream(self.stream):
            moved = map_tensors(pinned, lambda t: t.to(self.device, non_blocking=True))
            copied = torch.cuda.Event()
            copied.record(self.stream)
        self.ahead.append((moved, copied))
        self.copies += 1

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Any:
        if not self.ahead:  # the first step has nothing prefetched: its own batch is copied now
            self._copy_next()
        batch, copied = self.ahead.popleft()
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(copied)  # the GPU, not the CPU, waits for this batch's copy
        for tensor in tensors_of(batch):
            tensor.record_stream(compute)  # its memory is not reused while compute may read it
        while len(self.ahead) < self.depth:  # the next copies start now, beside this step's kernels
            self._copy_next()
        return batch


@dataclass(frozen=True)
class PrefetchConfig:
    depth: int = 1

    def __post_init__(self) -> None:
        check_int("prefetch", "depth", self.depth, 1)


class Prefetch(Technique):
    name = "prefetch"
    summary = "copy the next batches to the GPU on a side CUDA stream while the step computes"
    order = 12  # after the input pipelines (dataloader 10, dali 11), whose batches it moves
    group = "data"
    tune_space = {"depth": (1, 2)}
    Config = PrefetchConfig
    requires = ("cuda",)
    conflicts = {"dali": "DALI's GPU pipeline already delivers its batches on the device"}

    def apply(self, setup, config: PrefetchConfig) -> str:
        setup.loader_options["pin_memory"] = True
        device = setup.device
        setup.batch_stages.append(lambda batches: DevicePrefetcher(batches, device, config.depth))
        return f"batches copied {config.depth} step(s) ahead on a side CUDA stream, from pinned memory"


TECHNIQUE = Prefetch()
