"""The workbench command, used as a person would: list, env, ablate, show."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import OWN_JOB, plan_event

from workbench.cli import parse_technique_flag
from workbench.progress import describe_plan


def run(*arguments, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "workbench", *arguments], capture_output=True, text=True, timeout=timeout
    )


def run_here(capsys, *arguments):
    """The command in this process, as ``run`` gives it: a dry run measures nothing, so it needs no
    fresh interpreter of its own (each costs seconds of torch's import)."""
    from workbench.cli import main

    try:
        code = main(list(arguments))
    except SystemExit as exit:  # argparse's refusals
        code = exit.code
    said = capsys.readouterr()
    return subprocess.CompletedProcess(arguments, code, said.out, said.err)


def test_list_shows_availability_with_reasons():
    done = run("list", "--device", "cpu")
    assert done.returncode == 0
    line = next(line for line in done.stdout.splitlines() if line.strip().startswith("tf32"))
    assert line.split()[1] == "no" and "needs a CUDA device" in line
    assert run("list", "--models").stdout.count("gpt-mini") >= 1


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`workbench list --models | head -1`: the pipe closes before the output ends."""
    listing = subprocess.Popen([sys.executable, "-m", "workbench", "list", "--models"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    listing.stdout.close()  # the reader is gone before the first line
    assert listing.wait(timeout=60) == 141
    assert b"Traceback" not in listing.stderr.read()


def test_env_names_versions_and_cores():
    done = run("env")
    assert done.returncode == 0
    for word in ("torch", "cpu", "usable of", "cupy", "dali", "cuda"):
        assert word in done.stdout
    assert '"usable_cores"' in run("env", "--json").stdout


@pytest.mark.slow  # a real ablation in fresh processes
def test_ablate_prints_the_table_and_writes_results_and_plot(tmp_path):
    out = tmp_path / "cli"
    done = run(
        "ablate",
        "--model",
        "mlp",
        "-t",
        "amp:dtype=bfloat16",
        "-t",
        "tf32",
        "--steps",
        "5",
        "--warmup",
        "1",
        "--blocks",
        "2",
        "--out",
        str(out),
        "--no-progress",
    )
    assert done.returncode == 0, done.stderr
    plan = done.stdout.split("\n\n")[0]  # the plan's line, wrapped to the terminal's 80 columns
    assert "Plan: 2 blocks; 3 arms side by side in one process per block; 2 processes" in " ".join(
        plan.split()
    )
    assert max(len(line) for line in plan.splitlines()) <= 80, plan
    # The control's row: its name may wrap onto two lines in 80 columns; its verdict is "control".
    assert re.search(r"^baseline\s+control\s", done.stdout, re.MULTILINE), done.stdout
    assert "tf32: unavailable" in done.stdout
    for name in ("results.json", "table.csv", "losses.csv", "telemetry.csv", "plot.png"):
        assert (out / name).exists(), name
    shown = run("show", str(out))
    assert shown.returncode == 0 and "amp" in shown.stdout


def test_your_own_model_data_loss_and_optimizer_run_from_the_command_line(tmp_path, capsys, monkeypatch):
    """--model module:attribute, as the API's callables: imported from the folder the command runs in
    (which the console script's sys.path lacks), and again in each block's process."""
    from workbench.cli import _parser

    (tmp_path / "own_job_cli.py").write_text(OWN_JOB)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "own_job_cli", raising=False)
    try:
        done = run_here(capsys, "ablate", "--model", "own_job_cli:build", "--data", "own_job_cli:batches",
                        "--loss-fn", "own_job_cli:smoothed", "--optimizer", "own_job_cli:sgd", "-t",
                        "grad_accum:steps=2", "--steps", "4", "--warmup", "1", "--blocks", "1", "--out", "run",
                        "--no-progress")  # fmt: skip
    finally:
        sys.modules.pop("own_job_cli", None)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "run" / "results.json").read_text())
    config = record["config"]
    assert {unit["status"] for unit in record["units"]} == {"ok"}
    # Recorded as typed, so that the report's Reproduce gives the same command, and a Python call
    # that imports them.
    named = {"model": "build", "data": "batches", "loss_fn": "smoothed", "optimizer": "sgd"}
    assert {key: config[key] for key in named} == {key: f"own_job_cli:{name}" for key, name in named.items()}
    assert config["lr"] is None
    from workbench.report import reproduce

    command, python = reproduce(record)
    again = _parser().parse_args(shlex.split(command)[1:])
    assert (again.model, again.data, again.loss_fn, again.optimizer) == tuple(config[key] for key in named)
    assert "from own_job_cli import build" in python and "optimizer=sgd," in python


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--model", "own_job_cli:nope"], "--model own_job_cli:nope: own_job_cli has no attribute 'nope'; its callables: batches, broken, build, sgd, smoothed"),
        # a misspelling is named; the module's own callables come before those it imported (torch's nn)
        (["--loss-fn", "imports_job_cli:los"], "imports_job_cli has no attribute 'los' (did you mean 'loss'?); its callables: loss, Counter, OrderedDict"),
        (["--model", "no_such_module:build"], "--model no_such_module:build: no module named 'no_such_module' in "),
        (["--loss-fn", "cross_entropy"], "--loss-fn takes your own code as module:attribute"),
        (["--model", "script_job_cli:build"], "--model script_job_cli:build: importing script_job_cli fails: SystemExit: it exits as it is imported (2): guard its script part with if __name__ == '__main__':"),
        (["--model", "own_job_cli.py:build"], "--model own_job_cli.py:build: name the module, not its file: --model own_job_cli:build"),
        (["--model", "own_job_cli:build"], "data is required with your own model: give --data module:attribute, naming a Dataset, an iterable of batches, or a callable that returns one"),
        (["--model", "own_job_cli:broken", "--data", "own_job_cli:batches"], "the model factory own_job_cli:broken fails as it builds the model, as it would in every arm: RuntimeError: no weights here"),
        (["--model", "broken_job_cli:build"], "--model broken_job_cli:build: importing broken_job_cli fails: ModuleNotFoundError: No module named 'a_missing_dependency'"),
        (["--model", "own_job_cli"], "unknown model 'own_job_cli'; valid models: mlp, resnet-mini, gpt-mini; or your own, as --model module:attribute"),
        (["--optimizer", "own_job_cli:sgd", "--lr", "0.1"], "--lr 0.1 is for the built-in optimizers; your optimizer factory own_job_cli:sgd sets its own"),
        (["--optimizer", "lion"], "unknown optimizer 'lion'; valid optimizers: adamw, sgd; or your own factory"),
    ],
)  # fmt: skip
def test_your_own_code_that_cannot_be_found_is_one_line(arguments, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "own_job_cli.py").write_text(OWN_JOB)
    (tmp_path / "broken_job_cli.py").write_text("import a_missing_dependency\n")
    imports = "from collections import Counter, OrderedDict\n\ndef loss(outputs, targets):\n    return outputs.sum()\n"
    (tmp_path / "imports_job_cli.py").write_text(imports)
    # a training script's top level, given flags it does not know (as a command line's would be)
    script = "import argparse\nargparse.ArgumentParser().parse_args(['--model'])\n"
    (tmp_path / "script_job_cli.py").write_text(script)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        done = run_here(capsys, "ablate", *arguments, "--dry-run")
    finally:
        for name in ("own_job_cli", "script_job_cli", "imports_job_cli"):
            sys.modules.pop(name, None)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_the_ablate_command_advise_ends_with_names_your_own_code_as_you_typed_it(tmp_path, monkeypatch):
    """advise with --optimizer models:sgd crashed after measuring: its closing command asked the
    optimizer's choices for the word of the factory it had imported."""
    from workbench.cli import _ablate_command, _parser

    (tmp_path / "own_job_cli.py").write_text(OWN_JOB)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    typed = [
        "--model",
        "own_job_cli:build",
        "--data",
        "own_job_cli:batches",
        "--loss-fn",
        "own_job_cli:smoothed",
    ]
    try:
        args = _parser().parse_args(["advise", *typed, "--optimizer", "own_job_cli:sgd", "--steps", "9"])
        command = _ablate_command(args, {"amp": {}})
    finally:
        sys.modules.pop("own_job_cli", None)
    words = shlex.split(command.replace("\\\n", " "))
    assert words == [
        "workbench",
        "ablate",
        *typed,
        "--steps",
        "9",
        "--optimizer",
        "own_job_cli:sgd",
        "-t",
        "amp",
    ]


def test_dry_run_plans_without_running(capsys):
    done = run_here(capsys, "ablate", "--preset", "quick", "--dry-run")
    assert done.returncode == 0
    for arm in ("baseline", "amp", "channels_last", "checkpointing", "grad_accum"):
        assert arm in done.stdout
    # what the preset chose, which the arms' table does not show
    assert " ".join(done.stdout.split()).startswith(  # wrapped to the terminal's width
        "resnet-mini on textures, cpu, batch 32: 3 blocks, 20 timed steps per arm after 3 warm-up steps"
    ), done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) <= 80, done.stdout


@pytest.mark.slow  # one small run first, to hold a folder
def test_a_dry_run_refuses_a_results_folder_as_the_run_would(tmp_path, capsys):
    """It printed the plan and exited 0 where the same command without --dry-run was refused."""
    out = tmp_path / "q"
    common = [
        "ablate",
        "--model",
        "mlp",
        "-t",
        "grad_accum",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(out),
    ]
    assert run(*common, "--blocks", "2", "--no-progress").returncode == 0
    common.append("--dry-run")
    fewer = run_here(capsys, *common, "--blocks", "1")
    assert fewer.returncode == 2 and "--blocks 1 would leave some of them out" in fewer.stderr, fewer.stderr
    assert run_here(capsys, *common, "--blocks", "3").returncode == 0  # more blocks add to the run
    (out / "notes.txt").write_text("mine")
    over = run_here(capsys, *common, "--blocks", "2", "--overwrite")
    assert over.returncode == 2 and "did not write there (notes.txt)" in over.stderr, over.stderr
    assert (out / "notes.txt").read_text() == "mine" and len(list((out / "units").iterdir())) == 2
    # A folder that does not exist yet, under a file: refused as the run refuses it, and nothing made.
    under_a_file = tmp_path / "a-file" / "results"
    (tmp_path / "a-file").write_text("mine")
    dry = run_here(capsys, *common[:-3], "--out", str(under_a_file), "--dry-run")
    assert dry.returncode == 2 and f"--out {under_a_file} cannot be written: Not a directory" in dry.stderr
    made = tmp_path / "new" / "deeper"
    assert run_here(capsys, *common[:-3], "--out", str(made), "--dry-run").returncode == 0
    assert not (tmp_path / "new").exists(), "a dry run leaves no folder behind"


def test_a_plan_that_runs_no_technique_says_so(capsys):
    """Every -t switched off, or none available here: an A/A check, said, not a silent baseline run."""
    for flags in (["--techniques", '{"amp": false}'], ["-t", "cuda_graphs"]):  # off; unavailable on a CPU
        done = run_here(capsys, "ablate", *flags, "--dry-run")
        assert done.returncode == 0, done.stderr
        assert " ".join(done.stdout.split()).endswith(  # wrapped to the terminal's width
            "No technique will run: the baseline against its control only (an A/A check of the noise)."
        ), done.stdout
    assert "No technique will run" not in run_here(capsys, "ablate", "-t", "amp", "--dry-run").stdout
    # Without a control there is no A/A check to speak of (wb.advise, or --no-control): it said there was.
    alone = run_here(capsys, "ablate", "-t", "cuda_graphs", "--no-control", "--dry-run")
    assert alone.stdout.rstrip().endswith("No technique will run: the baseline alone."), alone.stdout
    event = plan_event(treatment_unavailable="needs a CUDA device")
    assert describe_plan(event).endswith(
        "; no technique will run: the baseline alone. Results are kept in memory only (out=False)."
    )
    # wb.advise (and a search, which keeps its rounds itself) asked for no out: nothing to say of it.
    assert describe_plan({**event, "label": "advise"}).endswith(
        "; no technique will run: the baseline alone."
    )
    event["arms"].append({"role": "control", "unavailable": "", "process": "block"})
    assert (
        "; no technique will run: the baseline against its control only (an A/A check of the noise)"
        in describe_plan(event)
    )


def test_a_dry_run_says_why_arms_cannot_run_in_the_flags_of_the_command_line(capsys):
    """The dry run's "Unavailable here" said "pass world_size=2 or more", the API's keyword."""
    from workbench.cli import main

    assert main(["ablate", "--dry-run", "--device", "cpu"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "ddp_compression: needs several ranks to communicate: pass --world-size 2 or more" in said
    assert "world_size=" not in said and "data='jpeg'" not in said


def test_a_value_that_starts_with_a_dash_meets_its_own_check(capsys):
    """argparse took "-5m" for a flag and said only "expected one argument"."""
    from workbench.cli import main

    for command, said in (
        (["tune", "mlp", "--budget", "-5m"], "--budget: a positive time like 600, 90s, 10m or 1h; got '-5m'"),
        (["ablate", "--dry-run", "--steps", "-5x"], "--steps must be an integer >= 1; got '-5x'"),
    ):
        try:
            code = main(command)
        except SystemExit as exit_:  # argparse's own checks exit; the API's return 2
            code = exit_.code
        assert code == 2 and said in capsys.readouterr().err, command


def test_listing_the_models_refuses_flags_that_would_change_nothing(capsys):
    """`list --models --device cuda` listed the same models and datasets, and took --device silently."""
    from workbench.cli import main

    for flags, named in (
        (["--device", "cuda"], "--device does"),
        (["--device", "cpu", "--model", "mlp"], "--device and --model do"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["list", "--models", *flags])
        assert exit_.value.code == 2 and f"which {named} not change" in capsys.readouterr().err
    assert main(["list", "--models"]) == 0 and "gpt-mini" in capsys.readouterr().out


def test_a_resumed_plan_counts_its_done_processes_in_words():
    event = {**plan_event(), "processes": 3, "remaining": 2}
    assert "; resuming: 1 process already done." in describe_plan(event)  # not "1 processes"
    assert "; resuming: 2 processes already done." in describe_plan({**event, "remaining": 1})
    # the batch is per rank: a batch of 32 read as the whole step's
    assert "; every arm a data-parallel group of 2 ranks, each with its own batch" in describe_plan(
        {**event, "world_size": 2}
    )


def test_technique_flag_parsing():
    assert parse_technique_flag("compile") == ("compile", True)
    assert parse_technique_flag("amp:off") == ("amp", False)
    assert parse_technique_flag("dataloader:num_workers=2,pin_memory=false,prefetch_factor=none") == (
        "dataloader",
        {"num_workers": 2, "pin_memory": False, "prefetch_factor": None},
    )
    assert parse_technique_flag("dataloader:num_workers=0|2") == ("dataloader", {"num_workers": [0, 2]})


def test_a_dry_run_under_torchrun_refuses_what_the_run_refuses_and_rank_0_alone_shows_it(capsys, monkeypatch):
    """Under torchrun the dry run passed --world-size 4 with two ranks, which the run refuses, and
    every rank printed the plan; the ranks' error lines ran together on one line."""
    torchrun = {
        "TORCHELASTIC_RUN_ID": "t",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    shown = {}
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        refused = run_here(capsys, "ablate", "--model", "mlp", "--world-size", "4", "--dry-run")
        who = "workbench" if rank == 0 else "workbench (rank 1)"
        assert refused.returncode == 2 and refused.stderr == (
            f"{who}: error: ablate: under torchrun the world size is torchrun's (2); got --world-size 4\n"
        ), refused.stderr
        shown[rank] = run_here(capsys, "ablate", "--model", "mlp", "-t", "ddp_compression", "--dry-run")
    assert shown[0].returncode == shown[1].returncode == 0
    assert shown[0].stdout.startswith("mlp on digits, cpu, batch 32 per rank, 2 ranks:"), shown[0].stdout
    assert shown[1].stdout == ""


def test_none_is_a_choices_own_word_where_the_setting_lists_it(capsys):
    """-t ddp_compression:hook=none was refused ("hook must be one of 'none' | ...; got None"),
    though the JSON form and the API take it: the bucket study of notebook 10 could not be typed."""
    flags = ["--model", "mlp", "--world-size", "2", "--dry-run"]
    done = run_here(capsys, "ablate", *flags, "-t", "ddp_compression:hook=none|fp16,bucket_cap_mb=none")
    assert done.returncode == 0, done.stderr
    assert "ddp_compression[hook=none]" in done.stdout and "ddp_compression[hook=fp16]" in done.stdout


def test_loader_only_sweep_dry_run(capsys):
    done = run_here(
        capsys,
        "ablate",
        "--model",
        "mlp",
        "--data",
        "jpeg",
        "-t",
        "dataloader:num_workers=0|1",
        "--loader-arms",
        "only",
        "--no-control",
        "--dry-run",
    )
    assert done.returncode == 0, done.stderr
    rows = done.stdout.split("\n\n")[1].splitlines()[1:]  # after the settings line and the headings
    # the name column, of each row's first line (a name has no two spaces; wrapped settings start with them)
    names = [re.split(r"\s{2,}", row)[0] for row in rows if not row.startswith(" ")]
    assert names == [
        "loader: baseline",
        "loader: baseline (own process)",  # what the arm with a worker process is compared with
        "loader: dataloader[num_workers=0]",
        "loader: dataloader[num_workers=1]",
    ]


def test_advise_whose_baseline_cannot_run_says_why_in_one_line_and_exits_1():
    """A baseline that times out leaves the advisor nothing to advise on: one line, exit 1, no traceback."""
    done = run("advise", "--model", "mlp", "--batch-size", "8", "--device", "cpu", "--timeout-s", "0.01")
    assert done.returncode == 1, done.stderr
    assert "workbench: advise: the baseline did not run (failed): timed out" in done.stderr
    assert "Traceback" not in done.stderr


def test_advise_checks_where_it_will_write_before_it_measures(tmp_path, capsys):
    """A user's file is never replaced, and a path that cannot be written is said at once, not
    after the measurement (which it would throw away)."""
    from workbench.cli import main
    from workbench.results_folder import MANIFEST

    mine = tmp_path / "notes.json"
    mine.write_text("the user's notes")
    a_run = tmp_path / "a-run"  # another run's results folder: its overwrite would refuse the file
    a_run.mkdir()
    (a_run / MANIFEST).write_text('{"files": []}')
    for flag, path, said in [
        ("--json", mine, "exists and workbench did not write it"),
        (
            "--json",
            a_run / "advice.json",
            f"--json '{a_run / 'advice.json'}' is inside the workbench results folder",
        ),
        (
            "--plot",
            a_run / "advice.png",
            f"--plot '{a_run / 'advice.png'}' is inside the workbench results folder",
        ),
        ("--json", tmp_path, "is a folder; name a file"),
        ("--plot", tmp_path / "missing" / "advice.png", "does not exist"),
        ("--plot", tmp_path / "advice.txt", "--plot writes a PNG image; name a .png file"),
    ]:
        assert main(["advise", "--model", "mlp", flag, str(path), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert said in err and "Plan:" not in capsys.readouterr().out, err
    assert mine.read_text() == "the user's notes"


def test_a_folder_that_cannot_be_read_or_written_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    """As root (CI) permissions are not enforced, so the refusals are provoked: the folder's access
    check says no, and a read fails as an unreadable file's would."""
    import os

    from workbench.cli import main

    real_access = os.access
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == read_only else real_access(p, mode))
    assert main(["advise", "--model", "mlp", "--json", str(read_only / "a.json"), "--no-progress"]) == 2
    assert "cannot be written" in capsys.readouterr().err

    results = tmp_path / "results.json"
    results.write_text("{}")

    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(results))

    monkeypatch.setattr("workbench.results.open", unreadable, raising=False)  # load_results' open
    assert main(["show", str(results)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"workbench: error: Permission denied: {results}" and "Traceback" not in err


def test_show_refuses_what_is_not_a_results_file_without_reading_it_all(tmp_path, capsys, monkeypatch):
    import os

    from workbench import results as results_module
    from workbench.cli import main

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # a read would block for ever
    assert main(["show", str(fifo)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    big = tmp_path / "model.ckpt"
    big.write_bytes(b"x" * 2048)
    monkeypatch.setattr(results_module, "MAX_RESULTS_BYTES", 1024)
    assert main(["show", str(big)]) == 2
    assert "where results.json holds kilobytes" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text("{}")
    (run / "table.csv").write_text("arm,speedup\n")
    assert main(["show", str(run / "table.csv")]) == 2
    assert f"pass the run's folder: {run}" in capsys.readouterr().err


def test_advise_recognises_the_files_it_wrote(tmp_path):
    from matplotlib.figure import Figure

    from workbench.cli import ADVICE_GENERATOR, _advice_json, _png_written_by

    _advice_png = _png_written_by(ADVICE_GENERATOR)

    ours, theirs = tmp_path / "advice.json", tmp_path / "other.json"
    ours.write_text(json.dumps({"generator": ADVICE_GENERATOR, "bottleneck": "launch"}))
    theirs.write_text(json.dumps({"bottleneck": "launch"}))
    assert _advice_json(ours) and not _advice_json(theirs)
    figure = Figure()
    figure.savefig(tmp_path / "ours.png", metadata={"Software": ADVICE_GENERATOR})
    figure.savefig(tmp_path / "theirs.png")
    assert _advice_png(tmp_path / "ours.png") and not _advice_png(tmp_path / "theirs.png")
    assert not _advice_png(theirs)  # not an image at all


def test_advise_ends_with_the_ablate_command_that_measures_its_advice(tmp_path, capsys):
    """It recommended "compile {'mode': 'default'}", Python's words, which a shell user has to
    translate into -t flags; and it wrote --json without saying so."""
    from workbench.cli import _parser, main

    advice_file = tmp_path / "advice.json"
    job = ["--model", "mlp", "--steps", "20", "--warmup", "2", "--batch-size", "64"]
    assert main(["advise", *job, "--no-progress", "--json", str(advice_file)]) == 0
    out = capsys.readouterr().out
    assert f"Wrote {advice_file}" in out
    assert out.startswith("Plan: 1 block; 1 arm"), out  # --no-progress drops the bar, not what will run
    recommended = json.loads(advice_file.read_text())["recommended"]
    if not recommended:  # nothing to measure: no command
        assert "To measure" not in out
        return
    command = out.split("To measure what is recommended:\n")[1].split("\nWrote")[0]
    assert all(len(line) <= 80 for line in command.splitlines()), command
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:2] == ["workbench", "ablate"] and words[2:10] == job
    parsed = _parser().parse_args(words[1:])  # the shell's words, as workbench reads them
    from workbench.techniques import get_technique

    flagged = dict(parse_technique_flag(flag) for flag in parsed.technique)
    assert list(flagged) == list(recommended)
    for name, settings in recommended.items():  # the same settings, once the flag's text is read
        technique = get_technique(name)
        assert technique.configure(flagged[name]) == technique.configure(settings or True)


def test_the_version_is_one_flag_away(capsys):
    import workbench as wb
    from workbench.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"workbench {wb.__version__}"


def test_list_and_env_speak_the_flags_and_never_cut_a_package_name(capsys):
    """`workbench list` said "pass world_size=2 or more to ablate" and "for executor='slurm'", and
    cut "cupy-cuda13x" at its hyphen, which copied as shown names no package."""
    from workbench.cli import main

    for command in (["list"], ["env"]):
        assert main(command) == 0
        out = capsys.readouterr().out
        said = " ".join(out.split())
        assert "--executor slurm" in said and "executor=" not in said, out
        packages = out.split("optional packages:")[1]
        assert not any(line.rstrip().endswith("-") for line in packages.splitlines()), packages
    assert main(["list"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "world_size=" not in said and "--world-size 2 or more" in said


def test_a_report_path_that_cannot_be_made_is_one_line_naming_it(tmp_path, capsys):
    from helpers import result_row, synthetic_results

    from workbench.cli import main

    synthetic_results([result_row("baseline", speedup=1.0, low=1.0, high=1.0)]).save(tmp_path / "run")
    assert main(["report", str(tmp_path / "run"), "--out", "/proc/no-such/report.html"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("workbench: error: the report cannot be written to /proc/no-such/report.html"), err


def test_progress_into_a_log_is_a_line_per_finished_process(capsys, monkeypatch):
    """Redirected to a file, the bar's redrawn frames piled up on one line joined by carriage
    returns, the last one still showing a phase long finished."""
    from workbench.progress import Progress

    bar = Progress(True, total=2, already=0, label="advise")
    bar.show("block 1/2: baseline: warmup")
    bar.advance()
    bar.advance()
    bar.close()
    err = capsys.readouterr().err
    assert err == "advise: 1/2 processes done\nadvise: 2/2 processes done\n", repr(err)
    assert "\r" not in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: tqdm's bar, redrawn in place
    bar = Progress(True, total=1, already=0, unit="block", label="ablate")
    assert bar.bar is not None
    bar.advance()
    bar.close()
    drawn = capsys.readouterr().err
    assert "ablate: 100%" in drawn and "done" in drawn  # its last frame says done, not the last phase


def test_what_a_run_says_as_it_goes_names_the_commands_flags_and_only_while_it_runs(capsys, monkeypatch):
    """After Ctrl-C the command line said "Run again with out='runs/x' (--out on the command line)",
    and the tuner's rounds named its keywords (budget_s=)."""
    from workbench.cli import _lines_in_flags, _parser
    from workbench.progress import say

    args = _parser().parse_args(["tune", "--budget", "60"])
    with _lines_in_flags(args):
        say("Run again with out='runs/x' to resume; or pass budget_s=600.")
    say("Run again with out='runs/x' to resume.")  # from Python again: the API's keywords
    assert capsys.readouterr().out.splitlines() == [
        "Run again with --out runs/x to resume; or pass --budget 600.",
        "Run again with out='runs/x' to resume.",
    ]
    # Wrapped at the terminal's width between words, paths whole: the terminal broke them anywhere.
    monkeypatch.setenv("COLUMNS", "40")
    folder = "/tmp/a-results-folder-named-at-length/for-this-run"
    with _lines_in_flags(args):
        say(f"\nStopped: 3 of 8 processes are saved in {folder}. Run again with out='{folder}' to resume.")
    assert capsys.readouterr().out.splitlines() == [
        "",
        "Stopped: 3 of 8 processes are saved in",
        folder + ".",
        "Run again with --out",
        folder,
        "to resume.",
    ]


def test_why_an_arm_ran_out_of_memory_names_the_flag_not_the_keyword(tmp_path, capsys):
    from helpers import result_row, synthetic_results

    from workbench.cli import main

    cap = "amp needs 5 MiB at its peak, more than memory_cap_mb=2 allows"
    user_error = "ValueError: my_model wants batch_size=3"  # the user's own words: kept
    rows = [result_row("baseline", speedup=1.0, low=1.0, high=1.0), result_row("amp", "oom", cap),
            result_row("compile", "failed", user_error)]  # fmt: skip
    synthetic_results(rows).save(tmp_path / "run")
    assert main(["show", str(tmp_path / "run")]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "more than --memory-cap-mb 2 allows" in said and user_error in said


def test_the_help_names_flags_where_the_api_names_keywords(capsys):
    """--help said "with profile_steps" and "batch_size samples per step": the API's words."""
    from workbench.cli import main

    with pytest.raises(SystemExit):
        main(["ablate", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "with --profile-steps," in said and "--batch-size samples per step" in said
    assert "profile_steps" not in said and "batch_size" not in said


def test_the_measuring_command_leaves_out_advises_profiling():
    """advise profiles by itself; its --trace-dir copied into the ablate command, without
    --profile-steps, made a command that ablate refuses."""
    from workbench.cli import _ablate_command, _parser

    args = _parser().parse_args(["advise", "--model", "mlp", "--trace-dir", "my traces", "--steps", "30"])
    command = _ablate_command(args, {"compile": {"mode": "default"}})
    assert "trace" not in command and "--steps 30" in command
    words = shlex.split(command.replace("\\\n", " "))
    _parser().parse_args(words[1:])  # a command ablate takes


def test_a_notebook_kernel_gets_the_bar_whatever_its_shell_class(monkeypatch):
    """Colab's shell is a subclass of Jupyter's; the bar is kept wherever a kernel shows it."""
    import types

    from workbench.progress import _bar_can_redraw

    class ColabShell:
        config = {"IPKernelApp": {}}

    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=ColabShell))
    assert _bar_can_redraw()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: None))
    assert not _bar_can_redraw()  # a plain script that imported IPython, into a pipe


def test_under_torchrun_with_one_rank_ddp_says_how_to_start_more(capsys, monkeypatch):
    """torchrun --nproc-per-node 1: ddp_compression said "pass --world-size 2 or more", which
    torchrun refuses; it is torchrun's --nproc-per-node that sets the ranks."""
    for name, value in {
        "TORCHELASTIC_RUN_ID": "t",
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
    }.items():
        monkeypatch.setenv(name, value)
    done = run_here(capsys, "ablate", "--model", "mlp", "-t", "ddp_compression", "--dry-run")
    assert done.returncode == 0 and "start torchrun with --nproc-per-node 2 or more" in " ".join(
        done.stdout.split()
    )
