"""The notebook panel, driven from Python the way a click would drive it."""

import html
import re
import sys
import threading
import time
import types
from dataclasses import dataclass, field

import ipywidgets as w
import pytest
import torch
from helpers import (
    RUN_SETTINGS,
    Sentences,
    bag_of_words,
    pad_to_longest,
    result_row,
    synthetic_results,
    two_layers,
)

import workbench as wb
from workbench import live_run, optional
from workbench.ablation import check_before_run
from workbench.config import NothingMeasured, RunConfig, run_options
from workbench.plots import plot_live
from workbench.techniques import Technique, all_techniques, register_technique, unregister_technique
from workbench.techniques.base import GROUPS
from workbench.telemetry import Sampler, _NvmlReader
from workbench.widgets import LiveRun, TechniqueRow, progress_line


def test_the_panel_is_generated_from_the_registry():
    panel = wb.panel(model="resnet-mini", techniques={"amp": {"dtype": "float16"}, "checkpointing": True})
    assert list(panel.rows) == [t.name for t in all_techniques()]
    assert panel.rows["amp"].toggle.value and panel.rows["checkpointing"].toggle.value
    assert not panel.rows["compile"].toggle.value
    dtype = panel.rows["amp"].fields["dtype"][1]
    assert (
        isinstance(dtype, w.Dropdown)
        and dtype.options == ("bfloat16", "float16")
        and dtype.value == "float16"
    )
    assert isinstance(panel.rows["dataloader"].fields["num_workers"][1], w.IntText)
    tf32 = panel.rows["tf32"]
    if tf32.unavailable:  # on a CPU machine: shown, disabled, with the reason
        assert tf32.toggle.disabled and "needs a CUDA device" in tf32.note.value


def test_techniques_are_grouped_and_numbered_in_their_order_of_application():
    assert {t.name for t in all_techniques() if t.group not in GROUPS} == set(), "every technique has a group"
    panel = wb.panel(model="mlp")
    groups = {}
    for box in _descendants(panel):
        for name in box._dom_classes:
            if name.startswith("workbench-group-"):
                groups[name.removeprefix("workbench-group-")] = [
                    c for c in box.children if isinstance(c, TechniqueRow)
                ]
    assert set(groups) == set(GROUPS)
    for group, rows in groups.items():
        assert [row.technique.name for row in rows] == [t.name for t in all_techniques() if t.group == group]
    for position, technique in enumerate(all_techniques(), start=1):
        place = panel.rows[technique.name].place.value
        assert f">{position}<" in place, f"{technique.name} should show that it is applied {position}th"


def test_a_techniques_settings_show_only_while_it_is_on():
    panel = wb.panel(model="mlp", techniques={"amp": True})
    amp, dataloader, channels_last = (panel.rows[name] for name in ("amp", "dataloader", "channels_last"))
    assert amp.settings_box.layout.display is None and dataloader.settings_box.layout.display == "none"
    dataloader.toggle.value = True
    assert dataloader.settings_box.layout.display is None
    amp.toggle.value = False
    assert amp.settings_box.layout.display == "none"
    channels_last.set_reason(None)
    channels_last.toggle.value = True  # no settings at all: nothing to show
    assert channels_last.settings_box.layout.display == "none"


def test_setting_controls_wrap_and_never_shrink():
    """A control squeezed by its row was drawn a few pixels wide (dali's prefetch_queue_depth)."""
    panel = wb.panel(model="mlp")
    for row in panel.rows.values():
        assert row.settings_box.layout.flex_flow == "row wrap"
        for name, (_, control) in row.fields.items():
            assert control.layout.flex == "0 0 auto", f"{row.technique.name}.{name} may shrink"
    for name, control in panel.settings.items():
        assert control.layout.flex == "0 0 auto", f"the run setting {name} may shrink"


def test_an_unavailable_technique_says_why_in_one_short_line():
    panel = wb.panel(model="mlp")
    row = panel.rows["ddp_compression"]  # needs two ranks: unavailable on every machine at world_size=1
    reason = "needs several ranks to communicate: pass world_size=2 or more to ablate"
    assert row.unavailable == reason
    shown = re.sub(r"<[^>]+>", "", row.note.value)
    assert html.unescape(shown) == "unavailable: needs several ranks to communicate"
    assert (
        f"title='{html.escape(reason, quote=True)}'" in row.note.value
        and "white-space:nowrap" in row.note.value
    )
    assert row.settings_box.layout.display == "none"


def test_a_choice_comes_back_with_its_technique_and_a_mended_settings_error_goes():
    panel = wb.panel(model="mlp")
    row, ranks = panel.rows["ddp_compression"], panel.settings["world_size"]
    ranks.value = 2
    row.toggle.value = True
    ranks.value = 1  # unavailable at one rank: switched off, and the choice remembered
    assert row.unavailable and not row.toggle.value
    ranks.value = 2
    assert row.unavailable is None and row.toggle.value
    ranks.value = 0
    assert "world_size must be" in panel.status.value
    ranks.value = 1
    assert "must be" not in panel.status.value and "Run ablation" in panel.status.value


def test_an_out_folder_the_run_would_refuse_is_refused_before_it_starts(tmp_path):
    """A folder of another run failed only after Run, from the run's thread; the message now
    names the panel's own overwrite checkbox, and the checkbox never deletes the user's files."""
    wb.ablate("mlp", techniques={}, steps=2, warmup=1, blocks=1, out=tmp_path / "r", progress=False)
    panel = wb.panel(model="mlp", steps=3, warmup=1, blocks=1, out=str(tmp_path / "r"))
    assert panel.run() is False and not panel.running
    said = html.unescape(panel.status.value)
    assert "holds a different ablation (differs in: " in said
    assert "tick 'discard its earlier results' beside out to discard it" in said
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    panel = wb.panel(model="mlp", steps=3, out=str(tmp_path / "mine"), overwrite=True)
    assert panel.overwrite.value is True
    assert (
        panel.run() is False
        and "did not write there (thesis.tex); workbench deletes only what this run wrote, so nothing there"
        in html.unescape(panel.status.value)
    )
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "precious"


def test_the_overwrite_checkbox_discards_the_earlier_run_once(tmp_path):
    """Ticked, Run replaces the earlier ablation in out; the tick does not outlive that run, so
    the next Run in the folder resumes (and refuses other settings) as the API does."""
    out = tmp_path / "r"
    wb.ablate("mlp", techniques={}, steps=2, warmup=1, blocks=1, out=out, progress=False)
    panel = wb.panel(model="mlp", techniques={}, steps=3, warmup=1, blocks=1, out=str(out))
    panel.overwrite.value = True
    assert panel.arguments()["overwrite"] is True
    assert panel.run() is True and panel.overwrite.value is False
    results = panel.wait(120)
    assert results is not None and results.complete, panel.status.value
    assert wb.load_results(out).record["config"]["steps"] == 3
    # Run again as it is: nothing is left to run, and "Done." would claim a measurement.
    assert panel.run() is True and panel.wait(120).complete
    said = html.unescape(panel.status.value)
    assert "Already complete: nothing was left to run" in said and "Done" not in said
    assert "tick 'discard its earlier results' beside out" in said
    panel.settings["steps"].value = 4
    assert panel.run() is False and "holds a different ablation" in panel.status.value


def test_optional_switches_show_auto_rather_than_a_blank():
    row = wb.panel(model="mlp").rows["dataloader"]
    persistent = row.fields["persistent_workers"][1]
    assert persistent.label == "auto" and row.setting()["persistent_workers"] is None
    persistent.value = "False"
    assert row.setting()["persistent_workers"] is False
    row.set_setting({"persistent_workers": True, "num_workers": 2})
    assert persistent.label == "True"


def test_the_data_control_names_the_dataset_the_run_uses():
    panel = wb.panel(model="mlp")
    assert panel.data.label == "digits (mlp's own)" and panel.arguments()["data"] is None
    panel.model.value = "resnet-mini"
    assert panel.data.label == "textures (resnet-mini's own)"
    panel.data.value = "jpeg"
    panel.model.value = "mlp"  # a dataset chosen by name stays chosen
    assert panel.data.label == "jpeg" and panel.arguments()["data"] == "jpeg"


def test_the_panel_batches_custom_data_with_its_collate_fn():
    panel = wb.panel(model=bag_of_words, data=Sentences(), collate_fn=pad_to_longest, batch_size=4)
    assert panel.data.label == "custom: Sentences"
    arguments = panel.arguments()
    assert not check_before_run(arguments).empty  # the default collate would refuse its sentences
    assert panel.advise_arguments()["data"] is arguments["data"]


class ClockedRun:
    """A LiveRun on a clock the test sets: ``at(seconds, event)`` delivers an event that many
    seconds after the run started; ``now(seconds)`` moves the clock without one."""

    def __init__(self, monkeypatch):
        self.clock = [1000.0]
        monkeypatch.setattr(live_run, "time", types.SimpleNamespace(time=lambda: self.clock[0]))
        self.live = LiveRun()

    def now(self, seconds: float) -> None:
        self.clock[0] = self.live.started + seconds

    def at(self, seconds: float, event: dict) -> None:
        self.now(seconds)
        self.live(event)

    def plan(self, blocks: int) -> None:
        arms = [{"name": name, "unavailable": None} for name in ("baseline", "amp")]
        self.at(0, {"type": "plan", "arms": arms, "blocks": blocks, "processes": blocks, "remaining": blocks})


def test_the_status_line_tells_progress_and_the_time_left(monkeypatch):
    run = ClockedRun(monkeypatch)
    live, at = run.live, run.at
    run.plan(blocks=3)
    at(0, {"type": "start", "block": 0, "arms": ["baseline", "amp"], "process": "block", "attempt": 1})
    at(1, {"type": "phase", "block": 0, "arm": "amp", "phase": "warmup"})
    assert progress_line(live.snapshot()) == (
        "process 1 of 3 · block 1 of 3 · now: amp, warmup · 0:01 elapsed · "
        "time left: known once the arms have warmed up"
    )
    # Warm: this process should take 2 s so far + 8 s of windows; three such processes, 5 s in.
    at(
        2,
        {
            "type": "phase",
            "block": 0,
            "phase": "measure",
            "rounds": 9,
            "expected_s": {"baseline": 4.0, "amp": 4.0},
        },
    )
    at(5, {"type": "phase", "block": 0, "arm": "baseline", "phase": "measure", "round": 2, "of": 9})
    assert progress_line(live.snapshot()).endswith(
        "now: baseline, measure 2/9 · 0:05 elapsed · about 0:25 left"
    )
    # The first process took 12 s: the others should too, and the second has run 3 s.
    at(12, {"type": "process_done", "block": 0, "job": "block"})
    at(12, {"type": "start", "block": 1, "arms": ["baseline", "amp"], "process": "block", "attempt": 1})
    at(15, {"type": "phase", "block": 1, "arm": "amp", "phase": "measure", "round": 3, "of": 9})
    assert progress_line(live.snapshot()) == (
        "process 2 of 3 · block 2 of 3 · now: amp, measure 3/9 · 0:15 elapsed · about 0:21 left"
    )


def test_the_time_left_keeps_moving_when_the_first_process_runs_past_its_forecast(monkeypatch):
    """It stalled: past its forecast, the process in flight counted as done and the others as
    long as the forecast. Now its windows' pace gives its own time left, and the later
    processes are taken to be as long as it will be."""
    run = ClockedRun(monkeypatch)
    live, at = run.live, run.at
    run.plan(blocks=2)
    at(0, {"type": "start", "block": 0, "arms": ["baseline", "amp"], "process": "block", "attempt": 1})
    # Warm at 2 s, forecast 2 + 4 = 6 s: 10 windows (5 rounds x 2 arms).
    at(
        2,
        {
            "type": "phase",
            "block": 0,
            "phase": "measure",
            "rounds": 5,
            "expected_s": {"baseline": 2.0, "amp": 2.0},
        },
    )
    for window in range(6):  # the windows run at 2 s each, not 0.4 s: window 6 begins at 12 s
        at(
            2 + 2 * window,
            {
                "type": "phase",
                "block": 0,
                "arm": "amp",
                "phase": "measure",
                "round": 1 + window // 2,
                "of": 5,
            },
        )
    # 5 windows took 10 s: 5 more, from the one running, take 10 s; the process about 22 s,
    # and the second as long.
    assert live_run.time_left_s(live.snapshot()) == pytest.approx(10 + 22)
    run.now(13)  # a second later: 2.2 s a window, 11 s left here, 24 s a process
    assert live_run.time_left_s(live.snapshot()) == pytest.approx(11 + 24)


def _descendants(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _descendants(child)


def test_availability_follows_the_chosen_model():
    panel = wb.panel(model="resnet-mini")
    assert not panel.rows["channels_last"].toggle.disabled
    panel.model.value = "gpt-mini"
    assert panel.rows["channels_last"].toggle.disabled
    assert "no Conv2d layers" in panel.rows["channels_last"].note.value


@pytest.mark.skipif(optional.missing("nvidia.dali") is not None, reason="DALI is not installed")
def test_availability_follows_the_chosen_data():
    panel = wb.panel(model="resnet-mini")  # its own data, textures, is not JPEG files
    assert panel.rows["dali"].toggle.disabled
    assert "needs JPEG files" in panel.rows["dali"].note.value
    panel.data.value = "jpeg"
    assert not panel.rows["dali"].toggle.disabled
    folder = wb.panel(model="mlp", data="jpeg-folder:/some/where")  # a custom folder, not yet scanned
    assert folder.data.value == "custom" and not folder.rows["dali"].toggle.disabled


@dataclass(frozen=True)
class LaterConfig:
    flavour: str = field(default="sweet", metadata={"choices": ("sweet", "sour")})
    strength: int = 3
    enabled_extra: bool = False


class LaterTechnique(Technique):
    name = "later"
    summary = "a technique added after the panel was written"
    order = 95
    Config = LaterConfig

    def apply(self, setup, config):
        return "nothing"


def test_a_technique_added_later_appears_without_editing_the_panel():
    register_technique(LaterTechnique())
    try:
        row = wb.panel().rows["later"]
        kinds = {name: type(widget) for name, (_, widget) in row.fields.items()}
        assert kinds == {"flavour": w.Dropdown, "strength": w.IntText, "enabled_extra": w.Checkbox}
        row.toggle.value = True
        row.fields["strength"][1].value = 7
        assert row.setting() == {"flavour": "sweet", "strength": 7, "enabled_extra": False}
    finally:
        unregister_technique("later")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: setattr(p.settings["steps"], "value", 0), "ablate: steps must be >= 1; got 0"),
        (lambda p: setattr(p.settings["warmup"], "value", 0), "ablate: warmup must be >= 1; got 0"),
        (
            lambda p: (
                setattr(p.rows["grad_accum"].toggle, "value", True),
                setattr(p.rows["grad_accum"].fields["steps"][1], "value", 64),
            ),
            "grad_accum: steps=64 exceeds batch_size=32",
        ),
        (
            lambda p: (
                setattr(p.rows["dataloader"].toggle, "value", True),
                setattr(p.rows["dataloader"].fields["num_workers"][1], "value", 0),
                setattr(p.rows["dataloader"].fields["prefetch_factor"][1], "value", "4"),
            ),
            "dataloader: prefetch_factor needs num_workers > 0",
        ),
    ],
)
def test_invalid_combinations_show_the_api_message(change, message):
    panel = wb.panel(model="mlp", techniques={})
    change(panel)
    assert panel.run() is False
    assert html.escape(message) in panel.status.value and "Error" in panel.status.value
    assert not panel.running


def test_a_saved_run_opens_in_the_panel(tmp_path):
    saved = synthetic_results(
        [
            result_row("baseline", speedup=1.0, low=1.0, high=1.0),
            result_row("amp", speedup=1.5, low=1.3, high=1.7),
            result_row("tf32", status="unavailable", reason="needs a CUDA device; this run is on cpu"),
        ],
        {"baseline": "baseline"},
    )
    saved.save(tmp_path / "run")
    panel = wb.panel(model="mlp")
    panel.saved_folder.value = str(tmp_path / "run")
    panel.open_button.click()
    assert panel.results is not None and panel.results.path == tmp_path / "run"
    assert "1.50× [1.30, 1.70]" in panel.table.value and "needs a CUDA device" in panel.table.value
    assert panel.final_image.layout.display != "none" and panel.final_image.value
    assert "Saved run (complete)" in panel.status.value
    # A folder without results says so in the status line, in one line, and changes nothing shown.
    assert not panel.open_saved(str(tmp_path / "nowhere"))
    assert "no results at" in panel.status.value and "1.50×" in panel.table.value


@pytest.mark.slow  # a real ablation in fresh processes
def test_run_shows_live_plots_and_results_and_refuses_a_second_run(tmp_path):
    # 10 steps: the live plot is drawn from the events of any run, and at the end whatever its length.
    panel = wb.panel(
        model="mlp", techniques={"amp": True}, steps=10, warmup=2, blocks=2, out=tmp_path / "panel"
    )
    assert panel.run() is True
    assert panel.run() is False and "already in progress" in panel.status.value
    results = panel.wait(timeout=300)
    assert results is not None and results.complete
    assert set(results.table.status) == {"ok"}
    assert panel.live_image.value[:4] == b"\x89PNG" and panel.final_image.value[:4] == b"\x89PNG"
    assert "baseline (control)" in panel.table.value and "Done" in panel.status.value
    assert len(panel.live.snapshot()["finished"]) == 6
    assert not panel.run_button.disabled and panel.stop_button.disabled


@pytest.mark.slow  # a real ablation in fresh processes
def test_stop_keeps_finished_blocks(tmp_path):
    # Each block is a fresh process of three arms of 20 steps (with amp's emulated bfloat16 on a
    # CPU: a second or more, process start included), so Stop, pressed within 0.2 s of the first
    # block's results, lands while the two blocks left are in flight.
    panel = wb.panel(
        model="mlp", techniques={"amp": True}, steps=20, warmup=2, blocks=3, out=tmp_path / "stop"
    )
    panel.run()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(panel.live.snapshot()["finished"]) < 2:
        time.sleep(0.2)
    panel.stop()
    results = panel.wait(timeout=120)
    assert results is not None and not results.complete
    assert "Stopped" in panel.status.value
    saved = wb.load_results(tmp_path / "stop")
    assert len(saved.record["units"]) >= 2


def test_a_stop_before_any_block_finished_shows_no_empty_results(capsys):
    """It said "finished blocks are kept" and drew an empty figure (a memory axis of +-0.04 MiB).
    And the run's own "Stopped before any process finished" went to the notebook's last cell."""
    panel = wb.panel(model="mlp", techniques={"amp": True}, steps=200, warmup=2, blocks=2, out=False)
    panel.run()
    panel.stop()  # the first block is still starting: nothing can have finished
    panel.wait(timeout=120)
    assert "nothing was measured" in panel.status.value and "kept" not in panel.status.value
    assert panel.final_image.layout.display == "none"
    assert "Stopped" not in capsys.readouterr().out  # the panel says it, in its own status line


def test_stop_while_advising_is_said_as_a_stop_not_an_error(monkeypatch):
    """Stop before advise's baseline (or tune's first round) finished read "Error: NothingMeasured".
    And Advise unticked the discard checkbox that only Run and Tune use."""

    def advise_until_stopped(**arguments):
        arguments["stop"].wait(60)
        raise NothingMeasured(
            "advise: the baseline's run was stopped before it finished; nothing to advise on"
        )

    monkeypatch.setattr("workbench.widgets.advise", advise_until_stopped)
    panel = wb.panel(model="mlp", steps=20, out=False)
    panel.overwrite.value = True
    assert panel.advise() is True
    panel.stop()
    panel.wait(timeout=60)
    assert panel.error is None and "Error" not in panel.status.value
    assert "Stopped before anything finished: nothing was measured" in panel.status.value
    assert panel.overwrite.value is True


def test_a_technique_asked_for_that_cannot_run_here_is_said_when_run_starts_and_ends():
    """tf32 on a CPU: the run measured the baseline alone and said "Done.", the reason only in the
    row's note."""
    panel = wb.panel(
        model="mlp", techniques={"tf32": True}, steps=4, warmup=1, blocks=1, control=False, out=False
    )
    assert panel.rows["tf32"].unavailable  # no CUDA device here
    assert panel.run() is True
    assert "Not run here (their notes say why): tf32." in panel.status.value
    assert panel.wait(timeout=120).complete
    said = panel.status.value
    assert said.startswith("<b>Done.</b>") and "Not run here (their notes say why): tf32." in said


def test_a_run_in_which_every_arm_failed_is_not_done():
    """Every arm timed out, and the status line said "Done." over a table of failures."""
    results = synthetic_results(
        [
            result_row("baseline", status="timed out", reason="over timeout_s"),
            result_row("amp", status="timed out"),
        ],
        roles={"baseline": "baseline"},
    )
    results.record["units"] = [
        {"arm": "baseline", "status": "timed out"},
        {"arm": "amp", "status": "timed out"},
    ]
    panel = wb.panel(model="mlp", out=False)
    panel._start(lambda: results, "running")
    panel.wait(timeout=60)
    assert "no arm measured a step" in panel.status.value and "Done" not in panel.status.value
    assert panel.final_image.value[:4] == b"\x89PNG"  # the table and figure say why each failed


A_PLAN = {
    "type": "plan",
    "arms": [{"name": "baseline", "unavailable": None}],
    "blocks": 1,
    "processes": 1,
    "remaining": 1,
}


def _redraw_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name == "workbench-panel-redraw")


def test_a_quick_stop_and_run_leaves_one_redraw_thread_and_stopping_stays_said(monkeypatch):
    """A redraw thread woken after its run ended went on drawing the next run beside that run's own;
    and a second after Stop, the redraw put "Running" back over "Stopping"."""
    monkeypatch.setattr("workbench.widgets.REDRAW_S", 0.05)
    panel = wb.panel(model="mlp", out=False)
    for _ in range(3):
        released = threading.Event()
        panel._start(lambda released=released: released.wait(60) and None, "running")
        panel.live(A_PLAN)  # the run's state is "running" from here on
        time.sleep(0.02)
        released.set()  # the job ends while its redraw thread sleeps
        panel.wait(timeout=10)
    panel._start(lambda: panel._stop.wait(60) and None, "running")
    panel.live(A_PLAN)
    # The earlier runs' redraw threads end once they wake and look (or finish a draw begun).
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _redraw_threads() > 1:
        time.sleep(0.05)
    assert _redraw_threads() == 1
    panel.stop()
    time.sleep(0.3)  # several redraws
    assert panel.status.value.startswith("Stopping")
    panel.wait(timeout=10)
    # wait() waits for the last redraw too: a daemon thread cut off inside matplotlib's font code
    # as the interpreter exits aborted the process ("terminate called without an active exception").
    assert _redraw_threads() == 0


def test_live_run_gathers_events_and_the_live_plot_renders():
    live = LiveRun()
    live(
        {
            "type": "plan",
            "arms": [{"name": "baseline", "unavailable": None}, {"name": "amp", "unavailable": None}],
            "processes": 2,
            "remaining": 2,
        }
    )
    live({"type": "start", "block": 0, "arms": ["baseline", "amp"], "process": "block", "attempt": 1})
    live({"type": "phase", "block": 0, "arm": "amp", "phase": "measure", "round": 3, "of": 10})
    assert live.snapshot()["current"] == "block 1: amp: measure 3/10"
    for block, rate in ((0, 120.0), (1, 125.0)):  # one line per block: no line across the gap between them
        progress = {
            "type": "progress",
            "arm": "amp",
            "block": block,
            "round": 3,
            "step": 5,
            "of": 10,
            "loss": 1.0,
        }
        live({**progress, "samples_per_s": rate})
    result = {
        "samples_per_s": 130.0,
        "losses": [2.0, 1.5, 1.2],
        "phase_ms": {"data": 1.0, "forward": 3.0, "backward": 5.0, "optimizer": 1.0},
        "wall_s": 0.1,
        "steps": 10,
    }
    live({"type": "unit", "arm": "amp", "block": 0, "status": "ok", "result": result})
    live({"type": "process_done", "block": 0, "job": "block"})
    live({"type": "telemetry", "time": time.time(), "cpu_percent": 80.0, "memory_used_mib": 2048.0})
    snapshot = live.snapshot()
    assert snapshot["state"] == "running" and len(snapshot["finished"]) == 1
    assert snapshot["processes_done"] == 1 and snapshot["processes"] == 2
    assert [(rate, block) for _, rate, block, _ in snapshot["throughput"]["amp"]] == [(120.0, 0), (125.0, 1)]
    figure = plot_live(snapshot)
    assert figure._repr_png_()[:4] == b"\x89PNG"
    gpu = {
        "type": "telemetry",
        "time": time.time(),
        "cpu_percent": 50.0,
        "memory_used_mib": 1.0,
        "gpu0_util_percent": 90.0,
        "gpu0_memory_used_mib": 4096.0,
        "gpu0_power_w": 300.0,
        "gpu0_sm_clock_mhz": 1800.0,
    }
    live(gpu)
    titles = [axes.get_title() for axes in plot_live(live.snapshot()).axes]
    assert "GPU util. and memory (NVML)" in titles and "GPU power and clock (NVML)" in titles


def test_the_live_view_draws_every_arm_of_a_grid_apart_and_says_what_empty_panels_wait_for():
    """A grid of three techniques plans ten arms: the seven colours came round, amp+compile drawn
    as the baseline. Before any block finished, two panels were bare 0-1 axes."""
    names = ["baseline", "baseline (control)", "amp", "compile", "grad_accum", "amp+compile", "amp+grad_accum",
             "compile+grad_accum", "amp+compile+grad_accum", "checkpointing+amp"]  # fmt: skip
    live = LiveRun()
    live({**A_PLAN, "arms": [{"name": name, "unavailable": None} for name in names], "processes": 3})
    for index, name in enumerate(names):
        live({"type": "progress", "arm": name, "block": 0, "samples_per_s": 100.0 + index})
    figure = plot_live(live.snapshot())
    throughput, breakdown, losses = figure.axes[:3]
    assert throughput.get_title().startswith("Throughput") and breakdown.get_title().startswith(
        "Step breakdown"
    )
    drawn = {line.get_label(): (line.get_color(), line.get_linestyle()) for line in throughput.get_lines()}
    assert set(drawn) == set(names) and len(set(drawn.values())) == len(names)
    for axes in (breakdown, losses):
        assert [text.get_text() for text in axes.texts] == ["shown once a block\nhas finished"]


def _fake_pynvml():
    fake = types.ModuleType("pynvml")
    fake.NVML_CLOCK_SM = 1
    fake.nvmlInit = lambda: None
    fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetCount = lambda: 1
    fake.nvmlDeviceGetHandleByIndex = lambda index: f"gpu{index}"
    fake.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=87, memory=40)
    fake.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=8 * 2**30, total=80 * 2**30)
    fake.nvmlDeviceGetPowerUsage = lambda handle: 312_500  # milliwatts
    fake.nvmlDeviceGetClockInfo = lambda handle, kind: 1755
    return fake


def test_the_sampler_reads_nvml_when_a_gpu_is_there(monkeypatch):
    """The NVML path, against a stand-in for nvidia-ml-py (no GPU here; verified on a device separately)."""
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    reader = _NvmlReader()
    assert reader.available
    assert reader.read() == {
        "gpu0_util_percent": 87.0,
        "gpu0_memory_used_mib": 8192.0,
        "gpu0_power_w": 312.5,
        "gpu0_sm_clock_mhz": 1755.0,
    }
    seen = []
    sampler = Sampler(interval_s=0.05, on_sample=seen.append).start()
    time.sleep(0.3)
    sampler.stop()
    assert seen and all(sample["gpu0_util_percent"] == 87.0 for sample in seen)


def test_without_nvidia_ml_py_the_reason_is_given(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # importing it raises ImportError
    reader = _NvmlReader()
    assert not reader.available and "pynvml is not installed (pip install nvidia-ml-py)" in reader.reason


@pytest.mark.slow  # a real ablation in fresh processes
def test_telemetry_is_stored_with_results_and_exported_to_csv(tmp_path):
    res = wb.ablate(
        model="mlp",
        techniques={},
        steps=400,
        warmup=2,
        blocks=1,
        control=False,
        out=tmp_path / "t",
        progress=False,
    )
    assert len(res.telemetry) >= 1 and {"time", "cpu_percent", "memory_used_mib"} <= set(
        res.telemetry.columns
    )
    res.save(tmp_path / "t")
    assert (tmp_path / "t" / "telemetry.csv").read_text().startswith("time,cpu_percent")


@pytest.mark.slow  # a real ablation in fresh processes
def test_out_false_keeps_nothing_on_disk(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    panel = wb.panel(model="mlp", techniques={}, steps=5, warmup=1, blocks=1, control=False, out=False)
    assert panel.arguments()["out"] is False
    assert panel.run()
    results = panel.wait(timeout=120)
    assert results is not None and results.path is None
    assert list(tmp_path.iterdir()) == [], "out=False must not create a results folder"
    assert panel.live_image.layout.display is None and panel.final_image.layout.display is None


@pytest.mark.slow  # a real ablation in fresh processes
def test_the_panel_says_when_the_figures_are_not_to_be_trusted(monkeypatch, tmp_path):
    from workbench import telemetry

    monkeypatch.setattr(telemetry, "LOAD_WARN_CORES", -1.0)  # any load at all counts as competition
    panel = wb.panel(model="mlp", techniques={}, steps=20, warmup=2, blocks=1, out=tmp_path / "busy")
    assert panel.run() is True
    results = panel.wait(timeout=300)
    assert results is not None and results.load["warning"]
    # Said once: counted in the status line, in full under the figure (the results' own table).
    assert re.search(r"<b>\d+ warnings?</b>, under the figure", panel.status.value)
    assert "other processes used" not in panel.status.value
    assert "other processes used" in html.unescape(panel.table.value)


@pytest.mark.parametrize("setting", sorted(RUN_SETTINGS))
def test_every_run_setting_reaches_ablate_through_the_panel(setting):
    """A setting the panel shows as a control, or passes through untouched: either way Run
    hands it to ablate (and the pre-flight checks it), so no option is lost on the way."""
    value = RUN_SETTINGS[setting]
    panel = wb.panel(model="mlp", **{setting: value})
    rule = run_options()[setting]  # a link comes back as its text, which means the same Link
    assert rule.validate(setting, panel.arguments()[setting]) == rule.validate(setting, value)
    assert panel.arguments()[setting] != getattr(RunConfig(), setting), "the control lost the value"


def test_every_setting_control_shows_its_value():
    """A Dropdown shows a value of None as blank: loader_arms' default (auto) once did."""
    panel = wb.panel(model="mlp")
    for name, control in panel.settings.items():
        if isinstance(control, w.Dropdown):
            assert control.label, f"{name}'s dropdown is blank"


def test_an_optimizer_factory_given_to_the_panel_is_a_choice_beside_the_built_in_ones():
    import functools

    import torch

    factory = functools.partial(torch.optim.SGD, lr=0.1)
    panel = wb.panel(model="mlp", optimizer=factory)
    control = panel.settings["optimizer"]
    assert control.label == "partial(SGD, lr=0.1)" and control.options[:2] == (
        ("adamw", "adamw"),
        ("sgd", "sgd"),
    )
    assert panel.arguments()["optimizer"] is factory
    lr = panel.settings["lr"]
    assert lr.disabled and "your optimizer factory sets its own" in lr.tooltip
    lr.value = 0.5  # a greyed-out box's value is not the factory's: not passed, so Run is not refused
    assert panel.arguments()["lr"] == wb.config.DEFAULT_LR and panel.run_config().optimizer is factory
    control.value = "sgd"
    assert panel.arguments()["optimizer"] == "sgd" and not lr.disabled
    assert panel.arguments()["lr"] == 0.5


def test_the_advise_and_tune_page_builds_its_calls_from_the_job_above():
    panel = wb.panel(model="mlp", techniques={"amp": True}, batch_size=8, blocks=3, steps=30)
    assert [panel.tabs.get_title(i) for i in range(2)] == ["Ablate", "Advise & tune"]
    advise_call = panel.advise_arguments()
    assert advise_call["batch_size"] == 8 and advise_call["steps"] == 30
    assert not {"techniques", "out", "blocks", "control", "loader_arms", "isolate"} & set(advise_call)
    tune_call = panel.tune_arguments()
    assert tune_call["techniques"] is None and tune_call["budget_s"] == 300.0  # the advisor's ranking
    assert not {"blocks", "mode", "loader_arms"} & set(tune_call)
    panel.search_space.value = "chosen"
    assert list(panel.tune_arguments()["techniques"]) == ["amp"]
    panel.rows["amp"].toggle.value = False
    assert panel.tune() is False and "switch on the techniques to search" in html.unescape(panel.status.value)
    # "Switch these on": the advice's (or the winner's) techniques become the Ablate page's toggles.
    panel._adoptable = {"compile": {"mode": "max-autotune"}, "grad_accum": {"steps": 4}}
    panel.rows["checkpointing"].toggle.value = True
    panel.tabs.selected_index = 1
    panel.adopt()
    chosen = panel.arguments()["techniques"]
    assert chosen["compile"]["mode"] == "max-autotune" and chosen["grad_accum"]["steps"] == 4
    assert "checkpointing" not in chosen and panel.tabs.selected_index == 0


def test_each_round_of_a_search_starts_the_live_lines_afresh():
    live = LiveRun()
    live({"type": "tune_round", "round": 1, "candidates": ["a", "b"], "blocks": 1})
    live({"type": "progress", "arm": "a", "samples_per_s": 100.0, "block": 0})
    live({"type": "tune_round", "round": 2, "candidates": ["a"], "blocks": 2})
    live({"type": "progress", "arm": "a", "samples_per_s": 120.0, "block": 0})
    snapshot = live.snapshot()
    assert [point[1] for point in snapshot["throughput"]["a"]] == [120.0]  # no line across rounds
    assert snapshot["current"].startswith("tuning, round 2: 1 candidate x 2 blocks")


def test_tune_is_refused_at_once_when_the_last_advice_recommends_nothing():
    from workbench.advisor import Facts, build_advice

    facts = Facts(
        device="cpu", step_ms=10.0, data_ms=1.0, comm_ms=0.0, overhead_ms=7.0, batch=8, half_batch_ms=6.0,
        full_batch_ms=7.0, busy_ms=3.0, matmul_ms=1.0, optimizer_ms=0.5, fp32_matmul_ms=0.0,
        forward_ms=3.0, ops=200.0, median_op_us=12.0, peak_mib=100.0, activation_mib=60.0,
        capacity_mib=1000.0, capacity_source="memory_cap_mb", has_conv=False, world_size=1,
    )  # fmt: skip
    empty = build_advice(facts, {})  # nothing available here: an empty ranking
    assert empty.bottleneck == "launch" and not empty.recommended
    panel = wb.panel(model="mlp", batch_size=8)
    panel._advice = (empty, panel.advise_arguments())  # as Advise leaves it for the same job
    assert panel.tune() is False and not panel.running
    message = html.unescape(panel.status.value)
    assert "found nothing available here that attacks this job's launch bottleneck" in message
    assert "search the techniques switched on in Ablate instead" in message
    panel.search_space.value = "chosen"  # the way out the message names still works
    assert "grad_accum" in panel.tune_arguments()["techniques"]


def eight_batches():
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator))
            for _ in range(8)]  # fmt: skip


@pytest.mark.slow  # the advisor's run and a search, in fresh processes
def test_advise_then_tune_from_the_panel(monkeypatch):
    # Without a C++ compiler, torch.compile is unavailable: its start (10-20 s here, measured in
    # the search's calibration and again in its screening) would only make this test wait.
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("workbench.techniques.compile.shutil.which", lambda name: None)
    # A candidate clearly slower than the baseline (grad_accum on a CPU, often) would end the search
    # after its screening, before Stop: this test is of Stop.
    monkeypatch.setattr("workbench.tuner._clearly_below_the_baseline", lambda figures: False)
    panel = wb.panel(model=two_layers, data=eight_batches(), batch_size=8, steps=20, warmup=2, out=False)
    panel.tabs.selected_index = 1
    assert panel.advise() is True
    advice = panel.wait(timeout=300)
    assert isinstance(advice, wb.Advice), panel.status.value
    assert f"the step is {advice.bottleneck}-bound" in panel.status.value
    assert panel.final_image.value[:4] == b"\x89PNG" and advice.bottleneck in panel.table.value
    assert not panel.adopt_button.disabled or not advice.recommended
    if advice.recommended:  # the search starts from that advice (not profiled again)
        assert panel.tune_arguments()["advice"] is advice
    else:  # a busy machine can leave nothing worth trying: refused at once, so search a chosen one
        assert panel.tune() is False and "found nothing available here" in html.unescape(panel.status.value)
        for name, row in panel.rows.items():
            if not row.unavailable:
                row.toggle.value = name == "grad_accum"
        panel.search_space.value = "chosen"
    # Stop ends the search like Ctrl-C.
    assert panel.tune() is True
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and panel.running and not panel.live.snapshot()["finished"]:
        time.sleep(0.2)
    assert panel.error is None, panel.error
    assert panel.live.snapshot()["current"].startswith("tuning, round 1"), panel.status.value
    panel.stop()
    panel.wait(timeout=120)
    assert not panel.running and not panel.tune_button.disabled and panel.stop_button.disabled
    assert panel.error is None, panel.error
    assert "stopped" in panel.status.value.lower() or "no candidate" in panel.status.value
