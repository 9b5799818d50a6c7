"""The fork-join probe of the CPU threads, and the warning when a run saw two machine states."""

import torch
from helpers import plan_event

from workbench.core_sync import (
    MIN_REPEATS,
    PROBE_REPEATS,
    fork_join_us,
    oversubscription,
    repeats_for,
    split_states,
)
from workbench.progress import describe_plan
from workbench.results import STATE_SPEEDUP_GAP, core_sync_states, oversubscribed_blocks

FAST_US, SLOW_US = 9.6, 11.4  # the two states seen on the CI VM (BENCHMARKS.md)


def test_the_probe_times_threads_working_together_and_says_nothing_with_one():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert fork_join_us(repeats=5) is None
        torch.set_num_threads(2)
        probe = fork_join_us(repeats=5)
        assert probe is not None and probe > 0
    finally:
        torch.set_num_threads(threads)


def test_the_probe_takes_about_a_hundredth_of_the_round_it_follows():
    assert repeats_for(round_s=0.25, probe_us=10.0) == PROBE_REPEATS  # resnet-mini's rounds: the most
    assert repeats_for(round_s=0.03, probe_us=10.0) == 30  # 0.3 ms after a 30 ms round
    assert repeats_for(round_s=0.005, probe_us=10.0) == MIN_REPEATS  # a short round: the fewest
    assert repeats_for(round_s=1.0, probe_us=0.0) == PROBE_REPEATS


def test_two_states_are_split_at_the_middle_and_one_state_is_not_split():
    two = [FAST_US, 9.5, 9.7, 9.6, 9.8, SLOW_US, 11.5, 11.3, 11.4, 11.6]
    middle = split_states(two)
    assert middle is not None and 9.8 < middle < 11.3
    steady = [9.6, 9.5, 9.7, 9.6, 9.8, 9.5, 9.6, 9.7, 9.6, 9.9]
    assert split_states(steady) is None
    assert split_states([*steady, 28.0]) is None  # one probe hit by an interruption is not a state
    assert split_states([FAST_US, SLOW_US]) is None  # too few probes to tell
    # Among ten or fewer, the 90th percentile is the largest probe: one blip made a "state".
    for count in (5, 9, 10):
        assert split_states([10.0] * (count - 1) + [30.0]) is None, count
    assert split_states([10.0] * 3 + [30.0] * 2) == 20.0  # two probes in the slow state: a state


def _run(slow_rounds: set[int], gains: dict[str, tuple[float, float]], rounds: int = 12, block: int = 0):
    """One shared block: the baseline's steps take 46 ms when the cores are fast and 52 ms when
    slow; each other arm gains gains[arm][0] in the fast state and gains[arm][1] in the slow."""
    probes = [SLOW_US if r in slow_rounds else FAST_US for r in range(rounds)]
    base_ms = [52.0 if r in slow_rounds else 46.0 for r in range(rounds)]
    arms = ["baseline", *gains]

    def windows(arm: str) -> list[dict]:
        found = []
        for r, ms in enumerate(base_ms):
            gain = 1.0 if arm == "baseline" else gains[arm][r in slow_rounds]
            found.append({"round": r, "steps": 1, "step_s": [ms / gain / 1e3]})
        return found

    blocks = [{"block": block, "arms": arms, "core_sync_us": probes}]
    units = [
        {"arm": arm, "block": block, "process": "block", "status": "ok", "result": {"windows": windows(arm)}}
        for arm in arms
    ]
    return blocks, units


def test_a_run_in_two_states_warns_and_names_the_arms_whose_gain_moved():
    blocks, units = _run(set(range(6, 12)), {"baseline (control)": (1.0, 1.0), "channels_last": (1.24, 1.33)})
    (warning,) = core_sync_states(blocks, units)
    assert "11.4 us in 6 rounds, in block 1 (6 of 12); 9.6 us in the others" in warning
    assert "channels_last 1.24x when they were fast, 1.33x when slow" in warning
    assert "control" not in warning  # its gain did not move
    assert "where the host puts its virtual CPUs" in warning
    # Beside a warning of other processes' load, that load is named as the likelier cause: the
    # warning blamed the host with 1.33 of 2 cores taken by other programs.
    (busy,) = core_sync_states(blocks, units, others_busy=True)
    assert "Other processes were busy on this machine meanwhile" in busy and "virtual CPUs" not in busy


def test_no_warning_in_one_state_and_no_names_when_no_gain_moved():
    blocks, units = _run(set(), {"channels_last": (1.24, 1.33)})
    assert core_sync_states(blocks, units) == []
    steady_gain = (1.24, 1.24 * (1 + STATE_SPEEDUP_GAP / 2))
    blocks, units = _run(set(range(6)), {"channels_last": steady_gain})
    (warning,) = core_sync_states(blocks, units)
    assert "two speeds" in warning and "differed" not in warning
    assert core_sync_states([{"block": 0, "arms": ["baseline"]}], []) == []  # older records: no probes


def test_blocks_wholly_in_one_state_are_named_but_no_arm_is_judged_across_processes():
    fast_blocks, fast_units = _run(set(), {"amp": (1.54, 1.54)})
    slow_blocks, slow_units = _run(set(range(12)), {"amp": (1.48, 1.48)}, block=1)
    (warning,) = core_sync_states(fast_blocks + slow_blocks, fast_units + slow_units)
    assert "in 12 rounds, in block 2 (all its rounds)" in warning
    assert "differed" not in warning  # amp's 4% lies between processes: their luck, not the state
    slow_blocks[0]["arms"] = ["baseline (own process)"]  # an arm's own process: named, read as English
    (warning,) = core_sync_states(fast_blocks + slow_blocks, fast_units + slow_units)
    assert "in the process of baseline (own process) in block 2 (all its rounds)" in warning


def test_process_luck_in_the_probe_and_a_passing_interruption_are_not_states():
    # A process's probe in the fast state lies anywhere from about 8.6 to 9.5 us on the CI VM.
    one, one_units = _run(set(), {"amp": (1.5, 1.5)})
    other, other_units = _run(set(), {"amp": (1.5, 1.5)}, block=1)
    other[0]["core_sync_us"] = [9.9] * 12
    other[0]["core_sync_us"][4] = 12.1  # one round interrupted
    one[0]["core_sync_us"] = [9.0] * 12
    assert core_sync_states(one + other, one_units + other_units) == []


def test_a_gap_within_the_rounds_noise_names_no_arm():
    """Per-round ratios that scatter by +/-10% around a 4% gap: not clear enough to name."""
    blocks, units = _run(set(range(6, 12)), {"channels_last": (1.24, 1.29)})
    scatter = [1.10, 0.90, 1.08, 0.92, 1.06, 0.94]
    (channels_last,) = [u for u in units if u["arm"] == "channels_last"]
    for window, factor in zip(channels_last["result"]["windows"], scatter * 2, strict=True):
        window["step_s"] = [window["step_s"][0] * factor]
    (warning,) = core_sync_states(blocks, units)
    assert "differed" not in warning
    blocks, units = _run(set(range(6, 12)), {"channels_last": (1.24, 1.29)})  # the same gap, steady
    assert "channels_last 1.24x when they were fast, 1.29x when slow" in core_sync_states(blocks, units)[0]


def test_each_arm_is_judged_against_its_own_baseline_and_baselines_are_not_judged():
    """A loader-only arm runs beside the training arms in a shared block; its gain in each state is
    over the loader's baseline, and the loader's baseline is not a gain over the training one."""
    blocks, units = _run(
        set(range(6, 12)), {"loader: baseline": (80.0, 90.0), "loader: pipeline": (160.0, 180.0)}
    )
    arms = [
        {"name": "baseline", "role": "baseline", "kind": "train", "process": "block"},
        {"name": "loader: baseline", "role": "baseline", "kind": "loader", "process": "block"},
        {"name": "loader: pipeline", "role": "treatment", "kind": "loader", "process": "block"},
    ]
    (warning,) = core_sync_states(blocks, units, arms)
    assert "two speeds" in warning and "differed" not in warning  # 2.00x over its own baseline in both
    blocks, units = _run(
        set(range(6, 12)), {"loader: baseline": (80.0, 80.0), "loader: pipeline": (160.0, 184.0)}
    )
    (warning,) = core_sync_states(blocks, units, arms)
    assert "loader: pipeline 2.00x when they were fast, 2.30x when slow" in warning
    assert "loader: baseline" not in warning.split("differed")[1]


def test_a_block_without_probes_is_not_named_as_slow():
    """A block on one thread takes no probes: it saw neither state."""
    blocks, units = _run(set(range(6, 12)), {"amp": (1.5, 1.5)})
    silent, silent_units = _run(set(), {"amp": (1.5, 1.5)}, block=1)
    silent[0]["core_sync_us"] = []
    (warning,) = core_sync_states(blocks + silent, units + silent_units)
    assert "in block 1 (6 of 12)" in warning and "block 2" not in warning


def test_threads_beyond_the_cores_are_named_and_threads_that_fit_are_not():
    assert oversubscription(threads=2, cores=2) is None
    assert oversubscription(threads=1, cores=2, ranks=2) is None  # two ranks of one thread each
    assert oversubscription(threads=3, cores=2) == "3 intra-op threads on 2 usable cores"
    assert oversubscription(threads=2, cores=2, ranks=2) == "2 ranks x 2 intra-op threads on 2 usable cores"


def test_a_run_whose_cpu_blocks_ran_more_threads_than_cores_warns_once_naming_them():
    def block(number, threads, device_type="cpu", cores=2, ranks=1):
        return {"block": number, "arms": ["baseline", "amp"], "torch_threads": threads, "usable_cores": cores,
                "ranks_here": ranks, "device_type": device_type, "core_sync_us": [70.0] * 6 + [9.0] * 6}  # fmt: skip

    (warning,) = oversubscribed_blocks([block(0, 3), block(1, 2), block(2, 3)])
    assert warning.startswith("blocks 1, 3 ran 3 intra-op threads on 2 usable cores")
    assert "at most the cores per rank" in warning
    assert oversubscribed_blocks([block(0, 2), block(1, 1, ranks=2)]) == []
    # more ranks than cores: one thread each is the least there is, so the ranks are what to cut
    (warning,) = oversubscribed_blocks([block(0, 1, ranks=4)])
    assert "Run at most 2 ranks on this machine (world_size)" in warning and "threads at" not in warning
    assert oversubscribed_blocks([block(0, 8, device_type="cuda")]) == []  # a GPU's steps do not wait on them
    assert (
        oversubscribed_blocks([{"block": 0, "arms": ["baseline"], "torch_threads": 8}]) == []
    )  # older records


def test_more_ranks_than_cores_are_warned_of_before_the_run_at_default_threads(monkeypatch):
    """The plan line (and the dry run) warned only when threads was set: 4 ranks on 2 cores, at
    one thread each by default, went unwarned until the results."""
    import workbench as wb
    from workbench import ablation, telemetry

    for module in (ablation, telemetry):  # the cores, and the threads each rank shares them into
        monkeypatch.setattr(module, "usable_cores", lambda: 2)
    plan = wb.plan("mlp", techniques={}, world_size=4, device="cpu")
    assert plan.attrs["oversubscribed"] == "4 ranks x 1 intra-op threads on 2 usable cores"
    assert wb.plan("mlp", techniques={}, world_size=2, device="cpu").attrs["oversubscribed"] is None
    assert wb.plan("mlp", techniques={}, threads=3, device="cpu").attrs["oversubscribed"] is not None


def test_the_plan_line_warns_before_an_oversubscribed_run_and_counts_in_the_singular():
    event = plan_event()
    line = describe_plan(event)
    assert line.startswith("Plan: 1 block; 2 arms side by side in one process per block; 1 process;")
    assert "WARNING" not in line
    line = describe_plan({**event, "oversubscribed": oversubscription(3, 2)})
    assert "WARNING: 3 intra-op threads on 2 usable cores" in line
