"""The measuring instruments: clocks, memory, utilization, sampler."""

import itertools
import math
import subprocess
import sys
import time

import pytest
import torch
from helpers import train

from workbench.telemetry import (
    CUDA_PHASE_EVERY,
    PHASES,
    ArmMemory,
    CompetingLoad,
    ProcessRss,
    Sampler,
    StepClock,
    competing_load,
    process_cpu_seconds,
)


@pytest.mark.timing
def test_step_clock_attributes_time_to_phases():
    # Phases 10 ms apart or more: a clock that gives a phase its neighbour's time is off by at
    # least 10 ms, while a busy machine wakes a sleeper late by a few.
    clock = StepClock(torch.device("cpu"))
    for _ in range(3):
        clock.start()
        for phase, seconds in zip(PHASES, (0.020, 0.040, 0.060, 0.010, 0.030), strict=True):
            time.sleep(seconds)
            clock.lap(phase)
        clock.stop()
    per_step = clock.phase_ms_per_step()
    for phase, expected_ms in zip(PHASES, (20, 40, 60, 10, 30), strict=True):
        assert expected_ms <= per_step[phase] < expected_ms + 8, (phase, per_step[phase])
    assert len(clock.step_s) == 3 and all(0.160 <= s < 0.190 for s in clock.step_s), clock.step_s


class _FakeCudaEvents:
    """torch.cuda.Event stand-in: each record() takes the fake stream's current time (ms)."""

    def __init__(self):
        self.now_ms = 0.0
        self.created = 0
        self.recorded = 0
        clock_of = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                clock_of.created += 1
                self.at_ms = None

            def record(self):
                clock_of.recorded += 1
                self.at_ms = clock_of.now_ms

            def elapsed_time(self, end):
                return end.at_ms - self.at_ms

        self.Event = Event


def _fake_cuda_window(clock, events, steps, phase_ms):
    """``steps`` steps whose phases take ``phase_ms`` (data, forward, backward, optimizer) on the stream."""
    for _ in range(steps):
        clock.start()
        for phase, duration in zip(("data", "forward", "backward", "optimizer"), phase_ms, strict=True):
            events.now_ms += duration
            clock.lap(phase)
        clock.stop()
    clock.resolve()


def test_cuda_step_clock_marks_phases_on_a_sample_of_steps_and_reuses_its_events(monkeypatch):
    # An event costs the CPU about a kernel launch (the clock's comment): a step that is not
    # sampled records one, a sampled step one per phase, and a second window creates none.
    events = _FakeCudaEvents()
    monkeypatch.setattr(torch.cuda, "Event", events.Event)
    clock = StepClock(torch.device("cuda"))
    every = CUDA_PHASE_EVERY
    steps = 2 * every
    _fake_cuda_window(clock, events, steps, (1.0, 2.0, 3.0, 4.0))
    # Two steps sampled: 4 events each; the others: 1 each; plus the window's first start.
    assert events.recorded == 1 + 2 * 4 + (steps - 2)
    assert clock.step_s == pytest.approx([0.010] * steps)  # every step timed, sampled or not
    assert clock.phase_steps == 2
    assert clock.phase_ms_per_step() == pytest.approx(
        {"data": 1.0, "forward": 2.0, "backward": 3.0, "optimizer": 4.0, "replay": 0.0}
    )
    created = events.created
    events.now_ms += 500.0  # other arms' windows: no step's time
    _fake_cuda_window(clock, events, steps, (1.0, 2.0, 3.0, 4.0))
    assert events.created == created  # events read are recorded again, not made anew
    assert clock.step_s[steps:] == pytest.approx([0.010] * steps)


def test_cuda_step_clock_without_sampling_marks_every_phase(monkeypatch):
    events = _FakeCudaEvents()
    monkeypatch.setattr(torch.cuda, "Event", events.Event)
    clock = StepClock(torch.device("cuda"), phase_every=1)
    _fake_cuda_window(clock, events, 3, (0.5, 1.0, 2.0, 0.5))
    assert events.recorded == 1 + 3 * 4  # the optimizer lap ends each step and begins the next
    assert clock.step_s == pytest.approx([0.004] * 3)
    assert clock.phase_ms_per_step()["backward"] == pytest.approx(2.0)


def test_cpu_peak_memory_sees_a_known_allocation():
    memory = ArmMemory(torch.device("cpu"))
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        block = torch.ones(16, 2**20)  # 64 MiB of float32, freed before the step ends
        return block.add_(1)[0, 0].item()  # in place: no hidden copy (a uint8 .sum() would add 512 MiB)

    peak, activations = memory.measure_step(step, model, optimizer)
    assert 64 <= peak < 70
    assert activations == 0  # nothing was saved for a backward


@pytest.mark.parametrize(
    ("peak", "cap", "said"), [(4.85, 4.8, "4.85"), (82.34, 82.3, "82.34"), (37.21, 30, "37.2")]
)
def test_the_memory_cap_message_shows_the_peak_above_the_cap(peak, cap, said):
    """It rounded to whole MiB: 'needs 5 MiB ... more than 4.8' beside 4.85 in the table, and
    'needs 82 MiB ... more than 82.3' would read as under the cap."""
    from types import SimpleNamespace

    from workbench.block import BlockArm, MemoryCapExceeded

    arm = SimpleNamespace(run=SimpleNamespace(memory_cap_mb=cap), name="baseline")
    with pytest.raises(
        MemoryCapExceeded, match=rf"baseline needs {said} MiB at its peak, more than .*{cap:g} allows"
    ):
        BlockArm._refuse_over_the_cap(arm, peak)


def test_the_early_cap_check_reads_the_peak_that_the_final_measurement_reads():
    """memory_cap_mb is checked on one step before the windows (peak_of_one_step) and again on the
    peak reported after them (measure_step): the two must agree, or an arm could pass the one and
    fail the other."""
    model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        return torch.ones(16, 2**20).add_(1)[0, 0].item()  # 64 MiB, freed before the step ends

    early = ArmMemory(torch.device("cpu")).peak_of_one_step(step, model, optimizer)
    final, _ = ArmMemory(torch.device("cpu")).measure_step(step, model, optimizer)
    assert 68 <= early < 74 and early == pytest.approx(final, abs=0.5)
    model(torch.ones(1, 1024)).sum().backward()  # the gradients a graph's pool holds
    graphed = ArmMemory(torch.device("cpu")).peak_of_one_step(
        step, model, optimizer, graphed=True, graph_pool_bytes=20 * 2**20
    )
    assert graphed == pytest.approx(4 + 20, abs=0.1)  # as measure_step counts it (the test below)


def test_a_steps_peak_is_its_own_not_what_an_earlier_profiled_step_kept():
    """The profiler's running count carried over: 64 MiB kept by one step read as 65 MiB in the
    next step's 1 MiB, even once freed (the arms measured later in a block read higher)."""
    from workbench.telemetry import _profiled_peak_bytes

    kept = []
    assert _profiled_peak_bytes(lambda: kept.append(torch.empty(64 * 2**20, dtype=torch.uint8))) == 64 * 2**20
    one = lambda: torch.empty(2**20, dtype=torch.uint8).zero_()  # noqa: E731
    assert _profiled_peak_bytes(one) == 2**20
    kept.clear()  # freed outside any profiled step
    assert _profiled_peak_bytes(one) == 2**20


def test_amp_o2s_float32_masters_count_in_the_memory_that_outlives_a_step():
    """They belong to the optimizer, not the model: O2 read as smaller than float32 (40 of 56 MiB)."""
    from workbench.mixed_precision import MasterWeightOptimizer
    from workbench.telemetry import _live_tensor_bytes

    model = torch.nn.Linear(1024, 1024, bias=False).to(torch.bfloat16)  # 2 MiB of weights
    optimizer = MasterWeightOptimizer(model.parameters(), lambda masters: torch.optim.SGD(masters, lr=0.1))
    assert _live_tensor_bytes(model, optimizer) == 2 * 2**20 + 4 * 2**20  # and 4 MiB of masters


def test_activation_memory_counts_what_autograd_saves_but_not_the_weights():
    weight = torch.nn.Parameter(torch.ones(1024))
    model = torch.nn.Module()
    model.weight = weight
    optimizer = torch.optim.SGD([weight], lr=0.1)

    def step():
        inputs = torch.ones(256, 1024)  # 1 MiB, saved by the multiplication (and the weight, not counted)
        (inputs * weight).exp().sum().backward()  # exp saves its 1 MiB output

    _, activations = ArmMemory(torch.device("cpu")).measure_step(step, model, optimizer)
    assert activations == pytest.approx(2.0)


def test_a_batch_sliced_from_a_preloaded_dataset_counts_as_the_slice_not_the_dataset():
    """Batches cut from one tensor in memory (X[i:i + B]) are views of all of X; what autograd
    saved is the slice, as it would be for a copied batch. Overlapping saves count once."""
    weight = torch.nn.Parameter(torch.ones(1024))
    model = torch.nn.Module()
    model.weight = weight
    optimizer = torch.optim.SGD([weight], lr=0.1)
    dataset = torch.ones(4096, 1024)  # 16 MiB, held before and after the step

    def step():
        inputs = dataset[1024:1280]  # 1 MiB of it, saved by the multiplication
        (inputs * weight).sum().backward()

    _, activations = ArmMemory(torch.device("cpu")).measure_step(step, model, optimizer)
    assert activations == pytest.approx(1.0)

    def together():  # 2 MiB and 2 MiB, overlapping by 1 MiB: 3 MiB of the dataset, not 4 nor 16
        halves = dataset[:512], dataset[256:768]
        ((halves[0] * weight).sum() + (halves[1] * weight).sum()).backward()

    _, activations = ArmMemory(torch.device("cpu")).measure_step(together, model, optimizer)
    assert activations == pytest.approx(3.0)


def test_rss_growth_sees_a_known_allocation():
    rss = ProcessRss()
    rss.mark_before_models()
    rss.begin_windows()
    block = torch.ones(100, 2**20, dtype=torch.uint8)
    grown = rss.growth_mib()
    del block
    assert grown >= 95


@pytest.mark.parametrize("technique", ["checkpointing", "grad_accum"])
def test_memory_savings_show_up_where_activations_dominate(technique):
    baseline = train("gpt-mini", {}, steps=2, warmup=1, batch_size=32)["peak_mem_mib"]
    saved = train("gpt-mini", {technique: True}, steps=2, warmup=1, batch_size=32)["peak_mem_mib"]
    assert saved < 0.7 * baseline, (technique, saved, baseline)


def test_cpu_seconds_of_a_busy_loop():
    before = process_cpu_seconds()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass
    assert process_cpu_seconds() - before > 0.1  # most of 0.3 s on one core, even on a shared machine


def test_cpu_seconds_resolve_a_window_of_a_few_milliseconds():
    """Read in clock ticks (10 ms), a 5-ms window's CPU time was 0 or 10 ms, and an arm's
    utilization, summed over such windows, came out above 100% of the cores."""
    deltas = []
    for _ in range(20):
        before = process_cpu_seconds()
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            pass
        deltas.append(process_cpu_seconds() - before)
    off_the_ticks = [d for d in deltas if abs(d * 100 - round(d * 100)) > 1e-6]
    assert off_the_ticks, deltas


def test_a_workers_cpu_seconds_resolve_a_window_of_a_few_milliseconds():
    """A DataLoader worker's time, read from /proc in ticks, put a loader arm at 104% of the cores."""
    import psutil

    from workbench.telemetry import _cpu_clock_seconds

    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"]
    )
    try:
        worker = psutil.Process(busy.pid)
        readings = []
        for _ in range(10):
            readings.append(_cpu_clock_seconds(worker))
            time.sleep(0.003)
        assert readings == sorted(readings) and readings[-1] > 0
        assert [r for r in readings if abs(r * 100 - round(r * 100)) > 1e-6], readings
    finally:
        busy.kill()
        busy.wait()


def _busy_child(go, cpu_s: float, done=None, leave=None) -> None:
    go.wait()
    end = time.process_time() + cpu_s  # its own CPU time: a busy machine only makes it take longer
    while time.process_time() < end:
        pass
    if done is not None:
        done.set()
        leave.wait()


def test_a_windows_cpu_counts_workers_that_exit_or_start_inside_it():
    """A DataLoader without persistent workers replaces them every epoch: listed once, at the
    first window, the new ones were never counted, and one that exited took its whole lifetime
    off the window (-0.06 s of CPU where a worker had used 1.9)."""
    import multiprocessing

    from workbench.telemetry import WindowCpu

    fork = multiprocessing.get_context("fork")
    go, done, leave = fork.Event(), fork.Event(), fork.Event()
    leaving = fork.Process(target=_busy_child, args=(go, 0.3))
    leaving.start()  # alive, listed, when the window starts; it exits inside it
    window = WindowCpu(workers=True)
    window.start()
    arriving = fork.Process(target=_busy_child, args=(go, 0.3, done, leave))  # starts inside the window
    arriving.start()
    go.set()
    leaving.join()
    assert done.wait(60)
    seen = window.seconds()  # the arriving child is alive, listed now; the leaving one is reaped
    leave.set()
    arriving.join()
    assert 0.55 <= seen < 2.0, seen


def test_sampler_collects_samples_in_the_background():
    sampler = Sampler(interval_s=0.05).start()
    time.sleep(0.4)
    samples = sampler.stop()
    assert len(samples) >= 4
    assert {"time", "cpu_percent", "memory_used_mib"} <= set(samples[0])
    assert all(0 <= s["cpu_percent"] <= 100 for s in samples)


def test_the_sampler_keeps_its_cadence_however_long_a_reading_takes(monkeypatch):
    """1 Hz stays 1 Hz: the wait after a reading is what is left of the interval. Run on a fake
    clock, in this thread, where each reading takes 0.3 s."""
    import types

    import workbench.telemetry as telemetry

    now = [100.0]
    wall = {"monotonic": lambda: now[0], "time": lambda: now[0], "perf_counter": lambda: now[0]}
    # the CPU clocks stay real: the cadence is the wall clock's
    fake = types.SimpleNamespace(**wall, process_time=time.process_time, clock_gettime=time.clock_gettime)
    monkeypatch.setattr(telemetry, "time", fake)
    waits = []

    class StopAfterSixWaits:
        def wait(self, timeout: float) -> bool:
            waits.append(timeout)
            now[0] += timeout
            return len(waits) > 6

    def slow_reading(sample: dict) -> None:
        now[0] += 0.3

    sampler = Sampler(interval_s=1.0, on_sample=slow_reading, gpu=False, _stop=StopAfterSixWaits())
    sampler._sample_forever()
    assert waits[0] == pytest.approx(1.0) and waits[1:] == pytest.approx([0.7] * 6)
    times = [sample["time"] for sample in sampler.samples]
    assert len(times) == 6 and all(b - a == pytest.approx(1.0) for a, b in itertools.pairwise(times))


@pytest.mark.slow  # a real ablation in fresh processes
@pytest.mark.timing  # it reads the machine's load, which other tests running beside it would change
def test_competing_load_counts_processes_outside_the_run_only(tmp_path):
    """A busy process that is not ours shows up in others_cpu_cores; a busy child of ours does not."""
    import subprocess
    import sys

    from workbench.telemetry import CompetingLoad, competing_load, usable_cores

    def others_over(seconds: float) -> float:
        load = CompetingLoad()
        time.sleep(seconds)
        return load.read()["others_cpu_cores"]

    background = others_over(2.0)  # CI may share the machine: measure what is there already
    if background > usable_cores() - 1.2:
        pytest.skip(f"the machine is too busy to see one more core ({background:.1f} cores in use by others)")
    spin = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass\n"
    (tmp_path / "spin.py").write_text(spin.format(s=3))
    # The shell exits at once, so the spinner is re-parented: outside this process's tree.
    subprocess.run(["sh", "-c", f"{sys.executable} {tmp_path / 'spin.py'} >/dev/null 2>&1 &"], check=True)
    outside = others_over(2.5)
    time.sleep(1.0)  # the outside spinner ends
    child = subprocess.Popen([sys.executable, str(tmp_path / "spin.py")])
    ours = others_over(2.5)
    child.wait()
    assert outside - background >= 0.5, (background, outside)  # about one more core
    assert ours - background < 0.5, (background, ours)  # the child's core is the run's, not competition

    summary = competing_load([{"others_cpu_cores": 0.9, "load_avg_1m": 2.0}] * 5, cores=2)
    assert "other processes used 0.90 of this machine's 2 cores" in summary["warning"]
    assert competing_load([{"others_cpu_cores": 0.05, "load_avg_1m": 1.0}] * 5, cores=2)["warning"] == ""


# A stand-in for torchrun's agent: two "ranks", one that burns CPU on cue, one that measures.
TORCHRUN_AGENT_OF_TWO_RANKS = """
import os, subprocess, sys
rank = "import sys, time\\nsys.stdin.readline()\\n{}"
burn = "end = time.process_time() + 0.6\\nwhile time.process_time() < end: pass\\nprint('burnt', flush=True)\\nsys.stdin.read()"
measure = (
    "from workbench.telemetry import CompetingLoad\\nload = CompetingLoad()\\nbefore = load._run_cpu_s()\\n"
    "print('ready', flush=True)\\nsys.stdin.readline()\\nprint(load._run_cpu_s() - before, flush=True)"
)
env = {**os.environ, "TORCHELASTIC_RUN_ID": "test"}
def start(code):
    return subprocess.Popen([sys.executable, "-c", rank.format(code)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
def tell(process):
    process.stdin.write("go\\n"); process.stdin.flush()
other, ours = start(burn), start(measure)
tell(ours)
assert ours.stdout.readline() == "ready\\n"  # its first reading taken
tell(other)
assert other.stdout.readline() == "burnt\\n"
tell(ours)
print(ours.stdout.readline().strip(), flush=True)
other.stdin.close(); other.wait(); ours.wait()
"""


def test_under_torchrun_every_local_rank_is_the_runs_own_cpu_not_another_programs():
    """Under torchrun rank 0 counted only its own process tree, so the other rank's core was
    warned about as another program's ("other processes used 1.49 of 2 cores"; about 0.7 really
    was). Here one "rank" burns 0.6 s of CPU while its sibling, started by the same agent,
    measures: the sibling's CPU is the run's."""
    seen = subprocess.run(
        [sys.executable, "-c", TORCHRUN_AGENT_OF_TWO_RANKS], capture_output=True, text=True, timeout=120
    )
    assert seen.returncode == 0, seen.stderr
    assert float(seen.stdout) >= 0.5, seen.stdout


def test_steal_time_is_named_as_other_virtual_machines():
    """On a shared host the competing load may be another guest: no process here shows it."""
    samples = [{"others_cpu_cores": 0.6, "steal_cpu_cores": 0.5, "load_avg_1m": 0.5}] * 5
    summary = competing_load(samples, cores=2)
    assert summary["steal_cpu_cores_p90"] == pytest.approx(0.5)
    assert "0.50 cores of it was steal time" in summary["warning"]
    no_steal = [{"others_cpu_cores": 0.6, "steal_cpu_cores": 0.0, "load_avg_1m": 0.5}] * 5
    assert "steal" not in competing_load(no_steal, cores=2)["warning"]
    assert "steal_cpu_cores" in CompetingLoad().read()  # measured here, even when it is 0


def test_a_graphed_step_counts_the_pool_its_graph_holds_once():
    # A replayed CUDA graph allocates nothing in the windows; what it holds is its private pool,
    # gradients included. The arithmetic is the same on any device, so it is checked here.
    model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 1024)).sum().backward()  # 4 MiB of gradients, which the pool holds
    pool = 20 * 2**20

    def step():
        return None

    eager_peak, _ = ArmMemory(torch.device("cpu")).measure_step(step, model, optimizer)
    graphed_peak, activations = ArmMemory(torch.device("cpu")).measure_step(
        step, model, optimizer, graphed=True, graph_pool_bytes=pool
    )
    assert eager_peak == pytest.approx(8, abs=0.1)  # weights and gradients
    assert graphed_peak == pytest.approx(4 + 20, abs=0.1)  # weights, and the pool with the gradients
    assert math.isnan(activations)


def test_utilization_is_a_share_of_the_usable_cores_and_at_most_all_of_them():
    """With every core busy, the kernel's lagging clocks of running threads summed to 101-104%."""
    from workbench.telemetry import cpu_utilization_pct, usable_cores

    cores = usable_cores()
    assert cpu_utilization_pct(0.5 * cores, 1.0) == pytest.approx(50.0)
    assert cpu_utilization_pct(1.04 * cores, 1.0) == 100.0
    assert cpu_utilization_pct(0.0, 0.0) == 0.0  # no window timed: nothing used, no division by zero
