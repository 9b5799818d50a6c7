"""Built-in datasets and adapters for the user's own data.

``data`` may be
- a built-in name: ``digits``, ``textures``, ``text``, ``jpeg`` (real data shipped inside
  packages, see datasets/) or ``synthetic`` (random tensors shaped like the model's default
  data, for speed-only runs);
- a folder of JPEG files: ``"jpeg-folder:PATH"`` or ``wb.JpegFolder(PATH, size=..., ...)``
  (see workbench.jpeg_folder); ``jpeg`` is such a folder, built from scikit-image's photos;
- a ``torch.utils.data.Dataset`` yielding (input, target) samples: it is wrapped in a
  DataLoader, so the ``dataloader`` technique applies;
- an iterable of ready-made (inputs, targets) batches, e.g. a list: it is cycled as is;
- a zero-argument callable returning either of the above (it runs in each arm's process,
  which is how to pass data that cannot be pickled, such as a generator).

A Dataset's samples are stacked into batches by torch's default collate; ``collate_fn=`` (of
ablate, plan, tune and advise, as DataLoader's) batches them otherwise, e.g. padding samples of
different lengths. It reaches every DataLoader workbench makes, so ``dataloader`` stays an arm.

Every arm sees the same samples in the same order: shuffling uses a generator seeded
from the run's seed, and batches are always full (drop_last) so shapes never change.
"""

from __future__ import annotations

import copy
import random
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler

from workbench.config import typed_name, unknown_name_error
from workbench.data_spec import BUILTIN_DATA, DataSpec, builtin_spec
from workbench.datasets import builders, ensure_built, jpeg, load
from workbench.jpeg_folder import ImageFiles, JpegDataset, JpegFolder, scan
from workbench.models import get_builtin_model

SYNTHETIC_SAMPLES = 2048
JPEG_FOLDER_PREFIX = "jpeg-folder:"


def list_datasets():
    """A DataFrame of the built-in datasets: name, kind, sample shape, classes, summary."""
    import pandas as pd

    summaries = {name: builder.summary for name, builder in builders().items()} | {"jpeg": jpeg.SUMMARY}
    rows = []
    for name in BUILTIN_DATA:
        if name == "synthetic":
            rows.append(
                {
                    "name": name,
                    "kind": "any",
                    "shape": "like the model's own dataset",
                    "classes": None,
                    "summary": "random tensors, for speed-only runs",
                }
            )
            continue
        spec = builtin_spec(name)
        rows.append(
            {
                "name": name,
                "kind": spec.kind,
                "shape": "x".join(map(str, spec.shape)),
                "classes": spec.num_classes,
                "summary": summaries[name],
            }
        )
    table = pd.DataFrame(rows)
    table["classes"] = table["classes"].astype("Int64")  # synthetic has none: keep the others integers
    return table


class ImageArrays(Dataset):
    """Images held as arrays; uint8 images are converted and normalised per sample."""

    def __init__(self, inputs: np.ndarray, targets: np.ndarray):
        self.inputs, self.targets = inputs, targets
        if inputs.dtype == np.uint8:
            scaled = inputs.astype(np.float32) / 255.0
            self.mean, self.std = float(scaled.mean()), float(scaled.std())

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = torch.from_numpy(self.inputs[index])
        if image.dtype == torch.uint8:
            image = (image.float() / 255.0 - self.mean) / self.std
            # A horizontal flip on every other sample: per-sample work like a real pipeline's
            # augmentation, fixed per index so that every arm sees identical data.
            if index % 2:
                image = image.flip(-1)
        return image, torch.tensor(self.targets[index])


class TokenWindows(Dataset):
    """Non-overlapping windows of a byte corpus; the target is the input shifted by one."""

    def __init__(self, corpus: np.ndarray, context: int):
        self.corpus, self.context = corpus, context

    def __len__(self) -> int:
        return (len(self.corpus) - 1) // self.context

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.context
        window = torch.from_numpy(self.corpus[start : start + self.context + 1].astype(np.int64))
        return window[:-1], window[1:]


def synthetic_dataset(spec: DataSpec, seed: int) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    if spec.kind == "tokens":  # random sequences, still shaped as next-token prediction
        sequences = torch.randint(
            0, spec.num_classes, (SYNTHETIC_SAMPLES, spec.shape[0] + 1), generator=generator
        )
        inputs, targets = sequences[:, :-1], sequences[:, 1:]
    else:
        inputs = torch.randn(SYNTHETIC_SAMPLES, *spec.shape, generator=generator)
        targets = torch.randint(0, spec.num_classes, (SYNTHETIC_SAMPLES,), generator=generator)
    return torch.utils.data.TensorDataset(inputs, targets)


@dataclass
class DataSource:
    """What to load, resolved in the ablation process and opened in each arm's process."""

    label: str
    spec: DataSpec | None = None  # None for user data: the user's model sizes itself
    builtin: str | None = None
    path: str | None = None  # cached .npz of a built-in dataset
    user: Any = None  # a Dataset, an iterable of batches, or a callable returning one
    is_dataset: bool = True  # False when batches arrive ready-made (no DataLoader to tune)
    images: ImageFiles | None = None  # a scanned JPEG folder: both DataLoader and DALI read it
    # An IterableDataset that gives every DataLoader worker the whole stream (see
    # whole_stream_per_worker): with several workers each sample would arrive once per worker.
    whole_stream_per_worker: bool = False
    collate_fn: Callable[[list], Any] | None = None  # the user's, for the DataLoaders workbench makes
    # the samples the user's Dataset holds, as resolving it saw them (a factory's Dataset too)
    samples: int | None = None
    # the worker processes of a DataLoader given as data (or that a factory gives): 0 loads in the
    # arm's own process
    loader_workers: int = 0

    def for_one_arm(self) -> DataSource:
        """This source with the user's data as one arm's own: see ``arms_own``."""
        return replace(self, user=arms_own(self.user))

    def open_dataset(self, seed: int) -> Dataset | Iterable:
        if self.images is not None:
            return JpegDataset(self.images)
        if self.builtin == "synthetic":
            return synthetic_dataset(self.spec, seed)
        if self.builtin is not None:
            arrays = load(self.path)
            if self.builtin == "text":
                return TokenWindows(arrays["corpus"], self.spec.shape[0])
            return ImageArrays(arrays["inputs"], arrays["targets"])
        return self.user() if callable(self.user) and not _is_data(self.user) else self.user


def arms_own(data: object) -> object:
    """A copy of a DataLoader or an IterableDataset for one arm of a block, whose arms share a process.

    Their iteration keeps state: the generator a DataLoader shuffles with, its sampler, a stream's
    own random generator. Arms sharing one object would each advance it, and so train on
    different batches, which the loss parity would then compare. The samples they hold (a
    map-style Dataset, tensors, arrays) are shared, not copied: only the state is the arm's.
    Anything else is given as it is: workbench makes a Dataset's DataLoader for each arm itself,
    and a factory is called for each arm. An object that cannot be copied (one holding an open
    file) is shared as it is.
    """
    if not isinstance(data, (DataLoader, IterableDataset)):
        return data
    samples = data.dataset if isinstance(data, DataLoader) else data
    try:
        shared = _arrays_held_by(samples) if isinstance(samples, IterableDataset) else [samples]
        return copy.deepcopy(data, {id(held): held for held in shared})
    except Exception:  # an open file, a lock, attributes in __slots__: shared, as before
        return data


def _arrays_held_by(dataset: object) -> list[object]:
    """The tensors, arrays and map-style Datasets that ``dataset``'s attributes hold, directly or
    in a list, tuple or dict: its samples, which a copy for one arm may share."""
    values = []
    for value in vars(dataset).values():
        if isinstance(value, dict):
            values += value.values()
        elif isinstance(value, (list, tuple)):
            values += value
        else:
            values.append(value)
    return [
        held
        for held in values
        if isinstance(held, (torch.Tensor, np.ndarray))
        or (isinstance(held, Dataset) and not isinstance(held, IterableDataset))
    ]


@dataclass(frozen=True)
class Collated:
    """The user's Dataset (or a factory of one) with the ``collate_fn`` that batches its samples:
    what ``collate_fn=`` makes of ``data``, carried as data through the tuner and the advisor."""

    data: Any
    collate_fn: Callable[[list], Any]


def with_collate_fn(data: object, collate_fn: Callable[[list], Any] | None) -> object:
    """``data`` as the public functions take it, with their ``collate_fn=`` argument."""
    if collate_fn is None:
        return data
    if not callable(collate_fn) or isinstance(collate_fn, type):
        raise ValueError(
            "collate_fn must be a function that makes one batch from a list of samples, as DataLoader's "
            f"collate_fn; got {collate_fn!r}"
        )
    return Collated(data, collate_fn)


def _is_data(obj: object) -> bool:
    return isinstance(obj, Dataset) or (isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)))


def as_jpeg_folder(data: object) -> JpegFolder | None:
    """The JpegFolder that ``data`` names ("jpeg", "jpeg-folder:PATH" or one), else None. Does no I/O."""
    if isinstance(data, JpegFolder):
        return data
    if isinstance(data, str) and data.startswith(JPEG_FOLDER_PREFIX):
        return JpegFolder(data[len(JPEG_FOLDER_PREFIX) :])
    if isinstance(data, str) and data == "jpeg":
        return JpegFolder(str(jpeg.default_root()), size=jpeg.CROP, on_corrupt="raise")
    return None


def data_label(data: object, model: object = None) -> str:
    """A short name for ``data`` (the model's own dataset when None), without loading anything."""
    if data is None and isinstance(model, str):
        return get_builtin_model(model).default_data
    if isinstance(data, Collated):
        return data_label(data.data)
    if isinstance(data, JpegFolder):
        return f"{JPEG_FOLDER_PREFIX}{data.root}"
    if isinstance(data, str):
        return data
    return typed_name(data) or getattr(data, "__name__", type(data).__name__)


def _resolve_jpeg_folder(folder: JpegFolder, label: str, builtin_model: Any) -> DataSource:
    if builtin_model is not None and "image" not in builtin_model.accepts:
        raise ValueError(
            f"model {builtin_model.name!r} trains on {', '.join(builtin_model.accepts)} data, not JPEG images"
        )
    if label == "jpeg":
        jpeg.ensure_built()
    images = scan(folder)
    spec = DataSpec("image", (3, folder.size, folder.size), len(images.classes))
    return DataSource(label=label, spec=spec, images=images)


def resolve_data(data: object, model: object) -> DataSource:
    """Check ``data`` against ``model`` and describe how each arm will load it."""
    if isinstance(data, Collated):
        return _with_collate_fn(resolve_data(data.data, model), data.collate_fn)
    builtin_model = get_builtin_model(model) if isinstance(model, str) else None
    if data is None:
        if builtin_model is None:
            raise ValueError(
                "data is required with your own model: pass a Dataset, an iterable of batches, or a callable"
            )
        data = builtin_model.default_data
    folder = as_jpeg_folder(data)
    if folder is not None:
        return _resolve_jpeg_folder(folder, data_label(data), builtin_model)
    if isinstance(data, str):
        if data not in BUILTIN_DATA:
            raise unknown_name_error("dataset", data, [*BUILTIN_DATA, f"{JPEG_FOLDER_PREFIX}PATH"])
        if builtin_model is None:
            raise ValueError(
                f"built-in dataset {data!r} is sized for the built-in models; with your own model, pass your own "
                "data: a Dataset of (input, target) samples, a list of batches, or a DataLoader"
            )
        spec = builtin_spec(builtin_model.default_data if data == "synthetic" else data)
        if spec.kind not in builtin_model.accepts:
            fitting = [
                d for d in BUILTIN_DATA if d == "synthetic" or builtin_spec(d).kind in builtin_model.accepts
            ]
            raise ValueError(
                f"model {builtin_model.name!r} cannot train on dataset {data!r} ({spec.kind} data); "
                f"datasets it accepts: {', '.join(fitting)}"
            )
        path = None if data == "synthetic" else str(ensure_built(data))
        return DataSource(label=data, spec=spec, builtin=data, path=path)
    if builtin_model is not None:
        raise ValueError(
            f"built-in model {builtin_model.name!r} trains on built-in data ({', '.join(BUILTIN_DATA)}) "
            f"or a JPEG folder ({JPEG_FOLDER_PREFIX}PATH); for other data, also pass your own model factory"
        )
    if isinstance(data, Dataset):
        return _user_source(typed_name(data) or type(data).__name__, data, data)
    if isinstance(data, Iterator):
        raise ValueError(
            "data is a one-shot iterator (e.g. a generator), which cannot be replayed for every arm; "
            "pass a list of batches, or a callable that returns a fresh iterator"
        )
    if isinstance(data, Iterable):
        label = typed_name(data) or type(data).__name__
        return DataSource(label=label, user=data, is_dataset=False, loader_workers=_loader_workers(data))
    if callable(data):
        # Called once here only to learn whether it gives a Dataset; each arm calls it again.
        sample = data()
        if not _is_data(sample):
            raise ValueError(
                f"the data factory {getattr(data, '__name__', data)!r} returned {type(sample).__name__}; "
                "it must return a Dataset or an iterable of (inputs, targets) batches"
            )
        return _user_source(typed_name(data) or getattr(data, "__name__", "data"), data, sample)
    raise ValueError(
        f"data must be a built-in name ({', '.join(BUILTIN_DATA)}), '{JPEG_FOLDER_PREFIX}PATH', a Dataset, an iterable of "
        f"(inputs, targets) batches, or a callable returning one; got {data!r}"
    )


def _with_collate_fn(source: DataSource, collate_fn: Callable[[list], Any]) -> DataSource:
    if source.user is None:
        raise ValueError(
            f"collate_fn batches your own Dataset's samples; {source.label!r} is built-in data, which "
            "workbench batches itself: leave collate_fn out, or pass your own Dataset and model"
        )
    if not source.is_dataset:
        raise ValueError(
            "collate_fn batches a Dataset's samples, but this data gives ready-made batches (a list, an "
            "iterable or a DataLoader), which workbench uses as they are: pass the Dataset itself with "
            "collate_fn, or leave collate_fn out"
        )
    return replace(source, collate_fn=collate_fn)


def _user_source(label: str, user: object, data: object) -> DataSource:
    """The user's Dataset, or a factory (``user``) of ``data``, a Dataset or batches."""
    if isinstance(data, Dataset):
        _refuse_unsized(data)
    return DataSource(
        label=label,
        user=user,
        is_dataset=isinstance(data, Dataset),
        whole_stream_per_worker=whole_stream_per_worker(data),
        samples=_length(data) if isinstance(data, Dataset) else None,
        loader_workers=_loader_workers(data),
    )


def _loader_workers(data: object) -> int:
    """The worker processes ``data`` loads in, when it is a DataLoader; else 0."""
    return data.num_workers if isinstance(data, DataLoader) else 0


def _refuse_unsized(data: Dataset) -> None:
    """A map-style Dataset (read by index) must say how many samples it holds: a DataLoader's
    sampler draws its indices from that (it failed later as "object has no len()")."""
    if not isinstance(data, IterableDataset) and _length(data) is None:
        raise ValueError(
            f"the Dataset {type(data).__name__} is read by index (__getitem__) but has no __len__, "
            "which a DataLoader needs to draw its indices: define __len__, or make it an "
            "IterableDataset that yields its samples"
        )


def _length(data: Dataset) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:  # no __len__, or an IterableDataset's that says it has none
        return None


def whole_stream_per_worker(data: object) -> bool:
    """Whether ``data`` is an IterableDataset that gives each DataLoader worker the whole stream.

    Every worker holds a copy of an IterableDataset and iterates all of it, unless its
    ``__iter__`` reads ``torch.utils.data.get_worker_info()`` and yields only its share (as
    PyTorch's IterableDataset documentation shows); with N workers each sample would then be
    trained on N times, shuffled or not. Found out in this process, on copies of the stream as a
    worker gets one, asked for their first samples as worker 0 and worker 1 of 2:
    - under the same seed, worker 1 begins elsewhere: it takes its share (False);
    - else, under another seed (each worker is seeded anew), it yields samples worker 0 yielded
      too: the same stream, in its order or shuffled (True), or only new ones, drawn at random,
      which no two workers repeat (False).
    False also when this cannot be told: the stream failed, or torch's worker state moved. The
    random states of torch, numpy and random are left as they were.
    """
    if not isinstance(data, IterableDataset):
        return False
    try:
        with _random_states_kept():
            mine = _first_samples(data, worker=0, seed=0, count=PROBED_REPEATS)
            theirs = _first_samples(data, worker=1, seed=0, count=1)
            if not (mine and theirs and _same_sample(mine[0], theirs[0])):
                return False  # nothing to compare, or worker 1 starts on a share of its own
            reseeded = _first_samples(data, worker=1, seed=1, count=PROBED_SAMPLES)
    except Exception:  # what the stream says is for its first batch to say, in each arm
        return False
    return any(_same_sample(a, b) for a in mine[:PROBED_REPEATS] for b in reseeded)


# What the probe reads of each worker's stream: enough to hold the whole of a small shuffled one,
# and at most a second's reading of an expensive one.
PROBED_SAMPLES, PROBED_S, PROBED_REPEATS = 256, 1.0, 16


def _first_samples(data: IterableDataset, worker: int, seed: int, count: int) -> list:
    """The first ``count`` samples (at most PROBED_S of reading) that worker ``worker`` of 2 would
    read, on a copy of ``data`` as an arm gets one (its own generator included, as a worker's copy
    has it; the tensors it holds shared, not copied), with torch, numpy and random seeded ``seed``."""
    stream = arms_own(data)
    torch.default_generator.manual_seed(seed)  # the CPU's alone: torch.manual_seed reseeds every GPU's too
    np.random.seed(seed)
    random.seed(seed)
    samples, began = [], time.perf_counter()
    with _as_worker(worker, of=2, dataset=stream):
        iterator = iter(stream)
        for sample in iterator:
            samples.append(sample)
            if len(samples) >= count or time.perf_counter() - began > PROBED_S:
                break
        getattr(iterator, "close", lambda: None)()  # a generator's own cleanup runs now
    return samples


@contextmanager
def _random_states_kept() -> Iterator[None]:
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


@contextmanager
def _as_worker(id: int, of: int, dataset: Dataset) -> Iterator[None]:
    """Within it, ``get_worker_info()`` answers as in DataLoader worker ``id`` of ``of``: it reads
    torch's module-level ``_worker_info``, which a worker process sets when it starts."""
    from torch.utils.data._utils import worker

    before = worker._worker_info
    worker._worker_info = worker.WorkerInfo(id=id, num_workers=of, seed=id, dataset=dataset)
    try:
        yield
    finally:
        worker._worker_info = before


def _same_sample(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same_sample(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_sample(x, y) for x, y in zip(a, b, strict=True))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # values that cannot be compared: not known to be the same
        return False


def check_sample_count(source: DataSource, batch_size: int, world_size: int = 1) -> None:
    """Refuse, before any arm starts, data that cannot fill one batch per rank."""
    count = sample_count(source)
    if count is not None:
        check_count(count, source.label, batch_size, world_size)


def sample_count(source: DataSource) -> int | None:
    """The samples the data holds, where that shows before an arm reads it: None for ready-made
    batches (refused when there are none), or a Dataset without a length."""
    user = source.user
    if source.images is not None:
        return len(source.images.files)
    if source.builtin == "synthetic":
        return SYNTHETIC_SAMPLES
    if source.builtin is not None:
        return len(source.open_dataset(0))  # a small array file, cached on disk
    if source.samples is not None:  # the user's Dataset, or the one their factory gave
        return source.samples
    if isinstance(user, (list, tuple)) and not user:  # ready-made batches
        raise ValueError("data holds no batches: the list is empty")
    return None  # batches, or an iterator: a length shows only when an arm reads it


def check_count(count: int, label: str, batch_size: int, world_size: int) -> None:
    if count == 0:
        raise ValueError(f"data {label!r} is empty: it holds no samples")
    if count < batch_size * world_size:
        raise ValueError(
            f"data {label!r} has {count} samples, fewer than batch_size={batch_size}"
            + (f" x {world_size} ranks" if world_size > 1 else "")
            + "; pass a smaller batch_size or more data"
        )


def endless_batches(
    source: DataSource,
    batch_size: int,
    seed: int,
    loader_options: dict[str, Any],
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[Any, Any]]:
    """Batches forever: a new epoch starts when the data runs out.

    With several ranks, each reads its own shard: a DistributedSampler splits a Dataset
    (reshuffled every epoch, the same way on every rank), and ready-made batches, or an
    IterableDataset's, are dealt out in turn (batch i goes to rank i mod world_size).
    """
    data = source.open_dataset(seed)
    if isinstance(data, Dataset):
        if hasattr(data, "__len__"):  # a factory's Dataset: its size shows only here, in the arm
            check_count(len(data), source.label, batch_size, world_size)
        if isinstance(data, IterableDataset):
            order: dict[str, Any] = {}  # a stream keeps its own order: a DataLoader cannot shuffle it
        elif world_size > 1:
            order = {
                "sampler": _ReshufflingSampler(
                    data, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
                )
            }
        else:
            # The order's own generator: one shared with the DataLoader also gives each new
            # iterator its workers' base seed, a draw that persistent workers skip from the second
            # epoch on, so that their arm was shuffled unlike the baseline's from then.
            order = {"sampler": RandomSampler(data, generator=torch.Generator().manual_seed(seed))}
        loader = DataLoader(
            data,
            batch_size=batch_size,
            drop_last=True,
            worker_init_fn=_seed_worker,
            # the workers' base seed, drawn at each new iterator: from this, not torch's global state
            generator=torch.Generator().manual_seed(seed),
            **order,
            **({"collate_fn": source.collate_fn} if source.collate_fn is not None else {}),
            **loader_options,
        )
        # batches are full (drop_last): a Dataset of fewer samples than one yields none at all
        no_batch = f"no full batch of batch_size={batch_size} samples; pass a smaller batch_size or more data"
        workers = loader_options.get("num_workers") or 0
        if isinstance(data, IterableDataset) and workers > 1:
            # each worker batches its own share, and drops what is left: shares under a batch give none
            no_batch += (
                f", or fewer DataLoader workers (each of the {workers} batches only its own share of the "
                "stream, and drops a last partial batch)"
            )
        batches = _cycle(
            loader,
            lambda: loader,
            no_batch,
            default_collate=source.collate_fn is None,
            read_as=BATCHED_SAMPLES if source.collate_fn is None else BATCHED_BY_YOURS,
        )
        if isinstance(data, IterableDataset) and world_size > 1:  # no sampler shards a stream: deal it out
            return (batch for index, batch in enumerate(batches) if index % world_size == rank)
        return batches
    batches = _cycle(data, _next_pass(source, data, seed))
    if world_size > 1:
        return (batch for index, batch in enumerate(batches) if index % world_size == rank)
    return batches


class _ReshufflingSampler(DistributedSampler):
    """A DistributedSampler that moves to the next epoch by itself after each pass.

    Each epoch is then shuffled anew, the same way on every rank, without the loop that
    cycles the loader having to call set_epoch.
    """

    def __iter__(self) -> Iterator[int]:
        indices = super().__iter__()  # drawn now, from this epoch's seed
        self.epoch += 1
        return indices


def _next_pass(source: DataSource, data: Iterable, seed: int) -> Callable[[], Iterable] | None:
    """What gives the batches again once ``data`` ran out: itself when it can be iterated again
    (a list, a DataLoader), the user's factory called anew when it made a one-pass iterator
    (a generator), nothing for an iterator given as it is."""
    if not isinstance(data, Iterator):
        return lambda: data
    if callable(source.user) and not _is_data(source.user):
        return lambda: source.open_dataset(seed)
    return None


def _cycle(
    iterable: Iterable,
    next_pass: Callable[[], Iterable] | None,
    no_batch: str = "no batches",
    default_collate: bool = True,
    read_as: str = "",
) -> Iterator[tuple[Any, Any]]:
    served = 0
    while True:
        before = served
        try:
            for batch in iterable:
                if served == 0:
                    _check_batch(batch, read_as)
                served += 1
                yield batch
        except RuntimeError as error:
            # torch's default collate failed to stack samples (not the user's own collate_fn)
            if not default_collate or "stack expects each tensor to be equal size" not in str(error):
                raise
            raise ValueError(UNEQUAL_SAMPLES + f" ({str(error).strip().splitlines()[-1]})") from None
        if served == before:
            raise ValueError(
                f"the data yielded {no_batch}" if served == 0 else "the data stopped yielding batches"
            )
        if next_pass is None:
            raise ValueError(
                f"the data ran out after {served} batches and cannot be replayed; pass a list, "
                "a Dataset, or a callable that returns a fresh iterable"
            )
        iterable = next_pass()


def release_loader_workers(data: object) -> None:
    """Shut down the workers a DataLoader with ``persistent_workers`` keeps after it was read.

    workbench reads the first batch in the caller's process, to check it before any arm runs;
    such a DataLoader then holds its worker processes there, and its iterator, which cannot be
    sent to the arms' processes. (``_iterator`` is where DataLoader keeps it: no public way.)
    """
    iterator = getattr(data, "_iterator", None) if isinstance(data, DataLoader) else None
    if iterator is not None:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        data._iterator = None


# --- batch forms -------------------------------------------------------------------------
# A batch is an (inputs, targets) pair, or a dict of named inputs (the Hugging Face
# convention: input_ids, attention_mask, labels), whose model computes its own loss from the
# labels in it. Inputs are a tensor (model(x)), a tuple or list (model(*x)) or a dict
# (model(**x)); the step and the techniques go through the helpers below, except grad_accum's
# _split and ablation._shapes_of, which walk the same forms (ARCHITECTURE.md, "Batches").


def inputs_and_targets(batch: Any) -> tuple[Any, torch.Tensor | None]:
    """``(inputs, targets)``; a dict batch is all inputs, with no targets of its own."""
    if isinstance(batch, Mapping):
        return batch, None
    inputs, targets = batch
    return inputs, targets


def map_tensors(value: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    """``function`` applied to every tensor in nested tuples, lists and dicts; the rest kept."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, Mapping):
        return {key: map_tensors(item, function) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(item, function) for item in value)
    return value


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor in nested tuples, lists and dicts, in order."""
    found: list[torch.Tensor] = []
    map_tensors(value, found.append)
    return found


def batch_size_of(inputs: Any, targets: torch.Tensor | None) -> int:
    """Samples in a batch: the targets' length, else the first dimension of the first input
    tensor that has one (a sequence model's inputs may lead with time: (T, B, F) with B targets)."""
    if targets is not None and targets.dim() > 0:
        return len(targets)
    rows = rows_of(inputs)
    if rows is None:
        raise ValueError(
            "a batch needs a batched tensor (one sample per row) among its targets or inputs; "
            "this one holds only scalars"
        )
    return rows


def not_leading_with_samples(inputs: Any, targets: torch.Tensor | None) -> list[tuple[int, ...]]:
    """The shapes of the batch's input tensors whose first dimension is not its samples (a
    time-major sequence's (T, B, F)): what splitting along the first dimension would cut in time."""
    size = batch_size_of(inputs, targets)
    return sorted({tuple(t.shape) for t in tensors_of(inputs) if t.dim() > 0 and t.shape[0] != size})


def rows_of(inputs: Any) -> int | None:
    """The first dimension of the first input tensor that has one (None: only scalars)."""
    return next((tensor.shape[0] for tensor in tensors_of(inputs) if tensor.dim() > 0), None)


def _check_batch(batch: object, read_as: str = "") -> None:
    """Refuse a first batch that is not a pair or a dict of tensors; ``read_as`` says how the data
    was read into batches (READY_MADE, BATCHED_SAMPLES, BATCHED_BY_YOURS), for what to change."""
    read_as = read_as or READY_MADE
    if isinstance(batch, Mapping):
        if not tensors_of(batch):
            raise ValueError(
                f"a dict batch must hold tensors (e.g. input_ids, labels); got keys {list(batch)}"
            )
        return
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        got = type(batch).__name__ + (f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else "")
        raise ValueError(
            "each batch must be an (inputs, targets) pair, or a dict of named inputs for a model that "
            f"computes its own loss (input_ids, attention_mask, labels); got a {got}. " + read_as
        )
    targets = batch[1]
    if isinstance(targets, (int, float)) or (isinstance(targets, torch.Tensor) and targets.dim() == 0):
        # one sample's pair (list(dataset), a DataLoader with batch_size=None): taken as a batch,
        # its features would be counted as samples
        raise ValueError(
            "a batch's targets hold one value per sample, but these are a single value: this is one "
            f"sample, not a batch. {read_as}"
        )
    if not isinstance(targets, torch.Tensor):
        raise ValueError(
            f"batch targets must be one tensor (stack several into one, and split them again in loss_fn); "
            f"got {type(targets).__name__}" + (f". {read_as}" if read_as == BATCHED_BY_YOURS else "")
        )


# The default collate stacks a batch's samples into one tensor: samples of different shapes fail there.
UNEQUAL_SAMPLES = (
    "the Dataset's samples differ in shape, so torch's default collate cannot stack them into a "
    "batch: pass collate_fn= (as DataLoader's) to batch them your way, e.g. padding them to one "
    "length, or pad them to one shape in __getitem__"
)

# What a mistaken batch's message adds: how workbench read the data, and what to pass instead.
BATCHED_SAMPLES = (
    "workbench batches a Dataset's samples with torch's default collate, which keeps each sample's "
    "form: __getitem__ must return an (input, target) pair, or a dict of named tensors, or pass "
    "collate_fn= to make the batches your way"
)
BATCHED_BY_YOURS = "This batch is what your collate_fn returned for a list of samples"
READY_MADE = (
    "A list, tuple or other iterable given as data is read as ready-made batches, each item one "
    "batch; for samples (tensors of them, or a list of (input, target) pairs) pass a Dataset, "
    "e.g. torch.utils.data.TensorDataset(inputs, targets), which workbench batches"
)


def loader_worker_error(error: BaseException) -> str | None:
    """A DataLoader worker's own error in one line ("KeyError: 'bad sample 7' (in DataLoader
    worker process 0)"), for the error it arrives wrapped in; None for any other error. The
    wrapper's text holds the worker's whole traceback, whose last line is the error itself: cut to
    a reason's length, it kept only the wrapper and the first frames."""
    lines = str(error).strip().splitlines()
    if len(lines) < 3 or not lines[0].startswith("Caught ") or not lines[1].startswith("Original Traceback"):
        return None
    where = lines[0].removeprefix("Caught ").partition(" in ")[2].rstrip(".")
    return f"{lines[-1].strip()} (in {where})" if where else lines[-1].strip()


def _seed_worker(worker_id: int) -> None:
    # DataLoader seeds torch in each worker; numpy and random are ours to seed.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def loader_feed(source: DataSource, batch_size: int, seed: int, workers: int, budget_s: float = 0.5) -> dict:
    """What a DataLoader with ``workers`` processes delivers to a consumer that does nothing:
    ``feed_ms``, the wall time per batch (the rate the loader can sustain), and ``taking_ms``,
    the consumer's own CPU time per batch (with workers, the hand-over: what a training step
    would still pay for each batch). The workers' start-up and first batches are excluded; at
    most ``budget_s`` is timed, and at least 5 batches.

    The advisor weighs workers by these, since Amdahl's bound on the data wait ignores the
    hand-over: for samples already in memory it can cost more than the loading it moves.
    """
    options = {"num_workers": workers, "persistent_workers": workers > 0}
    # More workers than cores is what is being measured, not a mistake: the DataLoader says so when
    # it is made and at each pass over the Dataset, and a pass may be a few batches.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        batches = endless_batches(source, batch_size, seed, options)
        try:
            for _ in range(2 * workers + 2):  # every worker started and one round of prefetch taken
                next(batches)
            count, wall_start, cpu_start = 0, time.perf_counter(), time.process_time()
            while count < 5 or time.perf_counter() - wall_start < budget_s:
                next(batches)
                count += 1
            wall_s, cpu_s = time.perf_counter() - wall_start, time.process_time() - cpu_start
        finally:
            batches.close()  # the DataLoader's iterator goes, and with it its worker processes
    return {"workers": workers, "feed_ms": 1e3 * wall_s / count, "taking_ms": 1e3 * cpu_s / count}
