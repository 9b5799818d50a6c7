"""How fast the CPU's threads start and finish a parallel operation together: a probe of the machine's state.

Why: on the 2-core CI-class virtual machine, channels_last's speedup over the baseline moves
between two levels, about 1.24 and 1.33, for seconds to minutes at a time, inside one process
(BENCHMARKS.md, "channels_last: a speedup that moves with the machine"). Neither address
layout nor transparent huge pages decide it. What tracks it is the cost of the threads
working *together*: a tiny elementwise operation split over both threads takes about 9 us
in one state and 11.5 us in the other, while the same operation on one thread, and
single-threaded matrix products, do not change. With one thread, channels_last's ratio stays
at one level. The likeliest cause, which the guest cannot see directly, is where the host
places the virtual CPUs relative to each other (cores that share a cache, or not).

A block therefore probes this after every round (``fork_join_us``), and the results warn
when a run saw more than one state (``workbench.results.core_sync_states``): a speedup
that depends on how the arms use the threads can then differ between blocks, beyond what
pairing inside a block cancels. The probe is not used to correct anything; it says when
to look twice.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

# Elements in the probe's tensor: above ATen's grain size (32768), so an elementwise op is split
# over the threads, and small enough (512 KiB) that starting and joining them dominates its time.
PROBE_ELEMENTS = 1 << 17
PROBE_REPEATS = 200  # about 2 ms in all on the CI VM
# After a round, the probe takes at most this share of the round's time, and at least
# MIN_REPEATS operations: a round of mlp's windows lasts about 10 ms, resnet-mini's 250 ms. On
# the CI VM the median of 10 lies within 2% of the median of 200 (10th to 90th percentile over
# 100 probes: 9.01-9.21 us with 10, 9.04-9.36 us with 200), far inside the 19-28% between states.
PROBE_SHARE = 0.01
MIN_REPEATS = 10
# Probes further apart than this ratio are in different states. On the CI VM a process's
# probes lie within 1-2% of each other; processes in one state differ by up to about 10%
# (8.6-9.5 us in the fast state over 16 fresh processes); the two states lie 19-28% apart
# inside one process (9.0 against 11.5 us in benchmarks/core_state.py's run).
STATE_RATIO = 1.15

_probe_tensors: dict = {}


def fork_join_us(repeats: int = PROBE_REPEATS) -> float | None:
    """The median time, in microseconds, of one small elementwise operation split over all of
    torch's intra-op threads. None with one thread: there is nothing to join."""
    import torch  # here, so that reading results (split_states) does not import torch

    if torch.get_num_threads() < 2:
        return None
    if not _probe_tensors:
        _probe_tensors["source"] = torch.ones(PROBE_ELEMENTS)
        _probe_tensors["out"] = torch.empty(PROBE_ELEMENTS)
    source, out = _probe_tensors["source"], _probe_tensors["out"]
    torch.add(source, 1.0, out=out)  # the first call after other work wakes the threads
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        torch.add(source, 1.0, out=out)
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def repeats_for(round_s: float, probe_us: float) -> int:
    """How many operations the probe after a round of ``round_s`` seconds times, when one takes
    about ``probe_us``: PROBE_SHARE of the round, between MIN_REPEATS and PROBE_REPEATS."""
    fitting = int(PROBE_SHARE * round_s / max(probe_us * 1e-6, 1e-9))
    return max(MIN_REPEATS, min(PROBE_REPEATS, fitting))


def split_states(probes: Sequence[float], ratio: float = STATE_RATIO) -> float | None:
    """The probe time that separates two states, if the probes show two: the midpoint between
    their 10th and 90th percentiles (nearest rank) when those differ by more than ``ratio``,
    and at least two probes lie on each side of it; else None.

    Percentiles, not the extremes, and two probes a side: one probe slowed by a passing
    interruption is not a state, even among ten or fewer probes, where the 90th percentile by
    nearest rank is the largest. A state held for fewer than a tenth of the probes is not seen.
    """
    if len(probes) < 5:
        return None
    ordered = sorted(probes)
    count = len(ordered)
    low, high = ordered[math.ceil(0.1 * count) - 1], ordered[math.ceil(0.9 * count) - 1]
    if high <= ratio * low:
        return None
    middle = (low + high) / 2
    slow = sum(probe > middle for probe in ordered)
    return middle if min(slow, count - slow) >= 2 else None


def oversubscription(threads: int, cores: int, ranks: int = 1) -> str | None:
    """What is wrong when ``ranks`` processes of ``threads`` intra-op threads each share ``cores``
    cores, or None when they fit.

    Why it matters: a parallel operation ends when its slowest thread does, and a thread without
    a core of its own waits for one. On the 2-core CI VM, mlp's step took 1.35 ms on 2 threads,
    2.23 ms on 1 and 2.22 ms on 3; this probe's operation took 8.7 us on 2 threads and 77 us on
    3. An oversubscribed run measures that waiting, not the job.
    """
    if threads * ranks <= cores:
        return None
    who = f"{ranks} ranks x {threads} intra-op threads" if ranks > 1 else f"{threads} intra-op threads"
    return f"{who} on {cores} usable cores"
