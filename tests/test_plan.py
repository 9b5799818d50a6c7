"""Planning: which arms each mode runs, in what order, and which combinations are refused."""

import argparse
import dataclasses
import inspect
from dataclasses import dataclass

import pytest
from helpers import RUN_SETTINGS

import workbench as wb
from workbench.ablation import plan_arguments
from workbench.arms import add_own_baseline, jobs_for_block, plan_arms
from workbench.cli import _parser, in_cli_terms, run_settings
from workbench.config import RunConfig
from workbench.techniques import Technique, parse_techniques, register_technique, unregister_technique


def test_one_at_a_time():
    table = wb.plan(
        model="resnet-mini", techniques={"amp": True, "channels_last": True, "tf32": True}, device="cpu"
    )
    assert list(table.name) == ["baseline", "baseline (control)", "channels_last", "amp", "tf32"]
    assert list(table.role) == ["baseline", "control", "treatment", "treatment", "treatment"]
    assert list(table.blocks) == [3, 3, 3, 3, 0]
    assert list(table.process) == ["block", "block", "block", "block", ""]
    assert "CUDA" in table.set_index("name").loc["tf32", "unavailable"]
    assert table.set_index("name").loc["amp", "techniques"] == "amp(dtype=bfloat16, level=O1)"


def test_leave_one_out():
    table = wb.plan(
        model="gpt-mini",
        techniques={"amp": True, "checkpointing": True, "grad_accum": {"steps": 2}},
        mode="leave-one-out",
        control=False,
        device="cpu",
    )
    assert list(table.name) == ["baseline", "all", "all - checkpointing", "all - amp", "all - grad_accum"]
    techniques = table.set_index("name").techniques
    assert techniques["all - amp"] == "checkpointing(select=None), grad_accum(steps=2)"


def test_grid_shows_every_combination_and_its_size():
    table = wb.plan(
        model="mlp",
        techniques={"amp": True, "checkpointing": True, "grad_accum": True},
        mode="grid",
        control=False,
        device="cpu",
    )
    assert len(table) == 2**3
    assert "checkpointing+amp+grad_accum" in set(table.name)
    assert table.blocks.sum() == 8 * 3


def test_a_grid_over_swept_settings_takes_one_value_of_each_technique_per_arm():
    table = wb.plan(
        model="resnet-mini",
        techniques={"amp": {"dtype": ["bfloat16", "float16"]}, "channels_last": True},
        mode="grid",
        device="cpu",
        control=False,
    )
    assert list(table.name) == [
        "baseline",
        "channels_last",
        "amp[dtype=bfloat16]",
        "amp[dtype=float16]",
        "channels_last+amp[dtype=bfloat16]",
        "channels_last+amp[dtype=float16]",
    ]  # never both amp values in one arm
    assert table.set_index("name").loc["channels_last+amp[dtype=float16]", "techniques"] == (
        "channels_last, amp(dtype=float16, level=O1)"
    )


def test_unavailable_techniques_stay_out_of_combinations():
    table = wb.plan(
        model="mlp",
        techniques={"amp": True, "tf32": True, "channels_last": True},
        mode="grid",
        control=False,
        device="cpu",
    )
    combined = [name for name in table.name if "+" in name]
    assert combined == [] and set(table.name) == {"baseline", "amp", "tf32", "channels_last"}
    reasons = table.set_index("name").unavailable
    assert "no Conv2d" in reasons["channels_last"] and "CUDA" in reasons["tf32"]


def test_a_combination_that_cannot_run_names_its_technique_once():
    """The tuner's candidates are combinations named by their techniques: "prefetch" alone must read
    "needs a CUDA device", not "prefetch: prefetch: needs ...", while "amp+prefetch" must say which
    of its two cannot run."""
    from workbench.arms import plan_combinations
    from workbench.techniques import technique_context

    ctx = technique_context(RunConfig(device="cpu"))
    combinations = {
        "prefetch": parse_techniques(["prefetch"]),
        "amp+prefetch": parse_techniques(["amp", "prefetch"]),
    }
    _, unavailable = plan_combinations(ctx, combinations, control=False)
    reasons = {arm.name: arm.unavailable for arm in unavailable}
    assert reasons["prefetch"].startswith("needs a CUDA device")
    assert reasons["amp+prefetch"].startswith("prefetch: needs a CUDA device")


def test_each_block_runs_its_processes_in_a_rotated_order():
    """The shared process and each arm's own process swap places from block to block."""
    arms = plan_arms("one-at-a-time", parse_techniques({"amp": True, "grad_accum": True}), control=False)
    arms[2].own_process = "a test"
    add_own_baseline(arms, "train")
    names = [[job.key for job in jobs_for_block(arms, block)] for block in range(3)]
    assert names == [
        ["block", "baseline_own_process", "grad_accum"],
        ["baseline_own_process", "grad_accum", "block"],
        ["grad_accum", "block", "baseline_own_process"],
    ]
    shared = jobs_for_block(arms, 0)[0]
    assert shared.shared and [arm.name for arm in shared.arms] == ["baseline", "amp"]


@dataclass(frozen=True)
class NoOptions:
    pass


class Exclusive(Technique):
    summary = "test-only"
    Config = NoOptions

    def __init__(self, name, order, conflicts):
        self.name, self.order, self.conflicts = name, order, conflicts

    def apply(self, setup, config):
        return "nothing"


@pytest.fixture
def conflicting():
    register_technique(Exclusive("left", 300, {"right": "both replace the data loader"}))
    register_technique(Exclusive("right", 301, {}))
    yield
    unregister_technique("left")
    unregister_technique("right")


def test_incompatible_combinations_are_rejected_naming_both(conflicting):
    chosen = {"left": True, "right": True, "amp": True}
    with pytest.raises(ValueError, match="left and right cannot be combined: both replace the data loader"):
        wb.plan(model="mlp", techniques=chosen, mode="leave-one-out", device="cpu")
    grid = wb.plan(model="mlp", techniques=chosen, mode="grid", control=False, device="cpu").set_index("name")
    assert (
        grid.loc["left+right", "unavailable"]
        == "left and right cannot be combined: both replace the data loader"
    )
    assert grid.loc["amp+left+right", "blocks"] == 0
    assert grid.loc["amp+left", "blocks"] == 3
    # one at a time never combines them
    assert wb.plan(model="mlp", techniques=chosen, device="cpu").unavailable.eq("").all()


def test_none_selects_every_technique():
    table = wb.plan(model="resnet-mini", techniques=None, device="cpu", control=False)
    training = table[~table.name.str.startswith("loader: ")]
    # dataloader's workers need processes of their own, so a baseline that runs alone comes along.
    assert set(training.name) == {"baseline", "baseline (own process)"} | {
        t.name for t in wb.list_techniques().itertuples()
    }
    # dataloader is among them, so the loader-only twins come along (dali needs JPEG data here).
    assert set(table.name) - set(training.name) == {
        "loader: baseline",
        "loader: baseline (own process)",
        "loader: dataloader",
    }
    assert table.set_index("name").loc["dali", "unavailable"].startswith("needs JPEG files")


def test_every_run_setting_reaches_ablate_plan_the_cli_and_the_panel():
    """Each RunConfig field is a keyword of ablate and plan (with RunConfig's default), a CLI
    flag with its help, and a panel control: all read from the field, so none can drift."""
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    assert sorted(fields) == sorted(RUN_SETTINGS), "add the new setting to RUN_SETTINGS"
    for function in (wb.ablate, wb.plan):
        parameters = inspect.signature(function).parameters
        for name, field in fields.items():
            assert parameters[name].default == field.default, f"{function.__name__}({name}=...) drifted"
            assert name in function.__doc__, f"{function.__name__}'s docstring lacks {name}"
    (commands,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    flags = {action.dest: action for action in commands.choices["ablate"]._actions}
    spelled = argparse.Namespace(command="ablate", command_parsers=commands.choices)
    for name, field in fields.items():
        rules = field.metadata["option"]
        if rules.parts is not None:  # one flag per part: --slurm-partition, ...
            for part in dataclasses.fields(rules.parts):
                assert f"{name}__{part.name}" in flags, (
                    f"workbench ablate has no flag for {name}'s {part.name}"
                )
            continue
        assert name in flags, f"workbench ablate has no flag for {name}"
        # the same help, naming flags where it names settings (in_cli_terms)
        assert (
            in_cli_terms(rules.help.replace("%", "%%"), spelled, technique_speaks=False) in flags[name].help
        )
    panel = pytest.importorskip("workbench.widgets").panel()
    assert list(panel.settings) == list(fields), "the panel lacks a control"


def test_cli_flags_give_the_same_run_as_the_api():
    """One non-default value per setting, typed as a person would on the command line."""
    typed = {
        "steps": "7", "warmup": "2", "blocks": "2", "rounds": "3", "batch-size": "16", "device": "cpu",
        "seed": "5", "mode": "grid", "optimizer": "sgd", "lr": "0.01", "loader-arms": "off",
        "world-size": "2", "link": "bandwidth_gbps=1.0", "memory-cap-mb": "4096", "profile-steps": "2", "trace-dir": "traces", "start": "spawn", "threads": "1", "heap": "as-is",
        "executor": "slurm", "slurm-partition": "debug", "slurm-time-min": "5", "timeout-s": "60",
    }  # fmt: skip
    argv = ["ablate", *[part for flag, text in typed.items() for part in (f"--{flag}", text)]]
    args = _parser().parse_args([*argv, "--no-control", "--isolate", "--find-unused-parameters"])
    assert RunConfig(**run_settings(args)) == RunConfig(**RUN_SETTINGS)
    assert run_settings(_parser().parse_args(["ablate"])) == {}, "a flag left out must leave the default"


@pytest.mark.parametrize("setting", sorted(RUN_SETTINGS))
def test_plan_checks_every_run_setting_as_ablate_does(setting):
    """plan_arguments keeps every run setting, and plan refuses a bad one (the dry run and the
    panel's pre-flight check through it)."""
    arguments = {"model": "mlp", "out": "ignored", "progress": False, setting: RUN_SETTINGS[setting]}
    assert plan_arguments(arguments) == {"model": "mlp", setting: RUN_SETTINGS[setting]}
    bad = {"steps": 0, "warmup": 0, "blocks": 0, "rounds": 0, "batch_size": 0, "device": "tpu"}
    bad |= {"seed": -1, "mode": "random", "optimizer": "lamb", "lr": -1.0, "control": "yes"}
    bad |= {"loader_arms": "sometimes", "world_size": 0, "isolate": "yes", "link": 5, "timeout_s": 0.0}
    bad |= {"memory_cap_mb": 0.5, "profile_steps": -1, "trace_dir": 3, "start": "fork", "heap": "jemalloc"}
    bad |= {"threads": 0, "find_unused_parameters": "yes"}
    bad |= {"executor": "kubernetes", "slurm": {"partiton": "gpu"}}
    with pytest.raises(ValueError):
        wb.plan(**plan_arguments({"model": "mlp", setting: bad[setting]}))


def test_swept_arms_are_named_by_the_settings_that_matter_even_when_unavailable():
    """One arm per distinct setting: PowerSGD's rank means nothing to the fp16 hook, so
    {hook: [fp16, powersgd], rank: [1, 2]} is three arms, not four; and an arm that cannot
    run here (one rank) still says which setting it was."""
    sweep = {"ddp_compression": {"hook": ["fp16", "powersgd"], "rank": [1, 2]}}
    expected = [
        "ddp_compression[hook=fp16]",
        "ddp_compression[hook=powersgd, rank=1]",
        "ddp_compression[hook=powersgd, rank=2]",
    ]
    alone = wb.plan(model="mlp", techniques=sweep, device="cpu", control=False)
    assert list(alone.name[1:]) == expected and (alone.unavailable[1:] != "").all()
    ranks = wb.plan(model="mlp", techniques=sweep, device="cpu", control=False, world_size=2)
    assert list(ranks.name[1:]) == expected and (ranks.unavailable == "").all()


def test_the_worker_receives_the_run_that_ablate_checked(monkeypatch):
    """The RunConfig ablate built travels to the block's process whole (device resolved), not
    re-packed field by field, so a new setting reaches the worker with no edit on the way."""
    from workbench import ablation

    sent = []

    def capture(spec, **kwargs):
        sent.append(spec)
        return {"type": "error", "status": "failed", "reason": "not run: the test only looks at the spec"}

    monkeypatch.setattr(ablation, "run_in_fresh_process", capture)
    settings = {"steps": 7, "warmup": 2, "blocks": 1, "rounds": 3, "batch_size": 16, "seed": 5, "lr": 0.01}
    wb.ablate("mlp", techniques={}, out=False, progress=False, optimizer="sgd", **settings)
    assert sent and all(spec.run == RunConfig(device="cpu", optimizer="sgd", **settings) for spec in sent)


def test_smoke_budgets_cut_steps_and_warm_up_but_keep_blocks(monkeypatch):
    """WORKBENCH_SMOKE=1 (the notebooks tier) cuts every run's steps and warm-up; blocks stay as
    written, since a notebook's plan and tables show them. A value that is neither on nor off is
    refused, naming both."""
    asked = {"steps": 150, "warmup": 5, "blocks": 3}
    monkeypatch.setenv("WORKBENCH_SMOKE", "1")
    cut = RunConfig.from_options("ablate", asked)
    assert (cut.steps, cut.warmup, cut.blocks) == (3, 2, 3)
    assert RunConfig.from_options("ablate", {"steps": 2, "warmup": 1}).steps == 2  # never raised
    assert set(wb.plan(model="mlp", techniques={}, **asked, device="cpu").blocks) == {3}
    monkeypatch.setenv("WORKBENCH_SMOKE", "0")
    assert RunConfig.from_options("ablate", asked).steps == 150
    monkeypatch.setenv("WORKBENCH_SMOKE", "maybe")
    with pytest.raises(ValueError, match=r"WORKBENCH_SMOKE must be 1 .* or 0 .*; got 'maybe'"):
        wb.plan(model="mlp", techniques={}, device="cpu")
