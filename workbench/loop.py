"""The one train step, with named hook points that techniques fill.

A step is: **batch** (fetch through the batch stages, move to the device, input
transforms), **split** (into
micro-batches), for each micro-batch **forward** (inside ``forward_context``) and
**backward** (through the loss scaler), then the **optimizer step** (through the loss
scaler). Techniques never branch the step: they set a hook point's field of the
TrainSetup, and every field's default is the plain step (one micro-batch, no context, no
loss scaling), so a technique that is off changes nothing. amp fills forward_context and
the loss scaler (workbench/techniques/amp.py), grad_accum the split (grad_accum.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from workbench.data import batch_size_of, inputs_and_targets, map_tensors
from workbench.distributed import no_sync_context
from workbench.telemetry import StepClock


class UnusableOutput(ValueError):
    """The default loss cannot use what the model returned (the message says what it was)."""


def default_loss(outputs: Any, targets: torch.Tensor | None) -> torch.Tensor:
    """The model's own loss when it computed one (a Hugging Face output, with labels in the
    batch); else cross-entropy of its logits (the tensor it returned, a ``logits`` field, or
    the first tensor of a tuple) against the targets, sequence outputs flattened per token.
    """
    own = _field(outputs, "loss")
    if isinstance(own, torch.Tensor):
        return own
    logits = _logits(outputs)
    if logits is None or targets is None:
        raise UnusableOutput(
            f"the default loss cannot use this model's output ({describe_output(outputs)}): "
            + (
                "it holds no 'loss', 'logits' or tensor to take cross-entropy of"
                if logits is None
                else "it has no 'loss' field, and a dict batch has no targets: the model must compute its "
                "own loss (a Hugging Face model does, given 'labels' in the batch and return_dict=True)"
            )
            + "; pass loss_fn=lambda outputs, targets: ... returning a scalar tensor"
        )
    if logits.dim() == 0:
        raise UnusableOutput(
            "the default loss is cross-entropy over the model's classes, and this model returns a single "
            "number: if it is the model's own loss, pass loss_fn=lambda outputs, targets: outputs"
        )
    if logits.dim() == 1 or logits.shape[-1] == 1:
        raise UnusableOutput(
            f"the default loss is cross-entropy over the model's classes, and this model returns one output "
            f"per sample ({describe_output(outputs)}): cross-entropy needs a score per class (over one class "
            "it is zero whatever the model predicts, and nothing trains); for a regression pass loss_fn=torch.nn.functional.mse_loss "
            "(or your own, returning the batch's mean loss)"
        )
    if logits.dim() > 2:
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    return F.cross_entropy(logits, targets)


def _field(outputs: Any, name: str) -> Any:
    if isinstance(outputs, Mapping):  # Hugging Face ModelOutput is a Mapping too
        return outputs.get(name)
    return getattr(outputs, name, None) if not isinstance(outputs, (torch.Tensor, tuple, list)) else None


def _logits(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = _field(outputs, "logits")
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(outputs, (tuple, list)):
        return next((item for item in outputs if isinstance(item, torch.Tensor)), None)
    return None


def describe_output(outputs: Any) -> str:
    """``a CausalLMOutput with fields logits, past_key_values``: what a model returned, in words."""
    kind = type(outputs).__name__
    if isinstance(outputs, torch.Tensor):
        return f"a tensor of shape {tuple(outputs.shape)}"
    if isinstance(outputs, Mapping):
        return f"a {kind} with fields {', '.join(map(str, outputs.keys())) or '(none)'}"
    if isinstance(outputs, (tuple, list)):
        return f"a {kind} of {len(outputs)}: {', '.join(type(item).__name__ for item in outputs)}"
    return f"a {kind}"


def call_model(model: nn.Module, inputs: Any) -> Any:
    """model(x) for a tensor, model(*x) for a tuple or list, model(**x) for a dict."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """The model ``build`` makes, on the meta device: shapes only, no memory, nothing computed."""
    with torch.device("meta"):
        model = build()
    return model.to("meta")  # a factory that places its parameters on a device explicitly


def first_samples(batch: Any, count: int) -> Any:
    """The first ``count`` samples of every tensor in ``batch`` (a scalar whole), on the CPU."""
    return map_tensors(batch, lambda tensor: (tensor[:count] if tensor.dim() else tensor).cpu())


# The CPU fallbacks of check_the_loss and FLOP counting build the model for real: not one this large.
CPU_CHECK_MAX_PARAMETERS = 100_000_000


def check_the_loss(build: Callable[[], nn.Module], batch: Any, loss_fn: Callable | None) -> None:
    """One forward and loss before any arm starts, so that a model whose output the loss cannot
    use fails in one line. On the meta device first (shapes only: nothing computed, no memory);
    a model that cannot run on meta tensors (``.item()`` in its forward, as Hugging Face's
    masks do) is built on the CPU and runs one sample there, without gradients, unless it is
    large. A model that runs neither way, and a user's loss that fails there, are not judged
    here: their arms will say what went wrong.
    """
    inputs, targets = inputs_and_targets(batch)
    meta, model = torch.device("meta"), None
    try:
        model = build_on_meta(build)
        outputs = call_model(model, to_device(inputs, meta, False))
        targets = to_device(targets, meta, False)
    except Exception:
        if model is None or sum(p.numel() for p in model.parameters()) > CPU_CHECK_MAX_PARAMETERS:
            return  # a factory that cannot build on meta, or a model too large to build twice
        one_input, one_target = first_samples((inputs, targets), 1)
        try:
            with torch.no_grad():
                outputs = call_model(build().cpu(), one_input)
            targets = one_target
        except Exception:
            return
    if loss_fn is None:
        try:
            default_loss(outputs, targets)
        except UnusableOutput:
            raise  # it names the output and the way out
        except Exception as error:  # cross-entropy refused the shapes: logits vs targets
            raise ValueError(
                f"the default loss failed on this model's output ({describe_output(outputs)}) and the "
                f"batch's targets: {type(error).__name__}: {str(error).splitlines()[0]}; "
                "pass loss_fn=lambda outputs, targets: ... returning a scalar tensor"
            ) from None
        return
    try:
        loss = loss_fn(outputs, targets)
    except Exception:
        return
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise ValueError(
            f"loss_fn must return a scalar tensor (the mean loss of the batch); it returned {shape}"
        )


def make_optimizer(name: str, lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=lr)


class LossScaler(Protocol):
    """What backward and the optimizer step go through (torch.amp.GradScaler fits it)."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor: ...
    def step(self, optimizer: torch.optim.Optimizer) -> Any: ...
    def update(self) -> None: ...


class NoLossScaling:
    """The default loss scaler: backward of the loss as it is, a plain optimizer step."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def step(self, optimizer: torch.optim.Optimizer) -> Any:
        return optimizer.step()

    def update(self) -> None:
        pass


class WholeBatch:
    """The default split: the batch is one micro-batch, carrying all of the loss."""

    parts = 1

    def __call__(self, inputs: Any, targets: torch.Tensor) -> list[tuple[Any, torch.Tensor, float]]:
        return [(inputs, targets, 1.0)]


@dataclass
class TrainSetup:
    """Everything the train step needs. Techniques edit it in their ``order``."""

    model: nn.Module
    device: torch.device
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    make_optimizer: Callable[[Any], torch.optim.Optimizer]
    loader_options: dict[str, Any] = field(default_factory=dict)  # DataLoader keyword arguments
    # --- hook points of the step, in the order the step reaches them ---
    # batch: stages the batch iterator goes through before the step takes from it (prefetch:
    # copies to the device ahead, on a side stream), each ``Iterator -> Iterator``.
    batch_stages: list[Callable[[Iterator], Iterator]] = field(default_factory=list)
    # batch: transforms applied to the inputs once they are on the device (channels_last).
    input_transforms: list[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    # split: (inputs, targets) -> [(inputs, targets, share of the batch)]; ``parts`` says how
    # many (grad_accum: its micro-batches).
    split_batch: Callable[[Any, torch.Tensor], list[tuple[Any, torch.Tensor, float]]] = field(
        default_factory=WholeBatch
    )
    # forward: the context each micro-batch's forward and loss run in (amp: autocast).
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # backward and optimizer step: a fresh LossScaler per arm (amp with float16: a GradScaler).
    make_loss_scaler: Callable[[], LossScaler] = NoLossScaling
    # --- what the hooks above leave for others to read ---
    autocast_dtype: torch.dtype | None = None  # amp's dtype: what matmuls run in, for MFU's peak
    autocast_cache: bool = True  # autocast's weight-cast cache must be off inside graph capture
    # An input pipeline that replaces the DataLoader (dali): (source, batch_size, seed) -> batches.
    make_batches: Callable[[Any, int, int], Iterator] | None = None
    # Data-parallel arms: this process's rank, and how DDP communicates (ddp_compression edits it).
    rank: int = 0
    world_size: int = 1
    comm: Any = None  # a workbench.distributed.CommSettings when world_size > 1
    # cuda_graphs: runs the compute step (trainer.compute) as a captured CUDA graph, replayed.
    graph_step: Callable[[Trainer, Any, torch.Tensor, StepClock], torch.Tensor] | None = None
    # Process-wide switches a technique flips (TF32): context managers entered around each of
    # this arm's windows (warm-up, timed windows, the memory step) and left after it, so that
    # other arms sharing the process never run under them.
    window_settings: list[Callable[[], contextlib.AbstractContextManager]] = field(default_factory=list)

    @property
    def loss_scaling(self) -> bool:
        """Whether a real loss scaler is in the step (amp with float16: it reads found_inf on the CPU)."""
        return self.make_loss_scaler is not NoLossScaling


def to_device(value: Any, device: torch.device, non_blocking: bool) -> Any:
    return map_tensors(value, lambda tensor: tensor.to(device, non_blocking=non_blocking))


class Trainer:
    def __init__(self, setup: TrainSetup, batches: Iterator):
        self.setup = setup
        self.model = setup.model
        for stage in setup.batch_stages:
            batches = stage(batches)
        self.batches = batches
        self.optimizer = setup.make_optimizer(self.model.parameters())
        self.scaler = setup.make_loss_scaler()  # per arm: a GradScaler's scale is state
        # Pinned host memory is what lets a host-to-device copy run asynchronously.
        self.non_blocking = bool(setup.loader_options.get("pin_memory")) and setup.device.type == "cuda"
        self.keep_gradients_local = no_sync_context(self.model, setup.comm)
        self.samples_seen = 0
        self.model.train()

    def next_batch(self) -> tuple[Any, torch.Tensor | None]:
        """The batch hook point: fetch, move to the device, apply the input transforms."""
        inputs, targets = inputs_and_targets(next(self.batches))
        self.samples_seen += batch_size_of(inputs, targets)
        inputs = to_device(inputs, self.setup.device, self.non_blocking)
        targets = to_device(targets, self.setup.device, self.non_blocking)
        for transform in self.setup.input_transforms:
            inputs = transform(inputs)
        return inputs, targets

    def step(self, clock: StepClock) -> torch.Tensor:
        """One optimizer step over one batch."""
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
        parts = self.setup.split_batch(inputs, targets)
        step_loss = None
        for index, (part_inputs, part_targets, share) in enumerate(parts):
            last = index == len(parts) - 1
            # DDP with no_sync keeps the gradients of all but the last micro-batch local.
            with contextlib.nullcontext() if last else self.keep_gradients_local():
                with self.setup.forward_context():
                    loss = self.setup.loss_fn(call_model(self.model, part_inputs), part_targets)
                if share != 1.0:
                    loss = loss * share  # each micro-batch's mean loss, weighted by its share of the batch
                clock.lap("forward")
                self.scaler.scale(loss).backward()  # gradients add up across micro-batches
                clock.lap("backward")
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        clock.lap("optimizer")
        return step_loss
