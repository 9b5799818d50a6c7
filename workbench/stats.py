"""The statistics behind every number in the results table.

Blocks, windows, steps
    A block is one worker process that runs every arm it holds side by side: after warm-up,
    R rounds, each running every arm for one window of W steps, in a fresh random order (see
    workbench.block). Arms that cannot share a process run in processes of their own, one
    per block, against a baseline that does too. Repeats are blocks.

Typical step time (``ESTIMATOR``)
    An arm's windows in a block give it a list of step times. Their typical value is
    ``ESTIMATORS[ESTIMATOR]`` of them; the candidates are the mean, the median of the
    per-window medians, a 20% trimmed mean, the 10th percentile, and a mean in which no step
    counts for more than STALL_CAP median steps. The choice is made on
    A/A evidence (benchmarks/aa_calibration.py, BENCHMARKS.md, "Which estimator"): it is the
    trimmed mean, the mean of the middle 60% of the arm's steps. Steps here are sometimes
    stalled by something outside the job (another process, the host) for several times
    their length: one 19 ms stall moves the mean of 200 steps of 2.5 ms by over 3%, and it lands
    on one arm of a block by chance. With the interval's floor (below), the trimmed mean's
    A/A intervals contained 1.0 in 200 of 200 runs, at median half-widths of 1.1-1.6%; the
    mean's, in 197 of 200, at 2.5-3.1% (both with the rounds' plain spread; with the robust
    one now used, below, the trimmed mean's held 1.0 in 237 of 240 over six sets). Without
    the floor the trimmed mean had missed 1.0 too often (148 of 160), because three blocks
    that agree by chance understate its spread.
    On resnet-mini's techniques the two estimators' median speedups agree within about 1%.
    A robust estimator would also set aside slow steps that are the job's own (a periodic
    step that does more): an arm whose every fifth step is 4x slower would look faster than
    it runs. Stalls land on a block's arms by chance; a job's own slow steps are there all
    the time. So when what one side's slowest steps add to its time (its mean step over its
    typical step) exceeds the other side's by more than SLOW_STEPS_PCT, in both halves of
    every block, that arm's speedup counts every step (a mean in which no step counts for
    more than STALL_CAP median steps: ``capped_mean``), and its row says so (``arm_speedup``).

Speedup
    Inside each block: the arm's throughput (samples per step / typical step time) over the
    baseline's in the same block, so the block's own speed (its process luck, 10-15%
    between processes here) cancels in the ratio. Across blocks: ``speedup`` is the geometric mean of the block ratios, and its 95%
    interval is the t-interval on their logarithms, mean +/- t(0.975, B-1) * sd / sqrt(B),
    with the block as the blocking factor. With few blocks the t quantile is large (4.30 for
    3 blocks), and that width is honest. It is never narrower than the interval the blocks'
    own rounds give (their within-block standard errors, as if the processes did not differ):
    three blocks can agree more closely than their rounds allow, by chance, and an interval
    built on that agreement alone missed 1.0 in 8 of 80 A/A runs on 2026-11-27
    (BENCHMARKS.md, "Which estimator").
    With a single block there is no block-to-block information: the interval then comes
    from the block's own rounds (paired round by round in a shared block), and the row says
    that it ignores process-to-process variation. With a single round too, it comes from
    resampling step times within the two windows (2,000 bootstrap draws); with a single step
    in either window, there is no interval (the verdict is "not compared").

Spread within and between blocks
    ``within_block_pct``: the standard error of a block's log ratio from its own rounds (the
    median over blocks), in percent. It is the standard error of the estimate the point uses:
    for the trimmed mean, from the rounds' winsorized spread, each arm winsorized on its own
    (its influence function, as in Yuen's standard error; ``_log_influence``), so that a
    stalled round the point sets aside does not widen the interval's floor or a single
    block's interval either. On the six A/A sets of 2026-11-27 that kept their windows, the
    intervals held 1.0 in 237 of 240 runs (the plain spread: 240 of 240), at median
    half-widths of 0.94-1.44% (1.08-1.49%); BENCHMARKS.md, "The rounds' spread, robust".
    ``between_block_pct``: the standard deviation of the block ratios' logarithms, in percent.
    Blocks that disagree far more than their own noise says they should point at a difference between the processes (or nodes) that the ratio
    did not cancel, or at a machine whose state changes what the arm gains: on the CI VM,
    channels_last gained 1.24x or 1.33x as the machine's state changed within minutes, and a
    block samples whichever held while it ran (BENCHMARKS.md). The table notes it.

Work that outlives a window
    An arm whose work goes on after its window ends (a background thread, a prefetching
    pipeline) slows whichever window runs next. Each window is compared with its arm's own
    typical window in the block; ``follower_effects`` says how much slower the other arms'
    windows ran right after a given arm's than after a third arm's. The order of the arms is
    random in every round, so without such leftover work the two are equal. Windows are
    compared by their mean step here, not ESTIMATOR: the slowed steps are what to look for.

Noise
    An arm is flagged ``noisy`` when its speedup interval reaches more than 10% either side
    of the speedup. The control arm (the baseline run a second time, in the same block)
    shows the machine's noise floor: its interval should contain 1.0.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

NOISE_THRESHOLD = 0.10
BOOTSTRAP_SAMPLES = 2000
CONFIDENCE = 0.95
DISAGREEMENT = 3.0  # blocks disagree when their spread is this many times their own noise

# The phases a step's time is split into (workbench.telemetry's StepClock measures them; the
# results table shows each phase's ms). Here, without torch, for where results are only read.
# "replay": a captured CUDA graph of the whole compute step (cuda_graphs), which has no inner phases.
PHASES = ("data", "forward", "backward", "optimizer", "replay")


def phase_shares(result: dict) -> list[float]:
    """Each phase's share (in PHASES order) of one block's timed wall clock for an arm.

    ``phase_ms`` is a mean per marked step (on CUDA every 8th step is marked), so times the
    steps it estimates the phase's whole time in the windows. Records from before the replay
    phase existed lack it. On the CPU every step is marked and the shares add up to at most 1
    (the rest is the harness between steps); on CUDA the marked steps only estimate the whole.
    """
    window_ms = 1e3 * result["wall_s"]
    if not window_ms > 0:
        return [0.0] * len(PHASES)
    return [result["phase_ms"].get(phase, 0.0) * result["steps"] / window_ms for phase in PHASES]


def _all_steps(windows: Sequence[Sequence[float]]) -> np.ndarray:
    return np.concatenate([np.asarray(w, dtype=float) for w in windows]) if windows else np.array([])


TRIM = 0.2  # the trimmed mean's cut at each end
ROBUST_SPREAD_ROUNDS = 20  # fewer windows in a block: their plain spread (see _log_influence)


def _trimmed_mean(values: np.ndarray, cut: float = TRIM) -> float:
    ordered = np.sort(values)
    drop = int(len(ordered) * cut)
    return float(ordered[drop : len(ordered) - drop].mean()) if len(ordered) > 2 * drop else math.nan


def _capped_mean(values: np.ndarray) -> float:
    """The mean, with no step counting for more than STALL_CAP median steps."""
    return float(np.minimum(values, STALL_CAP * np.median(values)).mean())


# Each takes an arm's windows in one block (a list of step-time lists) and returns one step time.
ESTIMATORS: dict[str, Callable[[Sequence[Sequence[float]]], float]] = {
    "mean": lambda windows: float(_all_steps(windows).mean()),
    "median_of_window_medians": lambda windows: float(np.median([np.median(w) for w in windows])),
    "trimmed_mean": lambda windows: _trimmed_mean(_all_steps(windows)),
    "p10": lambda windows: float(np.percentile(_all_steps(windows), 10)),
    "capped_mean": lambda windows: _capped_mean(_all_steps(windows)),
}
ESTIMATOR = "trimmed_mean"
SLOW_STEPS_PCT = 5.0  # slow steps of a side's own add this much more than the other side's (arm_speedup)
STALL_CAP = 10.0  # ... and then no step counts for more than this many median steps


def typical_step_s(windows: Sequence[Sequence[float]], estimator: str = ESTIMATOR) -> float:
    """The typical step time of one arm in one block (see the module docstring)."""
    if not windows or not any(len(w) for w in windows):
        return math.nan
    return ESTIMATORS[estimator]([w for w in windows if len(w)])


def median_and_spread(values: Sequence[float]) -> tuple[float, float]:
    """Median and interquartile range; (nan, nan) for no values."""
    if len(values) == 0:
        return float("nan"), float("nan")
    array = np.asarray(values, dtype=float)
    q1, median, q3 = np.percentile(array, [25, 50, 75])
    return float(median), float(q3 - q1)


def t_quantile(confidence: float, degrees_of_freedom: int) -> float:
    """The two-sided Student-t critical value, e.g. 4.303 for 95% and 2 degrees of freedom.

    scipy.special's inverse of the t distribution function, the same value as scipy.stats.t.ppf:
    importing scipy.stats costs a second or two more, in every command that shows results."""
    from scipy.special import stdtrit

    return float(stdtrit(degrees_of_freedom, 0.5 + confidence / 2))


@dataclass(frozen=True)
class Side:
    """One arm in one block: its windows' step times and the samples each step processes."""

    windows: Sequence[Sequence[float]]
    samples_per_step: float

    def throughput(self, estimator: str = ESTIMATOR) -> float:
        return self.samples_per_step / typical_step_s(self.windows, estimator)

    def window_steps(self, estimator: str = ESTIMATOR) -> np.ndarray:
        """Each window's typical step time, in its order."""
        return np.array([typical_step_s([w], estimator) for w in self.windows if len(w)])


def slow_step_excess_pct(side: Side, estimator: str = ESTIMATOR, every_step: str = "mean") -> float:
    """How far the arm's ``every_step`` step (the mean, or the capped mean) exceeds its
    typical (``estimator``) step, in percent: what its slowest steps add to its wall-clock time."""
    return 100 * (typical_step_s(side.windows, every_step) / typical_step_s(side.windows, estimator) - 1)


@dataclass(frozen=True)
class BlockRatio:
    """Arm over baseline inside one block: the log of the throughput ratio, and its own noise."""

    log_ratio: float
    within_se: float  # standard error of log_ratio from the block's windows (nan: fewer than 2)
    degrees_of_freedom: int
    baseline: Side
    arm: Side
    estimator: str = ESTIMATOR  # the typical step the ratio was taken from


def block_ratio(baseline: Side, arm: Side, *, paired: bool, estimator: str = ESTIMATOR) -> BlockRatio:
    """The ratio in one block. ``paired``: window i of both ran in round i of the same process."""
    log_ratio = math.log(arm.throughput(estimator) / baseline.throughput(estimator))
    # Each window's share of the spread of log(throughput): minus its share of log(step).
    cut = _cut_of(estimator)  # the spread of the estimate the point uses
    arm_spread, arm_kept = _log_influence(arm.window_steps(estimator), cut)
    base_spread, base_kept = _log_influence(baseline.window_steps(estimator), cut)
    if paired and len(arm_spread) == len(base_spread) >= 2:
        differences = base_spread - arm_spread  # log ratio = log(baseline step) - log(arm step)
        se = float(differences.std(ddof=1) / math.sqrt(len(differences)))
        dof = min(arm_kept, base_kept) - 1
    elif len(arm_spread) >= 2 and len(base_spread) >= 2:
        se = math.sqrt(arm_spread.var(ddof=1) / len(arm_spread) + base_spread.var(ddof=1) / len(base_spread))
        dof = min(arm_kept, base_kept) - 1
    else:
        se, dof = math.nan, 0
    return BlockRatio(log_ratio, se, dof, baseline, arm, estimator)


def _cut_of(estimator: str) -> float:
    """What ``estimator`` trims from each end: the spread of its estimate sets the same aside."""
    return TRIM if estimator == "trimmed_mean" else 0.0


def _log_influence(steps: np.ndarray, cut: float) -> tuple[np.ndarray, int]:
    """Each window's part in the spread of the log of its arm's typical step, and how many
    windows the estimate keeps (which sets the degrees of freedom).

    For the ``cut``-trimmed mean: each window's winsorized deviation over (1 - 2 cut) times the
    trimmed mean (its influence function; the delta method for the log, as in Yuen's standard
    error of a trimmed mean, 1974). Each arm is winsorized on its own, as the point trims each
    arm on its own, and paired rounds keep their covariance. A stalled round that the point
    sets aside then does not widen the interval either: one 359 ms stall had widened a
    600-round A/A interval by 75% when the plain spread was used. With ``cut`` 0, or fewer
    than ROBUST_SPREAD_ROUNDS windows, the log steps' own deviations: among a few rounds
    the winsorized values tie, and their spread can come out as nothing (five rounds of a
    kernel benchmark, one side twice the other's in another order, gave an interval of
    zero width)."""
    count = len(steps)
    trimmed = int(count * cut)
    if count < ROBUST_SPREAD_ROUNDS or cut == 0:
        logs = np.log(steps)
        return logs - logs.mean(), count
    ordered = np.sort(steps)
    winsorized = np.clip(steps, ordered[trimmed], ordered[count - 1 - trimmed])
    kept_share = (count - 2 * trimmed) / count
    return (winsorized - winsorized.mean()) / (kept_share * _trimmed_mean(steps, cut)), count - 2 * trimmed


@dataclass(frozen=True)
class Speedup:
    point: float
    low: float
    high: float
    blocks: int
    within_block_pct: float  # median over blocks of the within-block standard error, in percent
    between_block_pct: float  # standard deviation of the block log ratios, in percent (nan: 1 block)

    @property
    def blocks_disagree(self) -> bool:
        """The blocks spread far more than the noise inside them says they should."""
        return (
            self.blocks >= 3
            and math.isfinite(self.within_block_pct)
            and self.between_block_pct > DISAGREEMENT * max(self.within_block_pct, 0.1)
        )


def combine_blocks(
    ratios: Sequence[BlockRatio], *, confidence: float = CONFIDENCE, seed: int = 0, floored: bool = True
) -> Speedup:
    """The speedup over all blocks, with the block as the blocking factor (see the module docstring).

    ``floored=False`` drops the floor at the blocks' own rounds' interval:
    benchmarks/aa_calibration.py compares the two."""
    if not ratios:
        return Speedup(math.nan, math.nan, math.nan, 0, math.nan, math.nan)
    logs = np.array([r.log_ratio for r in ratios])
    within = [r.within_se for r in ratios if math.isfinite(r.within_se)]
    within_pct = 100 * float(np.median(within)) if within else math.nan
    mean = float(logs.mean())
    if len(ratios) >= 2:
        sd = float(logs.std(ddof=1))
        half = t_quantile(confidence, len(ratios) - 1) * sd / math.sqrt(len(ratios))
        if within and floored:
            # Never narrower than the blocks' own rounds allow, even if the processes did not
            # differ at all: a few blocks can agree more closely than that by chance (see the
            # module docstring). That interval's spread is known from many rounds, hence its t.
            rounds_dof = sum(r.degrees_of_freedom for r in ratios if math.isfinite(r.within_se))
            rounds_se = math.sqrt(float(np.mean(np.square(within))) / len(ratios))
            half = max(half, t_quantile(confidence, max(rounds_dof, 1)) * rounds_se)
        return Speedup(
            math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(ratios), within_pct, 100 * sd
        )
    (only,) = ratios
    if only.degrees_of_freedom >= 1:
        half = t_quantile(confidence, only.degrees_of_freedom) * only.within_se
        return Speedup(math.exp(mean), math.exp(mean - half), math.exp(mean + half), 1, within_pct, math.nan)
    low, high = _within_window_interval(
        only.baseline, only.arm, math.exp(mean), confidence, seed, _cut_of(only.estimator)
    )
    return Speedup(math.exp(mean), low, high, 1, within_pct, math.nan)


def projected_half_width_pct(
    between_block_pct: float, within_block_pct: float, blocks: int, confidence: float = CONFIDENCE
) -> float:
    """About how wide ``combine_blocks`` would make an interval over ``blocks`` blocks that spread
    as much as these did, either side, in percent of the log ratio (close to a share of the
    speedup): t over the blocks, floored at their rounds' noise (many rounds: the normal quantile).
    A guess, as good as the spread it is given: from three blocks, a standard deviation can be off
    by a factor of two or more."""
    between = t_quantile(confidence, blocks - 1) * between_block_pct / math.sqrt(blocks)
    within = (
        t_quantile(confidence, 1000) * within_block_pct / math.sqrt(blocks)
        if math.isfinite(within_block_pct)
        else 0
    )
    return max(between, within)  # of the log ratio, in percent: the interval is symmetric there


def blocks_for_half_width(
    between_block_pct: float, within_block_pct: float, target_pct: float, most: int
) -> int | None:
    """The fewest blocks whose projected interval is at most ``target_pct`` wide either side; None
    when even ``most`` would not do."""
    return next(
        (
            n
            for n in range(2, most + 1)
            if projected_half_width_pct(between_block_pct, within_block_pct, n) <= target_pct
        ),
        None,
    )


@dataclass(frozen=True)
class ArmSpeedup:
    """An arm's speedup over its baseline, which typical step time it was computed from, and
    the block ratios it combines (benchmarks/aa_calibration.py combines them without the floor)."""

    speedup: Speedup
    estimator: str
    ratios: list[BlockRatio]


def arm_speedup(
    pairs: Sequence[tuple[Side, Side]], *, paired: bool, estimator: str = ESTIMATOR
) -> ArmSpeedup:
    """The speedup of (baseline, arm) pairs, one per block, by ``estimator`` of each side's
    typical step; by their capped mean instead when one side has slow steps of its own.

    A robust estimator sets stalls from outside the job aside (see the module docstring). It
    would also set aside a job's own slow steps: an arm whose every fifth step is four times
    slower would look faster than it runs. What the slowest steps add to a side's time (its
    mean step over its typical step) is a few percent for any arm on a noisy machine, and
    more in the block where a stall landed; it differs between two sides only by chance. A
    job's own slow steps make it differ the same way everywhere. So when one side's slowest
    steps add more than SLOW_STEPS_PCT more than the other side's, in both halves of every
    block, every step counts: the speedup is taken from the mean step, with no step counting
    for more than STALL_CAP median steps (``capped_mean``), so that one long stall can neither
    hide that difference nor swamp the speedup."""
    differences = [
        slow_step_excess_pct(arm_half, estimator, "capped_mean")
        - slow_step_excess_pct(base_half, estimator, "capped_mean")
        for base, arm in pairs
        for base_half, arm_half in zip(_halves(base), _halves(arm), strict=True)
    ]
    if (
        estimator not in ("mean", "capped_mean")
        and differences
        and (all(d > SLOW_STEPS_PCT for d in differences) or all(d < -SLOW_STEPS_PCT for d in differences))
    ):
        estimator = "capped_mean"
    ratios = [block_ratio(base, arm, paired=paired, estimator=estimator) for base, arm in pairs]
    return ArmSpeedup(combine_blocks(ratios), estimator, ratios)


def _halves(side: Side) -> tuple[Side, Side]:
    """The first and the second half of a side's rounds (of its steps, when it has one window).
    A half without steps has a typical step of nan, and so never counts as slow."""
    windows = [list(w) for w in side.windows if len(w)]
    if len(windows) < 2:
        steps = windows[0] if windows else []
        windows = [steps[: len(steps) // 2], steps[len(steps) // 2 :]]
        middle = 1
    else:
        middle = len(windows) // 2
    return Side(windows[:middle], side.samples_per_step), Side(windows[middle:], side.samples_per_step)


def _resampled_step_means(
    steps: np.ndarray, rng: np.random.Generator, n: int, cut: float = 0.0
) -> np.ndarray:
    """``n`` bootstrap replicates of the ``cut``-trimmed mean of ``steps``."""
    draws = np.sort(steps[rng.integers(0, len(steps), size=(n, len(steps)))], axis=1)
    trimmed = int(len(steps) * cut)
    return draws[:, trimmed : len(steps) - trimmed].mean(axis=1)


def _within_window_interval(
    baseline: Side, arm: Side, point: float, confidence: float, seed: int, cut: float = 0.0
) -> tuple[float, float]:
    """One block, one window each: resample the step times of the two windows (a bootstrap)
    around ``point``, the speedup the row reports (by whichever estimator ``arm_speedup`` chose).
    A window of one step says nothing about its spread: no interval then (nan, "not compared"),
    rather than one of zero width that would call a single step's difference certain."""
    base_steps, arm_steps = _all_steps(baseline.windows), _all_steps(arm.windows)
    if len(base_steps) < 2 or len(arm_steps) < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    # Each replicate scales the point by the resampled change in the same typical step.
    base_center, arm_center = (_trimmed_mean(steps, cut) for steps in (base_steps, arm_steps))
    ratios = (
        point
        * (_resampled_step_means(base_steps, rng, BOOTSTRAP_SAMPLES, cut) / base_center)
        / (_resampled_step_means(arm_steps, rng, BOOTSTRAP_SAMPLES, cut) / arm_center)
    )
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)


def is_noisy(speedup: float, low: float, high: float) -> bool:
    """The interval reaches more than NOISE_THRESHOLD either side of the speedup."""
    if not (np.isfinite(speedup) and speedup > 0):
        return False
    return bool(max(speedup - low, high - speedup) / speedup > NOISE_THRESHOLD)


FOLLOWER_THRESHOLD = 0.05  # windows after an arm's this much slower (and clearly so) are called out


@dataclass(frozen=True)
class FollowerEffect:
    """How much slower the windows right after an arm's ran, than those after other arms' windows."""

    slowdown: float  # mean log-deviation after this arm minus after the others (~ a fraction)
    se: float
    windows: int  # windows that ran right after this arm's

    @property
    def clear(self) -> bool:
        return self.windows >= 3 and self.slowdown > FOLLOWER_THRESHOLD and self.slowdown > 3 * self.se


def follower_effects(sequences: Sequence[Sequence[tuple[str, float]]]) -> dict[str, FollowerEffect]:
    """From each block's windows in the order they ran, ``(arm, log(window's mean step / arm's usual))``.

    For every arm X and every other arm Y: Y's windows that ran right after one of X's,
    against Y's windows that ran right after a third arm's (see the module docstring); the
    differences are averaged over Y. X's own windows are not the question, and comparing
    each Y with itself keeps a slow or erratic arm from weighing on one side only.
    """
    followed: list[tuple[str, str, float]] = []  # (previous arm, arm, deviation)
    for sequence in sequences:
        for (previous, _), (arm, deviation) in itertools.pairwise(sequence):
            if previous != arm:
                followed.append((previous, arm, deviation))
    arms = {arm for _, arm, _ in followed} | {previous for previous, _, _ in followed}
    effects = {}
    for suspect in arms:
        differences, variances, windows = [], [], 0
        for follower in arms - {suspect}:
            after = [d for p, a, d in followed if a == follower and p == suspect]
            others = [d for p, a, d in followed if a == follower and p != suspect]
            if len(after) < 2 or len(others) < 2:
                continue
            differences.append(float(np.mean(after) - np.mean(others)))
            variances.append(np.var(after, ddof=1) / len(after) + np.var(others, ddof=1) / len(others))
            windows += len(after)
        if differences:
            se = math.sqrt(sum(variances)) / len(differences)
            effects[suspect] = FollowerEffect(float(np.mean(differences)), se, windows)
    return effects
