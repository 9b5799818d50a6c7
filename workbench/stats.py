"""The statistics behind every number in the results table.

Per arm
    Each repeat gives one throughput: samples in the timed window / wall time of the
    window. The arm's ``samples_per_s`` is the median over repeats and
    ``samples_per_s_spread`` their interquartile range (with 2-3 repeats: close to the range).

Speedup
    Each round (repeat) runs the baseline and the arm back to back, so machine drift
    cancels in their ratio. ``speedup`` is the geometric mean of the per-round ratios
    (arm throughput / baseline throughput), and its 95% interval is the paired
    t-interval on their logarithms: mean +/- t(0.975, n-1) * sd / sqrt(n), exponentiated.
    With few repeats the t quantile is large (4.30 for 3 repeats), and that width is
    honest: a bootstrap over 3 rounds would exclude 1.0 whenever all three ratios fall on
    the same side, which pure noise does one time in four.
    With a single repeat there is no run-to-run information; the interval then comes from
    resampling step times within the two windows (2,000 bootstrap draws), and the row is
    flagged as ignoring run-to-run variation.

Noise
    An arm is flagged ``noisy`` when its repeats spread (IQR) by more than 10% of their
    median, or when its speedup interval reaches more than 10% either side of the speedup. The control arm (the baseline
    run a second time) shows the machine's noise floor: its interval should contain 1.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NOISE_THRESHOLD = 0.10
BOOTSTRAP_SAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Window:
    """One timed window: its wall-clock throughput and the step times inside it."""

    samples_per_s: float
    step_s: Sequence[float]


def median_and_spread(values: Sequence[float]) -> tuple[float, float]:
    """Median and interquartile range; (nan, nan) for no values."""
    if len(values) == 0:
        return float("nan"), float("nan")
    array = np.asarray(values, dtype=float)
    q1, median, q3 = np.percentile(array, [25, 50, 75])
    return float(median), float(q3 - q1)


def _resampled_throughputs(window: Window, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` bootstrap replicates of one window's throughput, resampling its step times.

    Each replicate scales the wall-clock throughput by mean(step times) / mean(resampled
    step times), so the replicates centre on the measured wall-clock figure.
    """
    steps = np.asarray(window.step_s, dtype=float)
    if len(steps) < 2 or steps.mean() <= 0:
        return np.full(n, window.samples_per_s)
    draws = steps[rng.integers(0, len(steps), size=(n, len(steps)))].mean(axis=1)
    return window.samples_per_s * steps.mean() / draws


def speedup_interval(
    baseline: Sequence[Window],
    arm: Sequence[Window],
    *,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(speedup, low, high) of ``arm`` over ``baseline``; the two lists are paired by round."""
    if len(baseline) != len(arm):
        raise ValueError("baseline and arm windows must be paired round by round")
    rounds = len(arm)
    if rounds == 0:
        return float("nan"), float("nan"), float("nan")
    if rounds == 1:
        return _within_window_interval(baseline[0], arm[0], confidence, seed)
    log_ratios = np.log([a.samples_per_s / b.samples_per_s for a, b in zip(arm, baseline, strict=True)])
    mean = float(log_ratios.mean())
    half_width = float(t_quantile(confidence, rounds - 1) * log_ratios.std(ddof=1) / np.sqrt(rounds))
    return float(np.exp(mean)), float(np.exp(mean - half_width)), float(np.exp(mean + half_width))


def t_quantile(confidence: float, degrees_of_freedom: int) -> float:
    """The two-sided Student-t critical value, e.g. 4.303 for 95% and 2 degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.5 + confidence / 2, degrees_of_freedom))


def _within_window_interval(
    baseline: Window, arm: Window, confidence: float, seed: int
) -> tuple[float, float, float]:
    rng = np.random.default_rng(seed)
    ratios = _resampled_throughputs(arm, rng, BOOTSTRAP_SAMPLES) / _resampled_throughputs(
        baseline, rng, BOOTSTRAP_SAMPLES
    )
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return arm.samples_per_s / baseline.samples_per_s, float(low), float(high)


def is_noisy(samples_per_s: Sequence[float], speedup: float, low: float, high: float) -> bool:
    median, spread = median_and_spread(samples_per_s)
    if len(samples_per_s) >= 2 and median > 0 and spread / median > NOISE_THRESHOLD:
        return True
    if not (np.isfinite(speedup) and speedup > 0):
        return False
    return bool(max(speedup - low, high - speedup) / speedup > NOISE_THRESHOLD)
