"""The notebook control panel: toggle techniques, press Run, watch the ablation live.

``wb.panel(...)`` takes the same arguments as ``wb.ablate`` as its defaults and returns an
ipywidgets panel generated from the technique registry: one toggle per technique, under its
group's heading (data, compute, memory, communication) and numbered in the order of
application, with a control per field of its Config dataclass (a dropdown where the field
lists its choices) shown while it is switched on, or one line saying why it cannot run here.
A technique added later appears without any change to this module. Every control is as wide as
its label and its longest value, in rows that wrap: tests/test_browser.py measures the panel in
a real page. A second page, "Advise & tune", runs ``wb.advise`` and ``wb.tune`` on the job the
panel's settings describe, and can switch the advice's recommendations, or the tuner's winner,
on in the first page.

The ablation runs in a background thread, so the kernel stays responsive; its events
(``ablate(on_event=...)``) are gathered by a LiveRun, and a second thread redraws the live
figure about once a second and the status line (process i of n, block, arm, elapsed time and
time left) every second. Widgets are updated only by setting their traits (an Image's PNG
bytes, an HTML's text), which is safe from a thread, unlike an Output widget's context manager.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable
from typing import Any

from workbench.optional import needed_by

with needed_by("workbench.widgets", "ipywidgets"):  # the notebook extra, said with how to install it
    import ipywidgets as w

from workbench.ablation import ablate, check_before_run
from workbench.advisor import ADVISOR_FIXES, Advice, advise
from workbench.config import (
    DEFAULT_LR,
    OPTIMIZERS,
    TUNER_DECIDES,
    NothingMeasured,
    Option,
    RunConfig,
    run_options,
    unknown_name_error,
)
from workbench.data import BUILTIN_DATA, data_label, resolve_data, with_collate_fn
from workbench.live_run import LiveRun, progress_line
from workbench.models import BUILTIN_MODELS, get_builtin_model, model_label
from workbench.panel_controls import (
    TechniqueRow,
    checkbox,
    dropdown,
    fitted,
    setting_control,
    setting_value,
    technique_groups,
)
from workbench.plots import plot_live
from workbench.results import load_results
from workbench.results_view import search_html
from workbench.techniques import all_techniques, technique_context
from workbench.tuner import check_advice_has_candidates, tune

REDRAW_S = 1.0
REDRAW_JOIN_S = 60.0  # the most wait() waits for a redraw under way when the run ended (a loaded machine)
STOPPED_BEFORE_ANYTHING = "<b>Stopped before anything finished: nothing was measured.</b>"
# The results figure's width in the panel, in inches (90 px each): about the panel's own width,
# so that its text is drawn near full size rather than shrunk from the default 13 inches.
FIGURE_IN = 10.0
READY = "Choose the techniques, then press <b>Run ablation</b>."  # the status line before any run
TUNE_BUDGETS = [
    ("1 min", 60),
    ("2 min", 120),
    ("5 min", 300),
    ("10 min", 600),
    ("30 min", 1800),
    ("1 hour", 3600),
]
# ablate's keywords that the panel takes and hands on untouched (it sets progress, on_event
# and stop itself; every run setting gets a control, and overwrite a checkbox beside out).
PANEL_PASSES_ON = ("overwrite", "retry_failed")
OVERWRITE_LABEL = "discard its earlier results"
OWN_DATA = "own"  # the data control's value for the model's own dataset (data=None)
# A note's text box may shrink below its text (ipywidgets' HTML content keeps its text's width,
# which pushed the row past the panel's edge), so that the note's own ellipsis can cut it.
PANEL_CSS = (
    "<style>.workbench-panel .workbench-note .widget-html-content {min-width: 0; overflow: hidden}</style>"
)


class AblationPanel(w.VBox):
    """Run settings, then two pages: technique toggles with Run/Stop, and Advise/Tune; live
    plots and the final results below them.

    Each run setting (RunConfig's fields) gets a control, built from its declared type, choices
    and help: the main ones in the first row, the others under "More settings".
    """

    def __init__(
        self,
        model: Any = "mlp",
        data: Any = None,
        loss_fn: Any = None,
        techniques: Any = None,
        out: Any = None,
        collate_fn: Any = None,
        **options: Any,
    ):
        data = with_collate_fn(data, collate_fn)  # the custom data choice carries it (ablate's argument)
        self.custom_model = None if isinstance(model, str) else model
        # Anything but a built-in name ("jpeg-folder:PATH", a JpegFolder, a Dataset...) is "custom".
        self.custom_data = None if data is None or (isinstance(data, str) and data in BUILTIN_DATA) else data
        self.loss_fn = loss_fn
        self.keep_on_disk = out is not False  # out=False: results live in memory only
        rules = run_options()
        self.ablate_kwargs = _passed_on(options, rules)
        overwrite = self.ablate_kwargs.pop("overwrite", False)
        self._no_run_yet()
        self._make_setting_controls(model, data, out, overwrite, options)
        chosen = {t.name: t.Config() for t in all_techniques()} if techniques is None else dict(techniques)
        self.rows = {
            t.name: TechniqueRow(t, chosen.get(t.name, False), position)
            for position, t in enumerate(all_techniques(), start=1)
        }
        self._make_run_controls_and_outputs()
        ablate_page = w.VBox(
            [
                technique_groups(self.rows),
                w.HBox([self.run_button, self.stop_button]),
                self._make_open_controls(),
            ]
        )
        # The same Stop button shows on both pages: one widget, two views of it.
        self.tabs = w.Tab([ablate_page, self._make_tuning_page()])
        self.tabs.set_title(0, "Ablate")
        self.tabs.set_title(1, "Advise & tune")
        super().__init__(
            [
                w.HTML(PANEL_CSS + "<h3 style='margin:4px 0'>workbench: controlled ablation</h3>"),
                self._settings_box(rules),
                self.tabs,
                self.status,
                self.live_image,
                self.final_image,
                self.table,
            ]
        )
        self.add_class("workbench-panel")
        self.refresh_availability()

    def _no_run_yet(self) -> None:
        """The state of the panel's runs before the first."""
        self.results = None
        self.error: str | None = None
        self._stopped_before_anything = False  # Stop ended advise or tune before they had anything
        self._not_run_here = ""  # the techniques asked for that the last Run could not run here
        self.live = LiveRun()
        self._thread: threading.Thread | None = None
        self._redraw: threading.Thread | None = None  # the run's live view, redrawn while it goes on
        self._stop = threading.Event()
        self._sources: dict[tuple, Any] = {}  # resolved data per (model, data, seed) choice
        self._advice: tuple[Advice | None, dict | None] = (None, None)  # the last advice, and for what job
        self._adoptable: dict = {}  # what "Switch these on" would set: advice's or the tuner's winner

    def _make_setting_controls(self, model: Any, data: Any, out: Any, overwrite: Any, options: dict) -> None:
        """Model, data, out and overwrite, then one control per run setting, each at its value."""
        model_options = list(BUILTIN_MODELS) + (
            [f"custom: {model_label(model)}"] if self.custom_model else []
        )
        self.model = dropdown("model", model_options, model if isinstance(model, str) else model_options[-1])
        chosen = "custom" if self.custom_data is not None else OWN_DATA if data is None else data
        widest = max(len(label) for name in BUILTIN_MODELS for label, _ in self._data_options(name))
        self.data = dropdown("data", self._data_options(self.model.value), chosen, longest=widest)
        self.model.observe(lambda _: self._show_the_data_used(), names="value")
        # Each value checked on its own (a Link from its dict...); rules that tie settings
        # together (link needs world_size >= 2) are checked at Run, once the user has set both.
        defaults = RunConfig()
        self.settings = {
            name: setting_control(name, rule, rule.validate(name, options.get(name, getattr(defaults, name))))
            for name, rule in run_options().items()
        }
        self.out = w.Text(
            value="" if out in (None, False) else str(out),
            placeholder="new folder under workbench-results"
            if self.keep_on_disk
            else "none: results kept in memory",
            description="out",
            **fitted("out", 40, "text"),
        )
        self.overwrite = checkbox(
            OVERWRITE_LABEL,
            bool(overwrite),
            tooltip="at the next Run, remove what an earlier run wrote in out (only workbench's own "
            "files) and measure afresh; unticked again once that run starts",
        )
        for control in (self.model, self.data, self.settings["device"], self.settings["world_size"]):
            control.observe(lambda _: self.refresh_availability(), names="value")
        self.settings["optimizer"].observe(lambda _: self._lr_for_the_optimizer(), names="value")
        self._lr_for_the_optimizer()

    def _lr_for_the_optimizer(self) -> None:
        """An optimizer factory of the user's sets its own learning rate: the lr box, which is
        adamw's and sgd's, is greyed out (and not passed) while the factory is chosen."""
        lr = self.settings["lr"]
        lr.disabled = not isinstance(self.settings["optimizer"].value, str)
        lr.tooltip = (
            f"your optimizer factory sets its own learning rate; this box is for {' and '.join(OPTIMIZERS)}"
            if lr.disabled
            else run_options()["lr"].help
        )

    def _data_options(self, model: str) -> list[tuple[str, str]]:
        """The data choices, the model's own dataset named: the control shows what the run uses."""
        own = (
            f"{get_builtin_model(model).default_data} ({model}'s own)"
            if model in BUILTIN_MODELS
            else "none: give data= to wb.panel"
        )
        custom = (
            [(f"custom: {_short_label(self.custom_data)}", "custom")] if self.custom_data is not None else []
        )
        return [(own, OWN_DATA), *[(name, name) for name in BUILTIN_DATA], *custom]

    def _show_the_data_used(self) -> None:
        """Name the new model's own dataset (new options select the first one: the choice is kept)."""
        chosen = self.data.value
        self.data.options = self._data_options(self.model.value)
        self.data.value = chosen

    def _make_run_controls_and_outputs(self) -> None:
        """Run and Stop, the status line, the live and final plots and the results table."""
        self.run_button = w.Button(description="Run ablation", button_style="success", icon="play")
        self.stop_button = w.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.run_button.add_class("workbench-run")
        self.stop_button.add_class("workbench-stop")
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        self.status = w.HTML(READY)
        self._settings_error: str | None = None  # the status line's settings error, cleared once mended
        self.status.add_class("workbench-status")
        self.live_image = w.Image(
            format="png", layout=w.Layout(width="100%", max_width="1200px", display="none")
        )
        self.live_image.add_class("workbench-live-plot")
        self.final_image = w.Image(
            format="png", layout=w.Layout(width="100%", max_width="1200px", display="none")
        )
        self.table = w.HTML()
        self.table.add_class("workbench-results")

    def _make_open_controls(self) -> w.Widget:
        """A saved run's folder, and a button that shows its plot and table here."""
        self.saved_folder = w.Text(
            placeholder="a results folder, e.g. results/quick",
            layout=w.Layout(width="320px", min_width="200px"),
        )
        self.open_button = w.Button(
            description="Open saved run", icon="folder-open", layout=w.Layout(width="auto")
        )
        self.open_button.add_class("workbench-open")
        self.open_button.on_click(lambda _: self.open_saved())
        return w.HBox([self.saved_folder, self.open_button], layout=w.Layout(flex_flow="row wrap"))

    def open_saved(self, folder: str | None = None) -> bool:
        """Show a saved run (a results folder or its results.json) as a finished run is shown.
        Refused while a run is going; an unreadable folder is said in the status line."""
        if self.running:
            self.status.value = _error_html("a run is going on: stop it, or wait, before opening a saved one")
            return False
        folder = (folder if folder is not None else self.saved_folder.value).strip()
        if not folder:
            self.status.value = _error_html("type the results folder to open (one that ablate's out= wrote)")
            return False
        try:
            saved = load_results(folder)
        except (ValueError, FileNotFoundError) as error:
            self.status.value = _error_html(str(error))
            return False
        self.results, self.error = saved, None
        self.live_image.layout.display = "none"  # the live view belongs to the run made here
        self._show(saved.plot(FIGURE_IN), saved._repr_html_())
        state = "complete" if saved.complete else "partial: stopped before every block ran"
        self.status.value = f"<b>Saved run ({state}):</b> {html.escape(str(saved.path))}" + _warnings_below(
            saved.warnings()
        )
        return True

    def _make_tuning_page(self) -> w.Widget:
        """The advisor's verdict on the job set above, and the tuner's budgeted search."""
        self.budget = dropdown("budget", TUNE_BUDGETS, 300)
        self.search_space = dropdown(
            "search",
            [("the advisor's ranking", "advisor"), ("the techniques switched on in Ablate", "chosen")],
            "advisor",
        )
        self.advise_button = w.Button(description="Advise", button_style="info", icon="stethoscope")
        self.tune_button = w.Button(description="Tune", button_style="success", icon="sliders")
        self.adopt_button = w.Button(
            description="Switch these on in Ablate",
            icon="check",
            disabled=True,
            layout=w.Layout(width="auto"),
            tooltip="the advisor's recommendations, or the tuner's winner, as the Ablate page's toggles",
        )
        for button, name in (
            (self.advise_button, "advise"),
            (self.tune_button, "tune"),
            (self.adopt_button, "adopt"),
        ):
            button.add_class(f"workbench-{name}")
        self.advise_button.on_click(lambda _: self.advise())
        self.tune_button.on_click(lambda _: self.tune())
        self.adopt_button.on_click(lambda _: self.adopt())
        explanation = w.HTML(
            "<b>Advise</b> profiles a short baseline of the job above and names its bottleneck, with the "
            "figures. <b>Tune</b> searches combinations of techniques and their settings for the fastest "
            "whose loss still matches, within the budget: as many candidates as a share of it holds screened "
            "in one block, the better half kept each round with more blocks."
        )
        return w.VBox(
            [
                explanation,
                w.HBox([self.budget, self.search_space], layout=w.Layout(flex_flow="row wrap")),
                w.HBox([self.advise_button, self.tune_button, self.stop_button, self.adopt_button]),
            ]
        )

    def _settings_box(self, rules: dict[str, Option]) -> w.Widget:
        """Model, data and the main settings on top, wrapping on narrow pages; the rest folded."""
        wrap = w.Layout(flex_flow="row wrap")
        main = [self.settings[name] for name, rule in rules.items() if rule.main]
        more = [self.settings[name] for name, rule in rules.items() if not rule.main]
        folded = w.Accordion([w.HBox(more, layout=wrap)], selected_index=None)
        folded.set_title(0, "More settings")
        out = w.HBox([self.out, self.overwrite], layout=wrap)
        return w.VBox([w.HBox([self.model, self.data, *main], layout=wrap), out, folded])

    # ----- settings -> ablate arguments --------------------------------------------------

    def _model_value(self) -> Any:
        return self.custom_model if self.model.value.startswith("custom:") else self.model.value

    def _data_value(self) -> Any:
        if self.data.value == OWN_DATA:
            return None
        return self.custom_data if self.data.value == "custom" else self.data.value

    def refresh_availability(self) -> None:
        """Re-check every technique against the chosen model, data, device and ranks."""
        try:
            run = self.run_config()
            model = self._model_value()
            key = (self.model.value, self.data.value, run.seed)
            if key not in self._sources:  # a user's data factory is called once, not per change
                self._sources[key] = resolve_data(self._data_value(), model)
            ctx = technique_context(run, model, self._sources[key])
        except ValueError as error:
            self.status.value = self._settings_error = _error_html(str(error))
            return
        if self.status.value == self._settings_error:  # mended: its error goes
            self.status.value = READY
        self._settings_error = None
        for row in self.rows.values():
            row.set_reason(row.technique.unavailable_reason(ctx, row.technique.Config()))

    def run_config(self) -> RunConfig:
        """The run settings as the controls hold them now, checked (ValueError if one is bad)."""
        return RunConfig.from_options("panel", self.setting_values())

    def setting_values(self) -> dict[str, Any]:
        values = {name: setting_value(rule, self.settings[name]) for name, rule in run_options().items()}
        if not isinstance(values["optimizer"], str):  # a factory sets its own lr: the greyed-out box's
            values["lr"] = DEFAULT_LR  # value is adamw's and sgd's
        return values

    def arguments(self) -> dict:
        """What Run passes to ``wb.ablate``."""
        techniques = {name: row.setting() for name, row in self.rows.items() if not row.unavailable}
        return {
            "model": self._model_value(),
            "data": self._data_value(),
            "loss_fn": self.loss_fn,
            "techniques": {name: value for name, value in techniques.items() if value is not False},
            **self.setting_values(),
            "out": self.out.value.strip() or (None if self.keep_on_disk else False),
            "overwrite": self.overwrite.value,
            **self.ablate_kwargs,
        }

    def advise_arguments(self) -> dict:
        """What Advise passes to ``wb.advise``: the job and its settings, less what the advisor fixes."""
        arguments = self.arguments()
        for name in ("techniques", "out", *PANEL_PASSES_ON, *ADVISOR_FIXES):
            arguments.pop(name, None)
        return arguments

    def tune_arguments(self) -> dict:
        """What Tune passes to ``wb.tune`` (ValueError when there is nothing to search)."""
        arguments = self.arguments()
        chosen = arguments.pop("techniques")
        for name in ("retry_failed", *TUNER_DECIDES):
            arguments.pop(name, None)
        if self.search_space.value == "chosen" and not chosen:
            raise ValueError(
                "tune: switch on the techniques to search on the Ablate page, or search the advisor's ranking"
            )
        arguments["techniques"] = chosen if self.search_space.value == "chosen" else None
        advice, advised = self._advice
        if arguments["techniques"] is None and advice is not None and advised == self.advise_arguments():
            # An empty ranking has nothing to search: say so now rather than from the run's thread.
            check_advice_has_candidates(advice, "search the techniques switched on in Ablate instead")
            arguments["advice"] = advice  # the same job was just profiled: no need to profile it again
        return {**arguments, "budget_s": float(self.budget.value)}

    # ----- run / stop --------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self) -> bool:
        """Start the ablation in the background. Refused (False) while one is in flight or input is bad."""
        if self._refused_while_running():  # first: the pre-flight would read the running job's folder
            return False
        arguments = self.arguments()
        try:  # the same validation, and the same one-line messages, as the API
            check_before_run(arguments)  # bad settings or an out the run would refuse: said now
        except ValueError as error:
            self.status.value = _error_html(str(error))
            return False
        # A technique asked for that cannot run here is said now: its row's note alone was missed,
        # and a run of the baseline alone then said "Done." (tf32 on a CPU).
        missing = [name for name, row in self.rows.items() if row.wanted_but_unavailable]
        self._not_run_here = f" Not run here (their notes say why): {', '.join(missing)}." if missing else ""
        return self._start(
            lambda: ablate(**arguments, progress=False, on_event=self.live, stop=self._stop),
            "Starting: each block is a fresh process that runs every arm side by side, so it takes a few "
            "seconds to start." + html.escape(self._not_run_here),
        )

    def advise(self) -> bool:
        """Profile the job's baseline in the background (``wb.advise``); False if refused."""
        try:
            self.run_config()
            arguments = self.advise_arguments()
        except ValueError as error:
            self.status.value = _error_html(str(error))
            return False

        def advise_and_remember():
            advice = advise(**arguments, progress=False, on_event=self.live, stop=self._stop)
            self._advice = (advice, arguments)
            return advice

        # The advisor keeps no folder: the discard checkbox is left for the Run or Tune it is meant for.
        return self._start(
            advise_and_remember, "Advising: profiling a short baseline in a fresh process.", discards=False
        )

    def tune(self) -> bool:
        """Search for the fastest combination in the background (``wb.tune``); False if refused."""
        try:
            self.run_config()
            arguments = self.tune_arguments()
        except ValueError as error:
            self.status.value = _error_html(str(error))
            return False
        return self._start(
            lambda: tune(**arguments, progress=False, on_event=self.live, stop=self._stop),
            f"Tuning within {_budget_label(arguments['budget_s'])}: "
            + (
                "searching the techniques switched on."
                if arguments["techniques"]
                else "searching the last advice's ranking."
                if "advice" in arguments
                else "advising first."
            ),
        )

    def adopt(self) -> None:
        """Set the Ablate page's toggles to the last advice's recommendations or the tuner's winner."""
        if not self._adoptable:
            return
        for name, row in self.rows.items():
            if not row.unavailable:
                row.set_setting(self._adoptable.get(name, False))
        self.tabs.selected_index = 0
        self.status.value = (
            "Switched on: " + html.escape(", ".join(self._adoptable)) + ". Press <b>Run ablation</b>."
        )

    def _refused_while_running(self) -> bool:
        if self.running:
            self.status.value = _error_html("A run is already in progress: wait for it, or press Stop first.")
        return self.running

    def _start(self, job: Callable[[], Any], message: str, discards: bool = True) -> bool:
        if self._refused_while_running():
            return False
        self.error, self.results, self._adoptable = None, None, {}
        self._stopped_before_anything = False
        self.live = LiveRun()
        self._stop = threading.Event()
        self.final_image.value, self.table.value = b"", ""
        self.final_image.layout.display = "none"
        self._set_running(True)
        if (
            discards
        ):  # one discard per tick: a later run in the same folder resumes or refuses, as the API's do
            self.overwrite.value = False
        self.status.value = message
        self._thread = threading.Thread(
            target=self._run_job, args=(job,), daemon=True, name="workbench-panel-run"
        )
        self._thread.start()
        self._redraw = threading.Thread(
            target=self._redraw_while_running,
            args=(self._thread,),
            daemon=True,
            name="workbench-panel-redraw",
        )
        self._redraw.start()
        return True

    def _set_running(self, running: bool) -> None:
        for button in (self.run_button, self.advise_button, self.tune_button):
            button.disabled = running
        self.stop_button.disabled = not running
        self.adopt_button.disabled = running or not self._adoptable

    def stop(self) -> None:
        """End the run like Ctrl-C: the run in flight is dropped, finished ones are kept."""
        if self.running:
            self._stop.set()
            self.status.value = "Stopping: ending the process in flight; finished blocks are kept."

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the run finishes (for scripts and tests); returns its Results (an Advice
        after Advise)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive() and self._redraw is not None:
                # Its last draw, too: a daemon thread cut off inside matplotlib's font code as the
                # interpreter exits aborts the whole process ("terminate called without an active
                # exception", one script in three that stopped a run and then ended).
                self._redraw.join(REDRAW_JOIN_S)
        return self.results

    def _run_job(self, job: Callable[[], Any]) -> None:
        try:
            self.results = job()
        except Exception as error:  # shown in the panel: a thread has nowhere else to report
            if isinstance(error, NothingMeasured) and self._stop.is_set():
                # Stop pressed before advise's baseline or tune's first round finished: no error.
                self._stopped_before_anything = True
                self.live.state = "stopped"
            else:
                self.error = f"{type(error).__name__}: {error}"
                self.live.state = "failed"
        finally:
            self._finish()

    def _finish(self) -> None:
        self._draw_live()
        outcome = self.results
        if isinstance(outcome, Advice):
            self._show_advice(outcome)
        elif outcome is not None and "tune" in outcome.record:
            self._show_search(outcome)
        elif outcome is not None and not outcome.complete and not _measured(outcome):
            # Stopped before any block finished: an empty figure and table would only mislead.
            self.status.value = STOPPED_BEFORE_ANYTHING
        elif outcome is not None:
            self._show(outcome.plot(FIGURE_IN), outcome._repr_html_())
            where = f" Results: {outcome.path}" if outcome.path else ""
            said = f"<b>{self._verdict(outcome)}</b>{html.escape(where + self._not_run_here)}"
            self.status.value = said + _warnings_below(outcome.warnings())
        elif self._stopped_before_anything:
            self.status.value = STOPPED_BEFORE_ANYTHING
        elif self.error:
            self.status.value = _error_html(self.error)
        self._set_running(False)

    def _verdict(self, results) -> str:
        """The status line's first words for an ablation's results."""
        if not results.complete:
            return "Stopped; finished blocks are kept."
        if not _measured(results):  # every arm failed: the table under the figure says why
            return "Finished, but no arm measured a step: the table says why."
        if self.live.processes_started == 0:  # a folder whose run was complete: nothing was left to run
            return (
                "Already complete: nothing was left to run, so these are its saved results. To measure "
                f"again, tick '{OVERWRITE_LABEL}' beside out."
            )
        return "Done."

    def _show_advice(self, advice: Advice) -> None:
        self._adoptable = dict(advice.recommended)
        self._show(advice.plot(), advice._repr_html_())
        recommended = ", ".join(advice.recommended) or "nothing that runs here"
        self.status.value = (
            f"<b>Advice:</b> the step is {html.escape(advice.bottleneck)}-bound. Worth measuring: "
            f"{html.escape(recommended)}."
        )

    def _show_search(self, results) -> None:
        self._adoptable = dict(results.best)
        self._show(results.plot_tuning(), search_html(results.record["tune"]))
        where = f" Results: {results.path}" if results.path else ""
        self.status.value = (
            f"<b>{html.escape(results.tuning_verdict)}</b>{html.escape(where)}"
            + _warnings_html(results.warnings())
        )

    def _show(self, figure, table_html: str) -> None:
        self.final_image.value = figure._repr_png_()
        self.final_image.layout.display = None
        self.table.value = table_html

    def _redraw_while_running(self, job: threading.Thread) -> None:
        # While *its* run goes on: a redraw thread that watched the panel's running job would, woken
        # after a quick Stop and Run, go on beside the next run's own.
        drawn = -1
        while job.is_alive():
            if self.live.version != drawn:
                drawn = self.live.version
                self._draw_live()
            else:  # the clock moves on between events
                self._show_progress(self.live.snapshot())
            job.join(REDRAW_S)  # a pause that ends when the run does

    def _draw_live(self) -> None:
        snapshot = self.live.snapshot()
        self.live_image.value = plot_live(snapshot)._repr_png_()
        self.live_image.layout.display = None
        self._show_progress(snapshot)

    def _show_progress(self, snapshot: dict) -> None:
        if snapshot["state"] == "running" and self.running and not self._stop.is_set():  # else "Stopping"
            self.status.value = f"<b>Running:</b> {html.escape(progress_line(snapshot))}"


def _measured(results) -> bool:
    return any(unit["status"] == "ok" for unit in results.record["units"])


def _passed_on(options: dict[str, Any], rules: dict) -> dict[str, Any]:
    """Of the panel's keyword arguments, those it passes on to ablate as they are: not run settings
    (``rules``, which its controls hold), and only those in PANEL_PASSES_ON."""
    passed = {key: value for key, value in options.items() if key not in rules}
    for key in passed:
        if key not in PANEL_PASSES_ON:
            raise unknown_name_error("panel argument", key, [*PANEL_PASSES_ON, *rules])
    return passed


def _short_label(data: Any) -> str:
    label = data_label(data)
    return label if len(label) <= 40 else "..." + label[-37:]


def _warnings_html(warnings: list[str]) -> str:
    return "".join(
        f"<br><span style='color:#c44e52'><b>Warning:</b> {html.escape(w)}</span>" for w in warnings
    )


def _warnings_below(warnings: list[str]) -> str:
    """How many warnings the results' table shows under the figure: said once, not twice."""
    count = len(warnings)
    if not count:
        return ""
    return (
        f"<br><span style='color:#c44e52'><b>{count} warning{'s' * (count != 1)}</b>, "
        "under the figure: read before trusting the figures.</span>"
    )


def _budget_label(seconds: float) -> str:
    return next((label for label, value in TUNE_BUDGETS if value == seconds), f"{seconds:.0f} s")


def _error_html(message: str) -> str:
    # The API's advice in the panel's words: its checkbox is what overwrite=True is here.
    message = message.replace("pass overwrite=True to", f"tick '{OVERWRITE_LABEL}' beside out to")
    return f"<span style='color:#b00020'><b>Error:</b> {html.escape(message)}</span>"


def panel(
    model: Any = "mlp", data: Any = None, loss_fn: Any = None, techniques: Any = None, **kwargs: Any
) -> AblationPanel:
    """An ipywidgets control panel for ``wb.ablate``; its arguments are the panel's defaults."""
    return AblationPanel(model=model, data=data, loss_fn=loss_fn, techniques=techniques, **kwargs)
