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
import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from workbench.config import DEFAULT_LOSSES, OPTIMIZER_EXAMPLE, callable_label, error_text
from workbench.data import batch_size_of, inputs_and_targets, loader_worker_error, map_tensors, tensors_of
from workbench.distributed import no_sync_context
from workbench.models import model_label
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
    if logits is None:
        raise UnusableOutput(
            f"the default loss cannot use this model's output ({describe_output(outputs)}): it holds no "
            "'loss', 'logits' or tensor to take cross-entropy of; pass loss_fn=lambda outputs, targets: "
            "... returning a scalar tensor"
        )
    if targets is None:
        raise UnusableOutput(
            f"the default loss cannot use this model's output ({describe_output(outputs)}): it has no "
            "'loss' field, and a dict batch is all inputs, with no targets. Either the model computes "
            "its own loss (a Hugging Face model does, given 'labels' in the batch and return_dict=True), "
            "or pass (inputs, targets) pairs, whose inputs may be a dict (the model gets model(**inputs))"
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
        return _dense_cross_entropy(logits, targets, outputs)
    return F.cross_entropy(logits, targets)


def _dense_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, outputs: Any) -> torch.Tensor:
    """Cross-entropy of a score per class at every position, in whichever layout the targets fit.

    A sequence model gives (batch, tokens, classes), the classes last (gpt-mini, Hugging Face);
    PyTorch's own layout for dense predictions is (batch, classes, *positions), the classes second
    (a segmentation net's (B, C, H, W)), as F.cross_entropy takes it. Only the first was read, so
    a (B, 16, 16, 16) segmentation output trained on its widths as classes, without a word. Where
    both layouts fit, 3-D outputs read as sequences and 4-D or more as dense predictions."""
    positions = logits.dim() - 1 == targets.dim()
    classes_last = positions and logits.shape[:-1] == targets.shape
    classes_second = positions and logits.shape[:1] + logits.shape[2:] == targets.shape
    if classes_last and (logits.dim() == 3 or not classes_second):
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    if classes_second:
        return F.cross_entropy(logits, targets)
    raise UnusableOutput(
        f"the default loss cannot pair this model's output ({describe_output(outputs)}) with targets of shape "
        f"{tuple(targets.shape)}: cross-entropy takes (batch, tokens, classes) scores with (batch, tokens) "
        "class indices, or (batch, classes, *positions) with (batch, *positions); pass loss_fn=lambda "
        "outputs, targets: ... returning a scalar tensor"
    )


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


def check_the_loss(
    build: Callable[[], nn.Module],
    batch: Any,
    loss_fn: Callable | None,
    device: torch.device,
    world_size: int = 1,
    find_unused_parameters: bool = False,
) -> str:
    """One forward and loss before any arm starts, so that a mistake every arm would make fails
    in one line that says what to change: a model with nothing to train, a ``loss_fn`` that
    cannot take ``(outputs, targets)`` or does not return a scalar tensor, a loss with no
    gradient, labels the default loss cannot take, an output it cannot use.

    For a run on the CPU, the model runs for real on the first batch, as the arms will, so
    anything that fails there is the arms' failure too and is raised (with what the batch and
    the model hold, where their dtypes differ). Elsewhere it runs on the meta device (shapes
    only: nothing computed, no memory); a model that cannot (``.item()`` in its forward, as
    Hugging Face's masks do) runs two samples on the CPU instead, and a failure there is not
    judged: the arms, on their own device, will say what went wrong. A factory that cannot build
    on meta is built for real on a CPU run, as each arm will build it; elsewhere it is not
    checked, nor is a model too large to build twice. With several ranks, a trainable parameter
    the loss does not reach is refused too (``_check_every_parameter_learns``), unless
    ``find_unused_parameters`` lets DDP look for such parameters itself.

    Returns which default loss the arms will take, as config.DEFAULT_LOSSES names it (the
    model's own, cross-entropy, or the rule where it could not tell); "" with a ``loss_fn``.
    """
    inputs, targets = inputs_and_targets(batch)
    if loss_fn is not None:
        _check_loss_signature(loss_fn)
    judged = device.type == "cpu"
    trial = _Trial(build, inputs, targets, judged)
    untold = "" if loss_fn is not None else DEFAULT_LOSSES[2]
    with torch.random.fork_rng(devices=[]):  # building the model draws from the caller's generator
        try:
            model = build_on_meta(build)
        except Exception:
            if not judged:
                return untold
            model = trial.build_on_cpu()
        _check_something_trains(model)
        if trial.cpu_model is None:
            if sum(p.numel() for p in model.parameters()) > CPU_CHECK_MAX_PARAMETERS:
                return untold
            if not judged:
                trial.run_on(model, torch.device("meta"), inputs, targets)
        if loss_fn is None:
            loss = _check_the_default_loss(trial)
        else:
            loss = _check_the_users_loss(trial, loss_fn, isinstance(batch, Mapping))
        if world_size > 1 and loss is not None and not find_unused_parameters:
            _check_every_parameter_learns(trial.model, loss, world_size)
    if loss_fn is not None:
        return ""
    if trial.outputs is None:
        return untold
    return DEFAULT_LOSSES[1] if isinstance(_field(trial.outputs, "loss"), torch.Tensor) else DEFAULT_LOSSES[0]


class _Trial:
    """The first batch through the model: its outputs (None until a forward succeeded) and the
    targets they go with (``outputs_targets``), on the meta device or for real on the CPU; the
    batch itself stays as given, for the CPU's turn after meta."""

    def __init__(self, build: Callable[[], nn.Module], inputs: Any, targets: Any, judged: bool) -> None:
        self.build, self.inputs, self.targets, self.judged = build, inputs, targets, judged
        self.outputs: Any = None
        self.outputs_targets: Any = None
        self.cpu_model: nn.Module | None = None
        self.model: nn.Module | None = None  # the one whose forward gave ``outputs``
        self.on_cpu = False

    def run_on(self, model: nn.Module, device: torch.device, inputs: Any, targets: Any) -> bool:
        try:
            self.outputs = call_model(model, to_device(inputs, device, False))
        except Exception:
            if self.judged:
                raise
            return False
        self.outputs_targets = to_device(targets, device, False)
        self.model = model
        return True

    def build_on_cpu(self) -> nn.Module | None:
        """The model built for real on the CPU, once. A failure is raised when the run is on the
        CPU (each arm's build would fail the same way); otherwise it gives None."""
        if self.cpu_model is None:
            try:
                self.cpu_model = self.build().cpu()
            except Exception as error:
                if not self.judged:
                    return None
                raise ValueError(
                    f"building the model fails, as every arm's would: {error_line(error)}"
                ) from None
        return self.cpu_model

    def run_on_cpu(self) -> bool:
        """A real forward on the CPU, with gradients: on the whole batch when the run is on the
        CPU (a failure is raised, naming what to change), on two samples otherwise."""
        if self.on_cpu:
            return self.outputs is not None
        self.on_cpu, self.outputs = True, None
        inputs, targets = self.inputs, self.targets  # the whole batch, as the arms take it
        if not self.judged:
            try:
                inputs, targets = first_samples((inputs, targets), 2)
            except Exception:  # a layout slicing cannot take (sparse): the arms will tell
                return False
        model = self.build_on_cpu()
        if model is None:
            return False
        try:
            return self.run_on(model, torch.device("cpu"), inputs, targets)
        except Exception as error:  # raised only when judged
            said = error_line(error)
            # The dtypes are named only where the error is about types: beside another error (a
            # label's shape) "convert the token ids to floats" sent the user the wrong way.
            hint = _dtype_mismatch(model, inputs) if _ABOUT_TYPES.search(said) else ""
            raise ValueError(
                f"the model's forward on the first batch fails, as every arm's would: "
                f"{said.rstrip('.') if hint else said}{hint}"
            ) from None


# What PyTorch's errors say of mismatched types: "mat1 and mat2 must have the same dtype", "expected
# scalar type Float but found Long", "Input type (long int) and bias type (float)", "not implemented
# for 'Long'".
_ABOUT_TYPES = re.compile(r"dtype|scalar type|type \(|not implemented for|\b(Long|Int|Byte|Double|Half)\b")


def _check_the_default_loss(trial: _Trial) -> torch.Tensor | None:
    """The default loss on the trial's outputs, checked; None where it could not be computed."""
    if trial.outputs is None and not trial.run_on_cpu():
        return None
    outputs, targets = trial.outputs, trial.outputs_targets
    own = isinstance(_field(outputs, "loss"), torch.Tensor)
    if not own and isinstance(targets, torch.Tensor) and targets.dtype in NOT_CLASS_LABELS:
        raise ValueError(
            "the default loss is cross-entropy, which takes class labels as int64 (or uint8, or "
            f"probabilities as floats), and the batch's targets are {targets.dtype}: convert them "
            "(targets.long()), or pass loss_fn=..."
        )
    try:
        loss = default_loss(outputs, targets)
    except UnusableOutput:
        raise  # it names the output and the way out
    except Exception as error:  # cross-entropy refused the shapes: logits vs targets
        raise ValueError(
            f"the default loss failed on this model's output ({describe_output(outputs)}) and the "
            f"batch's targets: {error_line(error)}; "
            "pass loss_fn=lambda outputs, targets: ... returning a scalar tensor"
        ) from None
    _check_it_has_a_gradient(loss, "the model's own loss" if own else "the loss")
    return loss


def _check_the_users_loss(trial: _Trial, loss_fn: Callable, dict_batch: bool) -> torch.Tensor | None:
    """``loss_fn`` on the trial's outputs, checked; None where it could not be judged."""
    if trial.outputs is None and not trial.run_on_cpu():
        return None
    try:
        loss = loss_fn(trial.outputs, trial.outputs_targets)
    except Exception as error:
        if not trial.on_cpu:  # a loss may not run on meta tensors (.item(), data-dependent code)
            return _check_the_users_loss(trial, loss_fn, dict_batch) if trial.run_on_cpu() else None
        if not trial.judged:
            return None
        raise ValueError(
            f"loss_fn(outputs, targets) fails on the model's output for the first batch, as every "
            f"arm's would: {error_line(error)}"
            + (
                "; a dict batch is all inputs, so loss_fn gets targets=None: to give it targets, pass "
                "(inputs, targets) pairs, whose inputs may be a dict (the model gets model(**inputs))"
                if dict_batch
                else ""
            )
        ) from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise ValueError(
            f"loss_fn must return a scalar tensor (the mean loss of the batch); it returned {shape}"
            + (
                ": .item() and float() give a number that backward cannot go through"
                if isinstance(loss, float)
                else ""
            )
        )
    _check_it_has_a_gradient(loss, "loss_fn's loss")
    return loss


# Integer dtypes cross-entropy refuses as class labels (it takes int64 and uint8).
NOT_CLASS_LABELS = (torch.int8, torch.int16, torch.int32, torch.bool)


def _check_loss_signature(loss_fn: Callable) -> None:
    """A loss_fn that cannot be called as loss_fn(outputs, targets), refused with its signature."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without one: the first call will tell
        return
    try:
        signature.bind(None, None)
    except TypeError as error:
        raise ValueError(
            f"loss_fn is called as loss_fn(outputs, targets), and {model_label(loss_fn)}{signature} "
            f"cannot be: {error}"
        ) from None


def _check_something_trains(model: nn.Module) -> None:
    parameters = list(model.parameters())
    if not any(p.requires_grad for p in parameters):
        raise ValueError(
            f"the model has nothing to train: {'all of its' if parameters else 'it has no'} parameters"
            + (f" ({len(parameters)}) have requires_grad=False" if parameters else "")
            + "; an optimizer step needs at least one parameter with requires_grad=True"
        )


def _check_every_parameter_learns(model: nn.Module, loss: torch.Tensor, world_size: int) -> None:
    """Under DDP every rank waits, at each step, for the gradient of every trainable parameter;
    one the loss never reaches (an unused head, a pooler) fails every arm after its process
    started, with DDP's advice to set find_unused_parameters. So: one backward of the first
    batch's loss, before any arm starts (on meta tensors, for a run elsewhere)."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    try:
        gradients = torch.autograd.grad(loss, [p for _, p in trainable], allow_unused=True)
    except Exception:  # a backward the check cannot run here (an op without a meta kernel): the arms will
        return
    unused = [name for (name, _), gradient in zip(trainable, gradients, strict=True) if gradient is None]
    if unused:
        raise ValueError(
            f"with world_size={world_size}, DDP needs a gradient for every trainable parameter at each step, "
            f"and {', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''} get{'s' * (len(unused) == 1)} none "
            "from the first batch's loss: every rank would fail. Freeze them (requires_grad_(False)), "
            "leave them out of the model, or pass find_unused_parameters=True (DDP then looks for such "
            "parameters after every forward, at a cost)"
        )


def _check_it_has_a_gradient(loss: torch.Tensor, what: str) -> None:
    if not loss.requires_grad:
        raise ValueError(
            f"{what} has no gradient (requires_grad=False): it does not depend on any trainable "
            "parameter, so backward cannot run; compute it from the model's outputs, outside "
            "torch.no_grad() and without .detach()"
        )


def _dtype_mismatch(model: nn.Module, inputs: Any) -> str:
    """'; the batch's inputs are torch.float64 and the model's parameters torch.float32: ...', or ''."""
    held = {p.dtype for p in model.parameters() if p.is_floating_point()}
    given = {t.dtype for t in tensors_of(inputs) if t.is_floating_point()}
    integers = sorted({t.dtype for t in tensors_of(inputs) if not t.is_floating_point()}, key=str)
    if len(held) == 1 and not given and integers == [torch.uint8]:  # bytes, as images are stored
        return (
            f"; the batch's inputs are torch.uint8 (image bytes?) and the model's parameters "
            f"{held.pop()}: convert the data to floats (inputs.float() / 255) in the Dataset"
        )
    if len(held) == 1 and not given and integers:  # said only as the forward failed: token ids pass
        return (
            f"; the batch's inputs are {', '.join(map(str, integers))} and the model's parameters "
            f"{held.pop()}: if they are features, not token ids for an embedding, convert them to "
            "floats (inputs.float()) in the Dataset"
        )
    if len(held) != 1 or not given or given == held:
        return ""
    names = ", ".join(str(dtype) for dtype in sorted(given, key=str))
    return (
        f"; the batch's inputs are {names} and the model's parameters {held.pop()}: convert the "
        "data (inputs.float()) or the model"
    )


def error_line(error: BaseException) -> str:
    """An error as a message quotes it: its type and first line, or a DataLoader worker's own error."""
    return loader_worker_error(error) or error_text(error)


def make_optimizer(optimizer: str | Callable, lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    """The run's optimizer (RunConfig.optimizer) as a factory over an arm's parameters: the user's
    own factory as it is (``check_optimizer`` saw it build one), else a built-in with ``lr``."""
    if callable(optimizer):
        return optimizer
    if optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=lr)


def check_optimizer(optimizer: str | Callable, model: nn.Module, judged: bool = True) -> str:
    """Before any arm starts: the user's optimizer factory builds a torch.optim.Optimizer over the
    parameters it is given (not over another model's, which would leave every arm untrained).
    Returns what it built, its type and each group's settings (``lr=0.1, momentum=0.9``), which
    identify the job where the factory's source does not (a global or a closure it reads); "" for
    a built-in, or where it could not be built here.

    It is called on stand-ins of the model's trainable parameters (one element each, of their
    dtype and number of dimensions, so a factory that groups them by ``ndim`` groups them as it
    will), since the model may be on the meta device here. A factory that fails is refused only
    when ``judged`` (one CPU rank, as the arms will run it): one that needs a process group (a
    ZeroRedundancyOptimizer) or a GPU's tensors builds in the arms, which say it if it cannot.
    """
    if isinstance(optimizer, str):
        return ""
    label = callable_label(optimizer)
    stand_ins = [
        nn.Parameter(torch.zeros((1,) * p.dim(), dtype=p.dtype))
        for p in model.parameters()
        if p.requires_grad
    ]
    try:
        built = optimizer(list(stand_ins))  # a list, as every arm's is (Trainer)
    except Exception as error:
        if not judged:
            return ""
        raise ValueError(
            f"the optimizer factory {label} fails on the model's parameters, as it would in every "
            f"arm: {error_line(error)}"
        ) from error
    if not isinstance(built, torch.optim.Optimizer):
        raise ValueError(
            f"the optimizer factory {label} returned {type(built).__name__}, not a torch.optim.Optimizer: "
            f"it is called with each arm's parameters and returns the optimizer over them, e.g. {OPTIMIZER_EXAMPLE}"
        )
    if _step_needs_closure(built):
        raise ValueError(
            f"the optimizer factory {label} built {type(built).__name__}, whose step needs a closure that "
            "evaluates the loss again; the train step calls optimizer.step() once, after one backward "
            "(as loss scaling and CUDA Graphs need), so it cannot drive it: choose an optimizer whose "
            "closure is optional (SGD, Adam, AdamW, RMSprop, ...)"
        )
    held = {id(p) for group in built.param_groups for p in group["params"]}
    if stand_ins and not held & {id(p) for p in stand_ins}:
        raise ValueError(
            f"the optimizer factory {label} built {type(built).__name__} over none of the parameters it "
            "was given (over another model's?), so no arm would train: build it over the params argument"
        )
    groups = [
        ", ".join(f"{key}={value!r}" for key, value in sorted(group.items()) if key != "params")
        for group in built.param_groups
    ]
    return f"{type(built).__qualname__}: " + "; ".join(groups)


def _step_needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """LBFGS's step(closure) re-evaluates the loss several times; most optimizers take closure=None."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a C-implemented or oddly wrapped step: nothing to judge by
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


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
        # A list, as amp's O2 gives its masters: a factory that reads its params twice (one group by
        # ndim, then another) gets them all in every arm, not all in some and half in others.
        self.optimizer = setup.make_optimizer(list(self.model.parameters()))
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
