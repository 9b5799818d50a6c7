"""dali: decode and augment JPEGs in NVIDIA DALI's C++ pipeline instead of a torch DataLoader.

What it does
    Replaces the DataLoader with a DALI pipeline over the same JPEG files: a file reader,
    JPEG decode, random resized crop, a random horizontal flip, normalisation to CHW
    float32, and the labels, consumed through DALI's PyTorch iterator. The work runs in
    ``threads`` native threads (no Python, no worker processes, no pickling between them),
    and ``prefetch_queue_depth`` batches are prepared ahead of the training step. On CUDA,
    decoding is "mixed" (nvJPEG: Huffman decoding on the CPU, the rest on the GPU), the
    augmentations run on the GPU, and batches arrive in GPU memory without a host copy.
    On CPU, DALI's CPU operators run everything (``device_id=None``).

When it helps
    When the step waits for data: a large ``data_ms`` in the breakdown, a loader-only arm
    that feeds fewer images per second than training consumes. Baidu Intelligent Cloud Tech
    Hub ("How to Supercharge AI Model Training") and "Advanced AI Training Analysis"
    (serverrental.store, 2026) name data loading (storage I/O, CPU decode and augmentation,
    host-to-device copies) as the most common bottleneck. DALI moves decode and augmentation
    off the Python workers and, on a GPU, off the CPU altogether (NVIDIA DALI documentation).

When it hurts
    When data is not the bottleneck, it only adds start-up time. On a machine with few
    cores its threads compete with the training threads. Its random streams differ from the
    DataLoader's, so the two pipelines see differently augmented (equally distributed)
    samples: expect small loss differences, not identical curves.

Settings
    ``threads`` (default 2; the one that matters: CPU threads decoding and augmenting),
    ``prefetch_queue_depth`` (default 2 batches), ``decode`` (``auto``: ``mixed`` on CUDA,
    ``cpu`` otherwise), ``output_size`` (None: the data's crop size; it must equal it, so
    both pipelines feed the model the same shape), ``shard_id`` / ``num_shards`` (read one
    shard of the files: in data-parallel arms they are set per rank, overriding these; set by
    hand on one rank, the arm reads only that shard). A list of values sweeps a setting, e.g.
    ``{"threads": [1, 2]}``. Needs JPEG data: ``data="jpeg"``, ``"jpeg-folder:PATH"`` or
    ``wb.JpegFolder(...)``.

Unavailable
    Without the DALI package (``pip install -e .[dali]``), without JPEG data, and with
    ``decode="mixed"`` on a CPU. Not combined with ``dataloader`` (each is the whole input
    pipeline) or ``prefetch`` (DALI's GPU pipeline already delivers on the device).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from workbench.config import check_choice, check_int
from workbench.jpeg_folder import CROP_AREA, CROP_ASPECT, MEAN, STD, ImageFiles
from workbench.techniques.base import Technique

DECODE = ("auto", "cpu", "mixed")


@dataclass(frozen=True)
class DaliConfig:
    threads: int = 2
    prefetch_queue_depth: int = 2
    decode: str = field(default="auto", metadata={"choices": DECODE})
    output_size: int | None = None
    shard_id: int = 0
    num_shards: int = 1

    def __post_init__(self) -> None:
        check_int("dali", "threads", self.threads, 1)
        check_int("dali", "prefetch_queue_depth", self.prefetch_queue_depth, 1)
        check_choice("dali", "decode", self.decode, DECODE)
        if self.output_size is not None:
            check_int("dali", "output_size", self.output_size, 8)
        check_int("dali", "num_shards", self.num_shards, 1)
        check_int("dali", "shard_id", self.shard_id, 0)
        if self.shard_id >= self.num_shards:
            raise ValueError(
                f"dali: shard_id must be below num_shards ({self.num_shards}); got {self.shard_id}"
            )


def _decode_device(config: DaliConfig, device: torch.device) -> str:
    if config.decode == "auto":
        return "mixed" if device.type == "cuda" else "cpu"
    return config.decode


def build_pipeline(
    images: ImageFiles,
    config: DaliConfig,
    batch_size: int,
    seed: int,
    device: torch.device,
    with_source_info: bool = False,
):
    """The DALI pipeline over ``images``: read, decode, random resized crop, flip, normalise.

    ``with_source_info`` adds a third output, each sample's file path (as bytes), so tests
    can check which label went with which file.
    """
    from nvidia.dali import fn, pipeline_def

    files, labels = _shuffled(images, seed)
    decode = _decode_device(config, device)
    on_gpu = device.type == "cuda"

    @pipeline_def
    def jpeg_pipeline():
        encoded, label = _read_files(files, labels, config)
        normalized = _decode_and_augment(encoded, decode, on_gpu, images.size)
        outputs = [normalized, label.gpu() if on_gpu else label]
        if with_source_info:
            outputs.append(fn.get_property(encoded, key="source_info"))
        return tuple(outputs)

    device_id = (
        (device.index if device.index is not None else torch.cuda.current_device()) if on_gpu else None
    )
    pipeline = jpeg_pipeline(
        batch_size=batch_size,
        num_threads=config.threads,
        device_id=device_id,
        seed=seed,
        prefetch_queue_depth=config.prefetch_queue_depth,
    )
    pipeline.build()
    return pipeline


def _shuffled(images: ImageFiles, seed: int) -> tuple[list[str], list[int]]:
    """The file list and its labels, shuffled once, seeded.

    The reader then shards a class-balanced list, and its own shuffle buffer (initial_fill)
    only has to mix within a window, not across classes.
    """
    order = np.random.default_rng(seed).permutation(len(images.files))
    return [images.files[i] for i in order], [images.labels[i] for i in order]


def _read_files(files: list[str], labels: list[int], config: DaliConfig):
    """The pipeline's file reader: (encoded JPEG, label) per sample, from this shard of the files."""
    from nvidia.dali import fn

    return fn.readers.file(
        files=files,
        labels=labels,
        random_shuffle=True,
        initial_fill=min(len(files), 1024),
        shard_id=config.shard_id,
        num_shards=config.num_shards,
        name="reader",
    )


def _decode_and_augment(encoded, decode: str, on_gpu: bool, size: int):
    """Decode to RGB, random resized crop, random flip, normalise to CHW float32 (on the GPU on CUDA)."""
    from nvidia.dali import fn, types

    decoded = fn.decoders.image(encoded, device=decode, output_type=types.RGB)
    if on_gpu and decode == "cpu":
        decoded = decoded.gpu()
    cropped = fn.random_resized_crop(
        decoded,
        size=(size, size),
        random_area=list(CROP_AREA),
        random_aspect_ratio=list(CROP_ASPECT),
        interp_type=types.INTERP_LINEAR,
    )
    return fn.crop_mirror_normalize(
        cropped,
        dtype=types.FLOAT,
        output_layout="CHW",
        mean=[m * 255 for m in MEAN],
        std=[s * 255 for s in STD],
        mirror=fn.random.coin_flip(probability=0.5),
    )


def dali_batches(
    images: ImageFiles, config: DaliConfig, batch_size: int, seed: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(images, labels) batches forever, as torch tensors on ``device``'s type."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    shard = len(images.files) // config.num_shards
    if shard < batch_size:
        raise ValueError(f"dali: each shard holds about {shard} images, fewer than batch_size={batch_size}")
    pipeline = build_pipeline(images, config, batch_size, seed, device)
    iterator = DALIGenericIterator(
        pipeline,
        ["images", "labels"],
        reader_name="reader",
        last_batch_policy=LastBatchPolicy.DROP,  # full batches only, like the DataLoader baseline
        auto_reset=True,
    )
    while True:
        for outputs in iterator:
            batch = outputs[0]
            yield batch["images"], batch["labels"].reshape(-1).long()


class Dali(Technique):
    name = "dali"
    summary = "NVIDIA DALI pipeline: JPEG decode and augmentation in native threads (nvJPEG on GPU)"
    order = 11
    group = "data"
    tune_space = {"threads": (2, 4)}
    Config = DaliConfig
    requires = ("dali", "jpeg_files")
    input_pipeline = True
    own_process_reason = (
        "its pipeline threads keep preparing batches ahead (prefetch) while other arms' windows run, "
        "taking CPU (and GPU) time from them"
    )
    conflicts = {
        "dataloader": "both replace the input pipeline (DALI threads vs DataLoader worker processes); "
        "compare them as separate arms"
    }

    def check(self, ctx, config: DaliConfig) -> str | None:
        if _decode_device(config, ctx.device) == "mixed" and ctx.device.type != "cuda":
            return f"decode='mixed' runs nvJPEG on a GPU; this run is on {ctx.device.type} (use decode='cpu')"
        return None

    def validate(self, ctx, config: DaliConfig) -> None:
        if config.output_size is not None and ctx.image_size and config.output_size != ctx.image_size:
            raise ValueError(
                f"dali: output_size={config.output_size} differs from the data's crop size {ctx.image_size}; "
                "both pipelines must feed the model the same shape, so set the size on the data "
                "(wb.JpegFolder(root, size=...)) instead"
            )
        shards = ctx.world_size if ctx.world_size > 1 else config.num_shards  # ranks read a shard each
        if ctx.image_count is not None and ctx.image_count // shards < ctx.batch_size:
            # said now, not once the arm's process has started: DALI drops a shard's last partial batch
            raise ValueError(
                f"dali: {shards} shards of {ctx.image_count} images hold about {ctx.image_count // shards} "
                f"each, fewer than batch_size={ctx.batch_size}; pass "
                + (
                    "a smaller batch_size or fewer ranks"
                    if ctx.world_size > 1
                    else "fewer num_shards or a smaller batch_size"
                )
            )

    def apply(self, setup, config: DaliConfig) -> str:
        device = setup.device

        if setup.world_size > 1:  # data-parallel ranks: each reads its own shard of the files
            config = dataclasses.replace(config, shard_id=setup.rank, num_shards=setup.world_size)

        def make_batches(source, batch_size: int, seed: int):
            return dali_batches(source.images, config, batch_size, seed, device)

        setup.make_batches = make_batches
        decode = _decode_device(config, device)
        where = "GPU operators, batches stay on the GPU" if device.type == "cuda" else "CPU operators"
        shard = f", shard {config.shard_id + 1} of {config.num_shards}" if config.num_shards > 1 else ""
        return (
            f"DALI pipeline: decode={decode}, {where}, {config.threads} thread{'s' * (config.threads != 1)}, "
            f"prefetch {config.prefetch_queue_depth} batches{shard}"
        )


TECHNIQUE = Dali()
