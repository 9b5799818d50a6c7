"""Small builders shared by the tests (importable: tests/ is on sys.path via conftest)."""

import contextlib
import ctypes
import itertools
import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from technique_settings import TECHNIQUE_SETTINGS

import workbench as wb
from workbench.block import ArmSpec
from workbench.config import RunConfig, run_options
from workbench.data import resolve_data
from workbench.results import TABLE_COLUMNS
from workbench.techniques import get_technique, parse_techniques, technique_context
from workbench.worker import BlockSpec, run_block

ARM = "arm"  # the name of the one arm in the blocks these helpers build


def block_spec(
    model="mlp", techniques=None, steps=3, warmup=1, batch_size=16, data=None, arms=None, **overrides
) -> BlockSpec:
    """A BlockSpec for one arm (``techniques``), or for several: ``arms={"name": techniques, ...}``."""
    arms = arms if arms is not None else {ARM: techniques or {}}
    settings = {key: overrides.pop(key) for key in list(overrides) if key in run_options()}
    spec = BlockSpec(
        model=model,
        data=resolve_data(data, model),
        loss_fn=overrides.pop("loss_fn", None),
        arms=[ArmSpec(name, parse_techniques(chosen)) for name, chosen in arms.items()],
        run=RunConfig(
            steps=steps, warmup=warmup, batch_size=batch_size, **{"device": "cpu", "rounds": 1, **settings}
        ),
    )
    for key, value in overrides.items():
        setattr(spec, key, value)
    return spec


def run_spec(spec: BlockSpec, world_size: int = 1, timeout_s: float = 300.0, log_path=None) -> dict:
    """Run ``spec`` as ablate runs a block: its ranks forked from the warm template kept between
    runs (workbench.template), so that each test does not pay a fresh interpreter and torch import
    per rank (about 3 s each here, on cores the other rank needs); its answer (a dict)."""
    import tempfile
    from pathlib import Path

    from workbench.process import run_in_fresh_process
    from workbench.template import acquire_template, release_template

    template, _ = acquire_template()
    try:
        with tempfile.TemporaryDirectory() as folder:
            return run_in_fresh_process(
                spec,
                log_path=log_path or Path(folder) / "unit.log",
                timeout_s=timeout_s,
                world_size=world_size,
                template=template,
            )
    finally:
        release_template(template)


def two_layers() -> torch.nn.Module:
    """A small launch-bound job: the advisor recommends compile for it, and every process of a
    search compiles cold, in about a third of mlp's time (mlp: about 23 s on a 2-core machine)."""
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def unavailable_here(
    name: str, model: str, device: torch.device, world_size: int | None = None
) -> str | None:
    """Why technique ``name``, with its settings row, cannot run on ``model`` here (None: it can)."""
    row = TECHNIQUE_SETTINGS[name]
    technique = get_technique(name)
    source = resolve_data(row.get("data"), model)
    ranks = row.get("world_size", 1) if world_size is None else world_size
    ctx = technique_context(RunConfig(device=str(device), world_size=ranks), model, source)
    return technique.unavailable_reason(ctx, technique.configure(row["config"]))


def arm_result(answer: dict, name: str = ARM) -> dict:
    """One arm's measurements from a block's answer; a failure fails the test with its reason."""
    assert answer.get("type", "result") == "result", answer
    if name not in answer["arms"]:
        failure = answer["failures"].get(name, {})
        raise AssertionError(f"{name} failed: {failure.get('reason')}\n{failure.get('traceback', '')}")
    return answer["arms"][name]


def train(model="mlp", techniques=None, **kwargs) -> dict:
    """Run one arm in this process (fast; isolation is tested separately). Its measurements."""
    return arm_result(run_block(block_spec(model, techniques, **kwargs)))


# One non-default, valid value per run setting (RunConfig's fields).
RUN_SETTINGS = {
    "steps": 7,
    "warmup": 2,
    "blocks": 2,
    "rounds": 3,
    "batch_size": 16,
    "device": "cpu",
    "seed": 5,
    "mode": "grid",
    "optimizer": "sgd",
    "lr": 0.01,
    "control": False,
    "loader_arms": False,
    "world_size": 2,
    "find_unused_parameters": True,
    "isolate": True,
    "link": {"bandwidth_gbps": 1.0},
    "memory_cap_mb": 4096.0,
    "profile_steps": 2,
    "trace_dir": "traces",
    "start": "spawn",
    "threads": 1,
    "heap": "as-is",
    "executor": "slurm",
    "slurm": {"partition": "debug", "time_min": 5},
    "timeout_s": 60.0,
}


def is_workbench_process(cmdline: list[str] | None) -> bool:
    """A worker, or the warm template: workers forked from the template keep its command line."""
    joined = " ".join(cmdline or [])
    return "workbench.worker" in joined or "workbench.template" in joined


def is_kept_template(pid: int) -> bool:
    """Whether ``pid`` is the warm template kept for the next run (workbench.template), which a
    check for leftovers passes over; a worker forked from it has a pid of its own, so is still found."""
    from workbench.template import kept_template

    kept = kept_template()
    return kept is not None and pid == kept.process.pid


def left_behind() -> list:
    """workbench's processes still running under this one, but for the warm template kept for the
    next run."""
    return [p for p in _live_children() if is_workbench_process(_cmdline(p)) and not is_kept_template(p.pid)]


def _live_children() -> list:
    """This process's descendants that have not exited. A zombie (exited, not yet reaped by its
    parent) runs nothing, and psutil refuses to read its command line."""
    import psutil

    live = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                live.append(process)
        except psutil.NoSuchProcess:  # ZombieProcess too: it ended between the listing and the look
            continue
    return live


def _cmdline(process) -> list[str]:
    """``process``'s command line, or [] when it ended while it was being looked at."""
    import psutil

    try:
        return process.cmdline()
    except psutil.NoSuchProcess:
        return []


@contextlib.contextmanager
def adopting_orphans():
    """Inside the block, descendants whose parent dies are re-parented to this process (Linux's
    child subreaper) instead of to init, so a look at this process's own children finds a
    grandchild that a stopped process left running."""
    import psutil

    libc = ctypes.CDLL(None, use_errno=True)
    set_child_subreaper = 36  # PR_SET_CHILD_SUBREAPER, <linux/prctl.h>
    ours_before = {child.pid for child in psutil.Process().children()}
    if libc.prctl(set_child_subreaper, 1, 0, 0, 0) != 0:
        pytest.skip(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
    try:
        yield
    finally:
        libc.prctl(set_child_subreaper, 0, 0, 0, 0)
        _reap_adopted(ours_before)


def _reap_adopted(ours_before: set[int]) -> None:
    """Reap the adopted orphans that have exited. Nothing else waits for them: left as zombies,
    they would stay children of this test process for the rest of the session, where a later
    test's look at its own children finds them."""
    import psutil

    for child in psutil.Process().children():
        if child.pid in ours_before:
            continue  # started before the block: whoever started it waits for it
        # A child started inside the block has been waited for by its starter when the block ends
        # (as run_stage does), so a zombie left here is an orphan that was adopted.
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.NoSuchProcess, ChildProcessError):
            continue


def running_children(marker: str) -> list:
    """This process's descendants, not yet exited, whose command line holds ``marker``."""
    return [process for process in _live_children() if marker in " ".join(_cmdline(process))]


def unsteady_machine(res) -> str:
    """Why the machine could not judge ``res`` ('' when it was quiet and steady).

    Busy: other processes (or, in a virtual machine, other guests, as steal time) took CPU from
    the arms. Unsteady: the control arm's interval, the A/A check of the run itself, is wider
    than NOISE_THRESHOLD either side. On a quiet machine it is 2-4% here; CI on a shared host
    has seen the control 3-32% off with no load visible from inside, and a check whose own
    A/A interval is that wide has no power to show anything.
    """
    from workbench.stats import NOISE_THRESHOLD, is_noisy
    from workbench.telemetry import LOAD_WARN_CORES

    load = res.load
    others = load.get("others_cpu_cores_p90", 0.0)
    if others >= LOAD_WARN_CORES:
        return f"other processes used {others:.2f} of {load.get('cores', '?')} cores (90th percentile)"
    table = res.table.set_index("arm")
    if "baseline (control)" in table.index:
        control = table.loc["baseline (control)"]
        if is_noisy(control.speedup, control.speedup_low, control.speedup_high):
            return (
                f"the control's own interval [{control.speedup_low:.2f}, {control.speedup_high:.2f}] "
                f"reached more than {NOISE_THRESHOLD:.0%} from its speedup: the machine was unsteady"
            )
    return ""


def judged_on_a_quiet_machine(run_once, problem, attempts: int = 3):
    """Run a statistical timing check until a quiet machine can judge it; its last Results.

    ``problem(res)`` says what is wrong with one run ('' when it passes). A pass ends it. Two misses
    while the machine was quiet and steady fail the test: a 95% interval misses twice in a row 1 time
    in 400 by chance. A miss on a busy or unsteady machine (``unsteady_machine``) proves nothing (load
    slows arms unevenly), so CI on a shared machine retries, and skips with what it saw after
    ``attempts`` runs.
    """
    quiet, busy = [], []
    for _ in range(attempts):
        res = run_once()
        found = problem(res)
        if not found:
            return res
        load = unsteady_machine(res)
        (busy if load else quiet).append(f"{found} ({load})" if load else found)
        if len(quiet) == 2:
            pytest.fail("two misses on a quiet machine: " + "; ".join(quiet))
    pytest.skip("the machine was too busy or unsteady to judge this timing check: " + "; ".join(busy + quiet))


def rank_processes():
    """The multiprocessing context that rank processes of the tests come from: a forkserver that
    imports torch once for the whole test session (not this process, whose thread pools must not be
    forked), so each rank does not pay a fresh interpreter and torch import (about 3 s here)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "helpers"])
    return context


def on_ranks(world_size: int, function, *args, timeout_s: float = 180.0) -> list:
    """``function(rank, *args)`` in ``world_size`` fresh processes, each with the environment
    torchrun gives a rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT...), so that it can join one process
    group; their return values (picklable), rank by rank. A rank that raises ends the others and
    raises here with its traceback. ``function`` must be importable (module-level): the processes
    import it by name. They come from ``rank_processes()``."""
    from workbench.distributed import free_port

    context = rank_processes()
    answers = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(world_size, rank, port, answers, function, args))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    gathered: dict[int, object] = {}
    failure = None
    try:
        while len(gathered) < world_size and failure is None:
            rank, ok, value = answers.get(timeout=timeout_s)
            if ok:
                gathered[rank] = value
            else:
                failure = f"rank {rank} failed:\n{value}"
    finally:
        for process in processes:
            process.join(timeout=5 if failure else 60)
            if process.is_alive():
                process.kill()
                process.join()
    if failure:
        raise RuntimeError(failure)
    return [gathered[rank] for rank in range(world_size)]


def _rank_main(world_size, rank, port, answers, function, args) -> None:
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)  # ranks share this machine's cores
    try:
        outcome = (rank, True, function(rank, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        outcome = (rank, False, traceback.format_exc())
    answers.put(outcome)
    answers.close()
    answers.join_thread()  # the answer is through the pipe before this process ends
    if outcome[1] and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # No interpreter teardown: torch's C++ threads sometimes abort it after the work is done.
    os._exit(0)


def result_row(arm, status="ok", reason="", speedup=None, low=None, high=None, **figures):
    """One row of a results table with known figures (the rest unavailable), for tests."""
    row = dict.fromkeys(TABLE_COLUMNS)
    row.update(arm=arm, kind="train", process="block", techniques=arm, status=status, reason=reason,
               speedup=speedup, speedup_low=low, speedup_high=high, blocks=3, noisy=False, notes="")  # fmt: skip
    if status == "ok":
        row.update(samples_per_s=4640.2, step_ms=6.9, activation_mb=0.000123, loss_vs_baseline=1.0)
    row.update(figures)
    return row


_SYNTHETIC_RUNS = itertools.count()


def synthetic_results(rows, roles=None, config=None, path=None):
    """A Results with these table rows (arms as treatments unless ``roles`` says otherwise), run
    settings at their defaults on mlp/digits/cpu: its table, summary, plot and report read as usual."""
    roles = roles or {}
    # Each a run of its own, started a second after the last (compare refuses one run given twice).
    number = next(_SYNTHETIC_RUNS)
    started = f"2026-11-25T10:{number // 60 % 60:02d}:{number % 60:02d}"
    arms = [
        {
            "name": row["arm"],
            "role": roles.get(row["arm"], "treatment"),
            "kind": "train",
            "process": "block",
            "settings": {},
            "techniques": row["arm"],
        }  # fmt: skip
        for row in rows
    ]
    record = {
        "schema": "workbench-results/2",
        "created": started,
        "config": {
            "model": "mlp",
            "data": "digits",
            "loss_fn": "cross_entropy",
            "techniques": {},
            **RunConfig().to_json(),
            "device": "cpu",
            "batch_size": 32,
            **(config or {}),
        },  # fmt: skip
        "environment": {
            "torch": "2.13.0+cpu",
            "cpu": "test CPU",
            "python": "3.11",
            "logical_cores": 2,
            "usable_cores": 2,
        },  # fmt: skip
        "arms": arms,
        "units": [],
        "blocks": [],
        "complete": True,
        "table": rows,
    }
    return wb.Results(record, path)


def plan_event(treatment_unavailable: str = "") -> dict:
    """The plan event ablate sends (workbench.progress.describe_plan reads it): a baseline and
    one treatment, unavailable for this reason where one is given, in one block of one process."""
    arms = [
        {"role": "baseline", "unavailable": "", "process": "block"},
        {"role": "treatment", "unavailable": treatment_unavailable, "process": "block"},
    ]
    return {
        "arms": arms,
        "blocks": 1,
        "processes": 1,
        "remaining": 1,
        "steps": 10,
        "rounds": None,
        "out": None,
    }


class Sentences(torch.utils.data.Dataset):
    """Token sequences of different lengths: the default collate cannot stack them."""

    def __len__(self):
        return 48

    def __getitem__(self, index):
        return torch.arange(3 + index % 5) % 8, index % 2


def pad_to_longest(samples):
    """Pads each batch to its longest sentence: batches differ in length from one to the next."""
    longest = max(len(tokens) for tokens, _ in samples)
    tokens = torch.stack([torch.nn.functional.pad(t, (0, longest - len(t))) for t, _ in samples])
    return tokens, torch.tensor([label for _, label in samples])


def bag_of_words():
    return torch.nn.EmbeddingBag(8, 2)


# A user's own job as a module (model, data, loss, optimizer), for --model module:attribute and the like.
OWN_JOB = """
import functools
import torch
from torch import nn

def build():
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))

def batches():
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 12, generator=generator), torch.randint(0, 3, (8,), generator=generator)) for _ in range(4)]

def smoothed(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, label_smoothing=0.1)

sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)

def broken():
    raise RuntimeError("no weights here")
"""
