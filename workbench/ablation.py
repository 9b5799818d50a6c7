"""Controlled ablations: plan the arms, run them isolated and interleaved, summarise.

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
3. Interleave: repeat r runs every arm once, in an order rotated by r (A B C, B C A, C A B),
   so drift of the machine (heat, other load) and position effects hit every arm alike.
4. Isolate: each (arm, repeat) runs in a fresh process (see workbench.worker), with its
   own warm-up excluded from the clock.
5. Persist: each finished (arm, repeat) is written to ``out/units/`` atomically, and the
   summary is rewritten after it. Ctrl-C keeps everything finished; running again with the
   same ``out`` resumes, skipping what is done.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from workbench.config import RunConfig
from workbench.data import DataSource, resolve_data
from workbench.devices import resolve_device
from workbench.distributed import Torchrun
from workbench.environment import environment
from workbench.models import inspect_model, model_label
from workbench.process import Interrupted, run_in_fresh_process
from workbench.results import SCHEMA, Results, summarize, write_json_atomic
from workbench.techniques import Context, Technique, conflict_reason, parse_techniques
from workbench.telemetry import Sampler
from workbench.worker import UnitSpec


@dataclass
class Arm:
    name: str
    role: str  # "baseline", "control" or "treatment"
    techniques: list[tuple[Technique, Any]] = field(default_factory=list)
    unavailable: str | None = None  # why it cannot run here; None when it can
    kind: str = "train"  # "train", or "loader": the input pipeline alone, with a no-op model

    def record(self) -> dict:
        described = ", ".join(t.describe(c) for t, c in self.techniques) or "none"
        return {
            "name": self.name,
            "kind": self.kind,
            "role": self.role,
            "techniques": described,
            "technique_names": [t.name for t, _ in self.techniques],
            # Only the input pipeline differs from the baseline (dataloader, dali).
            "input_pipeline": bool(self.techniques) and all(t.input_pipeline for t, _ in self.techniques),
            "unavailable": self.unavailable,
        }


def sweep_names(techniques: list[tuple[Technique, Any]]) -> list[str]:
    """Arm names: the technique's name, plus the swept values when it appears more than once."""
    names = []
    for technique, config in techniques:
        siblings = [c for t, c in techniques if t is technique]
        if len(siblings) == 1:
            names.append(technique.name)
            continue
        swept = [
            f.name
            for f in dataclasses.fields(config)
            if len({repr(getattr(c, f.name)) for c in siblings}) > 1
        ]
        values = ", ".join(f"{name}={getattr(config, name)}" for name in swept)
        names.append(f"{technique.name}[{values}]")
    return names


def plan_arms(mode: str, techniques: list[tuple[Technique, Any]], control: bool) -> list[Arm]:
    """The arms of one ablation, baseline first. Raises ValueError for impossible combinations."""
    arms = [Arm("baseline", "baseline")]
    if control:
        arms.append(Arm("baseline (control)", "control"))
    if len({t.name for t, _ in techniques}) < len(techniques) and mode != "one-at-a-time":
        raise ValueError(
            f"a swept setting (a list of values) runs one arm per value, which needs mode='one-at-a-time'; "
            f"got mode={mode!r}"
        )
    if mode == "one-at-a-time":
        names = sweep_names(techniques)
        arms += [Arm(name, "treatment", [pair]) for name, pair in zip(names, techniques, strict=True)]
    elif mode == "leave-one-out":
        names = [t.name for t, _ in techniques]
        reason = conflict_reason(names)
        if reason:
            raise ValueError(f"leave-one-out needs every technique together, but {reason}")
        if techniques:
            arms.append(Arm("all", "treatment", list(techniques)))
        if len(techniques) > 1:
            for index, (technique, _) in enumerate(techniques):
                rest = techniques[:index] + techniques[index + 1 :]
                arms.append(Arm(f"all - {technique.name}", "treatment", rest))
    else:  # grid
        for size in range(1, len(techniques) + 1):
            for combination in itertools.combinations(techniques, size):
                chosen = list(combination)
                name = "+".join(t.name for t, _ in chosen)
                arms.append(Arm(name, "treatment", chosen, conflict_reason([t.name for t, _ in chosen])))
    return arms


def loader_twins(arms: list[Arm]) -> list[Arm]:
    """Loader-only copies of the baseline and of every arm made only of input-pipeline techniques."""
    return [
        Arm(f"loader: {arm.name}", arm.role, arm.techniques, arm.unavailable, kind="loader")
        for arm in arms
        if arm.role in ("baseline", "treatment") and all(t.input_pipeline for t, _ in arm.techniques)
    ]


@dataclass
class Prepared:
    """A validated ablation, ready to run (or to show as a plan)."""

    run: RunConfig
    model: Any
    data: DataSource
    loss_fn: Callable | None
    arms: list[Arm]
    config: dict


def prepare(
    model: Any,
    data: Any,
    loss_fn: Callable | None,
    techniques: Mapping[str, Any] | None,
    run: RunConfig,
) -> Prepared:
    # Cheap checks first: building a dataset or a model takes time bad input should not cost.
    device = resolve_device(run.device)
    if device.type == "cuda" and run.world_size > torch.cuda.device_count():
        raise ValueError(
            f"ablate: world_size={run.world_size} needs one GPU per rank on this machine; "
            f"it has {torch.cuda.device_count()} (use torchrun across machines, see the README)"
        )
    chosen = parse_techniques(techniques)
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be a callable (outputs, targets) -> scalar loss; got {loss_fn!r}")
    instance, label = inspect_model(model)
    source = resolve_data(data, model, run.seed)
    ctx = Context(
        device=device,
        model=instance,
        model_name=label,
        data_is_dataset=source.is_dataset,
        batch_size=run.batch_size,
        data_label=source.label,
        image_size=source.images.size if source.images is not None else None,
        world_size=run.world_size,
        warmup=run.warmup,
    )
    runnable, unavailable = [], []
    for technique, config in chosen:
        technique.validate(ctx, config)
        reason = technique.unavailable_reason(ctx, config)
        if reason:
            unavailable.append(Arm(technique.name, "treatment", [(technique, config)], reason))
        else:
            runnable.append((technique, config))
    arms = plan_arms(run.mode, runnable, run.control)
    loader_arms = run.loader_arms
    if loader_arms is None:  # auto: when an input-pipeline technique is ablated on a Dataset
        loader_arms = source.is_dataset and any(t.input_pipeline for t, _ in runnable)
    if loader_arms == "only":
        arms = loader_twins(arms)
    elif loader_arms:
        arms += loader_twins(arms)
    arms += unavailable
    described: dict[str, str] = {}
    for technique, config in chosen:
        text = technique.describe(config)
        described[technique.name] = (
            f"{described[technique.name]}; {text}" if technique.name in described else text
        )
    config = {
        "model": label,
        "data": source.label,
        "loss_fn": model_label(loss_fn) if loss_fn else "cross_entropy",
        "techniques": described,
        **asdict(run),
        "device": str(device),
    }
    return Prepared(run, model, source, loss_fn, arms, config)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def _fingerprint(prepared: Prepared) -> dict:
    """What must match for a rerun with the same ``out`` to resume rather than start over."""
    settings = {k: v for k, v in prepared.config.items() if k != "timeout_s"}
    settings["arms"] = [
        [arm.name, arm.record()["techniques"]] for arm in prepared.arms if not arm.unavailable
    ]
    text = json.dumps(settings, sort_keys=True, default=str)
    # Compare in the form it is stored in (JSON), so a reloaded plan equals a fresh one.
    return {"digest": hashlib.sha256(text.encode()).hexdigest()[:16], "settings": json.loads(text)}


def _schedule(arms: list[Arm], repeats: int) -> list[tuple[Arm, int]]:
    """(arm, repeat) in run order: every repeat runs each arm once, rotated by one each time."""
    runnable = [arm for arm in arms if not arm.unavailable]
    order = []
    for repeat in range(repeats):
        shift = repeat % len(runnable)
        order += [(arm, repeat) for arm in runnable[shift:] + runnable[:shift]]
    return order


def _default_out(label: str) -> Path:
    return Path("workbench-results") / f"{datetime.now():%Y%m%d-%H%M%S}-{_slug(label)}"


class _Progress:
    """A tqdm.auto bar over (arm, repeat) runs, with the arm and phase in flight."""

    def __init__(self, enabled: bool, total: int, already: int):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=already, desc="ablate", unit="run", dynamic_ncols=True)

    def show(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _open_out(out: Any, prepared: Prepared, overwrite: bool) -> tuple[Path, list[dict]]:
    """The output folder, and the units a previous run of this same ablation finished there."""
    folder = Path(out)
    fingerprint = _fingerprint(prepared)
    plan_file = folder / "plan.json"
    if plan_file.exists() and overwrite:
        shutil.rmtree(folder)
    if not plan_file.exists() and folder.is_dir() and any(folder.iterdir()):
        raise ValueError(
            f"out={str(folder)!r} already holds files that are not workbench results; choose a new or empty folder"
        )
    if plan_file.exists():
        previous = json.loads(plan_file.read_text())
        if previous.get("digest") != fingerprint["digest"]:
            old, new = previous.get("settings", {}), fingerprint["settings"]
            differing = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise ValueError(
                f"out={str(folder)!r} holds a different ablation (differs in: {', '.join(differing)}); "
                "choose another out, or pass overwrite=True to discard it"
            )
        units = [json.loads(p.read_text()) for p in sorted((folder / "units").glob("*.json"))]
        return folder, units
    write_json_atomic(plan_file, fingerprint)
    return folder, []


def ablate(
    model: Any = "mlp",
    data: Any = None,
    loss_fn: Callable | None = None,
    techniques: Mapping[str, Any] | None = None,
    mode: str = "one-at-a-time",
    steps: int = 30,
    warmup: int = 5,
    repeats: int = 3,
    batch_size: int = 32,
    device: str = "auto",
    seed: int = 0,
    out: str | Path | None | bool = None,
    progress: bool = True,
    *,
    control: bool = True,
    loader_arms: bool | str | None = None,
    world_size: int = 1,
    link: Any = None,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    timeout_s: float = 1800.0,
    overwrite: bool = False,
    on_event: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
) -> Results:
    """Run a controlled ablation and return its Results (``.table``, ``.plot()``, ``.save()``).

    model       a built-in name (``mlp``, ``resnet-mini``, ``gpt-mini``) or a zero-argument
                callable returning an nn.Module
    data        a built-in dataset (``digits``, ``textures``, ``text``, ``jpeg``, ``synthetic``),
                a JPEG ImageFolder (``"jpeg-folder:PATH"`` or ``wb.JpegFolder``), a Dataset,
                an iterable of (inputs, targets) batches, or a callable returning one;
                None picks the built-in model's own dataset
    loss_fn     ``(outputs, targets) -> loss``; default cross-entropy
    techniques  ``{"amp": {"dtype": "bfloat16"}, "compile": True, ...}``; None = all, defaults;
                a list of values sweeps a setting: ``{"dataloader": {"num_workers": [0, 2]}}``
    mode        ``one-at-a-time`` | ``leave-one-out`` | ``grid``
    steps       timed optimizer steps per repeat; ``warmup`` untimed steps before them
    repeats     fresh-process runs per arm, interleaved across arms
    batch_size  samples per optimizer step (grad_accum splits it; it never grows)
    out         folder for results (written after every run, resumable); None = a new folder
                under ./workbench-results; False = keep nothing on disk
    control     also rerun the baseline (an A/A check of the machine's noise)
    loader_arms time the input pipeline alone too (kind ``loader`` rows, a no-op model);
                None: when dataloader or dali is ablated on a Dataset; ``"only"``: nothing else
    world_size  ranks per arm: > 1 runs every arm as a DDP job on this machine (gloo on CPU,
                NCCL on CUDA), each rank on its own shard with ``batch_size`` samples per step;
                throughput is the job's (all ranks), and communication is measured
    link        a simulated network between the ranks, ``{"bandwidth_gbps": 1, "latency_ms": 0.1}``:
                each gradient bucket is delayed by latency + bytes / bandwidth (a simulation)
    timeout_s   limit for one (arm, repeat); past it the arm is recorded as failed
    on_event    called with a dict per event, for live UIs: ``plan``, then per run ``start``,
                ``phase``, ``progress`` (throttled: step, loss, samples/s), ``unit`` (the finished
                run, with its measurements in ``result``), ``telemetry`` (one sampler reading,
                1 Hz), and finally ``done`` or ``stopped``
    stop        a threading.Event; setting it ends the run like Ctrl-C, returning partial results

    Under ``torchrun`` (``torchrun --nnodes ... -m workbench ablate ...``) every process runs
    this; each arm then spans all of torchrun's ranks (``world_size`` is theirs), and rank 0
    alone keeps the results and shows progress.
    """
    launcher = Torchrun.detect()
    if launcher is not None:
        if world_size not in (1, launcher.rank.world_size):
            raise ValueError(
                f"ablate: under torchrun the world size is torchrun's ({launcher.rank.world_size}); got world_size={world_size}"
            )
        world_size = launcher.rank.world_size
        if launcher.rank.rank != 0:  # only rank 0 reports
            out, progress, on_event = False, False, None
    run = RunConfig(
        steps=steps,
        warmup=warmup,
        repeats=repeats,
        batch_size=batch_size,
        device=device,
        seed=seed,
        mode=mode,
        optimizer=optimizer,
        lr=lr,
        control=control,
        loader_arms=loader_arms,
        world_size=world_size,
        link=link,
        timeout_s=timeout_s,
    )
    prepared = prepare(model, data, loss_fn, techniques, run)
    temporary = None
    if out is False:
        temporary = tempfile.TemporaryDirectory(prefix="workbench-")
        out = temporary.name
    elif out is None or out is True:
        out = _default_out(prepared.config["model"])
    try:
        folder, finished = _open_out(out, prepared, overwrite)
        if launcher is not None:
            launcher.start(timeout_s)
            if launcher.resuming(len(finished)):
                raise ValueError("ablate: resuming under torchrun is not supported; pass a new out folder")
        results = _run(
            prepared,
            folder,
            finished,
            progress,
            on_event or (lambda event: None),
            stop,
            kept=temporary is None,
            launcher=launcher,
        )
    finally:
        if temporary is not None:
            temporary.cleanup()
        if launcher is not None:
            launcher.close()
    if temporary is not None:
        results.path = None
    return results


def plan(
    model: Any = "mlp",
    data: Any = None,
    loss_fn: Callable | None = None,
    techniques: Mapping[str, Any] | None = None,
    mode: str = "one-at-a-time",
    repeats: int = 3,
    batch_size: int = 32,
    device: str = "auto",
    control: bool = True,
    loader_arms: bool | str | None = None,
    world_size: int = 1,
    link: Any = None,
    steps: int = 30,
    warmup: int = 5,
):
    """The arms ``ablate`` would run with these arguments, as a DataFrame, without running them."""
    import pandas as pd

    run = RunConfig(
        steps=steps,
        warmup=warmup,
        repeats=repeats,
        batch_size=batch_size,
        device=device,
        mode=mode,
        control=control,
        loader_arms=loader_arms,
        world_size=world_size,
        link=link,
    )
    prepared = prepare(model, data, loss_fn, techniques, run)
    rows = [{**arm.record(), "runs": 0 if arm.unavailable else repeats} for arm in prepared.arms]
    return pd.DataFrame(rows)[["name", "role", "techniques", "unavailable", "runs"]]


def describe_plan(event: dict) -> str:
    """One line saying what will run: arms, repeats, what is unavailable, what is resumed."""
    unavailable = sum(1 for arm in event["arms"] if arm["unavailable"])
    runnable = len(event["arms"]) - unavailable
    text = (
        f"Plan: {runnable} arms x {event['repeats']} repeats = {event['runs']} runs, interleaved, "
        f"each in a fresh process"
    )
    if unavailable:
        text += f"; {unavailable} unavailable"
    if event["remaining"] < event["runs"]:
        text += f"; resuming: {event['runs'] - event['remaining']} already done"
    return text + (
        f". Results: {event['out']}" if event["out"] else ". Results are kept in memory only (out=False)."
    )


def _run(
    prepared: Prepared,
    folder: Path,
    finished: list[dict],
    progress: bool,
    on_event: Callable[[dict], None],
    stop: threading.Event | None,
    kept: bool = True,
    launcher: Torchrun | None = None,
) -> Results:
    run = prepared.run
    env = environment()
    units = list(finished)
    done = {(u["arm"], u["repeat"]) for u in units}
    schedule = _schedule(prepared.arms, run.repeats)
    arm_records = [arm.record() for arm in prepared.arms]
    sampler = Sampler(on_sample=lambda sample: on_event({"type": "telemetry", **sample})).start()
    record = {
        "schema": SCHEMA,
        "created": datetime.now().isoformat(timespec="seconds"),
        "config": prepared.config,
        "environment": env,
        "arms": arm_records,
    }

    def save(complete: bool) -> Results:
        record.update(
            units=units,
            complete=complete,
            telemetry=sampler.samples,
            table=summarize(arm_records, units, run.repeats, complete, sampler.samples),
        )
        write_json_atomic(folder / "results.json", record)
        return Results(record, folder)

    remaining = [(arm, r) for arm, r in schedule if (arm.name, r) not in done]
    bar = _Progress(progress, total=len(schedule), already=len(schedule) - len(remaining))
    plan_event = {
        "type": "plan",
        "arms": arm_records,
        "runs": len(schedule),
        "remaining": len(remaining),
        "repeats": run.repeats,
        "out": str(folder) if kept else None,
    }
    on_event(plan_event)
    if progress:
        print(describe_plan(plan_event), flush=True)
    failed_arms: dict[str, str] = {u["arm"]: u["reason"] for u in units if u["status"] in ("failed", "oom")}
    try:
        with tempfile.TemporaryDirectory(prefix="workbench-inductor-") as compile_cache:
            for arm, repeat in remaining:
                unit = {"arm": arm.name, "repeat": repeat, "log": f"logs/{_slug(arm.name)}-r{repeat}.log"}
                if arm.name in failed_arms:
                    # A failure that happened once (an import error, an OOM) happens again: skip, say why.
                    unit.update(
                        status="skipped",
                        reason=f"not run: an earlier repeat failed ({failed_arms[arm.name]})",
                        result=None,
                    )
                else:
                    only_rank = None
                    if launcher is not None:  # this process starts only its own rank's worker
                        rank = launcher.rank
                        only_rank = (rank.rank, rank.local_rank, launcher.master_addr, launcher.unit_port())
                    unit.update(
                        _run_unit(
                            prepared, arm, repeat, folder, compile_cache, bar, on_event, stop, only_rank
                        )
                    )
                    failed = unit["status"] in ("failed", "oom")
                    if launcher is not None:  # every node follows rank 0's verdict, to stay in step
                        failed = not launcher.agree(not failed)
                    if failed:
                        failed_arms[arm.name] = unit["reason"] or "failed on rank 0"
                unit["finished_at"] = time.time()
                write_json_atomic(folder / "units" / f"{_slug(arm.name)}-r{repeat}.json", unit)
                units.append(unit)
                save(complete=False)
                bar.advance()
                on_event({"type": "unit", **unit})
    except (Interrupted, KeyboardInterrupt):
        sampler.stop()
        bar.close()
        results = save(complete=False)
        finished_count = sum(1 for u in units if u["status"] != "skipped")
        where = (
            f"are saved in {folder}. Run the same ablation with the same out to resume."
            if kept
            else "are in the returned results only (out=False)."
        )
        print(f"\nStopped: {finished_count} of {len(schedule)} runs {where}", flush=True)
        on_event({"type": "stopped", "out": str(folder)})
        if stop is not None and stop.is_set():
            return results
        raise KeyboardInterrupt from None
    sampler.stop()
    bar.close()
    results = save(complete=True)
    on_event({"type": "done", "out": str(folder)})
    return results


def _run_unit(
    prepared: Prepared,
    arm: Arm,
    repeat: int,
    folder: Path,
    compile_cache: str,
    bar: _Progress,
    on_event: Callable[[dict], None],
    stop: threading.Event | None,
    only_rank: tuple[int, int, str, int] | None = None,
) -> dict:
    run = prepared.run
    spec = UnitSpec(
        model=prepared.model,
        data=prepared.data,
        loss_fn=prepared.loss_fn,
        techniques=arm.techniques,
        steps=run.steps,
        warmup=run.warmup,
        batch_size=run.batch_size,
        device=prepared.config["device"],
        seed=run.seed,
        optimizer=run.optimizer,
        lr=run.lr,
        labels={"arm": arm.name, "repeat": repeat},
        loader_only=arm.kind == "loader",
        link=run.link,
        comm_timeout_s=min(120.0, run.timeout_s),
    )
    label = f"{arm.name} (repeat {repeat + 1}/{run.repeats})"
    bar.show(f"{label}: starting")

    def relay(message: dict) -> None:
        phase = message.get("phase", "measure")
        detail = f" {message['step']}/{message['of']}" if "step" in message else ""
        bar.show(f"{label}: {phase}{detail}")
        on_event({**message, "arm": arm.name, "repeat": repeat})

    on_event({"type": "start", "arm": arm.name, "repeat": repeat})
    answer = run_in_fresh_process(
        spec,
        log_path=folder / "logs" / f"{_slug(arm.name)}-r{repeat}.log",
        timeout_s=run.timeout_s,
        # Each arm gets its own compiled-code cache, empty for its first repeat: startup_s (taken
        # from that repeat) is a cold compile, and no arm's compile time benefits from another's.
        env={"TORCHINDUCTOR_CACHE_DIR": str(Path(compile_cache) / _slug(arm.name))},
        on_message=relay,
        should_stop=(lambda: stop.is_set()) if stop is not None else (lambda: False),
        world_size=run.world_size,
        only_rank=only_rank,
    )
    if answer["type"] == "result":
        result = {k: v for k, v in answer.items() if k != "type"}
        return {"status": "ok", "reason": "", "result": result}
    return {
        "status": answer["status"],
        "reason": answer["reason"],
        "traceback": answer.get("traceback", ""),
        "result": None,
    }
