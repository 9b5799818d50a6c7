"""benchmarks/gpu_suite.py, the one command that verifies the GPU half, checked where there is no
GPU: its refusals, its time limits, its goals and a rehearsal of its stages on the CPU."""

import functools
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import adopting_orphans, left_behind, running_children

import workbench.ablation
from workbench.telemetry import Sampler

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "arguments, named",
    [
        (["--stage", "kernel"], "env, tests, models, kernels, cuda_graphs, precision, overhead"),
        (["--size", "tiny"], "full, short"),
        (["--device", "tpu"], "'cuda', 'cpu'"),
        (["--limit-s", "10"], "at least 70 seconds"),
    ],
)
def test_bad_choices_are_refused_naming_the_valid_ones(suite, tmp_path, capsys, arguments, named):
    with pytest.raises(SystemExit) as stopped:
        suite.main(["--out", str(tmp_path / "run"), *arguments])
    assert stopped.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_folder_with_anything_in_it_is_never_written_over(suite, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        suite.main(["--out", str(tmp_path), "--stage", "env"])
    assert "is not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_stage_past_its_limit_is_stopped_with_its_processes_and_the_summary_says_so(
    suite, tmp_path, monkeypatch
):
    # pytest alone takes longer than this to collect the GPU tests.
    monkeypatch.setitem(suite.SIZES["short"], "tests", {"limit_s": 2})
    code = suite.main(["--out", str(tmp_path), "--size", "short", "--stage", "tests", "--device", "cpu"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    (stage,) = summary["stages"]
    assert code == 1
    assert stage["status"] == "timed out" and "2 s limit" in stage["reason"]
    assert stage["seconds"] < 30
    assert not [p for p in left_behind() if "gpu_suite" in " ".join(p.cmdline())]
    assert "| tests | timed out |" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("size_name", ["full", "short"])
def test_every_stage_that_runs_an_ablation_leaves_it_time_to_start(suite, size_name):
    """A stage's child keeps WRITE_MARGIN_S to write and starts no ablation with less than
    SMALLEST_ABLATION_S left: a limit below their sum (and the child's start) measures nothing.
    The short cuda_graphs stage's 60 s did exactly that on the H100 (2026-11-28)."""
    size = suite.SIZES[size_name]
    runs_ablations = ["models", "cuda_graphs", "precision"] + (
        ["kernels"] if size["kernels"]["end_to_end"] else []
    )
    too_short = {
        name: size[name]["limit_s"]
        for name in runs_ablations
        if size[name]["limit_s"] < suite.SMALLEST_STAGE_S
    }
    assert not too_short, f"these limits leave an ablation under {suite.SMALLEST_ABLATION_S} s: {too_short}"


def test_limit_s_shortens_a_stage_and_never_lengthens_one(suite, tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr(suite, "launch", lambda name, out, size, limit_s: launched.append((name, limit_s)) or
                        {"stage": name, "status": "passed", "seconds": 1.0, "limit_s": limit_s, "reason": ""})  # fmt: skip
    suite.main(["--out", str(tmp_path), "--stage", "env", "--stage", "models", "--limit-s", "300"])
    assert launched == [("env", suite.SIZES["full"]["env"]["limit_s"]), ("models", 300)]
    assert "| models | passed | 1.0 | 300 |" in (tmp_path / "summary.md").read_text()


def _stage(folder: Path, name: str, parts: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps({"stage": name, "parts": parts, "errors": []}))


def test_goals_are_met_missed_or_not_measured_with_the_reason(suite, tmp_path):
    rows = [
        {"arm": "baseline", "speedup": 1.0},
        {"arm": "amp[dtype=bfloat16]", "speedup": 2.5, "speedup_low": 2.3, "speedup_high": 2.7},
        {"arm": "amp[dtype=float16]", "speedup": 1.4, "speedup_low": 1.3, "speedup_high": 1.5},
        {"arm": "tf32", "status": "failed", "speedup": None, "reason": "block 1: it broke"},
    ]
    _stage(tmp_path, "precision", {"gpt_mini": {"table": rows}})
    _stage(tmp_path, "kernels", {"kernels_float32": [{"operator": "AdamW step", "pass": "optimizer",
                                                       "dtype": "float32", "pct_of_copy": 91.0}]})  # fmt: skip
    results = {goal["goal"]: goal for goal in suite.goals(tmp_path)}
    assert results["bf16 autocast vs float32 (gpt-mini)"]["result"] == "met"
    assert results["fp16 + GradScaler vs float32 (gpt-mini)"]["result"] == "missed"
    tf32 = results["TF32 vs strict float32 (gpt-mini)"]
    assert tf32["result"] == "not measured" and tf32["reason"] == "block 1: it broke"
    assert results["CUDA Graphs vs eager (mlp, batch 8)"]["result"] == "not measured"
    assert results["AdamW step optimizer (float32) bandwidth"]["result"] == "met"
    assert results["harness vs hand-written loop (in-process)"]["result"] == "not measured"

    _stage(tmp_path, "overhead", {"overhead": {"in_process": {"ratio": 0.9862, "low": 0.9811, "high": 0.9894},
                                               "per_step_cost": {"implied_ratio": 0.9936}}})  # fmt: skip
    overhead = {goal["goal"]: goal for goal in suite.goals(tmp_path)}[
        "harness vs hand-written loop (in-process)"
    ]
    assert overhead["result"] == "missed"  # 0.986 < 0.99: four decimals, not a rounded 0.99
    assert overhead["figure"] == "0.9862 (0.9811 to 0.9894); the per-step cost implies 0.9936"


@pytest.mark.parametrize(
    ("value", "low", "high", "result"),
    [
        (0.9800, 0.9500, 1.0100, "unsettled"),
        (0.9950, 0.9800, 0.9900, "unsettled"),  # the interval reaches the goal
        (0.9950, 0.9910, 0.9990, "met"),
        (0.9950, 0.9900, 0.9990, "met"),  # an interval that starts at the goal is past it
        (0.9850, 0.9800, 0.9890, "missed"),
        (0.9950, None, None, "met"),  # one round: no interval, the figure alone
        (0.9850, None, None, "missed"),
    ],
)
def test_a_goal_is_met_or_missed_only_where_its_interval_says_so(suite, value, low, high, result):
    assert suite.verdict(value, low, high, 0.99) == result


def test_a_goal_whose_interval_holds_the_target_is_reported_unsettled(suite, tmp_path):
    # The H100's overhead rounds at 4ce5606: on the goal's side, with an interval far past it either way.
    _stage(
        tmp_path, "overhead", {"overhead": {"in_process": {"ratio": 0.9987, "low": 0.8305, "high": 1.2009}}}
    )
    _stage(tmp_path, "precision", {"gpt_mini": {"table": [
        {"arm": "tf32", "speedup": 1.52, "speedup_low": 1.31, "speedup_high": 1.74}]}})  # fmt: skip
    results = {goal["goal"]: goal["result"] for goal in suite.goals(tmp_path)}
    assert results["harness vs hand-written loop (in-process)"] == "unsettled"
    assert results["TF32 vs strict float32 (gpt-mini)"] == "unsettled"


@pytest.mark.slow
def test_a_rehearsal_on_the_cpu_runs_the_stages_that_can_run_and_skips_the_rest(tmp_path):
    # As on a GPU machine: a child interpreter with nothing but this tree on its path for workbench.
    import subprocess

    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--out", str(tmp_path),
               "--size", "short", "--device", "cpu", "--stage", "env", "--stage", "tests", "--stage", "kernels"]  # fmt: skip
    subprocess.run(command, check=True, cwd=tmp_path, timeout=300, capture_output=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(s["stage"], s["status"]) for s in summary["stages"]] == [
        ("env", "passed"), ("tests", "passed"), ("kernels", "skipped")
    ]  # fmt: skip
    assert "CUDA" in summary["stages"][2]["reason"]
    tests = json.loads((tmp_path / "tests.json").read_text())["parts"]
    # Every GPU test was collected, and each one skipped here with its reason.
    assert tests["counts"]["skipped"] >= 30 and set(tests["counts"]) == {"skipped"}
    assert summary["machine"]["torch"]


def test_an_ablation_with_too_little_time_left_is_not_started_and_the_stage_says_so(
    suite, tmp_path, monkeypatch
):
    monkeypatch.setattr(suite, "DEVICE", "cpu")
    monkeypatch.setattr(suite, "DEADLINE", time.time() + 5)
    monkeypatch.setitem(suite.STAGE_FUNCTIONS, "models", lambda record, size: suite._ablation(record, "mlp"))
    assert suite.run_stage("models", tmp_path, {}) == 4  # the parent reports it as timed out
    record = json.loads((tmp_path / "models.json").read_text())
    assert "not_started" in record["parts"]["mlp"]
    assert record["out_of_time"] == [f"mlp: {record['parts']['mlp']['not_started']}"]


def test_the_tests_stage_stops_pytest_at_its_own_deadline_and_keeps_what_it_saw(suite, tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "DEVICE", "cpu")
    monkeypatch.setattr(suite, "DEADLINE", 0.0)  # long past: pytest is stopped at its first line
    assert suite.run_stage("tests", tmp_path, {}) == 4
    record = json.loads((tmp_path / "tests.json").read_text())
    assert record["out_of_time"] == ["pytest: stopped at the limit"]
    assert record["parts"]["exit_code"] != 0 and not record["errors"]


@pytest.mark.parametrize(
    "arguments, says",
    [
        (["--rounds", "1"], "--rounds must be at least 2"),
        (["--cost-processes", "0"], "--cost-processes must be at least 1"),
    ],
)
def test_overhead_py_refuses_settings_that_measure_nothing(capsys, arguments, says):
    spec = importlib.util.spec_from_file_location("overhead", ROOT / "benchmarks" / "overhead.py")
    overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overhead)
    with pytest.raises(SystemExit) as stopped:
        overhead.main(arguments)
    assert stopped.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.slow
def test_the_overhead_stage_runs_the_harness_against_a_hand_written_loop(suite, tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "DEVICE", "cpu")
    monkeypatch.setattr(suite, "DEADLINE", time.time() + 240)
    size = {"model": "mlp", "rounds": 2, "steps": 5, "pairs": 2, "cost_steps": 100, "cost_processes": 1}
    assert suite.run_stage("overhead", tmp_path, size) == 0
    figures = json.loads((tmp_path / "overhead.json").read_text())["parts"]["overhead"]
    assert figures["device"] == "cpu" and figures["rounds"] == 2
    for design in ("end_to_end", "in_process"):
        assert figures[design]["low"] <= figures[design]["ratio"] <= figures[design]["high"]
    assert figures["per_step_cost"]["model_bare_step_us"] > 0
    assert 0 < figures["per_step_cost"]["implied_ratio"] <= 1.5
    assert figures["per_step_cost"]["clock_step_us"] > 0  # where the cost goes: the clock's share
    assert "fresh_event_us" not in figures["per_step_cost"]  # CUDA events: on a GPU only


def test_the_overhead_stage_is_stopped_at_its_deadline_with_its_processes(suite, tmp_path, monkeypatch):
    # A stand-in for overhead.py that, like it, starts a child of its own and outlasts the deadline.
    stand_in = tmp_path / "overhead.py"
    # It also writes a first round's figures, as overhead.py does after each round.
    stand_in.write_text(
        "import json, subprocess, sys, time\n"
        "figures = {'rounds': 3, 'rounds_done': 1, 'complete': False,\n"
        "           'in_process': {'ratio': 0.9421, 'low': None, 'high': None}, 'per_step_cost': None}\n"
        "open(sys.argv[sys.argv.index('--json') + 1], 'w').write(json.dumps(figures))\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', 'stand-in-child'])\n"
        "time.sleep(120)\n"
    )
    monkeypatch.setattr(suite, "OVERHEAD_SCRIPT", stand_in)
    monkeypatch.setattr(suite, "DEVICE", "cpu")
    monkeypatch.setattr(suite, "DEADLINE", time.time() + 3)
    size = {"model": "mlp", "rounds": 2, "steps": 5, "pairs": 2}
    seen, stopped = [], threading.Event()

    def watch():  # the stand-in's child, seen while the stage ran
        while not stopped.wait(0.1):
            seen.extend(running_children("stand-in-child"))

    with adopting_orphans():  # a child that outlived its parent is found below
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            assert suite.run_stage("overhead", tmp_path, size) == 4
        finally:
            stopped.set()
            watcher.join()
        time.sleep(0.3)
        assert seen, "the stand-in started no child before the deadline: the check below would prove nothing"
        assert not running_children("stand-in-child") and not running_children(str(stand_in))
    record = json.loads((tmp_path / "overhead.json").read_text())
    assert record["out_of_time"] == ["overhead: stopped at the limit"]
    assert record["parts"]["overhead"]["in_process"]["ratio"] == 0.9421  # the round done is kept
    overhead = {goal["goal"]: goal for goal in suite.goals(tmp_path)}[
        "harness vs hand-written loop (in-process)"
    ]
    assert overhead["result"] == "missed"
    assert overhead["figure"] == "0.9421 (one round), 1 of 3 rounds before the limit"


def test_an_orphan_adopted_for_a_check_is_reaped_when_the_check_ends():
    """An adopted orphan that exits is this test process's zombie until reaped; left, it made later
    tests' looks at their own children fail on the same pytest worker (CI, 2026-11-26)."""
    import psutil

    ours_before = {child.pid for child in psutil.Process().children()}
    with adopting_orphans():
        parent = subprocess.run(
            [
                sys.executable,
                "-c",
                "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', 'pass']).pid)",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        orphan = psutil.Process(int(parent.stdout))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and orphan.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
        assert orphan.ppid() == os.getpid(), "the orphan was not adopted: the check below would prove nothing"
    assert not psutil.pid_exists(orphan.pid), "the adopted orphan was left a zombie"
    assert {child.pid for child in psutil.Process().children()} <= ours_before
    assert left_behind() == [] and running_children("anything") == []


def test_the_telemetry_goal_needs_1_hz_and_gpu_readings(suite, tmp_path):
    def goal(telemetry):
        _stage(tmp_path, "models", {"gpt-mini": {"table": []}, "gpt-mini_telemetry": telemetry})
        return {g["goal"]: g for g in suite.goals(tmp_path)}["telemetry with GPU readings, plotted"]

    plot = {"samples": 98, "plot": "gpt-mini-live.png"}
    met = goal({**plot, "per_s": 0.9991, "gpu_readings": ["gpu0_util_percent"]})
    assert met["result"] == "met"
    assert met["figure"] == "1.00 Hz, 98 samples, gpu0_util_percent; gpt-mini-live.png"
    assert goal({**plot, "per_s": 0.91, "gpu_readings": ["gpu0_util_percent"]})["result"] == "missed"
    assert goal({**plot, "per_s": 1.0, "gpu_readings": []})["result"] == "missed"
    assert (
        goal({"samples": 1, "per_s": None, "gpu_readings": [], "plot": "x.png"})["result"] == "not measured"
    )


def test_an_ablation_with_a_live_view_keeps_the_panels_picture_and_its_telemetry_rate(
    suite, tmp_path, monkeypatch
):
    monkeypatch.setattr(suite, "DEVICE", "cpu")
    monkeypatch.setattr(suite, "DEADLINE", time.time() + 600)
    # This small ablation can end within the first second on a busy machine, before a 1 Hz sampler
    # takes its first reading (CI under load, 2026-11-27): sample at 20 Hz, whatever the load.
    monkeypatch.setattr(workbench.ablation, "Sampler", functools.partial(Sampler, interval_s=0.05))
    record = suite.Record(tmp_path / "models.json", "models", {})
    suite._ablation(record, "mlp", live_view=True, model="mlp", techniques={}, steps=20, warmup=2, blocks=1)
    parts = json.loads((tmp_path / "models.json").read_text())["parts"]
    telemetry = parts["mlp_telemetry"]
    assert telemetry["plot"] == "mlp-live.png" and telemetry["gpu_readings"] == []  # no GPU here
    assert (tmp_path / "mlp-live.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert telemetry["samples"] >= 1  # the 1 Hz sampler ran while the block did


def test_the_precision_arms_train_gpt_mini_on_the_same_batches_held_in_memory(suite, tmp_path, monkeypatch):
    """The precision stage holds the input pipeline out of the step: each arm's process cuts the
    same batches of gpt-mini's own text once and serves them from memory."""
    make_batches = suite.gpt_mini_batches_in_memory(batch_size=8, count=3)
    batches, again = make_batches(), make_batches()
    assert len(batches) == 3 and all(inputs.shape == (8, 64) for inputs, _ in batches)
    for (inputs, targets), (inputs_again, targets_again) in zip(batches, again, strict=True):
        assert inputs.equal(inputs_again) and targets.equal(targets_again)
    assert not batches[0][0].equal(batches[1][0])  # batches, not one batch repeated

    monkeypatch.setattr(suite, "DEVICE", "cpu")
    monkeypatch.setattr(suite, "DEADLINE", time.time() + 600)
    monkeypatch.setattr(suite, "PRECISION_ARMS", {"checkpointing": True})  # runs on a CPU, unlike amp here
    record = suite.Record(tmp_path / "precision.json", "precision", {})
    suite.stage_precision(record, {"batch_size": 8, "steps": 2, "blocks": 1})
    written = json.loads((tmp_path / "precision.json").read_text())
    assert written["errors"] == [] and list(written["parts"]) == ["gpt_mini"]  # no large batch asked for
    part = written["parts"]["gpt_mini"]
    settings = part["settings"]
    assert (settings["model"], settings["data"]) == ("gpt_mini_model", "gpt_mini_text_in_memory")
    rows = {row["arm"]: row for row in part["table"]}
    assert rows["checkpointing"]["status"] == "ok", rows["checkpointing"]["reason"]
    assert rows["checkpointing"]["final_loss"] > 0 and "data_ms" in rows["baseline"]
