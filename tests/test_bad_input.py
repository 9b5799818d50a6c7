"""Bad input: one clear line naming the valid choices, before any time is spent."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import workbench as wb
from workbench.config import RunConfig

QUIET = {"progress": False, "out": False}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"techniques": {"ampp": True}},
            r"unknown technique 'ampp'; valid techniques: dataloader, .*amp.* \(did you mean 'amp'\?\)",
        ),
        ({"model": "resnet"}, r"unknown model 'resnet'; valid models: mlp, resnet-mini, gpt-mini"),
        (
            {"model": "MLP"},
            r"unknown model 'MLP'; valid models: .* \(did you mean 'mlp'\?\)",
        ),  # not 'gpt-mini'
        (
            {"techniques": {"amp,compile": True}},
            r"unknown technique 'amp,compile'; .* \(2 techniques in one name: give 'amp' and 'compile' separately\)",
        ),
        (
            {"data": "cifar10"},
            r"unknown dataset 'cifar10'; valid datasets: digits, textures, text, jpeg, synthetic, jpeg-folder:PATH",
        ),
        ({"mode": "sweep"}, r"unknown mode 'sweep'; valid modes: one-at-a-time, leave-one-out, grid"),
        ({"device": "tpu"}, r"unknown device 'tpu'; valid devices: auto, cpu, cuda, cuda:N"),
        ({"device": torch.device("mps")}, r"unknown device 'mps'; valid devices: auto, cpu, cuda, cuda:N"),
        (
            {"optimizer": "lion"},
            r"unknown optimizer 'lion'; valid optimizers: adamw, sgd; or your own factory, params -> torch.optim.Optimizer",
        ),
        (
            {"optimizer": torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)},
            r"ablate: optimizer is an optimizer already built \(SGD\), over one model's parameters; .* pass a factory",
        ),
        (
            {"optimizer": 3},
            r"ablate: optimizer must be one of adamw, sgd or a factory params -> torch.optim.Optimizer",
        ),
        (
            {"optimizer": torch.optim.RMSprop, "lr": 0.1},
            r"ablate: lr=0.1 is for the built-in optimizers; your optimizer factory RMSprop sets its own",
        ),
        (
            {"optimizer": lambda params: "sgd"},
            r"the optimizer factory <lambda> returned str, not a torch.optim.Optimizer",
        ),
        (
            {"optimizer": lambda params: torch.optim.SGD(torch.nn.Linear(2, 2).parameters())},
            r"the optimizer factory <lambda> built SGD over none of the parameters it was given",
        ),
        (
            {"optimizer": lambda params: torch.optim.SGD(params, lr=-1.0)},
            r"the optimizer factory <lambda> fails on the model's parameters, as it would in every arm: "
            r"ValueError: Invalid learning rate: -1.0",
        ),
        (
            {"optimizer": torch.optim.LBFGS},
            r"the optimizer factory LBFGS built LBFGS, whose step needs a closure .* choose an optimizer whose "
            r"closure is optional",
        ),
        ({"steps": 0}, r"ablate: steps must be >= 1; got 0"),
        ({"steps": 2.5}, r"ablate: steps must be an integer >= 1; got 2.5"),
        ({"warmup": 0}, r"ablate: warmup must be >= 1; got 0 \(the first steps pay one-off costs"),
        ({"blocks": 0}, r"ablate: blocks must be >= 1; got 0"),
        ({"rounds": 0}, r"ablate: rounds must be >= 1; got 0"),
        (
            {"rounds": 50, "steps": 10},
            r"ablate: rounds=50 exceeds steps=10; each round's window needs at least one step",
        ),
        ({"batch_size": -32}, r"ablate: batch_size must be >= 1; got -32"),
        ({"lr": 0}, r"ablate: lr must be > 0.0; got 0"),
        ({"lr": float("nan")}, r"ablate: lr must be a finite number > 0.0; got nan"),
        ({"lr": float("inf")}, r"ablate: lr must be a finite number > 0.0; got inf"),
        ({"seed": 2**40}, r"ablate: seed must be <= 4294967295; got 1099511627776"),
        ({"seed": -1}, r"ablate: seed must be >= 0; got -1"),
        ({"batch_size": 5000}, r"data 'digits' has 1797 samples, fewer than batch_size=5000"),
        (
            {
                "model": lambda: torch.nn.Linear(2, 2),
                "data": torch.utils.data.TensorDataset(torch.zeros(0, 2)),
            },
            r"data 'TensorDataset' is empty: it holds no samples",
        ),
        ({"model": lambda: torch.nn.Linear(2, 2), "data": []}, r"data holds no batches: the list is empty"),
        (
            {"on_event": "print"},
            r"ablate: on_event must be a function that takes one event dict; got 'print'",
        ),
        ({"stop": True}, r"ablate: stop must be a threading.Event \(or anything with is_set\(\)\); got True"),
        ({"out": 3}, r"ablate: out must be a folder path"),
        (
            {"techniques": {"amp": {"dtype": "fp8"}}},
            r"amp: dtype must be one of 'bfloat16' \| 'float16'; got 'fp8'",
        ),
        ({"techniques": {"grad_accum": {"steps": 0}}}, r"grad_accum: steps must be >= 1; got 0"),
        (
            {"techniques": {"grad_accum": {"steps": 64}}, "batch_size": 32},
            r"grad_accum: steps=64 exceeds batch_size=32",
        ),
        (
            {"techniques": {"amp": "yes"}},
            r"amp: settings must be True, False, or a dict of options; got 'yes'",
        ),
        ({"techniques": "amp"}, r"techniques must be a dict like"),
        (
            {"model": "gpt-mini", "data": "digits"},
            r"model 'gpt-mini' cannot train on dataset 'digits' \(image data\); "
            r"datasets it accepts: text, synthetic",
        ),
        ({"model": torch.nn.Linear(2, 2)}, r"model must be a built-in name or a zero-argument callable"),
        (
            {"model": 42},
            r"model must be a built-in name \(mlp, resnet-mini, gpt-mini\) or a zero-argument callable",
        ),
        ({"model": lambda: torch.nn.Linear(2, 2)}, r"data is required with your own model"),
        (
            {"model": lambda: torch.nn.Linear(2, 2), "data": "digits"},
            r"built-in dataset 'digits' is sized for the built-in",
        ),
        ({"data": [(torch.zeros(2, 64), torch.zeros(2))]}, r"built-in model 'mlp' trains on built-in data"),
        ({"model": lambda: torch.nn.Linear(2, 2), "data": (b for b in [])}, r"one-shot iterator"),
        ({"model": lambda: torch.nn.Linear(2, 2), "data": 3}, r"data must be a built-in name"),
        ({"loss_fn": "mse"}, r"loss_fn must be a callable"),
        (
            {"loss_fn": torch.nn.MSELoss},
            r"loss_fn is the class MSELoss; pass an instance: loss_fn=MSELoss\(\)",
        ),
        (
            {"model": torch.nn.Linear, "data": [(torch.zeros(2, 4), torch.zeros(2))]},
            r"model is called with no arguments to build each arm's copy, and Linear needs some",
        ),
        ({"overwrite": "False"}, r"ablate: overwrite must be True or False; got 'False'"),
        ({"steps": 10**20}, r"ablate: steps must be <= 10000000; got 100000000000000000000$"),
        ({"blocks": 20_000}, r"ablate: blocks must be <= 10000; got 20000$"),
    ],
)
def test_bad_input_gives_one_clear_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as caught:
        wb.ablate(**{"model": "mlp", "techniques": {}, **QUIET, **kwargs})
    assert "\n" not in str(caught.value)


def test_counts_from_a_numpy_sweep_are_accepted_as_ints():
    config = RunConfig(
        steps=np.int64(4), warmup=np.int32(1), blocks=np.int64(1), batch_size=np.int16(8), seed=np.uint32(7)
    )
    assert all(
        type(v) is int for v in (config.steps, config.warmup, config.blocks, config.batch_size, config.seed)
    )
    res = wb.ablate(model="mlp", techniques={}, steps=np.int64(4), warmup=np.int64(1), blocks=np.int64(1),
                    control=False, **QUIET)  # fmt: skip
    assert list(res.table.status) == ["ok"]


def test_out_that_cannot_be_written_is_bad_input(tmp_path):
    with pytest.raises(ValueError, match="cannot be written"):
        wb.ablate(model="mlp", techniques={}, progress=False, out="/proc/no-such-folder/results")
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        with pytest.raises(ValueError, match="cannot be written: Permission denied"):
            wb.ablate(model="mlp", techniques={}, progress=False, out=locked / "results")
    finally:
        locked.chmod(0o700)


def test_a_trace_folder_that_cannot_be_made_is_refused_before_anything_runs(tmp_path):
    """A --trace-dir under /proc ran the whole block, then failed every arm with FileNotFoundError."""
    job = dict(model="mlp", techniques={}, progress=False, profile_steps=1, out=tmp_path / "run")
    with pytest.raises(ValueError, match=r"trace_dir='/proc/no-such/traces' cannot be made: No such file"):
        wb.ablate(**job, trace_dir="/proc/no-such/traces")
    note = tmp_path / "note.txt"
    note.write_text("the user's")
    with pytest.raises(ValueError, match="cannot be made: .*note.txt' is a file"):
        wb.plan(model="mlp", profile_steps=1, trace_dir=str(note / "traces"))  # a dry run too
    assert not (tmp_path / "run").exists() and note.read_text() == "the user's"


def test_a_model_factory_that_returns_no_module():
    with pytest.raises(ValueError, match="returned int, not an nn.Module"):
        wb.ablate(model=lambda: 3, data=[(torch.zeros(2, 2), torch.zeros(2))], techniques={}, **QUIET)


@settings(max_examples=150, deadline=None)
@given(
    steps=st.one_of(st.integers(-3, 50), st.floats(), st.booleans(), st.none(), st.text(max_size=3)),
    warmup=st.one_of(st.integers(-3, 5), st.floats(allow_nan=True)),
    blocks=st.one_of(st.integers(-3, 5), st.none()),
    rounds=st.one_of(st.integers(-3, 60), st.none(), st.floats()),
    batch_size=st.one_of(st.integers(-64, 256), st.sampled_from([1.0, "32"])),
    device=st.one_of(st.sampled_from(["auto", "cpu", "cuda", "cuda:0", "cuda:x", "gpu", ""]), st.integers()),
    mode=st.sampled_from(["one-at-a-time", "leave-one-out", "grid", "all", ""]),
    lr=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-1, 1)),
)
def test_run_config_validation_fuzz(steps, warmup, blocks, rounds, batch_size, device, mode, lr):
    """Whatever the values, RunConfig either validates them or raises one ValueError line."""
    try:
        config = RunConfig(
            steps=steps,
            warmup=warmup,
            blocks=blocks,
            rounds=rounds,
            batch_size=batch_size,
            device=device,
            mode=mode,
            lr=lr,
        )
    except ValueError as error:
        assert "\n" not in str(error)
        return
    assert config.steps >= 1 and config.warmup >= 1 and config.blocks >= 1 and config.batch_size >= 1
    assert config.rounds is None or 1 <= config.rounds <= config.steps
    assert config.mode in ("one-at-a-time", "leave-one-out", "grid") and config.lr > 0


def test_missing_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no CUDA device is visible; use device='cpu'"):
        wb.ablate(model="mlp", techniques={}, device="cuda", **QUIET)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["ablate", "-t", "ampp"], "unknown technique 'ampp'; valid techniques:"),
        (["ablate", "--model", "vit"], "unknown model 'vit'; valid models:"),
        # the API's checks, reworded to name the flags the user typed (cli.in_cli_terms)
        (["ablate", "--steps", "0"], "ablate: --steps must be >= 1; got 0"),
        (["advise", "--steps", "0"], "advise: --steps must be >= 1; got 0"),
        (["ablate", "--rounds", "50", "--steps", "10"], "ablate: --rounds 50 exceeds --steps 10;"),
        (["ablate", "--batch-size", "5000"], "fewer than --batch-size 5000; pass a smaller --batch-size"),
        (["ablate", "-t", "amp:dtype=fp8"], "amp: dtype must be one of"),
        (["ablate", "-t", "grad_accum:steps=0"], "grad_accum: steps must be >= 1; got 0"),
        (["ablate", "-t", "amp:dtype"], "cannot read technique option 'dtype'"),
        (["ablate", "-t", "amp:dtype=bfloat16,dtype=float16"], "option 'dtype' is given twice"),
        (["ablate", "--techniques", "{not json"], "--techniques is not valid JSON"),
        (["ablate", "-t", "amp:dtype=bfloat16", "-t", "amp:dtype=float16"], "amp is given twice"),
        (
            ["ablate", "--loader-arms", "only", "-t", "amp"],
            "times the input pipeline alone, so amp would measure nothing",
        ),
        (["ablate", "--profile-steps", "1", "--trace-dir", "pyproject.toml"], "is a file; name a folder"),
        (["show", "/no/such/folder"], "no results at /no/such/folder"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(arguments, message, capsys):
    """The command's main() in this process (an exception escaping it fails the test outright);
    the test below runs ``python -m workbench`` itself, so these need not pay its 3-5 s start each."""
    from workbench.cli import main

    assert main(arguments) == 2
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("workbench: error: ") and message in lines[0], stderr


def test_cli_errors_name_the_flag_not_the_keyword():
    """tune's budget is ``--budget`` on the command line and ``budget_s`` in Python."""
    from workbench.cli import _parser, in_cli_terms

    args = _parser().parse_args(["tune", "--budget", "5"])
    message = "tune: budget_s=5 is too small to tune this job ... Pass budget_s=14 or more, or fewer steps"
    assert in_cli_terms(message, args) == (
        "tune: --budget 5 is too small to tune this job ... Pass --budget 14 or more, or fewer steps"
    )
    args = _parser().parse_args(["ablate"])  # a flag that takes no value is suggested without one
    message = "out='/tmp/x' holds a different ablation; choose another results folder, or pass overwrite=True to discard it"
    assert in_cli_terms(message, args) == (
        "--out /tmp/x holds a different ablation; choose another results folder, or pass --overwrite to discard it"
    )
    # A string's value as a shell takes it: quoted only where it has to be.
    assert in_cli_terms("out='/tmp/my runs' holds", args) == "--out '/tmp/my runs' holds"
    # A value keeps its text, whatever it holds: a path, a URL, a string that is no repr.
    assert in_cli_terms("the same out='runs/steps=30'", args) == "the same --out runs/steps=30"
    assert in_cli_terms("traces in /tmp/trace_dir, see http://x?threads=2", args) == (
        "traces in /tmp/trace_dir, see http://x?threads=2"
    )
    assert (
        in_cli_terms("ablate: out='C:\\x1' is odd", args) == "ablate: --out 'C:\\x1' is odd"
    )  # no traceback
    assert (
        in_cli_terms("the control's band; blocks=9 (threads=1)", args)
        == "the control's band; --blocks 9 (--threads 1)"
    )
    # A call written as Python keeps its keywords: they are its own, not flags.
    assert in_cli_terms("your factory partial(SGD, lr=0.05) and grad_accum(steps=2); lr=0.1", args) == (
        "your factory partial(SGD, lr=0.05) and grad_accum(steps=2); --lr 0.1"
    )
    # A technique's own option keeps its name: grad_accum's steps is not the run's --steps.
    message = "grad_accum: steps=1000 exceeds batch_size=32; every micro-batch needs at least one sample"
    assert in_cli_terms(message, args).startswith("grad_accum: steps=1000 exceeds --batch-size 32;")


@pytest.mark.parametrize(
    ("arguments", "hint"),
    [
        # advise measures one block of the baseline: not a flag of its own
        (["advise", "--blocks", "3"], "--blocks is a flag of ablate, not of advise"),
        (["advise", "--mode", "grid"], "--mode is a flag of ablate, not of advise"),
        # not read as a prefix of --model, nor suggested as if it were
        (["tune", "--budget", "60", "--mode", "grid"], "--mode is a flag of ablate, not of tune"),
        (["ablate", "--step", "3"], "--step: did you mean --steps?"),
        (["ablate", "--warmpu=3"], "--warmpu: did you mean --warmup?"),
        (["ablate", "--modle", "mlp"], "--modle: did you mean --model?"),  # difflib's nearest: --mode
    ],
)
def test_flags_a_command_does_not_take_are_refused_by_name(arguments, hint, capsys):
    from workbench.cli import main

    with pytest.raises(SystemExit) as exited:
        main(arguments)
    assert exited.value.code == 2
    unknown = " ".join(arguments[-2:]) if "=" not in arguments[-1] else arguments[-1]
    (line,) = capsys.readouterr().err.splitlines()  # one line: no usage block before it
    assert line == (
        f"workbench {arguments[0]}: error: unrecognized arguments: {unknown}; {hint} "
        f"(see 'workbench {arguments[0]} --help')"
    )


def test_cli_unknown_flag_is_argparse_exit_2_in_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "workbench", "ablate", "--stepz", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "workbench ablate: error: unrecognized arguments: --stepz 3; --stepz: did you mean --steps? "
        "(see 'workbench ablate --help')"
    ]
    done = subprocess.run([sys.executable, "-m", "workbench"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert (
        done.stderr
        == "workbench: error: the following arguments are required: COMMAND (see 'workbench --help')\n"
    )


def test_the_old_name_of_blocks_still_works_and_says_so():
    with pytest.warns(DeprecationWarning, match="repeats= is now blocks="):
        table = wb.plan(model="mlp", techniques={}, repeats=2, device="cpu")
    assert set(table.blocks) == {2}


def test_a_warm_up_shorter_than_powersgds_start_iter_is_refused():
    """PowerSGD all-reduces in full until start_iter; a warm-up that ends earlier would time those
    steps, so plan (and ablate) refuse it, naming the warm-up that would do."""
    techniques = {"ddp_compression": {"hook": "powersgd", "start_iter": 3}}
    with pytest.raises(ValueError, match=r"warmup=2 is too short for powersgd.*use warmup >= 3"):
        wb.plan(model="mlp", techniques=techniques, world_size=2, warmup=2, device="cpu")
    planned = wb.plan(model="mlp", techniques=techniques, world_size=2, warmup=3, device="cpu")
    assert "ddp_compression" in set(planned.name)


def test_a_torch_device_is_taken_as_its_name():
    from workbench.config import RunConfig

    assert RunConfig(device=torch.device("cpu")).device == "cpu"
    assert RunConfig(device=torch.device("cuda", 1)).device == "cuda:1"  # checked against the machine later
    plan = wb.plan("mlp", techniques={}, device=torch.device("cpu"))
    assert list(plan["name"]) == ["baseline", "baseline (control)"]


def test_a_checkpointing_select_that_matches_nothing_is_refused_naming_what_it_could_match():
    """ "select='layers.*' matches no submodule of mlp" left the user to guess mlp's names, and
    showed the arm as unavailable beside the others, as if the model could not be checkpointed."""

    def refusal(select) -> str:
        with pytest.raises(ValueError) as refused:
            wb.plan(model="mlp", techniques={"checkpointing": {"select": select}}, device="cpu")
        return str(refused.value)

    said = refusal("layers.*")
    assert said.startswith(
        "checkpointing: select='layers.*' matches no submodule of mlp; its submodules include "
    )
    assert "blocks.0 (MLPBlock)" in said and "more" in said
    for typo, meant in (
        ("blokcs.*", "blocks.*"),
        ("type:MLPBlok", "type:MLPBlock"),
    ):  # a misspelling is named
        assert f"(did you mean {meant!r}?)" in refusal(typo)
    for no_better in ("blocks.[5-9]", "blocks.9?"):  # only a select that would match is offered
        assert "did you mean" not in refusal(no_better)
    assert "matches no submodule" in refusal(lambda name, module: False)
    # The default finds the repeated blocks itself: a model without any is unavailable, not refused.
    plan = wb.plan(model=lambda: torch.nn.Linear(4, 2), data=[(torch.zeros(2, 4), torch.zeros(2).long())],
                   techniques=["checkpointing"], device="cpu")  # fmt: skip
    assert "found no repeated blocks" in plan.set_index("name").loc["checkpointing", "unavailable"]


def test_advise_names_itself_and_its_own_arguments_when_one_is_unknown():
    """advise's settings were checked by the ablation inside it: "unknown ablate argument 'out'",
    listing ablate's out and techniques as valid, and "ablate: steps must be >= 1"."""
    with pytest.raises(
        ValueError, match=r"^unknown advise argument 'out'; valid advise arguments: model, "
    ) as unknown:
        wb.advise("mlp", out="somewhere", progress=False)
    assert "techniques" not in str(unknown.value) and "retry_failed" not in str(unknown.value)
    with pytest.raises(ValueError, match=r"^advise: steps must be >= 1"):
        wb.advise("mlp", steps=0, progress=False)


@pytest.mark.parametrize("call", ["plan", "ablate"])
def test_a_misspelt_keyword_is_matched_against_every_keyword_the_call_takes(call):
    """collate_fn was missing from the valid arguments, so colate_fn was offered 'isolate'; and
    repeats, the former name of blocks, was offered though the README never names it."""
    quiet = {"progress": False} if call == "ablate" else {}
    with pytest.raises(ValueError) as refused:
        getattr(wb, call)(model="mlp", colate_fn=lambda samples: samples, device="cpu", **quiet)
    said = str(refused.value)
    assert said.startswith(f"unknown {call} argument 'colate_fn'") and said.endswith(
        "(did you mean 'collate_fn'?)"
    )
    assert "repeats" not in said


def test_plan_called_from_python_names_itself_in_its_refusals():
    """wb.plan(blocks=0) said "ablate: blocks must be >= 1", a call the user never made."""
    with pytest.raises(ValueError, match=r"^plan: blocks must be >= 1; got 0$"):
        wb.plan(model="mlp", blocks=0)
    with pytest.raises(ValueError, match=r"^ablate: blocks must be >= 1; got 0$"):
        wb.ablate(model="mlp", blocks=0, progress=False)


def test_a_misspelt_choice_of_a_technique_setting_is_named():
    """-t ddp_compression:hook=fp61 listed the hooks but, unlike a misspelt technique, offered none."""
    with pytest.raises(ValueError, match=r"hook must be one of .*; got 'fp61' \(did you mean 'fp16'\?\)$"):
        wb.plan(model="mlp", techniques={"ddp_compression": {"hook": "fp61"}}, world_size=2)
    with pytest.raises(ValueError, match=r"got 'zzz'$"):  # nothing near it: nothing offered
        wb.plan(model="mlp", techniques={"ddp_compression": {"hook": "zzz"}}, world_size=2)


def test_find_unused_parameters_without_ranks_is_refused():
    """A DDP option on a one-process run would be accepted and do nothing."""
    with pytest.raises(
        ValueError, match=r"^plan: find_unused_parameters is DistributedDataParallel's option"
    ):
        wb.plan(model="mlp", find_unused_parameters=True)
