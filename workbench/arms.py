"""The arms of an ablation: which to run (one at a time, leave-one-out, the grid, sweeps,
loader-only twins), and where each runs (side by side in a block's shared process, or in a
process of its own against a baseline that also runs alone)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from workbench.block import ArmSpec
from workbench.techniques import Context, Technique, conflict_reason, settings_of
from workbench.worker import slug

DDP_OWN_PROCESS = "a data-parallel arm is a process group of its own (one process per rank)"
ISOLATED = "isolate=True: every arm in a process of its own"


def loader_workers_apart(workers: int) -> str:
    """Why every arm runs alone when the user's DataLoader loads in worker processes: each arm has
    its own loader, whose workers would go on loading while the other arms' windows run (as the
    dataloader technique's arms with workers would, which run alone for that)."""
    return (
        f"the DataLoader given as data loads in {workers} worker process(es), which would keep "
        "loading ahead during other arms' windows"
    )


@dataclass
class Arm:
    name: str
    role: str  # "baseline", "control" or "treatment"
    techniques: list[tuple[Technique, Any]] = field(default_factory=list)
    unavailable: str | None = None  # why it cannot run here; None when it can
    kind: str = "train"  # "train", or "loader": the input pipeline alone, with a no-op model
    own_process: str | None = None  # why it runs in a process of its own; None: it shares the block
    # The first block it runs in that kind of process: an arm moved to its own process in a
    # later block (out of memory beside the others) ran shared before, and so did not run alone.
    from_block: int = 0

    @property
    def process(self) -> str:
        return "own" if self.own_process else "block"

    def record(self) -> dict:
        described = ", ".join(t.describe(c) for t, c in self.techniques) or "none"
        return {
            "name": self.name,
            "kind": self.kind,
            "role": self.role,
            "process": self.process,
            "own_process": self.own_process,
            "techniques": described,
            "technique_names": [t.name for t, _ in self.techniques],
            "settings": {t.name: settings_of(c) for t, c in self.techniques},  # Results.best hands it back
            # Only the input pipeline differs from the baseline (dataloader, dali).
            "input_pipeline": bool(self.techniques) and all(t.input_pipeline for t, _ in self.techniques),
            "unavailable": self.unavailable,
            "from_block": self.from_block,
        }

    def spec(self) -> ArmSpec:
        return ArmSpec(self.name, self.techniques, loader_only=self.kind == "loader")


def sweep_names(techniques: list[tuple[Technique, Any]]) -> list[str]:
    """Arm names: the technique's name, plus the swept values when it appears more than once."""
    names = []
    for technique, config in techniques:
        siblings = [c for t, c in techniques if t is technique]
        if len(siblings) == 1:
            names.append(technique.name)
            continue
        matter = technique.settings_that_matter(config)
        # a value swept among the siblings it matters to (the workers' prefetch among the arms with
        # workers): one that only the arms without workers lack names nothing
        swept = [
            f.name
            for f in fields(config)
            if f.name in matter
            and len(
                {repr(getattr(c, f.name)) for c in siblings if f.name in technique.settings_that_matter(c)}
            )
            > 1
        ]
        values = ", ".join(f"{name}={getattr(config, name)}" for name in swept)
        names.append(f"{technique.name}[{values}]")
    return names


def plan_arms(
    mode: str, techniques: list[tuple[Technique, Any]], control: bool, names: list[str] | None = None
) -> list[Arm]:
    """The arms of one ablation, baseline first. Raises ValueError for impossible combinations.

    ``names``: the arm names of a one-at-a-time sweep, when they were chosen with all the
    swept values in view (some may be unavailable); by default, from ``techniques``.
    """
    arms = [Arm("baseline", "baseline")]
    if control:
        arms.append(Arm("baseline (control)", "control"))
    if len({t.name for t, _ in techniques}) < len(techniques) and mode == "leave-one-out":
        raise ValueError(
            "a swept setting (a list of values) runs one arm per value, which leave-one-out cannot: it "
            "needs every technique together once; use mode='one-at-a-time' or mode='grid'"
        )
    names = names or sweep_names(techniques)
    if mode == "one-at-a-time":
        arms += [Arm(name, "treatment", [pair]) for name, pair in zip(names, techniques, strict=True)]
    elif mode == "leave-one-out":
        reason = conflict_reason(techniques)
        if reason:
            raise ValueError(f"leave-one-out needs every technique together, but {reason}")
        if techniques:
            arms.append(Arm("all", "treatment", list(techniques)))
        if len(techniques) > 1:
            for index, (technique, _) in enumerate(techniques):
                rest = techniques[:index] + techniques[index + 1 :]
                arms.append(Arm(f"all - {technique.name}", "treatment", rest))
    else:  # grid: every combination of the techniques, each at one of its swept values
        named = dict(zip(map(id, techniques), names, strict=True))
        groups: dict[str, list[tuple[Technique, Any]]] = {}
        for pair in techniques:
            groups.setdefault(pair[0].name, []).append(pair)
        for size in range(1, len(groups) + 1):
            for chosen_groups in itertools.combinations(groups.values(), size):
                for combination in itertools.product(*chosen_groups):
                    chosen = list(combination)
                    name = "+".join(named[id(pair)] for pair in chosen)
                    arms.append(Arm(name, "treatment", chosen, conflict_reason(chosen)))
    return arms


def plan_combinations(
    ctx: Context, combinations: Mapping[str, list[tuple[Technique, Any]]], control: bool
) -> tuple[list[Arm], list[Arm]]:
    """The baseline (and control) and one arm per named combination; those that cannot run here
    (a technique unavailable, or two that conflict) come second, with the reason."""
    arms = plan_arms("one-at-a-time", [], control)
    unavailable = []
    for name, pairs in combinations.items():
        for technique, config in pairs:
            technique.validate(ctx, config)
        # the reason names its technique, unless the combination is that technique alone
        reason = next(
            (
                why if name == t.name else f"{t.name}: {why}"
                for t, c in pairs
                if (why := t.unavailable_reason(ctx, c))
            ),
            None,
        ) or conflict_reason(pairs)
        (unavailable if reason else arms).append(Arm(name, "treatment", list(pairs), reason))
    return arms, unavailable


def loader_twins(arms: list[Arm]) -> list[Arm]:
    """Loader-only copies of the baseline and of every arm made only of input-pipeline techniques."""
    return [
        Arm(f"loader: {arm.name}", arm.role, arm.techniques, arm.unavailable, kind="loader")
        for arm in arms
        if arm.role in ("baseline", "treatment") and all(t.input_pipeline for t, _ in arm.techniques)
    ]


def own_baseline_name(kind: str) -> str:
    return "baseline (own process)" if kind == "train" else f"{kind}: baseline (own process)"


def assign_processes(arms: list[Arm], ctx: Context, isolate: bool = False) -> list[Arm]:
    """Mark the arms that need a process of their own, and add a baseline that runs alone for them.

    With several ranks every arm is a process group of its own, and with ``isolate``, or data that
    loads in DataLoader workers of the user's (``ctx.loader_workers``), every arm runs alone (the
    baseline too, so nothing is added). Otherwise an arm shares the
    block unless one of its techniques says why it cannot (``Technique.own_process``), or a
    technique allowed once per process (``Technique.one_per_process``: torch.compile) is
    already held by an earlier arm of the block.
    """
    runnable = [arm for arm in arms if not arm.unavailable]
    if ctx.world_size > 1:
        every_arm_alone = DDP_OWN_PROCESS
    elif isolate:
        every_arm_alone = ISOLATED
    elif ctx.loader_workers:
        every_arm_alone = loader_workers_apart(ctx.loader_workers)
    else:
        every_arm_alone = None
    if every_arm_alone:
        for arm in runnable:
            arm.own_process = every_arm_alone
        return arms
    holder: dict[str, str] = {}  # a once-per-process technique -> the arm that holds it in the block
    for arm in runnable:
        arm.own_process = _own_process_reason(arm, ctx, holder)
        if arm.own_process is None:
            for technique, _ in arm.techniques:
                if technique.one_per_process:
                    holder.setdefault(technique.name, arm.name)
    for kind in dict.fromkeys(arm.kind for arm in runnable if arm.own_process):
        add_own_baseline(arms, kind)
    return arms


def _own_process_reason(arm: Arm, ctx: Context, holder: dict[str, str]) -> str | None:
    # Which technique the reason is about, when the arm has several (its name says it otherwise).
    def which(technique: Technique) -> str:
        return f"{technique.name}: " if len(arm.techniques) > 1 else ""

    for technique, config in arm.techniques:
        reason = technique.own_process(ctx, config)
        if reason:
            return which(technique) + reason
    for technique, _ in arm.techniques:
        if technique.one_per_process and technique.name in holder:
            return f"{which(technique)}{technique.one_per_process}; {holder[technique.name]!r} uses it in the block"
    return None


def add_own_baseline(arms: list[Arm], kind: str, from_block: int = 0) -> Arm:
    """The baseline that arms of ``kind`` running in their own processes are compared with (from
    block ``from_block`` on, when the first such arm was moved there during the run)."""
    name = own_baseline_name(kind)
    for arm in arms:
        if arm.name == name:
            return arm
    baseline = Arm(
        name,
        "baseline",
        kind=kind,
        own_process="the baseline for the arms that run in their own processes",
        from_block=from_block,
    )
    shared = [i for i, arm in enumerate(arms) if arm.kind == kind and arm.role in ("baseline", "control")]
    arms.insert(shared[-1] + 1 if shared else 0, baseline)
    return baseline


@dataclass
class Job:
    """One process to run: a block's shared process (several arms), or one arm's own process."""

    block: int
    arms: list[Arm]
    shared: bool

    @property
    def key(self) -> str:
        return "block" if self.shared else slug(self.arms[0].name)

    @property
    def file(self) -> str:
        return f"units/b{self.block}-{self.key}.json"


def jobs_for_block(arms: list[Arm], block: int) -> list[Job]:
    """Block ``block``'s processes: the shared one first, then each own-process arm, rotated by ``block``.

    Rotating moves every process through every position across blocks, so a slow start or a
    drift of the machine does not always land on the same arms.
    """
    runnable = [arm for arm in arms if not arm.unavailable]
    shared = [arm for arm in runnable if not arm.own_process]
    jobs = ([Job(block, shared, True)] if shared else []) + [
        Job(block, [arm], False) for arm in runnable if arm.own_process
    ]
    shift = block % len(jobs) if jobs else 0
    return jobs[shift:] + jobs[:shift]
