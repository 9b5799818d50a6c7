"""The contract every technique module fulfils.

A technique is a small class with
- ``name``, ``summary`` and an explicit ``order`` (lower applies first, like fastai's
  callback ``order``), so composing several is never ambiguous;
- ``group``: which part of training it changes, one of ``GROUPS`` (the panel's headings);
- ``Config``: a frozen dataclass that validates itself in ``__post_init__`` (a string field
  with a fixed set of values lists them in ``metadata={"choices": ...}``, so the notebook
  panel can offer a dropdown);
- ``requires``: named needs (``"cuda"``, ``"conv"``, ``"dataset"``, a package...) checked
  in one place, each failing with a human reason;
- ``check()``: any further condition, also answered with a reason;
- ``validate()``: settings that contradict the run (bad input) raise ValueError;
- ``conflicts``: other techniques it cannot be combined with, and why; ``conflict_with()``
  answers from the settings on both sides, when they decide it;
- ``apply()``: how it changes the run, by editing a :class:`~workbench.loop.TrainSetup`;
- ``own_process()``: why its arm cannot share a block's process with other arms, or None.

Sharing a process. An ablation runs its arms side by side in one worker process (a block),
which cancels the luck of that process in every ratio. Each arm keeps its own model,
optimizer, data iterator and random state, and a technique's process-wide switches go in
``TrainSetup.window_settings``, entered around each of the arm's windows and left after it.
A technique whose effect cannot be confined that way (state nobody can switch back, work
that keeps running between windows) says why in ``own_process_reason``; its arms then run
in their own processes, against a baseline that also runs alone. ``one_per_process`` marks
techniques whose per-process caches a second arm would reuse (torch.compile): the first
such arm shares the block, later ones run alone. Every technique is checked: an arm that
leaves process-wide state changed after its window is dropped from the block, with the
state it changed (workbench.process_state).

The module docstring of each technique is its method card: what it does, when it helps,
when it hurts, its settings, and where the idea comes from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from workbench import optional
from workbench.config import started_by_torchrun


@dataclass(frozen=True)
class Context:
    """What an availability check may look at. ``model`` is None when no model was named."""

    device: torch.device
    model: nn.Module | None = None
    model_name: str = ""
    data_is_dataset: bool = True  # False when the user passed ready-made batches
    # An IterableDataset that gives every DataLoader worker the whole stream (data.whole_stream_per_worker)
    whole_stream_per_worker: bool = False
    batch_size: int = 32
    data_label: str = ""
    image_size: int | None = None  # the crop size, when the data is a folder of JPEG files
    image_count: int | None = None  # the files of that folder, as its scan kept them
    world_size: int = 1  # ranks per arm (DDP)
    loader_workers: int = 0  # worker processes of a DataLoader the user gave as data (data.DataSource)
    # ready-made batches whose inputs lead with something else than samples: those inputs' shapes
    not_leading_with_samples: list[tuple[int, ...]] = field(default_factory=list)
    optimizer: str = "adamw"  # the run's optimizer: adamw, sgd, or "your own <factory's label>"
    warmup: int = 5  # untimed steps before the clock starts


def _needs_package(module: str, hint: str) -> Callable[[Context], str | None]:
    def check(ctx: Context) -> str | None:
        return optional.missing(module, hint)

    return check


def _needs_cuda(ctx: Context) -> str | None:
    if ctx.device.type != "cuda":
        return f"needs a CUDA device; this run is on {ctx.device.type}"
    return None


def _needs_conv(ctx: Context) -> str | None:
    if ctx.model is None:
        return None
    if not any(isinstance(m, nn.Conv2d) for m in ctx.model.modules()):
        return f"{ctx.model_name or 'the model'} has no Conv2d layers, so there is no conv memory layout to change"
    return None


def _needs_dataset(ctx: Context) -> str | None:
    if not ctx.data_is_dataset:
        return "needs a map-style Dataset to build a DataLoader from; this data arrives as ready-made batches"
    return None


def _needs_jpeg_files(ctx: Context) -> str | None:
    if ctx.data_label and ctx.image_size is None:  # no data_label: no data named, nothing to check
        return (
            "needs JPEG files to decode (data='jpeg', 'jpeg-folder:PATH' or wb.JpegFolder(...)); "
            f"this data is {ctx.data_label}"
        )
    return None


def _needs_ranks(ctx: Context) -> str | None:
    if ctx.world_size >= 2:
        return None
    if started_by_torchrun():  # torchrun's world size is the run's: --world-size cannot change it
        return "needs several ranks to communicate: start torchrun with --nproc-per-node 2 or more (or more nodes)"
    return "needs several ranks to communicate: pass world_size=2 or more to ablate"


# One place that turns a named requirement into a human reason (None = satisfied).
REQUIREMENTS: dict[str, Callable[[Context], str | None]] = {
    "cuda": _needs_cuda,
    "conv": _needs_conv,
    "dataset": _needs_dataset,
    "jpeg_files": _needs_jpeg_files,
    "ranks": _needs_ranks,
    "cupy": _needs_package("cupy", optional.install_hint("cupy")),
    "dali": _needs_package("nvidia.dali", optional.install_hint("nvidia.dali")),
}


# What part of training a technique changes: how batches are made, how the step computes, what it
# keeps in memory, what ranks exchange. The notebook panel shows the techniques under these headings.
GROUPS = ("data", "compute", "memory", "communication")


class Technique:
    """Base class for a toggleable acceleration technique. See the module docstring."""

    name: ClassVar[str]
    summary: ClassVar[str]
    order: ClassVar[int]
    group: ClassVar[str] = "other"  # one of GROUPS; a technique of your own may leave it
    Config: ClassVar[type]
    requires: ClassVar[tuple[str, ...]] = ()
    conflicts: ClassVar[Mapping[str, str]] = {}
    # True for techniques that change only how batches are produced (dataloader, dali): their
    # arms also get a loader-only twin that times the input pipeline alone.
    input_pipeline: ClassVar[bool] = False
    # Why this technique's arms cannot share a process with other arms (None: they can).
    own_process_reason: ClassVar[str | None] = None
    # Why only one arm per process may use it (its caches are per process); None: no limit.
    one_per_process: ClassVar[str | None] = None
    # Why its arms take far longer to start than the baseline's (None: they do not). The tuner
    # measures that start once, in its calibration, to cost the rounds that hold such arms.
    costly_start: ClassVar[str | None] = None
    # The main settings wb.tune tries besides the ones it was given (setting -> values): few, and
    # each one that changes speed for a reason the method card explains.
    tune_space: ClassVar[Mapping[str, tuple]] = {}

    def configure(self, value: Any) -> Any:
        """Turn what a user wrote (True, a dict, or a Config) into a validated Config."""
        if value is True:
            return self.Config()
        if isinstance(value, self.Config):
            return value
        if isinstance(value, Mapping):
            fields = [f.name for f in dataclasses.fields(self.Config)]
            unknown = [key for key in value if key not in fields]
            if unknown:
                valid = ", ".join(fields) if fields else "none (use True)"
                raise ValueError(f"{self.name}: unknown option {unknown[0]!r}; valid options: {valid}")
            return self.Config(**value)
        raise ValueError(f"{self.name}: settings must be True, False, or a dict of options; got {value!r}")

    def unavailable_reason(self, ctx: Context, config: Any) -> str | None:
        """None when the technique can run in this context, else why it cannot."""
        for requirement in self.requires:
            reason = REQUIREMENTS[requirement](ctx)
            if reason:
                return reason
        return self.check(ctx, config)

    def check(self, ctx: Context, config: Any) -> str | None:
        return None

    def validate(self, ctx: Context, config: Any) -> None:
        """Raise ValueError when the settings cannot make sense for this run (bad input)."""

    def sweep_member(self, settings: dict[str, Any]) -> dict[str, Any]:
        """One combination of a sweep's values, before it is configured (default: as it is).

        A technique may leave out what cannot apply to that one combination, where the same
        settings given alone are refused: a sweep of the DataLoader's num_workers over 0 and 2
        with prefetch_factor=4 means the prefetch for the arm with workers.
        """
        return settings

    def settings_that_matter(self, config: Any) -> list[str]:
        """The Config fields that change anything, given the others' values (default: all).

        A sweep makes one arm per combination of values; combinations that differ only in
        settings that do not matter (PowerSGD's rank under the fp16 hook) are one arm, and an
        arm's name shows only the settings that matter to it.
        """
        return [f.name for f in dataclasses.fields(config)]

    def conflict_with(self, config: Any, other: Technique, other_config: Any) -> str | None:
        """Why this technique, with these settings, cannot run in one arm with ``other`` (None: it can).

        Asked at plan time, for both orders of every pair in an arm, so an impossible combination
        is an ``unavailable`` row (or a leave-one-out error) before anything runs. The default
        answers from ``conflicts``, by name; override it when the answer depends on the settings.
        """
        return self.conflicts.get(other.name)

    def own_process(self, ctx: Context, config: Any) -> str | None:
        """Why an arm with these settings needs a process of its own, or None if it can share one."""
        return self.own_process_reason

    def apply(self, setup: Any, config: Any) -> str:
        """Change the run (a TrainSetup) and say in a few words what was done."""
        raise NotImplementedError

    def describe(self, config: Any) -> str:
        """``amp(dtype=bfloat16)``: the technique with the settings that matter to this config
        (PowerSGD's rank is left out under the fp16 hook)."""
        options = ", ".join(
            f"{name}={_short(getattr(config, name))}" for name in self.settings_that_matter(config)
        )
        return f"{self.name}({options})" if options else self.name

    def __repr__(self) -> str:
        return f"<technique {self.name}>"


def _short(value: Any) -> str:
    if callable(value):
        return getattr(value, "__name__", type(value).__name__)
    return str(value)
