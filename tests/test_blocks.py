"""Blocks: arms side by side in one process, each with its own state, and where they may not share one."""

import itertools
import math
import threading
import time
from dataclasses import dataclass

import pytest
import torch
from helpers import block_spec, judged_on_a_quiet_machine
from technique_settings import TECHNIQUE_SETTINGS
from torch import nn

import workbench as wb
from workbench.devices import TF32_ON, set_tf32_flags, tf32_flags
from workbench.process_state import differences, fingerprint
from workbench.results import oversubscribed_blocks
from workbench.techniques import Context, Technique, get_technique, register_technique, unregister_technique
from workbench.telemetry import usable_cores
from workbench.worker import choose_rewarm, choose_rounds, run_block, window_steps

QUIET = {"progress": False, "out": False}


def test_a_block_runs_every_arm_side_by_side_in_random_order():
    res = wb.ablate(
        model="mlp", techniques={"amp": True, "grad_accum": {"steps": 2}}, steps=12, warmup=2, blocks=2,
        rounds=4, **QUIET,
    )  # fmt: skip
    arms = ["baseline", "baseline (control)", "amp", "grad_accum"]
    blocks = res.record["blocks"]
    assert [b["block"] for b in blocks] == [0, 1] and len({b["pid"] for b in blocks}) == 2
    for block in blocks:
        assert (
            sorted(block["arms"]) == sorted(arms)
            and block["rounds"] == 4
            and block["window_steps"] == [3] * 4
        )
        assert all(sorted(order) == sorted(arms) for order in block["order"])  # every arm once per round
        # After every round, the probe of the threads working together (workbench.core_sync).
        probed = block["core_sync_us"]
        assert (len(probed) == 4 and min(probed) > 0) if block["torch_threads"] > 1 else probed == []
        # One untimed step at the start of each window (the others filled the caches) while a step is
        # short; on a machine loaded enough to make it long, none: the rule, not the machine's speed.
        assert block["rewarm"] == choose_rewarm(len(arms), block["warmup_step_ms"] / 1e3)
        if block["warmup_step_ms"] < 5:
            assert block["rewarm"] == 1
    assert len({tuple(order) for b in blocks for order in b["order"]}) > 1, "the order changes between rounds"
    for unit in res.record["units"]:
        result = unit["result"]
        assert unit["process"] == "block" and [w["round"] for w in result["windows"]] == [0, 1, 2, 3]
        rewarm = next(b["rewarm"] for b in blocks if b["block"] == unit["block"])
        assert sum(result["timed"]) == 12 and len(result["losses"]) == 2 + 4 * (rewarm + 3)
    table = res.table.set_index("arm")
    assert set(table.process) == {"block"} and set(table.blocks) == {2}
    assert math.isnan(table.loc["amp", "peak_rss_mb"])  # process-wide: not split between a block's arms
    assert res.blocks.rss_growth_mb.notna().all()  # the block reports it once
    if blocks[0]["torch_threads"] > 1:
        assert res.blocks.core_sync_us.notna().all() and (res.blocks.core_sync_us > 0).all()


def test_the_threads_setting_reaches_every_block_and_one_thread_is_not_probed():
    res = wb.ablate(model="mlp", techniques={"amp": True}, steps=4, warmup=1, blocks=1, threads=1, **QUIET)
    (block,) = res.record["blocks"]
    assert block["torch_threads"] == 1 and block["core_sync_us"] == []  # nothing to join on one thread
    assert res.config["threads"] == 1
    with pytest.raises(ValueError, match="threads"):
        wb.plan(model="mlp", threads=0)


def test_more_threads_than_cores_is_recorded_and_warned_of_instead_of_a_state_change():
    cores = usable_cores()
    res = wb.ablate(
        model="mlp", techniques={"amp": True}, steps=4, warmup=1, blocks=1, threads=cores + 1, **QUIET
    )
    (block,) = res.record["blocks"]
    assert (block["torch_threads"], block["usable_cores"], block["device_type"]) == (cores + 1, cores, "cpu")
    warnings = res.warnings()
    assert any(f"ran {cores + 1} intra-op threads on {cores} usable cores" in warning for warning in warnings)
    assert not any(
        "two speeds" in warning for warning in warnings
    )  # the probe timed threads waiting for cores
    (fitting,) = wb.ablate(
        model="mlp", techniques={}, steps=4, warmup=1, blocks=1, threads=cores, **QUIET
    ).record["blocks"]
    assert not oversubscribed_blocks([fitting])


def test_rounds_follow_the_step_time_and_split_the_steps_evenly():
    assert window_steps(10, 4) == [3, 3, 2, 2]
    assert choose_rounds(200, 0.001) == 40  # 5 steps of 1 ms: windows of about 5 ms
    assert choose_rounds(200, 0.004) == 200  # 4 ms steps: one step per window
    assert choose_rounds(20, 0.040) == 20  # slow steps: one step per window
    assert choose_rounds(3, 0.0001) == 1


class DropoutNet(nn.Module):
    """Dropout draws from the global generator: an arm's masks depend on its own random state."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 10)
        )

    def forward(self, x):
        return self.layers(x)


def digits():
    from sklearn.datasets import load_digits

    loaded = load_digits()
    inputs = torch.tensor(loaded.images[:256] / 16.0, dtype=torch.float32)
    return torch.utils.data.TensorDataset(inputs, torch.tensor(loaded.target[:256]))


def test_an_arm_trains_in_a_block_exactly_as_it_would_alone():
    """Same weights, batches and dropout masks: the losses are identical, step for step."""
    common = {"model": DropoutNet, "data": digits(), "steps": 12, "warmup": 2, "rounds": 4, "rewarm": 1}
    alone = run_block(block_spec(arms={"amp": {"amp": True}}, **common))["arms"]["amp"]
    beside = run_block(
        block_spec(arms={"a": {}, "amp": {"amp": True}, "b": {"grad_accum": {"steps": 2}}}, **common)
    )
    assert beside["arms"]["amp"]["losses"] == alone["losses"]
    assert beside["arms"]["a"]["losses"] != alone["losses"]  # the comparison can fail: other arms differ


def test_memory_is_measured_per_arm_inside_a_shared_process():
    answer = run_block(
        block_spec(
            "gpt-mini", arms={"plain": {}, "checkpointed": {"checkpointing": True}}, steps=2, batch_size=32
        )
    )
    plain, checkpointed = answer["arms"]["plain"], answer["arms"]["checkpointed"]
    # Checkpointing keeps only the blocks' inputs for backward: far fewer saved activations, lower peak.
    assert checkpointed["activation_mib"] < 0.5 * plain["activation_mib"]
    assert checkpointed["peak_mem_mib"] < plain["peak_mem_mib"]
    assert plain["peak_rss_mib"] is None and "process-wide" in plain["rss_method"]
    assert answer["block"]["rss_growth_mib"] > 0


def test_an_arm_over_the_memory_cap_fails_before_its_windows_and_the_others_go_on():
    """memory_cap_mb: the arm over it was refused only after running all its windows, whose figures
    were then thrown away (a search paid for them from its budget). It is now refused after its
    warm-up, on one extra step's peak, and the arm under the cap is measured as before."""
    arms = {"plain": {}, "checkpointed": {"checkpointing": True}}
    job = {"arms": arms, "steps": 4, "batch_size": 32, "rounds": 2}
    peaks = {
        name: arm["peak_mem_mib"] for name, arm in run_block(block_spec("gpt-mini", **job))["arms"].items()
    }
    between = (peaks["plain"] + peaks["checkpointed"]) / 2
    said: list[dict] = []
    answer = run_block(block_spec("gpt-mini", memory_cap_mb=between, **job), said.append)
    assert set(answer["arms"]) == {"checkpointed"}
    failure = answer["failures"]["plain"]
    assert failure["over_cap_peak_mib"] == pytest.approx(peaks["plain"], rel=0.05), (failure, peaks)
    assert f"more than memory_cap_mb={between:g} allows" in failure["reason"]
    windows = [m for m in said if m.get("phase") == "measure" and m.get("arm")]
    assert {m["arm"] for m in windows} == {"checkpointed"}, windows


def test_where_each_arm_runs_is_planned_with_reasons():
    plan = wb.plan(
        model="mlp", techniques={"dataloader": {"num_workers": [0, 2]}, "amp": True}, device="cpu"
    ).set_index("name")
    assert plan.loc["dataloader[num_workers=0]", "process"] == "block"
    assert plan.loc["dataloader[num_workers=2]", "process"] == "own"
    assert "prefetch" in plan.loc["dataloader[num_workers=2]", "own_process"]
    assert plan.loc["baseline (own process)", "process"] == "own"  # what the lone arm is compared with
    assert plan.loc["amp", "process"] == plan.loc["baseline", "process"] == "block"

    compiled = wb.plan(
        model="mlp", techniques={"compile": {"mode": ["default", "max-autotune"]}}, device="cpu"
    )
    compiled = compiled.set_index("name")
    assert compiled.loc["compile[mode=default]", "process"] == "block"
    assert compiled.loc["compile[mode=max-autotune]", "process"] == "own"
    assert "per process" in compiled.loc["compile[mode=max-autotune]", "own_process"]

    ddp = wb.plan(model="mlp", techniques={"amp": True}, world_size=2, device="cpu").set_index("name")
    assert set(ddp.process) == {"own"} and "baseline (own process)" not in ddp.index


def test_an_arm_in_its_own_process_is_compared_with_a_baseline_alone():
    res = wb.ablate(
        model="mlp", data="digits", techniques={"dataloader": {"num_workers": 1}}, steps=6, warmup=2, blocks=2,
        loader_arms=False, **QUIET,
    )  # fmt: skip
    table = res.table.set_index("arm")
    assert table.loc["dataloader", "process"] == "own" and table.loc["dataloader", "status"] == "ok"
    assert (
        "measured in its own process against a baseline in its own process"
        in table.loc["dataloader", "notes"]
    )
    assert table.loc["baseline (own process)", "speedup"] == 1.0
    # An arm alone in its process has the resident set to itself.
    assert table.loc["dataloader", "peak_rss_mb"] > 0


# --- contamination: an arm must not change what the others measure --------------------------------


def _shares_a_block(name: str) -> tuple[str, dict] | None:
    """(model, settings) with which technique ``name`` runs side by side here, or None."""
    technique, row = get_technique(name), TECHNIQUE_SETTINGS[name]
    settings = {"num_workers": 0} if name == "dataloader" else row["config"]  # workers need their own process
    config = technique.configure(settings)
    model = row["models"][0]
    from workbench.models import inspect_model

    instance, label = inspect_model(model)
    ctx = Context(device=torch.device("cpu"), model=instance, model_name=label)
    if row.get("world_size", 1) > 1 or row.get("data") or technique.unavailable_reason(ctx, config):
        return None
    if technique.own_process(ctx, config):
        return None
    return model, settings


# "Beyond the noise" (issue 22): twin arms in one process differ by up to about 2% here for the whole
# process (where their weights landed in memory), and 3 blocks cannot always average that out. Over
# eight techniques per CI run, the control's interval missed 1.0 by that much: at 1.005-1.008 with
# half-widths of 0.3% (BENCHMARKS.md, A/A), and at 0.982 [0.977, 0.987] beside the DataLoader arm.
# So the control must agree with the baseline to within that noise, not to within its own interval.
IN_PROCESS_NOISE = 0.02


def _aa_with(name: str, model: str, settings: dict, seed: int) -> wb.Results:
    # Three blocks, so that the control's interval is the honest one across processes. Inside one
    # process, where each arm's weights and buffers landed in memory (decided by the build order)
    # moves one eager arm against its twin by 1-3% for the whole process; with compile beside them
    # a single block's control missed 1.0 in 2 of 10 runs at one seed, and retries at the same seed
    # repeat the same build order. A fresh seed per attempt makes the attempts independent.
    # resnet-mini at a batch of 8, not its 32: a quarter of the step (44 s of CI for channels_last),
    # and the batch size has no part in whether an arm leaves work or state behind.
    batch = {"batch_size": 8} if model == "resnet-mini" else {}
    return wb.ablate(
        model=model, techniques={name: settings}, steps=30, warmup=3, blocks=3, seed=seed, **batch, **QUIET
    )


@pytest.mark.timing
@pytest.mark.parametrize("name", sorted(TECHNIQUE_SETTINGS))
def test_adding_an_arm_to_a_block_does_not_change_what_the_others_measure(name):
    """Three checks per technique that can share a process: it leaves process-wide state as it found
    it (else the block moves it out); the baseline and its control still agree; and the windows right
    after its windows run no slower than those after the others' (no work left running)."""
    shared = _shares_a_block(name)
    if shared is None:
        pytest.skip(f"{name} does not share a block here (unavailable, or needs a process of its own)")
    model, settings = shared

    def problem(res) -> str:
        table = res.table.set_index("arm")
        assert table.loc[name, "status"] == "ok" and table.loc[name, "process"] == "block", table.loc[
            name, "notes"
        ]
        control = table.loc["baseline (control)"]
        low, high = control.speedup_low, control.speedup_high
        if high < 1.0 - IN_PROCESS_NOISE or low > 1.0 + IN_PROCESS_NOISE:
            return (
                f"the control's interval [{low:.3f}, {high:.3f}] is more than {IN_PROCESS_NOISE:.0%} from 1"
            )
        if "slows the other arms" in table.loc[name, "notes"]:
            return table.loc[name, "notes"]
        return ""

    seeds = itertools.count()
    judged_on_a_quiet_machine(lambda: _aa_with(name, model, settings, next(seeds)), problem)


@dataclass(frozen=True)
class LingeringConfig:
    pass


class Lingering(Technique):
    """Test-only: after its steps, keeps a thread busy for 120 ms, into whatever runs next."""

    name = "lingering"
    summary = "test-only: work that outlives its window"
    order = 98
    Config = LingeringConfig

    def apply(self, setup, config):
        busy: list[threading.Thread] = []

        def spin() -> None:
            until = time.perf_counter() + 0.120
            while time.perf_counter() < until:
                sum(range(200))  # holds the GIL and a core

        def after_each_batch(inputs):
            if not busy or not busy[-1].is_alive():
                busy.append(threading.Thread(target=spin, daemon=True))
                busy[-1].start()
            return inputs

        setup.input_transforms.append(after_each_batch)
        return "leaves a busy thread behind each step"


@pytest.mark.timing
def test_work_that_outlives_its_window_is_called_out():
    """The negative control of the check above: the contamination test can fail."""
    register_technique(Lingering())

    def problem(res) -> str:
        notes = res.table.set_index("arm").loc["lingering", "notes"]
        if (
            "slows the other arms" in notes
            and "isolate=True measures every arm in a process of its own" in notes
        ):
            return ""
        return f"the lingering thread went unnoticed: {notes}"

    try:
        judged_on_a_quiet_machine(
            lambda: wb.ablate(
                model="mlp", techniques={"lingering": True}, steps=60, warmup=3, blocks=2, **QUIET
            ),
            problem,
        )
    finally:
        unregister_technique("lingering")


def test_the_fingerprint_sees_flags_threads_and_patches():
    before = fingerprint()
    threads = torch.get_num_threads()
    original_forward = nn.GELU.forward
    tf32 = tf32_flags()
    try:
        torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
        torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
        nn.GELU.forward = lambda self, x: original_forward(self, x)  # every GELU in the process
        flipped = ("ieee" if tf32[1] == TF32_ON else TF32_ON) if isinstance(TF32_ON, str) else not tf32[1]
        set_tf32_flags(tf32[0], flipped)  # convolutions' TF32 switched, matmuls' left
        changed = differences(before, fingerprint())
        assert any(c.startswith("cudnn_conv_tf32") for c in changed)
        assert any(c.startswith("cudnn_benchmark") for c in changed)
        assert any(c.startswith("torch_threads") for c in changed)
        assert any("monkey-patched (torch.nn.GELU.forward)" in c for c in changed)
    finally:
        torch.backends.cudnn.benchmark = before["cudnn_benchmark"]
        torch.set_num_threads(threads)
        nn.GELU.forward = original_forward
        set_tf32_flags(*tf32)
    assert differences(before, fingerprint()) == []


def test_a_library_that_adds_a_helper_to_nn_module_patches_nothing():
    """transformers adds nn.Module.smart_apply when it builds its first model: an addition
    changes no existing behaviour, so it must not move every arm to a process of its own."""
    before = fingerprint()
    nn.Module.workbench_test_helper = lambda self: None
    try:
        assert differences(before, fingerprint()) == []
    finally:
        del nn.Module.workbench_test_helper
