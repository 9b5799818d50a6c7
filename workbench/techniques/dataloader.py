"""dataloader: the classic input-pipeline knobs of ``torch.utils.data.DataLoader``.

What it does
    Loads and collates batches in ``num_workers`` background processes, each keeping
    ``prefetch_factor`` batches ready; ``persistent_workers`` keeps them alive between
    epochs; ``pin_memory`` puts batches in page-locked host memory so the copy to the GPU
    can run asynchronously.

When it helps
    When the step waits for data (a large ``data_ms`` in the breakdown): decoding and
    augmentation on the CPU, slow storage. Baidu Intelligent Cloud Tech Hub ("How to
    Supercharge AI Model Training"), ByteTrending ("Accelerate Model Training", 2025),
    "Advanced AI Training Analysis" (serverrental.store, 2026) and George Zemlak ("The
    Secret to Training AI Models Faster and More Efficiently") all name data loading as a
    first bottleneck and these knobs (parallel workers, pinned memory, prefetching to
    overlap I/O with compute) as the first fix; the Baidu AIAK-Training write-up reports
    dataloader-bound jobs among those that sped up most.

When it hurts
    When data is already cheap (a tensor in memory): workers add inter-process transfer and
    start-up costs for nothing. On a machine with few cores, workers compete with the
    training threads for the same cores. pin_memory has no effect without a GPU, and
    pinning too much memory can starve the host.

Settings
    ``num_workers`` (default 2; the one that matters), ``pin_memory`` (default True, CUDA only),
    ``prefetch_factor`` (default 2 when there are workers), ``persistent_workers`` (default
    True when there are workers). The baseline loads in the training process.

Unavailable
    When the data is ready-made batches (an iterable of batches, not a Dataset): there is
    nothing for a DataLoader to load. With more than one worker, when the data is an
    IterableDataset that does not share its stream among workers: each worker holds a copy and
    reads all of it unless ``__iter__`` yields only its share of ``get_worker_info()``, so every
    sample would be trained on once per worker (PyTorch's IterableDataset documentation).
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config import check_bool, check_int
from workbench.techniques.base import Technique


@dataclass(frozen=True)
class DataloaderConfig:
    num_workers: int = 2
    pin_memory: bool = True
    prefetch_factor: int | None = None
    persistent_workers: bool | None = None

    def __post_init__(self) -> None:
        check_int("dataloader", "num_workers", self.num_workers, 0)
        check_bool("dataloader", "pin_memory", self.pin_memory)
        if self.prefetch_factor is not None:
            check_int("dataloader", "prefetch_factor", self.prefetch_factor, 1)
            if self.num_workers == 0:
                raise ValueError(
                    "dataloader: prefetch_factor needs num_workers > 0 (it counts batches each worker loads ahead)"
                )
        if self.persistent_workers is not None:
            check_bool("dataloader", "persistent_workers", self.persistent_workers)
            if self.persistent_workers and self.num_workers == 0:
                raise ValueError("dataloader: persistent_workers=True needs num_workers > 0")


WORKER_SETTINGS = ("prefetch_factor", "persistent_workers")  # what only a worker process does


class Dataloader(Technique):
    name = "dataloader"
    summary = "DataLoader workers, pinned memory, prefetching, persistent workers"
    order = 10
    group = "data"
    tune_space = {"num_workers": (1, 2, 4)}  # past the cores, workers compete with training
    Config = DataloaderConfig
    requires = ("dataset",)
    input_pipeline = True

    def check(self, ctx, config: DataloaderConfig) -> str | None:
        if config.num_workers > 1 and ctx.whole_stream_per_worker:
            return (
                f"this IterableDataset gives every worker the whole stream, so with num_workers={config.num_workers} "
                f"each sample would arrive {config.num_workers} times; yield only the share that "
                "torch.utils.data.get_worker_info() names in its __iter__, or use num_workers=1"
            )
        return None

    def sweep_member(self, settings: dict) -> dict:
        # The workers' own settings are for the sweep's arms with workers: refused for an arm
        # without any, they made a sweep over num_workers=0|2 with them impossible to ask for.
        if settings.get("num_workers") == 0:
            return {k: v for k, v in settings.items() if k not in WORKER_SETTINGS}
        return settings

    def settings_that_matter(self, config: DataloaderConfig) -> list[str]:
        fields = super().settings_that_matter(config)
        return [name for name in fields if config.num_workers > 0 or name not in WORKER_SETTINGS]

    def own_process(self, ctx, config: DataloaderConfig) -> str | None:
        if config.num_workers > 0:
            return (
                "its worker processes keep loading batches ahead (prefetch) while other arms' windows run, "
                "taking CPU from them"
            )
        return None

    def apply(self, setup, config: DataloaderConfig) -> str:
        options = {
            "num_workers": config.num_workers,
            "pin_memory": config.pin_memory and setup.device.type == "cuda",
        }
        if config.num_workers > 0:
            options["prefetch_factor"] = config.prefetch_factor or 2
            options["persistent_workers"] = (
                True if config.persistent_workers is None else config.persistent_workers
            )
        setup.loader_options.update(options)
        note = ", ".join(f"{key}={value}" for key, value in options.items())
        if config.pin_memory and setup.device.type != "cuda":
            note += " (pin_memory only matters for copies to a GPU)"
        return note


TECHNIQUE = Dataloader()
