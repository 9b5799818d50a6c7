"""Controlled ablations: plan the arms, run them side by side in blocks, summarise.

Design, in the order a run happens:

1. Validate everything up front (names, values, combinations), so bad input fails in
   one line before any time is spent.
2. Plan the arms. ``one-at-a-time``: the baseline, then each technique alone.
   ``leave-one-out``: the baseline, all techniques, then all minus each one. ``grid``: every
   combination. Unless ``control=False``, the baseline runs a second time as a control arm:
   the A/A check that shows the machine's noise floor. Techniques that cannot run here
   become ``unavailable`` rows and are left out of the combinations. A list of values for
   a setting (``{"dataloader": {"num_workers": [0, 1, 2]}}``) sweeps it: one arm per value.
   When input-pipeline techniques (dataloader, dali) are ablated on a Dataset, each arm made
   of them alone, and the baseline, also gets a loader-only twin (kind ``loader``): the same
   pipeline feeding a model that does no work. Its samples/s is what the loader can feed,
   to read next to what training consumes.
3. Decide where each arm runs. Arms share a block: one fresh process that builds them all,
   warms each up, then runs them interleaved in windows, round after round, in a fresh random
   order (workbench.block). The luck of a process (10-15% of speed between processes here)
   then cancels in every ratio. An arm whose technique cannot share a process (see
   ``Technique.own_process``), or one that turns out not to fit beside the others, runs in a
   process of its own, against a baseline that also runs alone; the results say so.
4. Repeat: ``blocks`` fresh processes of each kind. Block b runs its processes in an order
   rotated by b. The speedup is computed inside each block, then combined over blocks
   (workbench.stats).
5. Persist: each finished process is written to ``out/units/`` atomically, and the summary
   is rewritten after it. Ctrl-C keeps everything finished; running again with the same
   ``out`` resumes, restarting the unfinished blocks. An arm that fails inside a block is
   recorded and the others go on; one that kills its block's process is named, recorded,
   and the block runs again without it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from workbench.arms import (
    Arm,
    Job,
    add_own_baseline,
    assign_processes,
    jobs_for_block,
    loader_twins,
    own_baseline_name,
    plan_arms,
    plan_combinations,
    sweep_names,
)
from workbench.config import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_LOSSES,
    SMOKE_NOTE,
    RunConfig,
    SlurmOptions,
    check_bool,
    smoke_test,
    takes_run_options,
    without_addresses,
)
from workbench.core_sync import oversubscription
from workbench.data import (
    DataSource,
    batch_size_of,
    check_count,
    check_sample_count,
    endless_batches,
    inputs_and_targets,
    release_loader_workers,
    resolve_data,
    rows_of,
    sample_count,
    tensors_of,
    with_collate_fn,
)
from workbench.devices import resolve_device
from workbench.distributed import Torchrun, ranks_on_this_machine
from workbench.environment import environment
from workbench.loop import check_optimizer, check_the_loss, error_line
from workbench.models import build_model, inspect_model, model_label
from workbench.process import STARTUP_LIMIT_S, Interrupted, first_cause, rank_log, run_in_fresh_process
from workbench.profiling import trace_owner
from workbench.progress import Progress, print_plan, say
from workbench.results import DID_NOT_RUN, SCHEMA, Results, summarize
from workbench.results_folder import ResultsFolder, write_json_atomic
from workbench.slurm import SlurmBlocks, attempt_folder, check_cluster, job_gpus
from workbench.techniques import (
    Technique,
    parse_techniques,
    technique_context,
)
from workbench.telemetry import Sampler, competing_load, threads_per_rank, usable_cores
from workbench.template import WarmTemplate, acquire_template, keep_warm_s, release_template
from workbench.worker import BlockSpec, slug, trace_file_name


@dataclass
class Prepared:
    """A validated ablation, ready to run (or to show as a plan)."""

    run: RunConfig
    model: Any
    data: DataSource
    loss_fn: Callable | None
    arms: list[Arm]
    config: dict
    # What the labels in config do not say (two models built by functions of one name): see job_identity.
    identity: dict = field(default_factory=dict)


def prepare(
    model: Any,
    data: Any,
    loss_fn: Callable | None,
    techniques: Mapping[str, Any] | None,
    run: RunConfig,
    combinations: Mapping[str, list[tuple[Technique, Any]]] | None = None,
) -> Prepared:
    """Validate an ablation and plan its arms (``plan`` shows them, ``ablate`` runs them).

    ``combinations``: arms chosen elsewhere (the tuner's candidates, by name) instead of those
    ``run.mode`` makes from ``techniques``; each is checked like any technique here.
    """
    # Cheap checks first: building a dataset or a model takes time bad input should not cost.
    device = _check_where_it_runs(run)
    chosen = parse_techniques(techniques)
    _check_loss_fn(loss_fn)
    inspected = inspect_model(model)
    # one CPU rank builds it as the arms will; a process group's or a GPU's optimizer, in the arms
    optimizer_built = check_optimizer(
        run.optimizer, inspected[0], judged=device.type == "cpu" and run.world_size == 1
    )
    source = resolve_data(data, model)
    run, first_batch = _with_batch_size(run, source)
    first_batch, default_loss = _check_the_first_batch(model, source, loss_fn, run, device, first_batch)
    ready_made = None if source.is_dataset else first_batch  # a Dataset's batches are workbench's own
    ctx = technique_context(run, model, source, inspected=inspected, first_batch=ready_made)
    label = ctx.model_name
    runnable, runnable_names, unavailable = [], [], []
    for name, (technique, config) in zip(sweep_names(chosen), chosen, strict=True):  # names see every value
        technique.validate(ctx, config)
        reason = technique.unavailable_reason(ctx, config)
        if reason:
            unavailable.append(Arm(name, "treatment", [(technique, config)], reason))
        else:
            runnable.append((technique, config))
            runnable_names.append(name)
    if combinations is not None:
        arms, unavailable = plan_combinations(ctx, combinations, run.control)
        chosen = [pair for pairs in combinations.values() for pair in pairs]
    else:
        arms = plan_arms(
            run.mode, runnable, run.control, runnable_names if run.mode == "one-at-a-time" else None
        )
    loader_arms = run.loader_arms
    if loader_arms is None:  # auto: when an input-pipeline technique is ablated on a Dataset
        loader_arms = source.is_dataset and any(t.input_pipeline for t, _ in runnable)
    if loader_arms == "only":
        _refuse_what_loaders_alone_cannot_time(runnable)
        arms = loader_twins(arms)
    elif loader_arms:
        arms += loader_twins(arms)
    arms = assign_processes(arms, ctx, run.isolate) + unavailable
    config = _config_of(label, source, loss_fn if loss_fn is not None else default_loss, chosen, run, device)
    identity = job_identity(model, inspected[0], source, first_batch, loss_fn, run.optimizer, optimizer_built)
    return Prepared(run, model, source, loss_fn, arms, config, identity)


def _check_the_first_batch(
    model: Any, source: DataSource, loss_fn: Callable | None, run: RunConfig, device, first_batch: Any
) -> tuple[Any, str]:
    """The job's first batch (read now where the checks or the job's identity need it), after one
    forward and loss on it (``check_the_loss``); and the default loss the arms take, by name."""
    own_model = not (isinstance(model, str) and loss_fn is None)  # a built-in with its own loss fits
    # the first batch checks the loss; a Dataset's or a list's, read again at no cost, identifies the data
    if first_batch is None and (own_model or isinstance(source.user, (Dataset, list, tuple))):
        first_batch = _first_batch(source, run.batch_size, run.seed)
    if not own_model:
        return first_batch, DEFAULT_LOSSES[0]  # a built-in model's, with no loss_fn: cross-entropy
    default_loss = check_the_loss(
        lambda: build_model(model, source.spec), first_batch, loss_fn, device, run.world_size,
        run.find_unused_parameters,
    )  # fmt: skip
    return first_batch, default_loss


def _config_of(
    label: str, source: DataSource, loss: Callable | str, chosen: list, run: RunConfig, device
) -> dict:
    """The job as results.json records it, by name: what it trains, on what, and how. ``loss``:
    the user's loss_fn, or the name of the default loss the arms take (config.DEFAULT_LOSSES)."""
    return {
        "model": label,
        "data": source.label,
        "loss_fn": loss if isinstance(loss, str) else model_label(loss),
        **({"collate_fn": model_label(source.collate_fn)} if source.collate_fn is not None else {}),
        "techniques": _described(chosen),
        **run.to_json(),
        "device": str(device),
    }


def _with_batch_size(run: RunConfig, source: DataSource) -> tuple[RunConfig, Any]:
    """``run`` with its batch size decided, and the first of ready-made batches (None for a Dataset);
    data that cannot fill a batch is refused.

    workbench batches a Dataset or built-in data itself: auto is DEFAULT_BATCH_SIZE, or the
    samples small data holds per rank. Batches given ready-made have their own size, which auto
    takes; a batch_size that disagrees is refused, because grad_accum splits by it and the
    results report it.
    """
    if source.is_dataset:
        count = sample_count(source)
        run = replace(run, batch_size=run.batch_size or _auto_batch_size(count, run.world_size))
        if count is not None:
            check_count(count, source.label, run.batch_size, run.world_size)
        return run, None
    check_sample_count(source, 1, run.world_size)  # that a list holds batches; their size is read here
    first_batch = _first_batch(source, DEFAULT_BATCH_SIZE, run.seed)
    release_loader_workers(source.user)
    inputs, targets = inputs_and_targets(first_batch)
    held = batch_size_of(inputs, targets)  # as the arms count samples
    # the inputs' rows count too: targets that disagree with them are for the loss check to name
    if run.batch_size not in (None, held, rows_of(inputs)):
        raise ValueError(
            f"batch_size={run.batch_size}, but the data's batches hold {held} samples (the first one "
            f"does): workbench uses batches given ready-made as they are, so leave batch_size out "
            f"(auto takes their size) or pass batch_size={held}"
        )
    return replace(run, batch_size=run.batch_size or held), first_batch


def _first_batch(source: DataSource, batch_size: int, seed: int) -> Any:
    """The data's first batch, read before any arm starts. An error of the user's data (a
    ``__getitem__`` that raises) is said as every arm would meet it, not as a bare KeyError from
    nowhere; workbench's own ValueErrors about the data are already said so."""
    try:
        return next(endless_batches(source, batch_size, seed, {}))
    except ValueError:
        raise
    except Exception as error:
        raise ValueError(
            f"reading the first batch of data {source.label!r} fails, as every arm's would: {error_line(error)}"
        ) from error


def _auto_batch_size(count: int | None, world_size: int) -> int:
    """DEFAULT_BATCH_SIZE, or all ``count`` samples per rank when the data holds fewer than that."""
    if count is not None and count >= world_size:
        return min(DEFAULT_BATCH_SIZE, count // world_size)
    return DEFAULT_BATCH_SIZE  # too small even so, or not known yet: check_count says what to do


def _check_loss_fn(loss_fn: Any) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be a callable (outputs, targets) -> scalar loss; got {loss_fn!r}")
    if isinstance(loss_fn, type):  # nn.MSELoss, not nn.MSELoss(): "calling" it builds a module
        raise ValueError(
            f"loss_fn is the class {loss_fn.__name__}; pass an instance: loss_fn={loss_fn.__name__}()"
        )
    if not isinstance(loss_fn, torch.nn.Module):
        return
    trained = [name for name, p in loss_fn.named_parameters() if p.requires_grad]
    if trained:  # an ArcFace-style head, a learned weight: it would keep its first values, unsaid
        raise ValueError(
            f"loss_fn holds parameters to train ({', '.join(trained[:4])}{', ...' if len(trained) > 4 else ''}), "
            "but the optimizer steps the model's parameters only, as the techniques change the model only: "
            "move them into the model (its forward returns what the loss needs), or freeze them "
            "(requires_grad_(False))"
        )


def _refuse_what_loaders_alone_cannot_time(runnable: list) -> None:
    """loader_arms='only' times the input pipeline without the model: a technique of the step would
    be dropped without a word, and leave nothing to compare against the loader's baseline."""
    others = [t.name for t, _ in runnable if not t.input_pipeline]
    if others:
        raise ValueError(
            f"loader_arms='only' times the input pipeline alone, so {', '.join(others)} would measure "
            "nothing there; leave them out, or use loader_arms='on' to add loader-only arms beside training"
        )


def _check_where_it_runs(run: RunConfig) -> torch.device:
    """The device, once the run's ranks fit on this machine and, for Slurm, jobs can be submitted."""
    device = resolve_device(run.device)
    if device.type == "cuda" and run.world_size > torch.cuda.device_count():
        raise ValueError(
            f"ablate: world_size={run.world_size} needs one GPU per rank on this machine; "
            f"it has {torch.cuda.device_count()} (use torchrun across machines, see the README)"
        )
    if run.start == "template":
        keep_warm_s()  # the environment's setting for the template kept between runs, checked up front
    if run.executor == "slurm":
        if Torchrun.detect() is not None:
            raise ValueError(
                "ablate: executor='slurm' submits the blocks as jobs itself; run it outside torchrun"
            )
        check_cluster()
    return device


def _described(chosen: list[tuple[Technique, Any]]) -> dict[str, str]:
    """Each technique's settings in words; a swept one's values joined by '; '."""
    described: dict[str, str] = {}
    for technique, config in chosen:
        text = technique.describe(config)
        described[technique.name] = (
            f"{described[technique.name]}; {text}" if technique.name in described else text
        )
    return described


def job_identity(
    model: Any,
    built: Any,
    source: DataSource,
    first_batch: Any,
    loss_fn: Callable | None,
    optimizer: str | Callable = "adamw",
    optimizer_built: str = "",
) -> dict:
    """What identifies the job beyond its labels, for deciding whether a folder holds this run.

    The labels name a user's model, data and loss by their function or type names: editing a
    model in a notebook and running again into the same ``out`` would otherwise resume, and
    mix the old model's blocks with the new one's. So: the model's layers (its repr), its
    tensors' names and shapes, and the source of its factory and of each layer class's
    ``forward``; an optimizer factory's source (and a partial's arguments), and the type and
    group settings of what it built before the run (a learning rate read from a global, edited
    between runs, is another job); user data's length and first batch's shapes and dtypes, and for a list of
    batches its first batch's values (not a Dataset's, which random augmentations change from
    run to run); a ``collate_fn``'s source; the loss (``_loss_text``); and the torch and
    workbench versions that measure it. Each part is a short digest, named in the
    "differs in" message when it changes.
    """
    from workbench import __version__

    layers = sorted({type(module) for module in built.modules()}, key=lambda cls: cls.__qualname__)
    model_text = [
        repr(built),
        *(f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in built.state_dict().items()),
    ]
    model_text += _factory_text(model) if callable(model) else [str(model)]
    model_text += [_source_of(cls.forward) for cls in layers]
    identity = {
        "model_structure": _digest(model_text),
        "loss_source": _digest(_loss_text(loss_fn)) if loss_fn is not None else "cross_entropy",
        "torch_version": torch.__version__,
        "workbench_version": __version__,
    }
    if source.builtin is None and source.images is None:  # user data: its label is only a type name
        # a Dataset class (a factory, as a lambda would be) has __len__ too, for its instances
        sized = hasattr(source.user, "__len__") and not isinstance(source.user, type)
        size = len(source.user) if sized else "a factory or an iterator"
        identity["data_shape"] = _digest([str(size), repr(_shapes_of(first_batch))])
        if isinstance(source.user, (list, tuple)):  # batches given as they are: no augmentation moves them
            identity["data_values"] = _digest([_tensor_digest(t) for t in tensors_of(first_batch)])
    if not isinstance(optimizer, str):  # its label shows a partial's arguments, not a function's body
        identity["optimizer_source"] = _digest(
            [*_factory_text(optimizer), without_addresses(optimizer_built)]
        )
    if source.collate_fn is not None:  # padding to another length, say, is another job
        identity["collate_source"] = _digest(_factory_text(source.collate_fn))
    return identity


def _tensor_digest(tensor: torch.Tensor) -> str:
    """A tensor's values as a digest of its bytes: flattened first, since a 0-d tensor cannot be
    viewed as bytes, and as bytes since numpy has no bfloat16; a sparse one by its dense values."""
    tensor = tensor.detach().cpu()
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    return hashlib.sha256(tensor.reshape(-1).contiguous().view(torch.uint8).numpy()).hexdigest()


def _loss_text(loss_fn: Callable) -> list[str]:
    """What identifies a loss: a function's source; a loss module's class source and its settings
    (``CrossEntropyLoss(label_smoothing=0.5)`` has the repr of the default, and a rerun with
    another smoothing resumed into the old losses), its tensors (a class ``weight``) by value; a
    ``functools.partial``'s function and arguments."""
    if isinstance(loss_fn, functools.partial):
        return [*_loss_text(loss_fn.func), *_arguments_text(loss_fn)]
    if not isinstance(loss_fn, torch.nn.Module):
        return [_source_of(loss_fn)]
    settings = sorted(
        (k, repr(v)) for k, v in vars(loss_fn).items() if not k.startswith("_") and k != "training"
    )
    tensors = [f"{name}:{_tensor_digest(t)}" for name, t in loss_fn.state_dict().items()]
    return [_source_of(type(loss_fn)), repr(settings), *tensors]


def _factory_text(factory: Callable) -> list[str]:
    """What identifies a model factory: its source; a ``functools.partial``'s function and the
    arguments it binds (``partial(Net, temperature=100.0)`` has no source of its own, and a
    rerun with another temperature resumed into the old model's results)."""
    if isinstance(factory, functools.partial):
        return [*_factory_text(factory.func), *_arguments_text(factory)]
    return [_source_of(factory)]


def _arguments_text(bound: functools.partial) -> list[str]:
    """A partial's arguments as text, without the addresses in default reprs (``<Cfg at 0x7f..>``),
    which differ in every process and would refuse every resume."""
    text = [repr(bound.args), repr(sorted(bound.keywords.items()))]
    return [without_addresses(part) for part in text]


def _source_of(obj: Any) -> str:
    """Its source where Python can find it (a notebook cell's too), else its qualified name."""
    try:
        if getattr(obj, "__name__", None) == "<lambda>":
            return _lambda_source(obj) or inspect.getsource(obj)
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return getattr(obj, "__qualname__", type(obj).__qualname__)


def _lambda_source(function: Any) -> str | None:
    """A lambda's own text, as ``lambda (o, y): body`` with its spaces closed up, or None.

    inspect.getsource gives the whole statement a lambda sits in: for ``wb.ablate(model=lambda:
    Net(), blocks=1)``, the call itself, so a rerun with blocks=2 to add blocks read as another
    model and was refused. The lambda's instructions know their columns (co_positions), which
    span its body alone."""
    lines, first = inspect.getsourcelines(function)
    spans = [
        position
        for position in function.__code__.co_positions()
        if None not in position and position[2:] != (0, 0)  # (0, 0): the frame's set-up, at no column
    ]
    if not spans:
        return None
    start_line, start = min((line, column) for line, _, column, _ in spans)
    end_line, end = max((line, column) for _, line, _, column in spans)
    text = [line.encode() for line in lines[start_line - first : end_line - first + 1]]  # columns count bytes
    if not text:
        return None
    body = text[0][start:end] if len(text) == 1 else text[0][start:] + b"".join(text[1:-1]) + text[-1][:end]
    return f"lambda {inspect.signature(function)}: {' '.join(body.decode(errors='replace').split())}"


def _shapes_of(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape), str(batch.dtype))
    if isinstance(batch, Mapping):
        return {key: _shapes_of(value) for key, value in sorted(batch.items(), key=lambda kv: str(kv[0]))}
    if isinstance(batch, (list, tuple)):
        return [_shapes_of(value) for value in batch]
    return type(batch).__qualname__


def _digest(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def _fingerprint(prepared: Prepared) -> dict:
    """What must match for a rerun with the same ``out`` to resume rather than start over."""
    # Where the blocks run and how long one may take do not change what is measured: a run
    # started locally may be resumed on a cluster, and the other way round.
    settings = {k: v for k, v in prepared.config.items() if k not in ("timeout_s", "executor", "slurm")}
    # The default loss is one rule, however results name it: a folder written before the model's
    # own loss was named so still resumes.
    if settings["loss_fn"] in DEFAULT_LOSSES:
        settings["loss_fn"] = DEFAULT_LOSSES[0]
    settings |= prepared.identity
    settings["arms"] = [
        [arm.name, arm.record()["techniques"], arm.process] for arm in prepared.arms if not arm.unavailable
    ]
    # More blocks add to a run's own (the same command with a larger blocks resumes and runs only
    # the new ones): the count is kept beside the digest, not in it.
    fingerprint = settings_fingerprint({k: v for k, v in settings.items() if k not in ADDABLE})
    fingerprint["settings"] |= {k: settings[k] for k in ADDABLE}
    return fingerprint


ADDABLE = ("blocks",)  # settings a resumed ablation may raise: each block is a process of its own
# Parts of a job's identity that workbench began to record after folders were written without them.
RECORDED_SINCE = ("data_values",)
# Run settings added since, with the value every run before them had: a folder without one
# resumes at that value, and is refused at another.
SETTINGS_ADDED = {"find_unused_parameters": False}


def settings_fingerprint(settings: dict) -> dict:
    """``{"digest", "settings"}``: what a resumed run (an ablation's, a search's) must match."""
    text = json.dumps(settings, sort_keys=True, default=str)
    # Compare in the form it is stored in (JSON), so a reloaded plan equals a fresh one.
    return {"digest": hashlib.sha256(text.encode()).hexdigest()[:16], "settings": json.loads(text)}


@contextlib.contextmanager
def _ctrl_c_waits():
    """Ctrl-C waits (said so) while what finished is saved; only the main thread gets signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def wait(signum, frame):
        print("\nworkbench: saving what finished; a moment...", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, wait)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _signals_held():
    """Ctrl-C and SIGTERM held back for the few milliseconds inside, then delivered as they came.

    A finished process's record is written, then counted: a signal between the two left the
    record on disk (and resumed later) while the stopped line said "nothing was measured"."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    # a handler that C code installed (getsignal gives None) could not be put back: left as it is
    holdable = [number for number in HELD_SIGNALS if signal.getsignal(number) is not None]
    previous = {number: signal.signal(number, lambda n, frame: held.append(n)) for number in holdable}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if held:
            signal.raise_signal(held[0])  # to the handler it would have reached


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _default_out(label: str) -> Path:
    """A new folder under ./workbench-results, named by the time and the model. Made here, at
    once and exclusively: two runs started in the same second (a sweep launched in parallel)
    each get their own, the second with a suffix, instead of one refusing the other's lock."""
    stem = Path("workbench-results") / f"{datetime.now():%Y%m%d-%H%M%S}-{slug(label)}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 1000):
        folder = stem if attempt == 1 else stem.with_name(f"{stem.name}-{attempt}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise ValueError(f"ablate: could not make a new results folder beside {stem}; pass out=")


def _open_out(
    out: Any,
    prepared: Prepared,
    overwrite: bool,
    retry_failed: bool = False,
    made_for_it: bool = False,
    before_planning: Callable[[list[dict]], None] = lambda finished: None,
) -> tuple[ResultsFolder, list[dict]]:
    """The output folder, locked for this run, and the processes a previous run of this same
    ablation finished there. The caller unlocks it when the run ends. ``made_for_it``: a folder
    that the run around it made for this one (a search's round, a Slurm job's block);
    ``before_planning(finished)`` may refuse the run before its plan.json is written."""
    folder = ResultsFolder(out)
    _refuse_a_file(folder)
    folder.refuse_inside_another_run(made_for_it=made_for_it)
    taken_over = folder.lock()
    try:
        if taken_over:
            say(f"workbench: {taken_over}", error=True)
        fingerprint = _fingerprint(prepared)
        if overwrite:
            folder.clear()  # only what workbench wrote; refuses if the user's files are there
        jobs = _refuse_the_folder(folder, fingerprint)
        if retry_failed:
            # A process in which an arm failed runs again whole: the arms of a block are only
            # comparable when measured side by side, in the same process.
            jobs = [job for job in jobs if not any(u["status"] in DID_NOT_RUN for u in job["units"])]
        before_planning(jobs)
        write_json_atomic(folder.file("plan.json"), fingerprint)  # a new run's, or the blocks asked for now
        return folder, sorted(jobs, key=lambda job: job.get("finished_at", 0))
    except BaseException:
        folder.unlock()
        raise


def _refuse_a_file(folder: ResultsFolder) -> None:
    if folder.path.exists() and not folder.path.is_dir():
        raise ValueError(f"out={str(folder.path)!r} is a file; out names a folder for the results")


# What a run writes in its folder: a file of the user's by one of these names (one the manifest
# does not list) would be overwritten, or read back as the run's own.
RUN_FILES = (
    "plan.json",
    "results.json",
    "table.csv",
    "losses.csv",
    "telemetry.csv",
    "plot.png",
    "report.html",
)
RUN_FOLDERS = ("units/", "logs/", "slurm/")


def _refuse_the_folder(folder: ResultsFolder, fingerprint: dict) -> list[dict]:
    """Raise when ``folder`` holds what this ablation may not add to: another kind of results,
    files workbench did not write, another ablation, or more blocks of this one than it asks for
    (ValueError naming it). Else return the processes a previous run of it finished there (none
    for a new run). A run of this ablation resumes beside the user's own files, but not over
    them: ``plan.json`` counts only when the folder's manifest lists it (a copy of a run's files
    is not that run)."""
    folder.refuse_other_results("plan.json", "an ablation")  # a search's, say (tune.json)
    resuming = "plan.json" in folder.own_files()
    folder.refuse_foreign_files(resuming, RUN_FILES + RUN_FOLDERS)
    if not resuming:
        return []
    plan = read_record(folder.path / "plan.json", "this run's plan")
    if isinstance(plan, dict) and plan.get("digest") == _digest_with_blocks_in_it(fingerprint, plan):
        plan = {**plan, "digest": fingerprint["digest"]}  # written before blocks could be added
    refuse_a_different_run(folder.path, plan, fingerprint, "ablation", addable=ADDABLE)
    jobs = [_read_unit(p) for p in sorted((folder.path / "units").glob("*.json"))]
    _refuse_fewer_blocks(folder, jobs, fingerprint["settings"]["blocks"])
    return jobs


def _digest_with_blocks_in_it(fingerprint: dict, plan: dict) -> str:
    """This run's digest as a plan.json written before ADDABLE took the block count out of it would
    hold it, with that plan's own count: equal when only the blocks differ."""
    old = plan.get("settings") if isinstance(plan.get("settings"), dict) else {}
    return settings_fingerprint({**fingerprint["settings"], **{k: old.get(k) for k in ADDABLE}})["digest"]


def _refuse_fewer_blocks(folder: ResultsFolder, jobs: list[dict], blocks: int) -> None:
    """A resumed run may add blocks, not leave out finished ones: what was measured stays counted."""
    finished = {job["block"] for job in jobs}
    if finished and max(finished) >= blocks:
        raise ValueError(
            f"out={str(folder.path)!r} holds this ablation's blocks up to block {max(finished) + 1}; "
            f"blocks={blocks} would leave some of them out. Pass blocks={max(finished) + 1} or more to resume "
            "(more add to them), or choose another results folder"
        )


def _read_unit(path: Path) -> dict:
    """One finished process's record, read back to resume; a damaged one is named, not guessed at."""
    job = read_record(path, "a finished process's record")
    if not (isinstance(job, dict) and isinstance(job.get("units"), list) and "block" in job and "job" in job):
        raise ValueError(f"{path} is not a workbench process record; move it out of units/ to resume")
    return job


def read_record(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path} ({what}) is damaged: {error}; move it away, or pass overwrite=True"
        ) from None


def check_before_run(arguments: Mapping[str, Any]):
    """Refuse now what ``ablate(**arguments)`` would refuse once started: bad settings, as
    ``plan`` does, and an ``out`` that is a file, a folder of another run (unless
    ``overwrite``) or of the user's files, or one inside another run's folder; else return the
    plan, as ``plan`` gives it. The panel asks before it starts a run, so that the refusal comes
    at once, not from the run's thread, and the CLI's dry run, so that it passes only what the run
    would; the job is prepared once (its data scanned once) for both checks."""
    prepared = _prepare_plan(**plan_arguments(arguments))
    _check_the_out(prepared, arguments.get("out"), bool(arguments.get("overwrite")))
    return _plan_table(prepared)


def _check_the_out(prepared: Prepared, out: Any, overwrite: bool) -> None:
    if out is None or out is False or out is True:  # a new folder, or none
        return
    folder = ResultsFolder(out)  # "~" expanded, as the run will
    folder.refuse_inside_another_run()  # as _open_out does first
    if not folder.path.exists():
        folder.refuse_if_it_cannot_be_made()  # under a file, or where this user may not write
        return
    _refuse_a_file(folder)
    folder.refuse_if_in_use()  # as lock() would: not the other run's half-written files, misread
    if overwrite:
        folder.refuse_to_clear_foreign()  # what clear() would refuse, in its words
        return
    _refuse_the_folder(folder, _fingerprint(prepared))


def refuse_a_different_run(
    path: Path, previous: dict, fingerprint: dict, what: str, addable: tuple[str, ...] = ()
) -> None:
    """Raise, naming the settings that differ, when ``path`` holds a run other than this one.
    ``addable``: settings outside the digest, which a resumed run may change (not named). A part
    of the identity that a later workbench added (RECORDED_SINCE) and the record lacks is not
    known to differ."""
    if previous.get("digest") != fingerprint["digest"]:
        old, new = previous.get("settings", {}), fingerprint["settings"]
        differing = sorted(
            k
            for k in set(old) | set(new)
            if old.get(k, SETTINGS_ADDED.get(k)) != new.get(k)
            and k not in addable
            and (k in old or k not in RECORDED_SINCE)
        )
        if not differing:
            return
        raise ValueError(
            f"out={str(path)!r} holds a different {what} (differs in: {', '.join(differing)}); "
            "choose another results folder, or pass overwrite=True to discard it"
        )


def _blocks_from(settings: dict, repeats: int | None) -> dict:
    """``repeats`` is the old name of ``blocks``: accepted, with a warning that says so."""
    if repeats is None:
        return settings
    warnings.warn(
        "ablate: repeats= is now blocks= (each block is one process running every arm side by side)",
        DeprecationWarning,
        stacklevel=3,
    )
    return {**settings, "blocks": repeats}


# The keywords ablate and plan take besides the run settings (named in an unknown one's error;
# repeats, blocks' former name, still works but is not offered).
PLAN_ONLY = ("model", "data", "loss_fn", "techniques", "collate_fn")
ABLATE_ONLY = (*PLAN_ONLY, "out", "progress", "overwrite", "retry_failed", "on_event", "stop")


@takes_run_options
def ablate(
    model: Any = "mlp",
    data: Any = None,
    loss_fn: Callable | None = None,
    techniques: Mapping[str, Any] | None = None,
    *,
    collate_fn: Callable[[list], Any] | None = None,
    out: str | Path | None | bool = None,
    progress: bool = True,
    overwrite: bool = False,
    retry_failed: bool = False,
    on_event: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
    repeats: int | None = None,
    **settings: Any,
) -> Results:
    """Run a controlled ablation and return its Results (``.table``, ``.plot()``, ``.save()``).

    model       a built-in name (``mlp``, ``resnet-mini``, ``gpt-mini``) or a zero-argument
                callable returning an nn.Module
    data        a built-in dataset (``digits``, ``textures``, ``text``, ``jpeg``, ``synthetic``),
                a JPEG ImageFolder (``"jpeg-folder:PATH"`` or ``wb.JpegFolder``), a Dataset,
                an iterable of (inputs, targets) batches, or a callable returning one;
                None picks the built-in model's own dataset
    loss_fn     ``(outputs, targets) -> loss``, the batch's mean loss (grad_accum weights
                micro-batches by their share, right for a mean); default cross-entropy
    techniques  ``{"amp": {"dtype": "bfloat16"}, "compile": True, ...}``, or names with their
                defaults (``["amp", "tf32"]``); None = all, defaults; a list of values sweeps a setting: ``{"dataloader": {"num_workers": [0, 2]}}``
    collate_fn  ``(list of samples) -> batch``, as DataLoader's: how workbench batches your
                Dataset's samples (e.g. padding them to one length); default torch's stacking

    How each arm is trained and timed (workbench.config.RunConfig, the same for the CLI's flags
    and the panel's controls):

    {run_options}

    out         folder for results (written after every process, resumable); None = a new folder
                under ./workbench-results; False = keep nothing on disk
    overwrite   remove the files an earlier run wrote in ``out`` (only those: with any other
                file there, it refuses and lists them) and start afresh
    retry_failed  when resuming, run again the blocks in which an arm failed, ran out of
                memory or was skipped, instead of keeping those records
    on_event    called with a dict per event, for live UIs: ``plan``; per process ``start``
                (its block and arms); per arm ``phase`` (startup, warmup, measure with its
                round), ``progress`` (throttled: step, loss, samples/s), ``arm_error``; ``unit``
                (one arm's measurements in one block, in ``result``); ``process_done``;
                ``telemetry`` (one sampler reading, 1 Hz); with executor="slurm", ``slurm``
                (jobs done, running, pending) and ``slurm_retry``; finally ``done`` or ``stopped``
    stop        a threading.Event; setting it ends the run like Ctrl-C, returning partial results
    repeats     the former name of ``blocks``

    Under ``torchrun`` (``torchrun --nnodes ... -m workbench ablate ...``) every process runs
    this; each arm then spans all of torchrun's ranks (``world_size`` is theirs), and rank 0
    alone keeps the results and shows progress.
    """
    return run_ablation(
        model, with_collate_fn(data, collate_fn), loss_fn, techniques, settings, out=out, progress=progress, overwrite=overwrite,
        retry_failed=retry_failed, on_event=on_event, stop=stop, repeats=repeats,
    )  # fmt: skip


def run_ablation(
    model: Any,
    data: Any,
    loss_fn: Callable | None,
    techniques: Mapping[str, Any] | None,
    settings: dict[str, Any],
    *,
    out: str | Path | None | bool,
    progress: bool,
    overwrite: bool,
    retry_failed: bool,
    on_event: Callable[[dict], None] | None,
    stop: threading.Event | None,
    repeats: int | None = None,
    bar_label: str = "ablate",
) -> Results:
    """``wb.ablate``'s work, with its arguments as it takes them; ``bar_label`` names the
    progress bar (wb.advise runs an ablation of the baseline alone, under its own name)."""
    if on_event is not None and not callable(on_event):
        raise ValueError(f"ablate: on_event must be a function that takes one event dict; got {on_event!r}")
    if stop is not None and not callable(getattr(stop, "is_set", None)):
        raise ValueError(f"ablate: stop must be a threading.Event (or anything with is_set()); got {stop!r}")
    if not (out is None or isinstance(out, (bool, str, os.PathLike))):
        raise ValueError(
            f"ablate: out must be a folder path, None (a new folder) or False (keep nothing); got {out!r}"
        )
    # A string such as "False" from a config file is true to Python: it would discard results.
    check_bool("ablate", "overwrite", overwrite)
    check_bool("ablate", "retry_failed", retry_failed)
    settings = _blocks_from(settings, repeats)
    settings, launcher = _under_torchrun(settings)
    if launcher is not None and launcher.rank.rank != 0:  # only rank 0 reports
        out, progress, on_event = False, False, None
    run = RunConfig.from_options("ablate", settings, also=ABLATE_ONLY)
    prepared = prepare(model, data, loss_fn, techniques, run)
    # The trace folder is made now: one that cannot be made would fail every arm, after its block ran.
    if run.trace_dir is not None:
        try:
            Path(run.trace_dir).expanduser().mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(
                f"ablate: trace_dir={run.trace_dir!r} cannot be made: {error.strerror}"
            ) from None
    return _run_in_folder(
        prepared, out, overwrite, retry_failed, progress, on_event, stop, launcher, bar_label
    )


def _run_in_folder(
    prepared: Prepared,
    out: Any,
    overwrite: bool,
    retry_failed: bool,
    progress: bool,
    on_event: Callable[[dict], None] | None,
    stop: threading.Event | None,
    launcher: Torchrun | None,
    bar_label: str = "ablate",
    made_for_it: bool = False,
) -> Results:
    """Run a prepared ablation into ``out`` (False: a temporary folder, removed afterwards).
    ``bar_label``: the progress bar's name for what runs (wb.advise's and wb.tune's runs say theirs);
    ``made_for_it``: ``out`` is a room the caller's run made for this one (a search's round)."""
    temporary = None
    if out is False:
        temporary = tempfile.TemporaryDirectory(prefix="workbench-")
        out = temporary.name
    elif out is None or out is True:
        out = _default_out(prepared.config["model"])
    folder = None
    try:
        _refuse_traces_not_ours(prepared, None if temporary else str(Path(out).expanduser().resolve()))
        folder, finished = _open_out(
            out,
            prepared,
            overwrite,
            retry_failed,
            made_for_it,
            _refusing_a_torchrun_resume(launcher, prepared),
        )
        runner = _Runner(
            prepared,
            folder,
            finished,
            on_event or (lambda event: None),
            stop,
            kept=temporary is None,
            launcher=launcher,
            nested=made_for_it,
        )
        results = runner.run(progress, bar_label)
    finally:
        if folder is not None:
            folder.unlock()
        if temporary is not None:
            temporary.cleanup()
        if launcher is not None:
            launcher.close()
    if temporary is not None:
        results.path = None
    return results


def _refusing_a_torchrun_resume(
    launcher: Torchrun | None, prepared: Prepared
) -> Callable[[list[dict]], None]:
    """Under torchrun, joins the ranks' control group and refuses a resume (rank 0 alone knows its
    folder's finished processes), before the folder's plan.json is touched."""

    def check(finished: list[dict]) -> None:
        if launcher is None:
            return
        launcher.start(prepared.run.timeout_s or STARTUP_LIMIT_S)
        if launcher.resuming(len(finished)):
            raise ValueError("ablate: resuming under torchrun is not supported; pass a new out folder")

    return check


def _rank_zeros_with_the_cause(records: list[dict]) -> tuple[list[dict], dict]:
    """Under torchrun, each node's record of one process, made one: rank 0's, which every node
    keeps (so all skip the same later blocks, and a script reading the results on any rank reads
    the same), with each failed arm's reason from the rank whose error caused the others' (a
    collective failing because a peer went away only echoes it: process.first_cause). Each
    node's parent sees only its own rank's worker: rank 0 alone said its peer had crashed."""
    units = records[0]["units"]
    for unit in units:
        if unit["status"] not in ("failed", "oom"):
            continue
        errors = {
            rank: theirs
            for rank, record in enumerate(records)
            for theirs in record["units"]
            if theirs["arm"] == unit["arm"] and theirs["status"] in ("failed", "oom")
        }
        cause = first_cause(errors)
        if cause != 0:
            theirs = errors[cause]
            unit.update(status=theirs["status"], reason=f"rank {cause} of {len(records)}: {theirs['reason']}",
                        traceback=theirs.get("traceback", ""))  # fmt: skip
    return units, records[0]["moved"]


def _earlier_samples(folder: Path) -> list[dict]:
    """The telemetry an earlier run of this ablation saved in ``folder`` (results.json), which a
    resumed run keeps beside its own: its blocks were measured under that load. Empty when the
    file is missing or unreadable (the finished processes themselves are in units/)."""
    try:
        samples = json.loads((folder / "results.json").read_text()).get("telemetry")
    except (OSError, ValueError, AttributeError):
        return []
    return [sample for sample in samples if isinstance(sample, dict)] if isinstance(samples, list) else []


def _refuse_traces_not_ours(prepared: Prepared, owner: str | None) -> None:
    """Before anything runs: the trace files this run would write may replace only its own
    (a resumed run's, a Slurm job's of this run) or those of an earlier run that kept no results
    folder (``owner`` None), as that one would too. A user's file, or another results folder's
    trace (two runs pointed at one trace_dir), is refused, naming it."""
    run = prepared.run
    if run.trace_dir is None:
        return
    folder = Path(run.trace_dir).expanduser()
    ranks = range(run.world_size) if run.world_size > 1 else [None]
    names = sorted(
        {
            trace_file_name(block, arm.name, rank)
            for block in range(run.blocks)
            for arm in prepared.arms
            for rank in ranks
        }  # fmt: skip
    )
    listed = _listed_in(owner)
    problems = []
    for name in names:
        if not (folder / name).is_file():
            continue
        marked, written_for = trace_owner(folder / name)
        if marked and not _same_run(written_for, owner):
            problems.append(f"{name} (the trace of the run in {written_for!r})")
        elif not marked and not listed(folder / name):  # unmarked: an older workbench's, inside out
            problems.append(f"{name} (workbench did not write it)")
    if problems:
        raise ValueError(
            f"ablate: trace_dir={run.trace_dir!r} holds {', '.join(problems[:3])}"
            f"{f' and {len(problems) - 3} more' if len(problems) > 3 else ''}, which this run would "
            "replace; workbench replaces only its own files: choose another trace_dir, or move them away"
        )


def _listed_in(owner: str | None) -> Callable[[Path], bool]:
    """Whether the manifest of results folder ``owner`` lists a file (False outside it, or with none)."""

    def listed(path: Path) -> bool:
        if owner is None or not path.resolve().is_relative_to(owner):
            return False
        try:
            return ResultsFolder(owner).wrote(path.resolve().relative_to(owner).as_posix())
        except ValueError:  # a damaged manifest vouches for nothing
            return False

    return listed


def _same_run(written_for: str | None, owner: str | None) -> bool:
    """Whether a trace written for results folder ``written_for`` is this run's (``owner``) to replace:
    the same folder, or one nested in it (a Slurm job's); or neither kept a folder."""
    if written_for is None or owner is None:
        return written_for == owner
    return Path(written_for).is_relative_to(owner)


def run_slurm_block(prepared: Prepared, folder: str, block: int) -> str:
    """What a Slurm job runs: block ``block`` of ``prepared`` (already made local), as an ordinary
    local run into ``folder``. Its answer is that folder's JSON; the value returned (the folder)
    travels back through submitit's pickle and is never read."""
    # A requeued job starts its block afresh: a block's arms are comparable only when measured
    # side by side, in one process, on one node.
    files, _ = _open_out(folder, prepared, overwrite=True, made_for_it=True)
    try:
        print(f"workbench: block {block + 1}/{prepared.run.blocks} into {folder}", flush=True)
        _Runner(prepared, files, [], lambda event: None, None, only_block=block).run(progress=False)
    finally:
        files.unlock()
    return folder


@takes_run_options
def plan(
    model: Any = "mlp",
    data: Any = None,
    loss_fn: Callable | None = None,
    techniques: Mapping[str, Any] | None = None,
    *,
    collate_fn: Callable[[list], Any] | None = None,
    repeats: int | None = None,
    **settings: Any,
):
    """The arms ``ablate`` would run with these arguments, as a DataFrame, without running them.

    It takes every run setting ``ablate`` takes (RunConfig's fields) and checks them the same
    way, so ``plan(**plan_arguments(kwargs))`` refuses exactly what ``ablate(**kwargs)`` would.

    ``process`` says where each arm runs: ``block`` (side by side with the others in each
    block's process) or ``own`` (a process of its own per block, with ``own_process`` saying why).

    {run_options}
    """
    # repeats= warned of here, so that the warning names the caller's line (stacklevel)
    settings = _blocks_from(settings, repeats)
    try:
        return _plan_table(_prepare_plan(model, data, loss_fn, techniques, collate_fn=collate_fn, **settings))
    except ValueError as error:  # the checks speak as ablate (the CLI's dry run and the panel say
        said = str(error)  # their own names): called as plan, they name plan
        if not said.startswith("ablate: "):
            raise
        raise ValueError(f"plan: {said.removeprefix('ablate: ')}") from error.__cause__


def _plan_table(prepared: Prepared):
    """``plan``'s table of a prepared ablation, its settings in ``attrs["config"]``."""
    import pandas as pd

    blocks = prepared.run.blocks
    rows = [{**arm.record(), "blocks": 0 if arm.unavailable else blocks} for arm in prepared.arms]
    for row in rows:  # a text column with nothing to say holds "", as in Results.table
        if row["unavailable"]:
            row["process"] = ""
        row["unavailable"] = row["unavailable"] or ""
        row["own_process"] = row["own_process"] or ""
    columns = ["name", "role", "process", "techniques", "unavailable", "own_process", "blocks"]
    table = pd.DataFrame(rows)[columns]
    # the settings as the run would take them (a preset's, the device), for the CLI's dry run
    table.attrs["config"] = prepared.config
    table.attrs["oversubscribed"] = _oversubscribed_here(prepared)
    return table


def _oversubscribed_here(prepared: Prepared) -> str | None:
    """What is wrong when a CPU run's ranks x threads outnumber this machine's cores, or None."""
    if prepared.config["device"] != "cpu" or prepared.run.executor == "slurm":  # a node's cores, not ours
        return None
    ranks = ranks_on_this_machine(prepared.run.world_size)
    threads = prepared.run.threads or threads_per_rank(ranks)  # as each rank starts (worker.prepare_process)
    return oversubscription(threads, usable_cores(), ranks)


def _prepare_plan(
    model: Any = "mlp",
    data: Any = None,
    loss_fn: Callable | None = None,
    techniques: Mapping[str, Any] | None = None,
    *,
    collate_fn: Callable[[list], Any] | None = None,
    repeats: int | None = None,
    **settings: Any,
) -> Prepared:
    """``plan``'s checks and arms, as ``prepare`` gives them (``check_before_run`` needs the job's
    fingerprint too)."""
    settings, _ = _under_torchrun(_blocks_from(settings, repeats))
    run = RunConfig.from_options("plan", settings, also=PLAN_ONLY)
    return prepare(model, with_collate_fn(data, collate_fn), loss_fn, techniques, run)


def _under_torchrun(settings: dict[str, Any]) -> tuple[dict[str, Any], Torchrun | None]:
    """Under torchrun, the run's world size is torchrun's: ``settings`` with it, and the launcher
    (None elsewhere). Another world size is refused, by ``plan`` (a dry run) as by ``ablate``, in
    ablate's words as plan's other checks are."""
    launcher = Torchrun.detect()
    if launcher is None:
        return settings, None
    world_size = settings.get("world_size", 1)
    if world_size not in (1, launcher.rank.world_size):
        raise ValueError(
            f"ablate: under torchrun the world size is torchrun's ({launcher.rank.world_size}); "
            f"got world_size={world_size}"
        )
    return {**settings, "world_size": launcher.rank.world_size}, launcher


def plan_arguments(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """Of ``ablate``'s arguments, those ``plan`` takes: all that decide and check the arms.

    The CLI's --dry-run and the panel's pre-flight pass their whole ablate arguments through
    this, so neither keeps its own list of keys that could fall behind ablate's.
    """
    accepted = inspect.signature(plan).parameters
    return {key: value for key, value in arguments.items() if key in accepted}


def _compile_cache_env(folder: Path | None) -> dict[str, str]:
    return {} if folder is None else {"TORCHINDUCTOR_CACHE_DIR": str(folder)}


class _Runner:
    """Runs the planned processes block by block, keeps every measurement, and resumes."""

    def __init__(
        self,
        prepared: Prepared,
        folder: ResultsFolder,
        finished: list[dict],
        on_event: Callable[[dict], None],
        stop: threading.Event | None,
        kept: bool = True,
        launcher: Torchrun | None = None,
        only_block: int | None = None,
        nested: bool = False,
    ):
        self.prepared, self.run_config = prepared, prepared.run
        self.only_block = only_block  # a Slurm job's run: this one block (run_slurm_block)
        self.nested = nested  # a run inside another's folder (a search's round): that one resumes it
        self.files, self.folder = folder, folder.path  # every file written is entered in its manifest
        self.kept = kept  # False when out=False (a temporary folder)
        self.on_event, self.stop, self.launcher = on_event, stop, launcher
        self.units: list[dict] = []
        self.stopped = False
        self.template: WarmTemplate | None = None  # while the run goes on (workbench.template)
        self.template_ended = False  # it died during the run: the processes after it were spawned
        self.block_records: list[dict] = []
        self.done: set[tuple[int, str]] = set()
        self.failed: dict[str, str] = {}  # arm -> why: its later blocks are skipped, not rerun
        for job in finished:  # resuming: what a previous run of this ablation finished
            self._keep(job)
        # On Slurm, the submitting machine's load says nothing about the nodes: each job's run
        # samples its own node, and those samples are kept here, by block.
        self.node_telemetry: dict[int, list[dict]] = {}
        self.node_loads: dict[int, dict] = {}
        self.sampler = Sampler(on_sample=lambda sample: on_event({"type": "telemetry", **sample}))
        # resuming: the machine's samples while the finished processes ran (and its load then)
        self.earlier_samples = _earlier_samples(self.folder) if finished else []
        self.record = {
            "schema": SCHEMA,
            "created": datetime.now().isoformat(timespec="seconds"),
            "config": prepared.config,
            "environment": environment(),
        }
        if smoke_test():  # RunConfig.from_options cut the budget: say so wherever results are shown
            self.record["smoke_test"] = SMOKE_NOTE

    # --- bookkeeping ------------------------------------------------------------------------

    def _keep(self, job: dict) -> None:
        """Take in one finished process's record (just run, or read back when resuming)."""
        self.done.add((job["block"], job["job"]))
        for name, reason in job.get("moved", {}).items():
            self._move(name, reason, job["block"])
        self.units += job["units"]
        for unit in job["units"]:
            if unit["status"] in ("failed", "oom"):
                self.failed.setdefault(unit["arm"], unit["reason"])
        if job.get("process"):
            self.block_records.append(job["process"])

    def _move(self, name: str, reason: str, block: int) -> None:
        """From block ``block`` on, run arm ``name`` in a process of its own (it could not share it)."""
        arm = next(arm for arm in self.prepared.arms if arm.name == name)
        if not arm.own_process:
            arm.own_process, arm.from_block = reason, block
            add_own_baseline(self.prepared.arms, arm.kind, from_block=block)

    def save(self, complete: bool) -> Results:
        arms = [arm.record() for arm in self.prepared.arms]
        self.record.update(
            arms=arms,
            units=self.units,
            blocks=self.block_records,
            complete=complete,
            telemetry=self._telemetry(),
            load=self._load(),
            table=summarize(arms, self.units, self.run_config.blocks, complete, self._telemetry()),
        )
        results = Results(self.record, self.folder)
        # The last save writes the tables and the plot too; but not a Slurm job's (only_block): the
        # submitting process reads its results.json the moment it appears, makes the run's own
        # tables and plot, and may remove a temporary folder (out=False) while the job still wrote.
        if self.kept and (complete or self.stopped) and self.only_block is None:
            results.save(self.files)
        else:
            write_json_atomic(self.files.file("results.json"), self.record)
        return results

    def _telemetry(self) -> list[dict]:
        """The machine's samples; on Slurm, those of the nodes, as each job's run took them."""
        if not self._on_slurm():
            return self.earlier_samples + self.sampler.samples
        return [sample for block in sorted(self.node_telemetry) for sample in self.node_telemetry[block]]

    def _load(self) -> dict:
        """The competing load; on Slurm, the busiest node's, saying which block and node it was."""
        if not self._on_slurm():
            return competing_load(self._telemetry(), usable_cores())
        loads = {block: load for block, load in self.node_loads.items() if load}
        if not loads:
            return {}
        block = max(loads, key=lambda b: loads[b]["others_cpu_cores_median"])
        load = dict(loads[block])
        if load.get("warning"):
            load["warning"] = f"in block {block + 1}, on its Slurm node: {load['warning']}"
        return load

    def _blocks(self) -> list[int]:
        return list(range(self.run_config.blocks)) if self.only_block is None else [self.only_block]

    def _planned(self) -> int:
        """Processes this ablation runs in all, as planned now (an arm moved to its own adds some)."""
        return sum(len(jobs_for_block(self.prepared.arms, block)) for block in self._blocks())

    def _on_slurm(self) -> bool:
        return self.run_config.executor == "slurm" and self.only_block is None

    # --- running ----------------------------------------------------------------------------

    def run(self, progress: bool, bar_label: str = "ablate") -> Results:
        run = self.run_config
        planned = max(self._planned(), len(self.done))
        plan_event = {
            "type": "plan",
            "arms": [arm.record() for arm in self.prepared.arms],
            "blocks": run.blocks,
            "rounds": run.rounds,  # None: each block chooses them from its step time
            "steps": run.steps,
            "world_size": run.world_size,
            "processes": planned,
            "remaining": planned - len(self.done),
            "out": str(self.folder) if self.kept else None,
            "label": bar_label,  # what runs: ablate, advise, or a part of a search
        }
        if self._on_slurm():
            plan_event["executor"] = "slurm"
        else:  # said before anything runs; each block's record carries what it found (Results.warnings)
            plan_event["oversubscribed"] = _oversubscribed_here(self.prepared)
        self.on_event(plan_event)
        if progress:  # before the bar exists, so that the two never share a line
            print_plan(plan_event)
        here = not self._on_slurm()
        if here:
            bar = Progress(progress, total=planned, already=len(self.done), label=bar_label)
        else:  # the bar counts blocks (a Slurm job is one block)
            done = run.blocks - len(self._blocks_not_done())
            bar = Progress(progress, total=run.blocks, already=done, unit="block", label=bar_label)
        stopped = False
        try:
            if here and len(self.done) < planned:
                # Inside the try: an interrupt while they start (a notebook's, at any moment)
                # must still end the sampler's thread and give the template back.
                self.sampler.start()
                self.template = self._start_template(bar)
                self._run_here(bar)
            elif here:
                # A finished run opened again: nothing runs, so nothing is sampled; its samples and
                # its load warning stay those it was measured under.
                pass
            else:  # each job samples its own node and starts its own template; this process does neither
                self._run_on_slurm(bar)
        except (Interrupted, KeyboardInterrupt):
            stopped = True
        finally:  # however the run ends, its template is given back and its sampler stopped
            self._close_template()
            self.sampler.stop()
        if stopped:
            return self._stopped(bar, planned, progress)
        bar.close()
        results = self.save(complete=True)
        self.on_event({"type": "done", "out": str(self.folder)})
        return results

    def _stopped(self, bar: Progress, planned: int, progress: bool) -> Results:
        """Ctrl-C or Stop: keep what finished, say how to resume; Ctrl-C goes on up as itself.

        A ``stop`` asked for without ``progress`` (the panel's Stop) is not printed: its caller
        has the partial results and says it in its own words. Ctrl-C is always said."""
        bar.close()
        self.stopped = True
        with _ctrl_c_waits():  # a second Ctrl-C would cut the save short: the files, then the line
            results = self.save(complete=False)
            line = self._stopped_line(planned)
            asked = self.stop is not None and self.stop.is_set()
            if line is not None and (progress or not asked):
                say(f"\n{line}")
        self.on_event({"type": "stopped", "out": str(self.folder)})
        if asked:
            return results
        raise KeyboardInterrupt from None

    def _stopped_line(self, planned: int) -> str | None:
        """What a stopped run says: how much finished, where it is, and how to go on."""
        if self.launcher is not None and self.launcher.rank.rank != 0:
            return None  # rank 0 speaks for the run
        run = self.run_config
        why = getattr(self.stop, "why", None)  # a tuner's round, cut by the search's budget on purpose
        if why is not None:
            if not self.done:  # a calibration cut, say: nothing that could count
                return f"Stopped, as {why}, before any process finished."
            return f"Stopped, as {why}: {len(self.done)} of {planned} processes finished, and count"
        if not self.kept:
            where = "are in the returned results only (out=False)."
        elif self.launcher is not None:
            where = (
                f"are saved in {self.folder}. Under torchrun a run cannot resume: run again with a new out."
            )
        elif self.nested:  # its own out would be refused: the run around it resumes it
            where = (
                f"are saved in {self.folder}. Run the command that started it again, with "
                f"out={str(self.folder.parent)!r}, to resume."
            )
        else:  # named in full: out=None made a new folder, and the same call would make another
            where = f"are saved in {self.folder}. Run again with out={str(self.folder)!r} to resume."
        if self._on_slurm():  # this run's Slurm jobs were cancelled (workbench.slurm)
            done = run.blocks - len(self._blocks_not_done())
            return f"Stopped, its Slurm jobs cancelled: {done} of {run.blocks} blocks {where}"
        if not self.done:
            if self.nested:  # a search's round: the search says what it kept
                return f"Stopped before any process of {self.folder.name} finished."
            return "Stopped before any process finished: nothing was measured."
        return f"Stopped: {len(self.done)} of {planned} processes {where}"

    # --- on a Slurm cluster (workbench.slurm) -------------------------------------------------

    def _blocks_not_done(self) -> list[int]:
        return [b for b in self._blocks() if not all((b, job.key) in self.done for job in self._jobs(b))]

    def _run_on_slurm(self, bar: Progress) -> None:
        """One Slurm job per block that is not done; each completed one is merged as it ends."""
        run = self.run_config
        device = self.prepared.config["device"]
        options = run.slurm or SlurmOptions()
        local = replace(
            run, executor="local", slurm=None, device="cuda" if device.startswith("cuda") else device
        )
        prepared = replace(
            self.prepared, run=local, config={**self.prepared.config, "executor": "local", "slurm": None}
        )
        self.record["worker_start"] = (
            "in each Slurm job, as a local run of its block (see slurm/ in the results folder)"
        )
        for merged in self.block_records:  # resuming: the nodes' samples of blocks merged before
            if merged.get("slurm_attempt") and merged["block"] not in self.node_telemetry:
                where = self.folder / attempt_folder(merged["block"], merged["slurm_attempt"])
                if (where / "results.json").is_file():
                    self._read_node_samples(merged["block"], where)
        SlurmBlocks(
            options,
            job_gpus(options, run.world_size, device),
            self.files,
            self._blocks_not_done(),
            functools.partial(run_slurm_block, prepared),
            self._merge_block,
            self._give_up_block,
            self.on_event,
            self.stop,
            bar,
        ).run()

    def _merge_block(self, block: int, folder: Path, attempt: dict) -> None:
        """Take a completed Slurm attempt's processes into this run, replacing any partial record
        of the block that an earlier local run left."""
        records = [json.loads(p.read_text()) for p in sorted((folder / "units").glob("*.json"))]
        self._forget_block(block)
        self._read_node_samples(block, folder)
        prefix = folder.relative_to(self.folder).as_posix()
        for record in sorted(records, key=lambda r: r.get("finished_at", 0)):
            for unit in record["units"]:
                if unit.get("log"):
                    unit["log"] = f"{prefix}/{unit['log']}"
            if record.get("process"):
                record["process"].update(slurm_job_id=attempt["job_id"], slurm_attempt=attempt["attempt"])
            write_json_atomic(self.files.file(f"units/b{block}-{record['job']}.json"), record)
            self._keep(record)
            for unit in record["units"]:
                self.on_event({"type": "unit", **unit})
            self.on_event({"type": "process_done", "block": block, "job": record["job"]})
        self.save(complete=False)

    def _read_node_samples(self, block: int, folder: Path) -> None:
        """The telemetry and competing load that block's job sampled on its node."""
        node_run = json.loads((folder / "results.json").read_text())
        host = next((b.get("host") for b in node_run.get("blocks", [])), None)
        samples = node_run.get("telemetry", [])
        self.node_telemetry[block] = [{**sample, "block": block, "host": host} for sample in samples]
        self.node_loads[block] = node_run.get("load") or {}

    def _give_up_block(self, block: int, reason: str) -> None:
        """Every process of a block whose Slurm job failed past its retries: recorded as failed."""
        self._forget_block(block)
        for job in self._jobs(block):
            units = [self._unit(arm, job, 1, "failed", reason) for arm in job.arms]
            for unit in units:
                unit["log"] = None
            self._keep_job(job, units, {}, None, Progress(False, 0, 0))

    def _forget_block(self, block: int) -> None:
        for path in (self.folder / "units").glob(f"b{block}-*.json"):
            path.unlink()  # workbench's own record (units/ is entered in the manifest)
        self.units = [unit for unit in self.units if unit["block"] != block]
        self.block_records = [b for b in self.block_records if b.get("block") != block]
        self.done = {(b, key) for b, key in self.done if b != block}

    def _run_here(self, bar: Progress) -> None:
        """The blocks one after another on this machine, each process as its turn comes."""
        with tempfile.TemporaryDirectory(prefix="workbench-inductor-") as compile_cache:
            for block in self._blocks():
                queue = self._jobs(block)
                while queue:
                    job = queue.pop(0)
                    if (block, job.key) in self.done:
                        continue
                    if self.stop is not None and self.stop.is_set():  # not a process started to be ended
                        raise Interrupted
                    self._run_job(job, Path(compile_cache), bar)
                    # Arms moved to their own processes run in this block too, after the others.
                    queued = {j.key for j in queue}
                    queue += [
                        j
                        for j in self._jobs(block)
                        if not j.shared and j.key not in queued and (block, j.key) not in self.done
                    ]
                    bar.at_least(self._planned())

    def _start_template(self, bar: Progress) -> WarmTemplate | None:
        """The warm template the run's processes fork from, or None (plain spawns); either is recorded."""
        if self.run_config.start == "spawn":
            self.record["worker_start"] = "plain spawn, as asked (start='spawn')"
            return None
        bar.show("importing torch once for the run's processes")
        template, how = acquire_template()  # kept warm from an earlier run, or started now
        self.record["worker_start"] = how
        return template

    def _template_ended(self) -> bool:
        """Whether the warm template ended during the run, first seen now: the process it forked
        went with it, which is no arm's doing (the arm in flight was moved to a process of its
        own, as if it had been killed). The processes after it are plain spawns, and the results
        say so."""
        if self.template is None or self.template.alive() or self.template_ended:
            return False
        self.template_ended = True
        self.record["worker_start"] += (
            "; the template ended during the run, and the processes after that were plain spawns"
        )
        return True

    def _live_template(self) -> WarmTemplate | None:
        """The template to fork the next process from, or None (a plain spawn) once it has ended."""
        if self._template_ended() or self.template is None or not self.template.alive():
            return None
        return self.template

    def _close_template(self) -> None:
        release_template(self.template)  # it waits for the next run a while (workbench.template)
        self.template = None

    def _jobs(self, block: int) -> list[Job]:
        """Block ``block``'s processes, less an added lone baseline that no arm needs any more."""
        arms = self.prepared.arms
        lone = {arm.kind for arm in arms if arm.own_process and not arm.unavailable and arm.name not in self.failed
                and arm.name != own_baseline_name(arm.kind)}  # fmt: skip
        return [
            job
            for job in jobs_for_block(arms, block)
            if job.shared
            or job.arms[0].name != own_baseline_name(job.arms[0].kind)
            or job.arms[0].kind in lone
        ]

    def _run_job(self, job: Job, compile_cache: Path, bar: Progress) -> None:
        """Run one process (again without an arm that killed it, if one did) and keep what it measured."""
        started = time.time()
        units = [self._skipped(arm, job) for arm in job.arms if arm.name in self.failed]
        runnable = [arm for arm in job.arms if arm.name not in self.failed]
        moved: dict[str, str] = {}
        block_record = None
        attempt = 0
        while runnable:
            attempt += 1
            answer, arm_errors = self._launch(job, runnable, attempt, compile_cache, bar)
            if answer["type"] == "result":
                for arm in runnable:
                    if arm.name in answer["arms"]:
                        units.append(self._unit(arm, job, attempt, "ok", "", result=answer["arms"][arm.name]))
                    else:
                        failure = answer["failures"].get(arm.name) or {
                            "status": "failed",
                            "reason": "no result",
                        }
                        self._failed_in_block(arm, job, attempt, failure, len(runnable), units, moved)
                block_record = {
                    **answer["block"],
                    "job": job.key,
                    "attempts": attempt,
                    "wall_s": time.time() - started,
                }
                break
            runnable = self._without_the_culprit(job, attempt, answer, arm_errors, runnable, units, moved)
        if self.launcher is not None:  # every node takes rank 0's record, to stay in step
            units, moved = _rank_zeros_with_the_cause(self.launcher.gather({"units": units, "moved": moved}))
        self._keep_job(job, units, moved, block_record, bar)

    def _without_the_culprit(
        self, job: Job, attempt: int, answer: dict, arm_errors: dict, runnable: list, units: list, moved: dict
    ) -> list[Arm]:
        """After a process died or was ended: record who failed; the arms to run again (maybe none)."""
        if answer.get("signal") == signal.SIGKILL and self._template_ended():
            return list(runnable)  # the template's end took its worker with it: the block again, spawned
        runnable = list(runnable)
        for arm in list(runnable):  # arms that reported their own failure first keep it
            if arm.name in arm_errors:
                self._failed_in_block(arm, job, attempt, arm_errors[arm.name], len(runnable), units, moved)
                runnable.remove(arm)
        culprit = next((arm for arm in runnable if arm.name == answer.get("arm")), None)
        if culprit is None or len(runnable) == 1:
            # Nothing to single out (the process failed before or between arms): all of them failed.
            for arm in runnable:
                units.append(self._unit(arm, job, attempt, answer["status"], answer["reason"], answer))
            return []
        if answer.get("shared_state"):
            moved[culprit.name] = f"it changed process-wide state ({'; '.join(answer['shared_state'])})"
        elif answer["status"] == "oom":  # alone, it shows whether it was the arms together
            moved[culprit.name] = (
                f"its block's process ran out of memory while it ran ({answer['reason']}): it may not fit "
                "beside the other arms"
            )
        elif answer.get("signal") == signal.SIGKILL:  # no word from the kernel's OOM killer
            moved[culprit.name] = (
                f"its block's process was killed while it ran ({answer['reason']}): by another program, or "
                "a memory limit this machine does not count (a container's); alone, it shows whether the "
                "arms together were the cause"
            )
        else:
            units.append(self._unit(culprit, job, attempt, answer["status"], answer["reason"], answer))
        runnable.remove(culprit)  # and run the block again without it
        return runnable

    def _keep_job(self, job: Job, units: list, moved: dict, block_record: dict | None, bar: Progress) -> None:
        """Write the process's record to the results folder at once, then tell the listeners."""
        record = {
            "block": job.block,
            "job": job.key,
            "units": units,
            "moved": moved,
            "process": block_record,
            "finished_at": time.time(),
        }
        with _signals_held():  # on disk and counted, or neither (the stopped line counts it)
            write_json_atomic(self.files.file(job.file), record)
            self._keep(record)
        self.save(complete=False)
        bar.advance()
        for unit in units:
            self.on_event({"type": "unit", **unit})
        self.on_event({"type": "process_done", "block": job.block, "job": job.key})

    def _failed_in_block(
        self, arm: Arm, job: Job, attempt: int, failure: dict, arms_in_process: int, units: list, moved: dict
    ) -> None:
        """An arm failed inside a running process. Out of memory beside others: try it alone. Over
        memory_cap_mb it is not tried again: its peak is its own, in any process."""
        beside_others = job.shared and arms_in_process > 1 and "over_cap_peak_mib" not in failure
        if beside_others and failure["status"] == "oom":
            moved[arm.name] = f"it ran out of memory beside the block's other arms ({failure['reason']})"
        else:
            units.append(self._unit(arm, job, attempt, failure["status"], failure["reason"], failure))

    def _unit(self, arm: Arm, job: Job, attempt: int, status: str, reason: str, detail: dict | None = None,
              result: dict | None = None) -> dict:  # fmt: skip
        failed_rank = (detail or {}).get("rank") or 0  # the rank whose failure it was
        unit = {
            "arm": arm.name,
            "block": job.block,
            "process": "block" if job.shared else "own",
            "status": status,
            "reason": reason,
            "result": result,
            # its log, not rank 0's, which said nothing of rank 1's error
            "log": str(rank_log(self._log_path(job, attempt), failed_rank).relative_to(self.folder)),
        }
        if status != "ok":
            unit["traceback"] = (detail or {}).get("traceback", "")
        if detail and "over_cap_peak_mib" in detail:
            unit["over_cap_peak_mib"] = detail["over_cap_peak_mib"]
        return unit

    def _skipped(self, arm: Arm, job: Job) -> dict:
        # A failure that happened once (an import error, an OOM) happens again: skip, and say why.
        return {
            "arm": arm.name,
            "block": job.block,
            "process": "block" if job.shared else "own",
            "status": "skipped",
            "reason": f"not run: it failed in an earlier block ({self.failed[arm.name]})",
            "result": None,
        }

    def _log_path(self, job: Job, attempt: int) -> Path:
        suffix = f"-attempt{attempt}" if attempt > 1 else ""
        path = self.folder / "logs" / f"b{job.block}-{job.key}{suffix}.log"
        for rank in range(self.run_config.world_size):  # each rank of a DDP arm logs beside rank 0
            self.files.file(rank_log(path, rank).relative_to(self.folder))
        return path

    @staticmethod
    def _compile_cache_dir(compile_cache: Path, job: Job, attempt: int) -> Path | None:
        """Where this process's compiled code goes (TORCHINDUCTOR_CACHE_DIR), inside the run's own
        temporary folder.

        A fresh one per process: each compile is a cold one, and startup_s says what a new job pays.
        A smoke test (WORKBENCH_SMOKE=1) measures nothing worth deciding on, so its processes use
        inductor's own cache (None: TORCHINDUCTOR_CACHE_DIR as the environment sets it, else
        inductor's default folder), shared with other runs: most of a cold compile on the CPU is
        common to every graph (about 20 s of the 25 s the small mlp takes on 2 cores).
        """
        return None if smoke_test() else compile_cache / f"b{job.block}-{job.key}-{attempt}"

    def _trace_owner(self) -> str | None:
        """The results folder that the traces this run writes say they belong to (profiling.TraceFile)."""
        return str(self.folder.resolve()) if self.kept else None

    def _enter_traces(self, block: int, arms: list[Arm]) -> None:
        """A trace_dir inside out holds workbench's files: enter the traces this process will write
        in the manifest first, so that overwrite removes them and counts no stranger's file."""
        trace_dir = self.run_config.trace_dir
        if trace_dir is None or not self.kept:
            return
        inside = Path(trace_dir).expanduser().resolve()
        if not inside.is_relative_to(self.folder.resolve()):
            return
        ranks = range(self.run_config.world_size) if self.run_config.world_size > 1 else [None]
        for arm in arms:
            for rank in ranks:
                name = trace_file_name(block, arm.name, rank)
                self.files.file((inside / name).relative_to(self.folder.resolve()))

    def _launch(
        self, job: Job, arms: list[Arm], attempt: int, compile_cache: Path, bar: Progress
    ) -> tuple[dict, dict[str, dict]]:
        """Start the process for ``arms`` and wait for its answer; also the arms' own error reports."""
        run, prepared = self.run_config, self.prepared
        spec = BlockSpec(
            model=prepared.model,
            data=prepared.data,
            loss_fn=prepared.loss_fn,
            arms=[arm.spec() for arm in arms],
            run=replace(run, device=prepared.config["device"]),
            block=job.block,
            trace_owner=self._trace_owner(),
        )
        self._enter_traces(job.block, arms)
        arm_errors: dict[str, dict] = {}
        where = f"block {job.block + 1}/{run.blocks}" + ("" if job.shared else f", {arms[0].name} alone")

        def relay(message: dict) -> None:
            if message["type"] == "arm_error":
                arm_errors[message["arm"]] = message
            arm = message.get("arm")
            if arm is not None:
                detail = f" {message['round']}/{message['of']}" if message.get("phase") == "measure" else ""
                bar.show(f"{where}: {arm}: {message.get('phase', 'measure')}{detail}")
            self.on_event({**message, "block": job.block})

        bar.show(f"{where}: starting")
        self.on_event(
            {
                "type": "start",
                "block": job.block,
                "arms": [arm.name for arm in arms],
                "process": "block" if job.shared else "own",
                "attempt": attempt,
            }
        )
        only_rank = None
        if self.launcher is not None:  # this process starts only its own rank's worker
            rank = self.launcher.rank
            only_rank = (rank.rank, rank.local_rank, self.launcher.master_addr, self.launcher.unit_port())
        answer = run_in_fresh_process(
            spec,
            log_path=self._log_path(job, attempt),
            timeout_s=run.timeout_s,
            env=_compile_cache_env(self._compile_cache_dir(compile_cache, job, attempt)),
            on_message=relay,
            should_stop=(lambda: self.stop.is_set()) if self.stop is not None else (lambda: False),
            world_size=run.world_size,
            only_rank=only_rank,
            template=self._live_template(),
        )
        return answer, arm_errors
