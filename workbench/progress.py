"""What a running ablation tells a person: the plan in one line, and a progress bar over its
processes with the block, arm and phase in flight."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar

from workbench.worker import WINDOW_TARGET_S

# How the lines a run prints as it goes name its settings: the API's keywords (out='runs/x'),
# or, while the command line runs a command, its flags (--out runs/x; cli.ablate_spelling).
SPELLING: ContextVar[Callable[[str], str]] = ContextVar("SPELLING", default=lambda text: text)


def say(text: str, error: bool = False) -> None:
    """Print a line of the run's own, in the caller's spelling (SPELLING); to stderr if ``error``."""
    print(SPELLING.get()(text), file=sys.stderr if error else sys.stdout, flush=True)


def no_technique(arms: Iterable[Mapping]) -> str | None:
    """What a plan that applies no technique here runs (its arms' records, or wb.plan's rows), or
    None when some arm applies one. Said because it may be meant (an A/A check of the noise, or
    wb.advise measuring the baseline alone) or a mistake (every -t switched off, or unavailable)."""
    arms = list(arms)
    if any(arm["role"] == "treatment" and not arm["unavailable"] for arm in arms):
        return None
    if any(arm["role"] == "control" and not arm["unavailable"] for arm in arms):
        return "no technique will run: the baseline against its control only (an A/A check of the noise)"
    return "no technique will run: the baseline alone"


def describe_plan(event: dict) -> str:
    """One line saying what will run: arms, blocks, processes, what is unavailable, what is resumed."""
    arms = event["arms"]
    unavailable = sum(1 for arm in arms if arm["unavailable"])
    shared = sum(1 for arm in arms if not arm["unavailable"] and arm["process"] == "block")
    own = len(arms) - unavailable - shared
    parts = []
    if shared:
        parts.append(
            f"{shared} arms side by side in one process per block"
            if shared > 1
            else "1 arm in one process per block"
        )
    if own:
        parts.append(
            f"{own} arm{'s' * (own != 1)} in {'their' if own != 1 else 'its'} own process{'es' * (own != 1)}"
        )
    rounds = (
        f"{event['steps']} timed steps per arm in {event['rounds']} windows"
        if event["rounds"]
        else f"{event['steps']} timed steps per arm in windows of about {1e3 * WINDOW_TARGET_S:.0f} ms"
    )
    blocks, processes = event["blocks"], event["processes"]
    ranks = event.get("world_size", 1)
    if ranks > 1:  # the batch is per rank: said, or a batch of 32 reads as the whole step's
        rounds += f"; every arm a data-parallel group of {ranks} ranks, each with its own batch"
    text = f"Plan: {blocks} block{'s' * (blocks != 1)}; {' and '.join(parts)}; {processes} process{'es' * (processes != 1)}; {rounds}"
    if event.get("executor") == "slurm":
        text += "; each block a Slurm job (one node each)"
    if unavailable:
        text += f"; {unavailable} unavailable"
    if nothing_applied := no_technique(arms):
        text += f"; {nothing_applied}"
    if event.get("oversubscribed"):  # workbench.core_sync.oversubscription
        text += f"; WARNING: {event['oversubscribed']}: threads will wait for cores, and steps measure that"
    if event["remaining"] < event["processes"]:
        done = event["processes"] - event["remaining"]
        text += f"; resuming: {done} process{'es' * (done != 1)} already done"
    if event["out"]:
        return text + f". Results: {event['out']}"
    if event.get("label", "ablate") == "ablate":  # wb.advise and wb.tune keep what they need themselves
        return text + ". Results are kept in memory only (out=False)."
    return text + "."


def print_plan(event: dict) -> None:
    """The plan's line, wrapped to the terminal's width: one line of 150 columns broke mid-word."""
    from workbench.results_view import terminal_width

    print(textwrap.fill(describe_plan(event), terminal_width(), break_on_hyphens=False), flush=True)


class Progress:
    """A tqdm.auto bar over the processes to run, with the block, arm and phase in flight.
    ``label``: what runs, as the bar's first word (``ablate``, ``advise``, a tuner's round).

    Where stderr is no terminal and no notebook shows the bar (a log file, a Slurm job's output,
    a pipe), a bar's redrawn frames would pile up on one line: there, each finished process is
    one line instead."""

    def __init__(self, enabled: bool, total: int, already: int, unit: str = "process", label: str = "ablate"):
        self.bar = None
        self.lines = enabled and not _bar_can_redraw()
        self.label, self.unit, self.total, self.done = label, unit, total, already
        if enabled and not self.lines:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=already, desc=label, unit=unit, dynamic_ncols=True)

    def show(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)  # tqdm redraws at most 10 times a second

    def note(self, text: str) -> None:
        """A line that stays (a warning while the run waits), above the bar when there is one;
        shown with the bar switched off too, in the caller's spelling (SPELLING)."""
        if self.bar is not None:
            self.bar.write(SPELLING.get()(text), file=sys.stderr)
        else:
            say(text, error=True)

    def at_least(self, total: int) -> None:
        """Raise the total (an arm moved to a process of its own adds processes)."""
        self.total = max(self.total, total)
        if self.bar is not None and total > self.bar.total:
            self.bar.total = total
            self.bar.refresh()

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.lines:
            units = self.unit + ("es" if self.unit.endswith("s") else "s") * (self.total != 1)
            print(f"{self.label}: {self.done}/{self.total} {units} done", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            if self.done >= self.total:  # not the last phase seen, as if it were still running
                self.bar.set_postfix_str("done", refresh=False)
            self.bar.close()


def _bar_can_redraw() -> bool:
    """Whether a progress bar redraws in place: stderr is a terminal, or a notebook shows it as a widget."""
    if getattr(sys.stderr, "isatty", lambda: False)():
        return True
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})  # tqdm.auto's own test
