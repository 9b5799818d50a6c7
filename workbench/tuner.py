"""The tuner: under a time budget, the fastest combination of techniques whose loss still matches.

``tune(model, data, budget_s=600, ...)`` searches combinations of techniques and their main
settings (each technique's ``tune_space``) the way a careful experimenter spends a fixed amount
of machine time, by **successive halving** (Jamieson and Talwalkar, "Non-stochastic best arm
identification and hyperparameter optimization", AISTATS 2016; the inner loop of Li et al.'s
Hyperband):

1. **Calibrate.** The advisor (``wb.advise``) profiles the baseline and ranks what could help;
   its run also says what one process and one arm cost here. With ``techniques=`` given, a
   plain one-block baseline does the costing instead. A technique slow to start
   (``Technique.costly_start``: torch.compile) runs once beside that baseline, and its
   candidates are costed with the start it measured until a round measures them; a block is
   costed as the processes its arms need (a second compiled arm runs in a process of its own).
2. **Screen.** The candidate combinations (conflicts and unavailable ones left out, with the
   reason), fewest techniques and best-ranked first, as many as a share of the budget holds
   (at most ``max_candidates``), run beside the baseline and its control in one block: a
   cheap, noisy first look.
3. **Combine.** Screening alone cannot find a combination it had no budget to screen, and a
   technique slower than the leader may still add to it. So after screening, the combinations of
   the techniques that were measurably faster than the baseline on their own (the union of the
   best two, of the best three, ...) join the next round, whether they were screened or not.
4. **Halve.** Each following round keeps the better half, and measures it with more blocks
   (fresh processes). A candidate leaves early when its final loss drifts from the baseline's
   (convergence parity: ``workbench.results_view.loss_drifted``), when it fails, or when its whole speedup interval
   lies below the leader's by more than the control's band is wide.
5. **Decide.** The last round compares the finalists over the most blocks. The winner,
   ``best`` (``Results.best``: a techniques mapping for ``wb.ablate``), is the fastest finalist
   whose round's verdict is "faster" (the whole interval above the control arm's band, as in
   an ablation) over at least ``DECIDING_BLOCKS`` blocks; a finalist faster by its point but
   not measurably faster stays beside it as the runner-up, saying why. With no such finalist
   ``best`` is ``{}`` (``_answer``).

Each round is an ordinary ablation in ``out/round-N``, N from 1 (arms side by side in one process, block
by block), so its figures are as honest as any ablation's, and a rerun with the same ``out``
resumes: finished blocks are read back, decisions are re-derived from them, and the search goes
on with what is left of the budget. ``out/results.json`` holds the last round's results with
the search record (``record["tune"]``); ``out/tune.csv`` lists every candidate, how far it got
and why it left; ``out/tune.png`` shows the candidates' speedups round by round (``out/plot.png``
is the last round's ablation figure, as any ablation's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from workbench.ablation import (
    RUN_FILES,
    Prepared,
    _default_out,
    _run_in_folder,
    prepare,
    read_record,
    refuse_a_different_run,
    settings_fingerprint,
)
from workbench.config import (
    MAX_BLOCKS,
    SMOKE_BUDGET_S,
    TUNER_DECIDES,
    NothingMeasured,
    RunConfig,
    check_bool,
    smoke_test,
    takes_run_options,
)
from workbench.data import with_collate_fn
from workbench.progress import say
from workbench.results import Results, loss_drifted
from workbench.results_folder import ResultsFolder, json_values, write_json_atomic
from workbench.results_view import against_noise, noise_band, with_roles
from workbench.techniques import Technique, all_techniques, get_technique, parse_techniques, settings_of
from workbench.template import WarmTemplate, acquire_template, release_template

# Settings the tuner decides for each round itself; the advisor's own run fixes some more.
MAX_CANDIDATES = 24
MAX_BUDGET_S = 30 * 24 * 3600  # beyond it, a typo of extra digits: refused, not planned for
SEARCH_FILES = ("tune.json", "tune.csv", "tune.png", *RUN_FILES)  # what a search writes in its folder
RESERVE = 0.8  # the final round plans for this share of what is left: costs are estimates
# The least blocks a deciding figure comes from: one block's interval holds only the noise inside
# its process, not the process's own luck (which the blocks' spread measures), so a winner seen
# in one block alone (a budget spent on screening) is reported, not called best.
DECIDING_BLOCKS = 2
# After screening, at most this many combinations of the techniques that helped on their own
# join the next round (the union of the best two, the best three...).
GROWN_AFTER_SCREENING = 3


@dataclass
class Candidate:
    """One combination in the search, and what became of it."""

    name: str
    pairs: list[tuple[Technique, Any]]
    rank: int  # its place in the pool's order (the advisor's ranking, then size)
    rounds: list[dict] = field(default_factory=list)  # per round measured: speedup, interval, loss
    dropped: str = ""  # why it left the search ('' while in it)
    dropped_in: int | None = None

    @property
    def techniques(self) -> dict[str, dict]:
        return {technique.name: settings_of(config) for technique, config in self.pairs}

    def drop(self, round_index: int, why: str) -> None:
        self.dropped, self.dropped_in = why, round_index


@dataclass
class _Calibrating:
    """One calibration run: its stop, whether it finished, and how far the baseline's timed steps
    got (from its progress events), which say how long calibrating takes when the budget cuts it."""

    deadline: Deadline
    steps: int  # the baseline's timed steps in all
    step: int = 0
    finished: bool = False
    slow: dict[str, str] = field(default_factory=dict)  # techniques slow to start (compile): why
    others: tuple[str, ...] = ()  # the rest of the search's techniques: a search without the slow ones

    def watch(self, event: dict) -> None:
        # of all its steps (a window's own progress counts that window's steps: another "of")
        if (
            event.get("type") == "progress"
            and event.get("arm") == "baseline"
            and event.get("of") == self.steps
        ):
            self.step = max(self.step, event["step"])


class Deadline(threading.Event):
    """A round's (or the calibration's) stop: set when the search's budget runs out (``why`` then
    says so, and the round's ablation does not offer to resume what the search meant to cut), or
    when the user stops the search."""

    why: str | None = None

    def expire(self) -> None:
        self.why = "the search's budget ran out"
        self.set()


@dataclass
class Costs:
    """What a round costs here, in seconds: once per round (its warm template's start, saving),
    per process (its start and exit), and per arm in a process: the arm's own time (by name; an
    arm not yet measured costs the baseline's, or its prior) plus what the block spends on each
    arm besides. A block is as many processes as its arms need (``_Search._processes_of``)."""

    run_s: float
    process_s: float
    default_arm_s: float
    per_arm_s: float = 0.0
    arm_s: dict[str, float] = field(default_factory=dict)
    # executor="slurm": each block is a job, and what a job costs (its queueing, a fresh interpreter
    # importing torch, the results' way back) is per block, not per round.
    per_job: bool = False
    # Arms not measured yet whose start costs far more than the baseline's (a technique's
    # ``costly_start``: torch.compile compiling), costed from the calibration's measurement.
    prior_s: dict[str, float] = field(default_factory=dict)

    def block_s(self, processes: list[list[str]]) -> float:
        """One block: each process's start (one job's on Slurm), and each arm's time in it."""
        arms = sum(
            self.arm_s.get(n, self.prior_s.get(n, self.default_arm_s)) + self.per_arm_s
            for names in processes
            for n in names
        )
        return (1 if self.per_job else len(processes)) * self.process_s + arms

    def round_s(self, processes: list[list[str]], blocks: int) -> float:
        return self.run_s + blocks * self.block_s(processes)

    def blocks_within(self, processes: list[list[str]], seconds: float) -> int:
        """The most blocks of these processes a round can run in ``seconds``."""
        return min(max(int((seconds - self.run_s) // self.block_s(processes)), 0), MAX_BLOCKS)

    def learn(
        self, results: Results, began: float, starts: list[float], last_unit: float, ended: float
    ) -> None:
        """Learn from a finished round. ``starts``: when each of its processes started; the round's
        own cost is before the first and after the last answer (saving, the plot)."""
        per_arm: dict[str, list[float]] = {}
        arms_by_block: dict[int, list[str]] = {}
        for unit in results.record["units"]:
            if unit["status"] == "ok":
                per_arm.setdefault(unit["arm"], []).append(_arm_seconds(unit["result"]))
                arms_by_block.setdefault(unit["block"], []).append(unit["arm"])
        self.arm_s.update({name: float(np.median(values)) for name, values in per_arm.items()})
        if self.per_job:
            self._learn_per_job(arms_by_block, ended - began)
            return
        if not starts:
            return
        self.run_s = (starts[0] - began) + (ended - last_unit)
        blocks = [b for b in results.record.get("blocks", []) if b.get("wall_s")]
        inside = []  # per block: its wall time beyond its arms' own, per arm
        for block in blocks:
            own = sum(self.arm_s.get(name, self.default_arm_s) for name in block["arms"])
            inside.append(max(block["wall_s"] - own, 0.0) / max(len(block["arms"]), 1))
        if inside:
            self.per_arm_s = float(np.median(inside))
        block_wall = float(np.median([b["wall_s"] for b in blocks])) if blocks else 0.0
        # A run's first process pays for warming the template's caches: it counts as the round's
        # cost, and the others' time beyond their block's work is the per-process cost.
        first = (starts[1] if len(starts) > 1 else last_unit) - starts[0]
        self.run_s += max(first - block_wall - self.process_s, 0.0)
        if len(starts) > 1:
            self.process_s = max((last_unit - starts[1]) / (len(starts) - 1) - block_wall, 0.0)

    def _learn_per_job(self, arms_by_block: dict[int, list[str]], wall_s: float) -> None:
        """Slurm runs the jobs, as many at once as it grants: this process sees neither their starts
        nor their queueing. So the round's whole wall time beyond its arms' own is charged to its
        blocks, at the concurrency the cluster gave: a later round of N blocks is then estimated at
        N times what a block took here, however many ran at once. ``arms_by_block``: the arms that
        finished in each of the round's blocks."""
        if not arms_by_block:
            return
        own = float(np.median([sum(self.arm_s.get(a, self.default_arm_s) for a in arms)
                               for arms in arms_by_block.values()]))  # fmt: skip
        self.run_s, self.per_arm_s = 0.0, 0.0
        self.process_s = max(wall_s / len(arms_by_block) - own, 0.0)


def _arm_seconds(result: dict) -> float:
    """One arm's time in one block: its start-up, then every step it took (warm-up included)."""
    steps = len(result.get("losses", [])) or len(result.get("step_s", []))
    return float(result.get("startup_s") or 0.0) + steps * float(np.median(result["step_s"]))


# --- the candidates ----------------------------------------------------------------------------


def check_advice_has_candidates(advice, remedy: str = "pass techniques= to search anyway") -> None:
    """ValueError when the advice recommends nothing: a search of its ranking has nothing to try.
    The panel asks before it starts a search, so the refusal comes at once, not from a thread."""
    if not advice.recommended:
        raise ValueError(
            f"tune: the advisor found nothing available here that attacks this job's {advice.bottleneck} "
            f"bottleneck; {remedy}"
        )


def pool_from_advice(recommended: Mapping[str, dict]) -> list[tuple[Technique, list[Any]]]:
    """The advisor's techniques, in its order, each with its recommended settings and the main
    alternatives of its ``tune_space``."""
    pool = []
    for name, settings in recommended.items():
        technique = get_technique(name)
        variants = [dict(settings)]
        for key, values in technique.tune_space.items():
            variants += [{**settings, key: value} for value in values if value != settings.get(key)]
        configs, seen = [], set()
        for variant in variants:
            config = technique.configure(variant)
            key = tuple(repr(getattr(config, f)) for f in technique.settings_that_matter(config))
            if key not in seen:
                seen.add(key)
                configs.append(config)
        pool.append((technique, configs))
    return pool


def pool_from_techniques(techniques: Mapping[str, Any] | list[str]) -> list[tuple[Technique, list[Any]]]:
    """The user's techniques, in their order; a list of values sweeps a setting, as for ablate."""
    grouped: dict[str, tuple[Technique, list[Any]]] = {}
    for technique, config in parse_techniques(techniques):
        grouped.setdefault(technique.name, (technique, []))[1].append(config)
    order = list(techniques) if not isinstance(techniques, Mapping) else list(techniques.keys())
    return sorted(grouped.values(), key=lambda item: order.index(item[0].name))


def candidates_from(pool: list[tuple[Technique, list[Any]]], limit: int) -> list[Candidate]:
    """Every combination of at most one setting per technique, smallest and best-ranked first."""
    options = [[None, *range(len(configs))] for _, configs in pool]
    combos = [c for c in itertools.product(*options) if any(i is not None for i in c)]
    # Fewer techniques first (each one's effect is seen before they are mixed), then the
    # advisor's order, then each technique's own settings in order.
    combos.sort(key=lambda c: (sum(i is not None for i in c), [i is None for i in c], [i or 0 for i in c]))
    registry = [technique.name for technique in all_techniques()]
    found = []
    for rank, combo in enumerate(combos[:limit]):
        pairs, parts = [], []
        for (technique, configs), index in zip(pool, combo, strict=True):
            if index is None:
                continue
            config = configs[index]
            pairs.append((technique, config))
            parts.append(technique.name + _swept(technique, configs, config))
        # The techniques in the order they are applied, as parse_techniques gives them back on resume.
        pairs.sort(key=lambda pair: registry.index(pair[0].name))
        found.append(Candidate("+".join(parts), pairs, rank))
    return found


def _swept(technique: Technique, configs: list[Any], config: Any) -> str:
    """``[dtype=float16]`` when the pool holds this technique with several settings, else ''."""
    if len(configs) < 2:
        return ""
    differ = [
        name
        for name in technique.settings_that_matter(config)
        if len({repr(getattr(c, name)) for c in configs}) > 1
    ]
    return "[" + ",".join(f"{name}={getattr(config, name)}" for name in differ) + "]"


# --- the search --------------------------------------------------------------------------------


@takes_run_options
def tune(
    model: Any = "mlp",
    data: Any = None,
    loss_fn: Callable | None = None,
    *,
    budget_s: float,
    collate_fn: Callable[[list], Any] | None = None,
    techniques: Mapping[str, Any] | list[str] | None = None,
    advice: Any = None,
    max_candidates: int = MAX_CANDIDATES,
    out: str | Path | None | bool = None,
    overwrite: bool = False,
    progress: bool = True,
    on_event: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
    **settings: Any,
) -> Results:
    """Search, within ``budget_s`` seconds, for the fastest combination whose loss still matches.

    budget_s        the wall-clock time the whole search may take, calibration included
    techniques      what to search (as for ``ablate``; a list of values sweeps a setting); None:
                    the advisor's recommendations with each one's main settings
    advice          an Advice from ``wb.advise`` for this same job, to skip the advisor's run
    collate_fn      how your Dataset's samples are batched, as for ``ablate``
    max_candidates  combinations screened at most (the best-ranked, fewest techniques first)
    out             the search's folder (rounds in ``round-N``; rerun with the same out to
                    resume); None: a new folder under ./workbench-results; False: keep nothing

    Returns the last round's Results with the search in ``record["tune"]``; ``.best`` is the
    winner's techniques mapping ({} when no candidate beat the baseline measurably),
    ``.tuning`` the candidates table. See the module docstring for the method. The run
    settings are ``ablate``'s, except those the tuner decides (blocks, mode, loader_arms,
    profile_steps, trace_dir):

    {run_options}
    """
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s > 0:
        raise ValueError(f"tune: budget_s must be a positive number of seconds (e.g. 600); got {budget_s!r}")
    if budget_s > MAX_BUDGET_S:
        raise ValueError(f"tune: budget_s must be at most {MAX_BUDGET_S} (30 days); got {budget_s!r}")
    check_bool("tune", "overwrite", overwrite)  # "False" from a config file would discard a search
    if not (isinstance(max_candidates, int) and max_candidates >= 1):
        raise ValueError(f"tune: max_candidates must be a whole number of at least 1; got {max_candidates!r}")
    for name in TUNER_DECIDES:
        if name in settings:
            raise ValueError(f"tune: {name} is decided by the tuner, round by round; leave it out")
    run = RunConfig.from_options(
        "tune", settings, also=("model", "data", "loss_fn", "budget_s", "collate_fn", "techniques", "advice",
                                "max_candidates", "out", "overwrite", "progress", "on_event", "stop"),
    )  # fmt: skip
    if techniques is not None and advice is not None:
        raise ValueError("tune: pass techniques (what to search) or advice (the advisor's ranking), not both")
    data = with_collate_fn(data, collate_fn)  # as data from here on: the advisor and every round take it
    checked = prepare(
        model, data, loss_fn, {}, run
    )  # bad model, data or settings: refused before anything runs
    if smoke_test():  # WORKBENCH_SMOKE=1 (workbench.config): the rounds are cut, so is the search
        budget_s = min(budget_s, SMOKE_BUDGET_S)
    temporary = tempfile.TemporaryDirectory(prefix="workbench-tune-") if out is False else None
    search = _Search(
        checked, data, settings, float(budget_s), progress, on_event, stop, kept=temporary is None
    )
    folder_path = Path(
        temporary.name if temporary else out or _default_out(f"tune-{checked.config['model']}")
    )
    search.open(folder_path, overwrite, techniques, advice, max_candidates)
    try:
        results = search.run()
    except KeyboardInterrupt:  # the round's own line names only the round: the search is kept too
        say(f"\n{search.stopped_line()}")
        raise
    finally:
        search.close()
        if temporary is not None:
            temporary.cleanup()
    if temporary is not None:
        results.path = None
    return results


class _Search:
    """One search's state: the candidates, the rounds run, the costs learned, the clock."""

    def __init__(self, checked: Prepared, data, settings, budget_s, progress, on_event, stop, kept: bool):
        # The job as prepare() checked it (its data resolved once: checked.data), and the data as
        # the user gave it, which each round's ablation resolves in its own processes.
        self.checked, self.data = checked, data
        self.model, self.loss_fn, self.run_config = checked.model, checked.loss_fn, checked.run
        self.settings = settings  # as the user gave them: the rounds' ablations take them again
        self.budget_s, self.progress, self.stop = budget_s, progress, stop
        self.on_event = on_event or (lambda event: None)
        self.folder: ResultsFolder | None = None
        self.state: dict = {}
        self.candidates: list[Candidate] = []
        self.reserve: list[Candidate] = []  # runnable beyond max_candidates: only combining adds them
        self.excluded: list[dict] = []  # combinations that cannot run here, with the reason
        self.costs: Costs | None = None
        # The search holds the kept warm template (workbench.template) from its calibration to its
        # end, so every round forks from it: otherwise a round could import torch again before its
        # first block (about 3.5 s on a 2-core machine).
        self.template: WarmTemplate | None = None
        self.holds_template = False
        self.started = time.monotonic()
        self.spent_before = 0.0  # what earlier runs of this search spent (resuming)
        self.kept = kept  # False with out=False: the search's folder goes when it ends

    # --- the folder and its state -------------------------------------------------------------

    def open(self, path: Path, overwrite: bool, techniques, advice, max_candidates: int) -> None:
        folder = ResultsFolder(path)
        path = folder.path  # "~" expanded
        if path.exists() and not path.is_dir():
            raise ValueError(f"out={str(path)!r} is a file; out names a folder for the search")
        folder.refuse_inside_another_run()
        folder.lock()
        self.folder = folder
        try:
            fingerprint = self._fingerprint(techniques, advice, max_candidates)
            state_file = path / "tune.json"
            if overwrite:
                folder.clear()
            folder.refuse_other_results("tune.json", "a search")  # an ablation's, say (plan.json)
            # As an ablation's folder (ablation._refuse_the_folder): tune.json counts only where
            # the manifest lists it, and a search resumes beside the user's files, not over them.
            resuming = "tune.json" in folder.own_files()
            folder.refuse_foreign_files(resuming, (*SEARCH_FILES, "round-"))
            if resuming:
                state = read_record(state_file, "this search's state")
                # a search given more (or less) budget goes on from where it was: the budget is not
                # part of what the search is (a refusal of too small a budget keeps its calibration)
                refuse_a_different_run(path, state, fingerprint, "search", addable=("budget_s",))
                self._restore({**state, **fingerprint})
                if not self.state["rounds"]:  # refused before, or stopped before its first round
                    self._check_budget()
                return
            self.state = {**fingerprint, "rounds": [], "spent_s": 0.0}
            self._calibrate(techniques, advice, max_candidates)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.holds_template:
            release_template(self.template)
            self.template, self.holds_template = None, False
        if self.folder is not None:
            self.folder.unlock()

    def _hold_template(self) -> None:
        """Hold the warm template for the rest of the search, started on first use, so that each
        round's ablation finds it kept (none with start='spawn'; on Slurm each job starts its own
        on its node)."""
        if self.holds_template or self.run_config.executor == "slurm" or self.run_config.start == "spawn":
            return
        self.template, how = acquire_template()
        self.holds_template = True
        self.state["worker_start"] = how

    def _fingerprint(self, techniques, advice, max_candidates) -> dict:
        settings = {
            "model": self.checked.config["model"],
            "data": self.checked.config["data"],
            "run": self.run_config.to_json(),
            "pool": "the advisor" if techniques is None else repr(pool_from_techniques(techniques)),
            "advice": None if advice is None else advice.recommended,
            "max_candidates": max_candidates,
            **self.checked.identity,  # a model edited under the same name is another search
        }
        return settings_fingerprint(settings)

    def _save_state(self) -> None:
        self.state["spent_s"] = self.spent_s
        self.state["budget_s"] = self.budget_s  # the latest run's: a resumed search may be given more
        self.state["candidates"] = [
            {"name": c.name, "techniques": c.techniques, "rank": c.rank} for c in self.candidates
        ]
        self.state["reserve"] = [
            {"name": c.name, "techniques": c.techniques, "rank": c.rank} for c in self.reserve
        ]
        self.state["excluded"] = self.excluded
        self.state["costs"] = dataclasses.asdict(self.costs)
        write_json_atomic(self.folder.file("tune.json"), self.state)

    def _restore(self, state: dict) -> None:
        self.state = state
        self.spent_before = float(state.get("spent_s", 0.0))
        self.candidates, self.reserve = (
            [Candidate(c["name"], parse_techniques(c["techniques"]), c["rank"]) for c in state.get(key, [])]
            for key in ("candidates", "reserve")
        )
        self.excluded = state.get("excluded", [])
        self.costs = Costs(**state["costs"])
        before = state.get("budget_s")
        now = (
            ""
            if before in (None, self.budget_s)
            else f" (its budget was {before:g} s, now {self.budget_s:g} s)"
        )
        self._say(
            f"resuming the search in {self.folder.path}: {self.spent_before:.0f} s of the budget spent before{now}"
        )

    def stopped_line(self) -> str:
        """What a search stopped by Ctrl-C says: what it kept, and how to go on."""
        rounds = sum(1 for planned in self.state.get("rounds", []) if planned.get("folder"))
        kept = (
            f"its calibration and {rounds} round{'s' * (rounds != 1)} begun are"
            if rounds
            else "its calibration is"
        )
        if not self.kept:
            return f"tune: stopped after {self.spent_s:.0f} s; nothing is kept (out=False)."
        return (
            f"tune: stopped after {self.spent_s:.0f} s of the budget; {kept} saved in {self.folder.path}. "
            f"Run the same command again (out={str(self.folder.path)!r}) to go on from there."
        )

    @property
    def spent_s(self) -> float:
        return self.spent_before + time.monotonic() - self.started

    @property
    def left_s(self) -> float:
        return self.budget_s - self.spent_s

    def _say(self, text: str) -> None:
        if self.progress:
            say(f"tune: {text}")

    # --- calibration ------------------------------------------------------------------------------

    def _calibrate(self, techniques, advice, max_candidates: int) -> None:
        """The candidates, and what a process and an arm cost here, from one measured run."""
        from workbench.advisor import advise

        run_settings = {k: v for k, v in self.settings.items() if k not in ("control", "isolate")}
        began = time.monotonic()
        ran_here = advice is None  # an Advice passed in ran before: its time is not this calibration's
        if techniques is None:
            if advice is None:
                self._say("calibrating: the advisor profiles the baseline and ranks what could help")
                with self._within_the_budget() as calibrating:
                    advice = advise(
                        self.model,
                        self.data,
                        self.loss_fn,
                        progress=self.progress,
                        stop=calibrating.deadline,
                        on_event=calibrating.watch,
                        **run_settings,
                    )
                    calibrating.finished = True  # a run cut short raised NothingMeasured
            check_advice_has_candidates(advice)
            pool = pool_from_advice(advice.recommended)
            self.state["advice"] = advice.to_json()
        else:
            pool = pool_from_techniques(techniques)
            if not pool:
                raise ValueError("tune: techniques names nothing to search (every one is switched off)")
        # Which combinations can run here is known before anything is measured: a search with
        # none is refused at once, not after a calibration's 30 s.
        self._choose_candidates(pool, max_candidates)
        # A technique whose arms start far slower than the baseline (compile) is measured once
        # here, beside the baseline: costed as the baseline, its candidates would overrun the
        # rounds that hold them (a screening cut by the budget measures nothing).
        costly = {t.name: config for t, configs in pool if t.costly_start for config in configs[:1]}
        calibration = advice.results if advice is not None else None
        if calibration is None or techniques is not None or costly:
            also = f" and {', '.join(costly)} (slow to start)" if costly else " alone"
            self._say(f"calibrating: one block of the baseline{also}, to learn what a process costs here")
            self._hold_template()  # part of the search's cost, but not of a round's: timed apart
            began = time.monotonic()
            alone = replace(self.run_config, blocks=1, control=False, isolate=False)
            # Stop is heard here too: a search stopped while it calibrates ends now, not after it.
            with self._within_the_budget() as calibrating:
                calibrating.slow = {t.name: t.costly_start for t, _ in pool if t.name in costly}
                calibrating.others = tuple(dict.fromkeys(t.name for t, _ in pool if t.name not in costly))
                calibration = _run_in_folder(prepare(self.model, self.data, self.loss_fn, costly, alone), False,
                                             False, False, self.progress, calibrating.watch, calibrating.deadline,
                                             None, "tune: calibrate")  # fmt: skip
                calibrating.finished = calibration.complete
            ran_here = True
        self._learn_calibration(calibration, time.monotonic() - began, list(costly), ran_here)
        self._price_candidates()

    def _learn_calibration(
        self, calibration: Results, wall: float, costly: list[str], ran_here: bool
    ) -> None:
        """What a process, an arm and each slow-starting technique cost here, from the calibration."""
        units = {u["arm"]: u for u in calibration.record["units"]}
        unit = units["baseline"]
        if unit["status"] != "ok":
            raise NothingMeasured(f"tune: the baseline did not run ({unit['status']}): {unit['reason']}")
        arm = _arm_seconds(unit["result"])
        # What each slow-starting technique adds to an arm: its own arm's time beyond the baseline's.
        extra = {}
        for record in calibration.record["arms"]:
            names, measured = record.get("technique_names") or [], units.get(record["name"])
            if len(names) == 1 and names[0] in costly and measured and measured["status"] == "ok":
                extra[names[0]] = max(_arm_seconds(measured["result"]) - arm, 0.0)
        arms = arm + sum(extra.values())
        # One process cannot tell the round's start from the process's: all of the rest is charged
        # to the round, a conservative guess that the first round's figures replace. An Advice
        # passed in ran earlier (wall is ~0 here): its arm's cost stands in for the rest. A wall
        # shorter than the arms' estimate (a noisy one, from few steps) leaves no rest to charge:
        # charging an arm's cost there doubled every estimate, and the least budget with them.
        overhead = max(wall - arms, 0.0) if ran_here else arm
        if self.run_config.executor == "slurm":  # the calibration was a job, and each block will be one
            self.costs = Costs(run_s=0.0, process_s=overhead, default_arm_s=arm, per_job=True)
        else:
            self.costs = Costs(run_s=overhead, process_s=0.0, default_arm_s=arm)
        self.state["calibration"] = {
            "wall_s": wall,
            "arm_s": arm,
            "overhead_s": overhead,
            "startup_extra_s": extra,
            # Other processes' CPU while it ran, when enough to matter: they inflate every cost above.
            "competing_load": (
                {key: calibration.load[key] for key in ("others_cpu_cores_median", "cores")}
                if calibration.load.get("warning")
                else None
            ),
        }

    def _choose_candidates(self, pool, max_candidates: int) -> None:
        from workbench.arms import plan_combinations

        everything = candidates_from(pool, limit=10_000)
        runnable, unavailable = plan_combinations(
            self._context, {c.name: c.pairs for c in everything}, control=False
        )
        reasons = {arm.name: arm.unavailable for arm in unavailable}
        self.excluded = [{"name": c.name, "why": reasons[c.name]} for c in everything if c.name in reasons]
        kept = [c for c in everything if c.name not in reasons]
        for c in kept[max_candidates:]:
            self.excluded.append({"name": c.name, "why": f"beyond max_candidates={max_candidates}"})
        self.candidates, self.reserve = kept[:max_candidates], kept[max_candidates:]
        if not self.candidates:
            shown = "; ".join(f"{e['name']}: {e['why']}" for e in self.excluded[:5])
            raise ValueError(f"tune: no combination can run here ({shown})")

    def _price_candidates(self) -> None:
        """Each candidate's expected arm time from the calibration (slow starters cost more), then
        the budget's check and the search's first saved state."""
        extra = self.state["calibration"].get("startup_extra_s", {})
        for candidate in [*self.candidates, *self.reserve]:
            slow = sum(extra.get(technique.name, 0.0) for technique, _ in candidate.pairs)
            if slow:
                self.costs.prior_s[candidate.name] = self.costs.default_arm_s + slow
        self._save_state()  # first: a budget refused keeps the calibration, for the rerun with more
        self._check_budget()

    @functools.cached_property
    def _context(self):
        from workbench.techniques import technique_context

        return technique_context(self.run_config, self.model, self.checked.data)

    def _processes_of(self, names: list[str]) -> list[list[str]]:
        """The processes one block of a round of these candidates runs, each with its arms: the
        shared one (the baseline, its control and every arm that can share it), and one for each
        arm that cannot (torch.compile's second arm, say), with a baseline of its own."""
        from workbench.arms import assign_processes, plan_combinations

        by_name = {c.name: c.pairs for c in [*self.candidates, *self.reserve]}
        arms, _ = plan_combinations(self._context, {n: by_name[n] for n in names}, self.run_config.control)
        arms = [
            a for a in assign_processes(arms, self._context, self.run_config.isolate) if not a.unavailable
        ]
        shared = [a.name for a in arms if not a.own_process]
        return ([shared] if shared else []) + [[a.name] for a in arms if a.own_process]

    # The budget a refusal suggests, over the least search it measured: 1.2 was refused again on
    # a busy 2-core VM, where the next calibration took 33% longer.
    BUDGET_MARGIN = 1.5

    def _check_budget(self) -> None:
        """Refuse a budget that cannot hold the least search: two candidates screened, then compared."""
        pair = [c.name for c in self.candidates[:2]]
        least = (
            self.spent_s  # the calibration, and the template's start
            + self.costs.round_s(self._processes_of(pair), 1)
            + self.costs.round_s(self._processes_of(pair), 2)
        )
        if self.budget_s < least:
            measured = " and ".join(["its baseline", *self.state["calibration"].get("startup_extra_s", {})])
            screened = "two candidates" if len(pair) > 1 else "its one candidate"
            raise ValueError(
                f"tune: budget_s={self.budget_s:g} is too small to tune this job: calibrating ({measured} measured once) took "
                f"{self.state['calibration']['wall_s']:.1f} s here, and the least search ({screened} screened "
                f"beside the baseline, then compared over 2 blocks) needs about {math.ceil(least)} s in all, that "
                f"calibration included. Pass budget_s={math.ceil(least * self.BUDGET_MARGIN)} or more (a margin for a machine "
                "whose speed varies: a calibration here can take a third longer the next time), or fewer steps"
                + self._load_said()
                + (
                    f". The calibration is kept: the same call with a larger budget_s and out={str(self.folder.path)!r} "
                    "goes on from it"
                    if self.kept
                    else ""
                )
            )

    def _load_said(self) -> str:
        """What other processes took while the calibration ran, when enough to matter: it priced
        everything from a slowed machine."""
        load = self.state["calibration"].get("competing_load")
        if not load:
            return ""
        return (
            f". Other processes used {load['others_cpu_cores_median']:.1f} of this machine's {load['cores']} "
            "cores while it calibrated, which slowed it: on a quieter machine, or with fewer threads than "
            "cores (threads=1) to leave them one, the search costs less"
        )

    # --- rounds -----------------------------------------------------------------------------------

    def run(self) -> Results:
        alive = [c for c in self.candidates]
        results, index = None, 0
        stopped = ""
        while alive:
            planned = self._plan_round(index, alive)
            if planned is None:
                stopped = "the budget ran out before another round could run"
                break
            names, blocks = planned
            round_alive = [c for c in alive if c.name in names]
            for candidate in alive:
                if candidate.name not in names:
                    candidate.drop(index, "not screened: the budget held only the better-ranked candidates")
            outcome = self._run_round(index, round_alive, blocks)
            if outcome is None:
                stopped = "stopped before the round measured anything"
                break
            results, complete = outcome
            final = index > 0 and len(round_alive) <= 2  # the screening round never decides
            alive = self._judge(index, round_alive, results, final)
            grown = self._combine(alive) if index == 0 and complete else []
            alive += grown
            if not complete:
                done = len(
                    {u["block"] for u in results.record["units"] if u["status"] in ("ok", "interrupted")}
                )
                why = (
                    "the run was stopped"
                    if self.stop is not None and self.stop.is_set()
                    else "the budget ran out"
                )
                stopped = f"{why} during round {index + 1}, after {done} of {blocks} blocks"
                break
            if final and not grown:
                break
            if alive and _clearly_below_the_baseline(alive[0].rounds[-1]):  # more blocks cannot help
                stopped = (
                    f"after round {index + 1} even the fastest candidate was clearly slower than the "
                    "baseline, so the search ended there, with the rest of its budget unspent"
                )
                break
            index += 1
        return self._finish(results, stopped)

    def _plan_round(self, index: int, alive: list[Candidate]) -> tuple[list[str], int] | None:
        """The candidates and blocks of round ``index``, or None when the budget holds no round."""
        recorded = self.state["rounds"]
        if index < len(recorded):  # resuming: the round as it was planned
            return recorded[index]["candidates"], recorded[index]["blocks"]
        names = [c.name for c in alive]
        # Halving from n candidates to the two finalists takes log2(n) rounds: each gets an equal
        # share of what is left, so the fewer candidates of later rounds get more blocks each.
        rounds_left = max(1, math.ceil(math.log2(len(names)))) if len(names) > 1 else 1
        share = self.left_s / (rounds_left + (index == 0))  # the screening leaves room for combining
        if index == 0:  # screening: one block each, as many of the best-ranked as a share holds
            while len(names) > 2 and self.costs.round_s(self._processes_of(names), 1) > share:
                names.pop()
            blocks = 1
        elif len(names) <= 2:  # the final: all that is left
            blocks = self.costs.blocks_within(self._processes_of(names), RESERVE * self.left_s)
        else:
            blocks = self.costs.blocks_within(self._processes_of(names), share)
        if blocks < 1 or self.costs.round_s(self._processes_of(names), blocks) > self.left_s:
            return None
        final = index > 0 and len(names) <= 2
        recorded.append({"round": index + 1, "candidates": names, "blocks": blocks, "final": final})
        self._save_state()
        return names, blocks

    def _run_round(self, index: int, alive: list[Candidate], blocks: int) -> tuple[Results, bool] | None:
        estimate = self.costs.round_s(self._processes_of([c.name for c in alive]), blocks)
        new = sum(c.name not in self.costs.arm_s for c in alive)
        self._say(_round_plan(index, len(alive), blocks, estimate, new, self.left_s))
        self.on_event({"type": "tune_round", "round": index + 1, "candidates": [c.name for c in alive],
                       "blocks": blocks, "estimate_s": estimate, "left_s": self.left_s})  # fmt: skip
        run = replace(self.run_config, blocks=blocks, mode="one-at-a-time", loader_arms=False, profile_steps=0,
                      trace_dir=None)  # fmt: skip
        prepared = prepare(self.model, self.data, self.loss_fn, {}, run, {c.name: c.pairs for c in alive})
        self._hold_template()  # held already, unless this search resumed: not part of the round's cost
        starts: list[float] = []
        last_unit = [0.0]

        def watch(event: dict) -> None:
            if event["type"] == "start":
                starts.append(time.monotonic())
            elif event["type"] == "unit":
                last_unit[0] = time.monotonic()
            self.on_event(event)

        began = time.monotonic()
        sub = f"round-{index + 1}"  # numbered from 1, as the messages count rounds
        where = self.folder.nest(sub)  # an ablation's folder of its own, inside the search's
        self.state["rounds"][index]["folder"] = sub
        try:
            round_label = f"tune: round {index + 1}"  # the progress bar's name
            with self._deadline() as deadline:
                results = _run_in_folder(
                    prepared,
                    where,
                    False,
                    False,
                    self.progress,
                    watch,
                    deadline,
                    None,
                    round_label,
                    made_for_it=True,
                )
        finally:
            self._save_state()  # Ctrl-C included: the time this round took stays spent when it resumes
        self.costs.learn(results, began, starts, last_unit[0] or time.monotonic(), time.monotonic())
        ran = len({u["block"] for u in results.record["units"] if u["status"] == "ok"})
        self._save_state()
        if not ran:
            return None
        return results, results.complete

    def _combine(self, alive: list[Candidate]) -> list[Candidate]:
        """Combinations of the techniques that were measurably faster than the baseline on their
        own, with their loss matching, not measured yet: the union of the best two, of the best
        three, ... (a technique appears once: of amp's two settings, the faster)."""
        helpful = sorted(
            (c for c in self.candidates if c.rounds and _helped(c.rounds[-1])),
            key=lambda c: -c.rounds[-1]["speedup"],
        )
        parts, used = [], set()
        for candidate in helpful:
            if used.isdisjoint(candidate.techniques):
                parts.append(candidate)
                used |= set(candidate.techniques)
        known = {_settings_key(c.techniques): c for c in [*self.candidates, *self.reserve]}
        grown = []
        for size in range(2, len(parts) + 1):
            union = {name: settings for part in parts[:size] for name, settings in part.techniques.items()}
            candidate = known.get(_settings_key(union))  # None: it cannot run here (a conflict)
            if candidate is None or candidate.rounds or candidate in alive:
                continue
            candidate.dropped, candidate.dropped_in = "", None  # it may have waited unscreened
            if candidate in self.reserve:
                self.reserve.remove(candidate)
                self.candidates.append(candidate)
                self.excluded = [e for e in self.excluded if e["name"] != candidate.name]
            grown.append(candidate)
            if len(grown) == GROWN_AFTER_SCREENING:
                break
        if grown:
            self._say(
                "combining what helped alone: " + ", ".join(c.name for c in grown) + " join the next round"
            )
            self._save_state()
        return grown

    @contextlib.contextmanager
    def _within_the_budget(self) -> Iterator[_Calibrating]:
        """The calibration's stop, set when the budget runs out or the user stops the search, and
        a watch of its progress. The user's stop ends the search here; so does the budget's, when it
        cut the calibration short: that measured nothing to price a round by, and spent the whole
        budget (it used to run on past the budget, for as long as it took). A calibration that
        finished as the budget ran out is kept: the budget's check then says the least it needs."""
        with self._deadline() as deadline:
            calibrating = _Calibrating(deadline, self.run_config.steps)
            try:
                yield calibrating
            except NothingMeasured:  # an advise cut short says so in its own words
                if not deadline.is_set():
                    raise
        if deadline.is_set() and deadline.why is None:  # the user's stop
            raise NothingMeasured("tune: stopped while calibrating; nothing was measured")
        if deadline.why is not None and not calibrating.finished:
            raise ValueError(self._calibration_cut(calibrating))

    def _calibration_cut(self, calibrating: _Calibrating) -> str:
        """Why the budget cannot hold the search, when it ran out while calibrating: about how long
        calibrating takes, from how far the baseline got. Rough both ways: the progress it goes by
        comes now and then (so it lags), and what follows the timed steps (the advisor's profile, a
        slow-starting arm) adds to it. A technique slow to start (compile) warms up beside the
        baseline before either times a step: the line names it, and the search without it."""
        step, of, slow = calibrating.step, calibrating.steps, calibrating.slow
        said = f"tune: budget_s={self.budget_s:g} ran out while calibrating, after {self.spent_s:.0f} s: "
        if slow and not step:
            names = " and ".join(slow)
            whys = "; ".join(f"{name}: {why}" for name, why in slow.items())
            without = (
                f"Leave {names} out (techniques={list(calibrating.others)!r}), or p"
                if calibrating.others
                else "P"
            )
            return said + (
                f"{names} was still warming up beside the baseline, before either timed a step ({whys}). "
                f"{without}ass a budget_s of several minutes; if it is still too small for a search, the "
                "search then says the least it needs"
            )
        if step and of and step < of:
            needs = math.ceil(self.spent_s * of / step)
            said += (
                f"the baseline had run {step} of its {of} timed steps, so calibrating alone takes about "
                f"{needs} s here, or more. Pass a budget_s well above that"
            )
        elif step:
            said += "the baseline had run its timed steps; what follows them took the rest. Pass a larger budget_s"
        else:
            said += "the baseline had not reported a timed step (starting and warming up took it all). Pass a larger budget_s"
        return said + "; if it is still too small for a search, the search then says the least it needs"

    @contextlib.contextmanager
    def _deadline(self) -> Iterator[Deadline]:
        """A Deadline that expires when the budget left runs out, and is set when the user stops."""
        deadline, ended = Deadline(), threading.Event()
        if self.left_s <= 0:
            deadline.expire()  # at once, not from the timer's thread: nothing may start
        timer = threading.Timer(max(self.left_s, 0.0), deadline.expire)
        relay = threading.Thread(target=self._relay_stop, args=(deadline, ended), daemon=True)
        timer.start()
        relay.start()
        try:
            yield deadline
        finally:
            timer.cancel()
            ended.set()  # ends the relay thread

    def _relay_stop(self, deadline: threading.Event, ended: threading.Event) -> None:
        while not ended.wait(0.2):
            if self.stop is not None and self.stop.is_set():
                deadline.set()

    def _judge(self, index: int, alive: list[Candidate], results: Results, final: bool) -> list[Candidate]:
        """Record each candidate's figures; drop failures, loss drift and the clearly slower; halve."""
        with_role = with_roles(results.table, results.record["arms"])
        judged = {
            row.arm: (against_noise(row, with_role), noise_band(row, with_role))
            for row in with_role.itertuples()
        }
        table = results.table.set_index("arm")
        standing = []
        for candidate in alive:
            if candidate.name not in table.index:
                candidate.drop(index, "not measured")
                continue
            row = table.loc[candidate.name]
            candidate.rounds.append(_figures(index, row, *judged[candidate.name]))
            # A round the deadline cut short still measured its finished blocks, side by side.
            if row.status not in ("ok", "interrupted") or not math.isfinite(row.speedup):
                candidate.drop(index, f"{row.status}: {row.reason or row.notes or 'no measurement'}")
            elif loss_drifted(row.loss_vs_baseline, row.loss_gap_of_fall):
                candidate.drop(
                    index,
                    f"loss parity: its final loss is {row.loss_vs_baseline - 1:+.0%} off the baseline's",
                )
            else:
                standing.append(candidate)
        standing.sort(key=lambda c: -c.rounds[-1]["speedup"])
        if not standing:
            return []
        leader = standing[0].rounds[-1]
        kept = [standing[0]]
        for candidate in standing[1:]:
            mine = candidate.rounds[-1]
            if _clearly_slower(mine, leader):
                candidate.drop(
                    index,
                    f"clearly slower than {standing[0].name}: x{mine['speedup']:.2f} "
                    f"[{mine['speedup_low']:.2f}, {mine['speedup_high']:.2f}] against x{leader['speedup']:.2f} "
                    f"[{leader['speedup_low']:.2f}, {leader['speedup_high']:.2f}]",
                )
            elif _clearly_below_the_baseline(mine):  # the leader may be too: run() then ends the search
                low, high = mine["noise_band"]
                candidate.drop(
                    index,
                    f"clearly slower than the baseline: x{mine['speedup']:.2f} [{mine['speedup_low']:.2f}, "
                    f"{mine['speedup_high']:.2f}] below the control's band [{low:.2f}, {high:.2f}]",
                )
            else:
                kept.append(candidate)
        if final:
            return kept
        half = max(2, math.ceil(len(standing) / 2))
        for position, candidate in enumerate(kept[half:], start=half + 1):
            candidate.drop(
                index,
                f"in the lower half of round {index + 1}: x{candidate.rounds[-1]['speedup']:.2f}, "
                f"{position} of {len(standing)}",
            )
        return kept[:half]

    # --- the answer -------------------------------------------------------------------------------

    def _finish(self, results: Results | None, stopped: str) -> Results:
        if results is None:
            raise NothingMeasured(
                f"tune: no round finished ({stopped})"
                + (f"; the calibration is saved in {self.folder.path}" if self.kept else "")
            )
        best, runner_up, undecided = _answer([c for c in self.candidates if c.rounds])
        faster = best is not None and undecided is None
        record = {
            "budget_s": self.budget_s,
            "spent_s": self.spent_s,
            "stopped": stopped,
            "rounds": self.state["rounds"],
            "calibration": self.state["calibration"],
            "advice": self.state.get("advice"),
            "best": _summary(best) if faster else None,
            "undecided": undecided,  # why the fastest is not called best (None when it is)
            "fastest": _summary(best),
            "runner_up": _summary(runner_up),
            "candidates": [_summary(c) for c in self.candidates],
            "excluded": self.excluded,
        }
        results.record["tune"] = json_values(record)
        results.path = self.folder.path
        self._save_state()
        results.save(self.folder)
        results.tuning.to_csv(self.folder.file("tune.csv"), index=False)
        results.plot_tuning(self.folder.file("tune.png"))
        self._say(results.tuning_verdict)
        self.on_event({"type": "tune_done", "best": record["best"], "out": str(self.folder.path)})
        return results


def _figures(index: int, row, verdict: str, band: tuple[float, float]) -> dict:
    """A candidate's figures in round ``index``, from its row of the round's table. The verdict is
    against the round's control band (the baseline measured again), as an ablation judges:
    "faster" only when the whole interval lies above what a change that does nothing shows."""
    return {
        "round": index + 1,
        # The blocks behind the interval: those in which the baseline measured too.
        "blocks": int(row.speedup_blocks) if row.speedup_blocks == row.speedup_blocks else 0,
        "status": row.status,
        "speedup": row.speedup,
        "speedup_low": row.speedup_low,
        "speedup_high": row.speedup_high,
        "loss_vs_baseline": row.loss_vs_baseline,
        "loss_gap_of_fall": row.loss_gap_of_fall,
        "verdict": verdict,
        "noise_band": list(band),
    }


def _round_plan(index: int, candidates: int, blocks: int, estimate_s: float, new: int, left_s: float) -> str:
    """What a round runs and about how long it takes. ``new`` candidates, not measured yet, are
    costed at the baseline's speed (or a slow starter's prior): a guess that a slower technique
    (amp emulated on a CPU, ten times the baseline's step) overruns, so the line says so; the
    budget's deadline holds either way."""
    plan = f"round {index + 1}: {candidates} candidate{'s' * (candidates != 1)} x {blocks} block{'s' * (blocks != 1)}"
    if left_s <= 0:  # resuming a search whose budget is spent: what its blocks measured still counts
        return f"{plan}: the budget is spent; reading back the blocks that finished"
    guess = f" if its {new} new candidate{'s' * (new != 1)} run as fast as the baseline" if new else ""
    return f"{plan} (about {estimate_s:.0f} s{guess}; {left_s:.0f} s left)"


def _faster(figures: dict) -> bool:
    """Its round called it faster: the whole interval above the control's band (state saved
    before the verdict was recorded: above 1)."""
    if "verdict" in figures:
        return figures["verdict"] == "faster"
    return figures["speedup_low"] > 1.0


def _helped(figures: dict) -> bool:
    """Measured faster than the baseline, beyond the control's band, with its loss matching."""
    return (
        figures["status"] in ("ok", "interrupted")
        and _faster(figures)
        and not loss_drifted(figures["loss_vs_baseline"], figures.get("loss_gap_of_fall", math.nan))
    )


def _not_decided(figures: dict) -> str | None:
    """Why these (the fastest's last) figures cannot name a winner; None when they can."""
    low, high = figures.get("noise_band", (1.0, 1.0))
    if figures.get("verdict") == "slower":  # the fastest of them: every candidate was slower
        return (
            f"measurably slower than the baseline: its interval [{figures['speedup_low']:.2f}, "
            f"{figures['speedup_high']:.2f}] lies below the control's band [{low:.2f}, {high:.2f}]"
        )
    if figures.get("blocks", 0) < DECIDING_BLOCKS:
        return (
            "measured in one block only: one process's figures cannot tell its luck "
            f"from a gain (a winner needs a round of {DECIDING_BLOCKS} blocks or more; give the search more budget)"
        )
    if not _faster(figures):
        return (
            f"not measurably faster than the baseline: its interval [{figures['speedup_low']:.2f}, "
            f"{figures['speedup_high']:.2f}] reaches into the control's band [{low:.2f}, {high:.2f}]"
        )
    return None


def _clearly_below_the_baseline(mine: dict) -> bool:
    """``_clearly_slower`` than the baseline, which stands as its control's band: measured at 1,
    its interval the band (the baseline measured again)."""
    low, high = mine.get("noise_band", (1.0, 1.0))
    return _clearly_slower(mine, {"speedup": 1.0, "speedup_low": low, "noise_band": (low, high)})


def _clearly_slower(mine: dict, leader: dict) -> bool:
    """The intervals do not overlap, and the gap is wider than the control's band: the spread a
    change that does nothing showed in the same round. (One block's intervals hold only the noise
    inside its process, narrower than the band, so that their gap alone is not enough.)"""
    low, high = leader.get("noise_band", (1.0, 1.0))
    return mine["speedup_high"] < leader["speedup_low"] and leader["speedup"] / mine["speedup"] > high / low


def _settings_key(techniques: Mapping[str, dict]) -> str:
    return json.dumps(techniques, sort_keys=True, default=str)


def _answer(measured: list[Candidate]) -> tuple[Candidate | None, Candidate | None, str | None]:
    """The search's answer from the candidates measured: the winner (or, when none is decided,
    the fastest finalist), the runner-up, and why the first is no winner (None when it is).

    The winner is the fastest finalist measurably faster than the baseline. A faster one whose
    interval still reaches the noise is no winner, and need not leave the search without one:
    it stays beside the winner as the runner-up, and says why."""
    final_round = max(c.rounds[-1]["round"] for c in measured)
    finalists = sorted(
        (c for c in measured if c.rounds[-1]["round"] == final_round and not c.dropped),
        key=lambda c: -c.rounds[-1]["speedup"],
    )
    decided = [c for c in finalists if _not_decided(c.rounds[-1]) is None]
    best = decided[0] if decided else finalists[0] if finalists else None
    # The runner-up: the finalist beside the winner, or else the candidate still in the search
    # that went furthest (its figures are from its last round, with that round's blocks). Not one
    # the search dropped: one measurably slower than another, or whose loss drifted, is no
    # second choice, and "runner-up" hid why it was dropped.
    others = sorted(
        (c for c in measured if c is not best and not c.dropped and c.rounds[-1]["speedup"] is not None),
        key=lambda c: (-len(c.rounds), -c.rounds[-1]["speedup"]),  # the furthest, then the faster
    )
    runner_up = others[0] if others else None
    for candidate in finalists[: finalists.index(best)] if decided else ():
        candidate.dropped = f"faster by its point, but {_not_decided(candidate.rounds[-1])}"
    undecided = _not_decided(best.rounds[-1]) if best is not None else None
    if best is not None:
        best.dropped = "" if undecided is None else f"the fastest, but {undecided}"
    return best, runner_up, undecided


def _summary(candidate: Candidate | None) -> dict | None:
    if candidate is None:
        return None
    last = candidate.rounds[-1] if candidate.rounds else {}
    return {
        "name": candidate.name,
        "techniques": candidate.techniques,
        "rounds": len(candidate.rounds),
        "history": candidate.rounds,
        "speedup": last.get("speedup"),
        "speedup_low": last.get("speedup_low"),
        "speedup_high": last.get("speedup_high"),
        "loss_vs_baseline": last.get("loss_vs_baseline"),
        "blocks": last.get("blocks"),
        "dropped": candidate.dropped,
        "dropped_in_round": None if candidate.dropped_in is None else candidate.dropped_in + 1,
    }
