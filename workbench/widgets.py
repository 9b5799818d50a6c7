"""The notebook control panel: toggle techniques, press Run, watch the ablation live.

``wb.panel(...)`` takes the same arguments as ``wb.ablate`` as its defaults and returns an
ipywidgets panel generated from the technique registry: one toggle per technique, with a
control per field of its Config dataclass (a dropdown where the field lists its choices),
disabled with its reason when it cannot run here. A technique added later appears
without any change to this module. A second page, "Advise & tune", runs ``wb.advise`` and
``wb.tune`` on the job the panel's settings describe, and can switch the advice's
recommendations, or the tuner's winner, on in the first page.

The ablation runs in a background thread, so the kernel stays responsive; its events
(``ablate(on_event=...)``) are gathered by a LiveRun, and a second thread redraws the live
figure about once a second. Widgets are updated only by setting their traits (an Image's
PNG bytes, an HTML's text), which is safe from a thread, unlike an Output widget's
context manager.
"""

from __future__ import annotations

import dataclasses
import html
import threading
import time
import types
import typing
from collections.abc import Callable
from typing import Any

import ipywidgets as w

from workbench.ablation import ablate, plan, plan_arguments
from workbench.advisor import ADVISOR_FIXES, Advice, advise
from workbench.config import TUNER_DECIDES, Option, RunConfig, run_options, unknown_name_error
from workbench.data import BUILTIN_DATA, data_label, resolve_data
from workbench.models import BUILTIN_MODELS, model_label
from workbench.plots import plot_live
from workbench.techniques import Technique, all_techniques, technique_context
from workbench.tuner import tune

REDRAW_S = 1.0
TUNE_BUDGETS = [
    ("1 min", 60),
    ("2 min", 120),
    ("5 min", 300),
    ("10 min", 600),
    ("30 min", 1800),
    ("1 hour", 3600),
]
# ablate's keywords that the panel takes and hands on untouched (it sets progress, on_event
# and stop itself; every run setting gets a control).
PANEL_PASSES_ON = ("overwrite", "retry_failed")


class LiveRun:
    """Everything a running ablation has reported so far, gathered from its events (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.time()
        self.arms: list[str] = []
        self.processes = 0  # blocks' processes planned (a block's shared one, arms' own ones)
        self.processes_done = 0
        self.finished: list[dict] = []  # "unit" events: one arm's measurements in one block
        # arm -> [(seconds, samples/s, block)]: the block lets a plot break the line between processes
        self.throughput: dict[str, list[tuple[float, float, int]]] = {}
        self.telemetry: list[dict] = []
        self.current = ""
        self.stage = ""  # the tuner's round, shown before what runs now
        self.state = "idle"  # idle, running, done, stopped, failed
        self.version = 0  # bumped by every event, so the redraw thread knows when to redraw

    def __call__(self, event: dict) -> None:
        with self._lock:
            self.version += 1
            kind = event["type"]
            elapsed = time.time() - self.started
            if kind == "plan":
                self.arms = [arm["name"] for arm in event["arms"] if not arm["unavailable"]]
                self.processes = event["processes"]
                self.processes_done = event["processes"] - event["remaining"]
                self.state = "running"
            elif kind == "start":
                alone = f", {event['arms'][0]} in its own process" if event["process"] == "own" else ""
                self.current = f"block {event['block'] + 1}{alone}: starting"
            elif kind == "phase" and "arm" in event:
                round_text = f" {event['round']}/{event['of']}" if event.get("phase") == "measure" else ""
                self.current = f"block {event['block'] + 1}: {event['arm']}: {event['phase']}{round_text}"
            elif kind == "progress":
                point = (elapsed, event["samples_per_s"], event["block"])
                self.throughput.setdefault(event["arm"], []).append(point)
            elif kind == "unit":
                self.finished.append(event)
            elif kind == "process_done":
                self.processes_done += 1
            elif kind == "telemetry":
                self.telemetry.append(event)
            elif kind in ("done", "stopped"):
                self.state = kind
            elif kind == "tune_round":
                # Each round is a new ablation of other arms: its throughput lines start afresh
                # (block numbers restart at 0, and a line must never join two rounds' points).
                self.throughput, self.finished, self.processes_done = {}, [], 0
                count = len(event["candidates"])
                self.stage = (
                    f"tuning, round {event['round'] + 1}: {count} candidate{'s' * (count != 1)} x "
                    f"{event['blocks']} block{'s' * (event['blocks'] != 1)}"
                )

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "started": self.started,
                "arms": list(self.arms),
                "processes": self.processes,
                "processes_done": self.processes_done,
                "finished": list(self.finished),
                "throughput": {arm: list(points) for arm, points in self.throughput.items()},
                "telemetry": list(self.telemetry),
                "current": f"{self.stage}; {self.current}" if self.stage else self.current,
                "state": self.state,
            }


def _field_widget(config_field: dataclasses.Field, value: Any, hints: dict) -> w.Widget:
    """A control for one Config field, chosen from its type and declared choices."""
    annotation = hints.get(config_field.name, str)
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else ()
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    layout = w.Layout(width="170px")
    label = config_field.name
    if "choices" in config_field.metadata:
        return w.Dropdown(
            options=list(config_field.metadata["choices"]),
            value=value,
            description=label,
            layout=layout,
            style={"description_width": "initial"},
        )
    if base is bool and not optional:
        return w.Checkbox(value=bool(value), description=label, indent=False, layout=w.Layout(width="150px"))
    if base is bool:
        return w.Dropdown(
            options=[("auto", None), ("True", True), ("False", False)],
            value=value,
            description=label,
            layout=layout,
            style={"description_width": "initial"},
        )
    if base is int and not optional:
        return w.IntText(
            value=value, description=label, layout=layout, style={"description_width": "initial"}
        )
    shown = "" if value is None or callable(value) else str(value)
    return w.Text(
        value=shown,
        placeholder="default",
        description=label,
        layout=w.Layout(width="220px"),
        style={"description_width": "initial"},
    )


def _read_field(widget: w.Widget, config_field: dataclasses.Field, hints: dict) -> Any:
    if not isinstance(widget, w.Text):
        return widget.value
    text = widget.value.strip()
    if not text:
        return None
    annotation = hints.get(config_field.name, str)
    for number in (int, float):  # e.g. bucket_cap_mb: float | None
        if number in typing.get_args(annotation):
            try:
                return number(text)
            except ValueError:
                continue
    return text  # the Config's own validation names the field and the rule


class TechniqueRow(w.HBox):
    """One technique: its toggle, a control per Config field, and why it is unavailable (if so)."""

    def __init__(self, technique: Technique, setting: Any):
        self.technique = technique
        self.hints = typing.get_type_hints(technique.Config)
        enabled = setting is not None and setting is not False
        config = technique.configure(setting) if enabled else technique.Config()
        self.toggle = w.Checkbox(
            value=enabled, description=technique.name, indent=False, layout=w.Layout(width="140px")
        )
        self.toggle.add_class(f"workbench-technique-{technique.name}")
        self.fields = {
            f.name: (f, _field_widget(f, getattr(config, f.name), self.hints))
            for f in dataclasses.fields(technique.Config)
        }
        self.note = w.HTML(layout=w.Layout(width="auto"))
        self.summary = technique.summary
        super().__init__([self.toggle, *(widget for _, widget in self.fields.values()), self.note])
        self.set_reason(None)

    def set_reason(self, reason: str | None) -> None:
        """Disable the row, showing why, when the technique cannot run here."""
        self.unavailable = reason
        self.toggle.disabled = reason is not None
        for _, widget in self.fields.values():
            widget.disabled = reason is not None
        if reason:
            self.toggle.value = False
            self.note.value = f"<span style='color:#a33'>unavailable: {html.escape(reason)}</span>"
        else:
            self.note.value = f"<span style='color:#666'>{html.escape(self.summary)}</span>"

    def set_setting(self, setting: Any) -> None:
        """Switch the technique on with ``setting`` (True, a dict) or off (False), as ablate reads it."""
        enabled = setting is not None and setting is not False
        config = self.technique.configure(setting) if enabled else self.technique.Config()
        self.toggle.value = enabled
        for name, (_, widget) in self.fields.items():
            value = getattr(config, name)
            widget.value = ("" if value is None else str(value)) if isinstance(widget, w.Text) else value

    def setting(self) -> Any:
        """False when off; otherwise the dict of options (validated later, by the API)."""
        if not self.toggle.value:
            return False
        return {name: _read_field(widget, f, self.hints) for name, (f, widget) in self.fields.items()}


def _setting_control(name: str, rules: Option, value: Any) -> w.Widget:
    """A control for one run setting, from its Option: a dropdown for choices, a checkbox for a
    switch, a number box, or a text box where "auto" (or "none") is a valid answer."""
    common = {"description": name, "tooltip": rules.help, "style": {"description_width": "initial"}}
    narrow = w.Layout(width="190px")
    if name == "device":  # its choices are this machine's devices
        return w.Dropdown(options=_device_options(value), value=value, layout=narrow, **common)
    if rules.choices is not None:
        width = 9 * max(len(word) for word in rules.choices) + 8 * len(name) + 50
        # The words are the options: a Dropdown shows a value of None (loader_arms' "auto") as blank.
        return w.Dropdown(
            options=list(rules.choices),
            value=rules.word(value),
            layout=w.Layout(width=f"{width}px"),
            **common,
        )
    if rules.kind is bool:
        return w.Checkbox(value=value, indent=False, layout=w.Layout(width="150px"), **common)
    if rules.kind is int and not rules.auto:
        return w.IntText(value=value, layout=narrow, **common)
    if rules.kind is float and not rules.auto:
        return w.FloatText(value=value, layout=narrow, **common)
    wide = rules.kind is str  # a link's text is long: bandwidth_gbps=1,latency_ms=0.1
    return w.Text(
        value=rules.text(value),
        placeholder=rules.unset if rules.auto else "",
        layout=w.Layout(width="390px" if wide else "190px"),
        **common,
    )


def _setting_value(rules: Option, control: w.Widget) -> Any:
    if isinstance(control, w.Text):
        return rules.parse(control.value)
    if rules.choices is not None:
        return rules.choices[control.value]  # the word shown -> the value it stands for
    return control.value


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
        **options: Any,
    ):
        self.custom_model = None if isinstance(model, str) else model
        # Anything but a built-in name ("jpeg-folder:PATH", a JpegFolder, a Dataset...) is "custom".
        self.custom_data = None if data is None or (isinstance(data, str) and data in BUILTIN_DATA) else data
        self.loss_fn = loss_fn
        self.keep_on_disk = out is not False  # out=False: results live in memory only
        rules = run_options()
        self.ablate_kwargs = {k: v for k, v in options.items() if k not in rules}
        for key in self.ablate_kwargs:
            if key not in PANEL_PASSES_ON:
                raise unknown_name_error("panel argument", key, [*PANEL_PASSES_ON, *rules])
        self.results = None
        self.error: str | None = None
        self.live = LiveRun()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._sources: dict[tuple, Any] = {}  # resolved data per (model, data, seed) choice
        self._advice: tuple[Advice | None, dict | None] = (None, None)  # the last advice, and for what job
        self._adoptable: dict = {}  # what "Switch these on" would set: advice's or the tuner's winner

        self._make_setting_controls(model, data, out, options)
        chosen = {t.name: t.Config() for t in all_techniques()} if techniques is None else dict(techniques)
        self.rows = {t.name: TechniqueRow(t, chosen.get(t.name, False)) for t in all_techniques()}
        self._make_run_controls_and_outputs()
        technique_box = w.VBox([w.HTML("<b>Techniques</b> (applied top to bottom)"), *self.rows.values()])
        ablate_page = w.VBox([technique_box, w.HBox([self.run_button, self.stop_button])])
        # The same Stop button shows on both pages: one widget, two views of it.
        self.tabs = w.Tab([ablate_page, self._make_tuning_page()])
        self.tabs.set_title(0, "Ablate")
        self.tabs.set_title(1, "Advise & tune")
        super().__init__(
            [
                w.HTML("<h3 style='margin:4px 0'>workbench: controlled ablation</h3>"),
                self._settings_box(rules),
                self.tabs,
                self.status,
                self.live_image,
                self.final_image,
                self.table,
            ]
        )
        self.refresh_availability()

    def _make_setting_controls(self, model: Any, data: Any, out: Any, options: dict) -> None:
        """Model, data and out, then one control per run setting, each starting at its value."""
        small = {"style": {"description_width": "initial"}, "layout": w.Layout(width="190px")}
        model_options = list(BUILTIN_MODELS) + (
            [f"custom: {model_label(model)}"] if self.custom_model else []
        )
        data_options = [("model's own", None), *[(d, d) for d in BUILTIN_DATA]]
        if self.custom_data is not None:
            data_options.append((f"custom: {_short_label(self.custom_data)}", "custom"))
        self.model = w.Dropdown(
            options=model_options,
            value=model if isinstance(model, str) else model_options[-1],
            description="model",
            **small,
        )
        self.data = w.Dropdown(
            options=data_options,
            value="custom" if self.custom_data is not None else data,
            description="data",
            **small,
        )
        # Each value checked on its own (a Link from its dict...); rules that tie settings
        # together (link needs world_size >= 2) are checked at Run, once the user has set both.
        defaults = RunConfig()
        self.settings = {
            name: _setting_control(
                name, rule, rule.validate(name, options.get(name, getattr(defaults, name)))
            )
            for name, rule in run_options().items()
        }
        self.out = w.Text(
            value="" if out in (None, False) else str(out),
            placeholder="new folder under workbench-results"
            if self.keep_on_disk
            else "none: results kept in memory",
            description="out",
            style={"description_width": "initial"},
            layout=w.Layout(width="390px"),
        )
        for control in (self.model, self.data, self.settings["device"], self.settings["world_size"]):
            control.observe(lambda _: self.refresh_availability(), names="value")

    def _make_run_controls_and_outputs(self) -> None:
        """Run and Stop, the status line, the live and final plots and the results table."""
        self.run_button = w.Button(description="Run ablation", button_style="success", icon="play")
        self.stop_button = w.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.run_button.add_class("workbench-run")
        self.stop_button.add_class("workbench-stop")
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        self.status = w.HTML("Choose the techniques, then press <b>Run ablation</b>.")
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

    def _make_tuning_page(self) -> w.Widget:
        """The advisor's verdict on the job set above, and the tuner's budgeted search."""
        wide = {"style": {"description_width": "initial"}}
        self.budget = w.Dropdown(
            options=TUNE_BUDGETS, value=300, description="budget", layout=w.Layout(width="160px"), **wide
        )
        self.search_space = w.Dropdown(
            options=[
                ("the advisor's ranking", "advisor"),
                ("the techniques switched on in Ablate", "chosen"),
            ],
            value="advisor",
            description="search",
            layout=w.Layout(width="360px"),
            **wide,
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
            "whose loss still matches, within the budget: every candidate screened in one block, the better "
            "half kept each round with more blocks."
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
        return w.VBox([w.HBox([self.model, self.data, *main], layout=wrap), self.out, folded])

    # ----- settings -> ablate arguments --------------------------------------------------

    def _model_value(self) -> Any:
        return self.custom_model if self.model.value.startswith("custom:") else self.model.value

    def _data_value(self) -> Any:
        return self.custom_data if self.data.value == "custom" else self.data.value

    def refresh_availability(self) -> None:
        """Re-check every technique against the chosen model, data, device and ranks."""
        try:
            run = self.run_config()
            model = self._model_value()
            key = (self.model.value, self.data.value, run.seed)
            if key not in self._sources:  # a user's data factory is called once, not per change
                self._sources[key] = resolve_data(self._data_value(), model, run.seed)
            ctx = technique_context(run, model, self._sources[key])
        except ValueError as error:
            self.status.value = _error_html(str(error))
            return
        for row in self.rows.values():
            row.set_reason(row.technique.unavailable_reason(ctx, row.technique.Config()))

    def run_config(self) -> RunConfig:
        """The run settings as the controls hold them now, checked (ValueError if one is bad)."""
        return RunConfig.from_options("panel", self.setting_values())

    def setting_values(self) -> dict[str, Any]:
        return {name: _setting_value(rule, self.settings[name]) for name, rule in run_options().items()}

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
            arguments["advice"] = advice  # the same job was just profiled: no need to profile it again
        return {**arguments, "budget_s": float(self.budget.value)}

    # ----- run / stop --------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self) -> bool:
        """Start the ablation in the background. Refused (False) while one is in flight or input is bad."""
        arguments = self.arguments()
        try:  # the same validation, and the same one-line messages, as the API
            plan(**plan_arguments(arguments))
        except ValueError as error:
            self.status.value = _error_html(str(error))
            return False
        return self._start(
            lambda: ablate(**arguments, progress=False, on_event=self.live, stop=self._stop),
            "Starting: each block is a fresh process that runs every arm side by side, so it takes a few "
            "seconds to start.",
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

        return self._start(advise_and_remember, "Advising: profiling a short baseline in a fresh process.")

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

    def _start(self, job: Callable[[], Any], message: str) -> bool:
        if self.running:
            self.status.value = _error_html("A run is already in progress: wait for it, or press Stop first.")
            return False
        self.error, self.results, self._adoptable = None, None, {}
        self.live = LiveRun()
        self._stop = threading.Event()
        self.final_image.value, self.table.value = b"", ""
        self.final_image.layout.display = "none"
        self._set_running(True)
        self.status.value = message
        self._thread = threading.Thread(
            target=self._run_job, args=(job,), daemon=True, name="workbench-panel-run"
        )
        self._thread.start()
        threading.Thread(
            target=self._redraw_while_running, daemon=True, name="workbench-panel-redraw"
        ).start()
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
        return self.results

    def _run_job(self, job: Callable[[], Any]) -> None:
        try:
            self.results = job()
        except Exception as error:  # shown in the panel: a thread has nowhere else to report
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
        elif outcome is not None:
            self._show(outcome.plot(), self._table_html(outcome.table.drop(columns=["techniques", "notes"])))
            where = f" Results: {outcome.path}" if outcome.path else ""
            verb = "Done" if outcome.complete else "Stopped; finished blocks are kept"
            self.status.value = f"<b>{verb}.</b>{html.escape(where)}" + _warnings_html(outcome.warnings())
        elif self.error:
            self.status.value = _error_html(self.error)
        self._set_running(False)

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
        self._show(results.plot_tuning(), self._table_html(results.tuning.drop(columns=["techniques"])))
        where = f" Results: {results.path}" if results.path else ""
        self.status.value = (
            f"<b>{html.escape(results.tuning_verdict)}</b>{html.escape(where)}"
            + _warnings_html(results.warnings())
        )

    def _show(self, figure, table_html: str) -> None:
        self.final_image.value = figure._repr_png_()
        self.final_image.layout.display = None
        self.table.value = table_html

    @staticmethod
    def _table_html(table) -> str:
        return table.to_html(
            index=False, float_format=lambda v: f"{v:.3g}", na_rep="-", classes="workbench-table"
        )

    def _redraw_while_running(self) -> None:
        drawn = -1
        while self.running:
            if self.live.version != drawn:
                drawn = self.live.version
                self._draw_live()
            time.sleep(REDRAW_S)

    def _draw_live(self) -> None:
        snapshot = self.live.snapshot()
        self.live_image.value = plot_live(snapshot)._repr_png_()
        self.live_image.layout.display = None
        if snapshot["state"] == "running":
            self.status.value = (
                f"Running: {snapshot['processes_done']} of {snapshot['processes']} processes finished. "
                f"Now: {html.escape(snapshot['current'])}"
            )


def _device_options(device: str) -> list[str]:
    import torch

    options = ["auto", "cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return options if device in options else [*options, device]


def _short_label(data: Any) -> str:
    label = data_label(data)
    return label if len(label) <= 40 else "..." + label[-37:]


def _warnings_html(warnings: list[str]) -> str:
    return "".join(
        f"<br><span style='color:#c44e52'><b>Warning:</b> {html.escape(w)}</span>" for w in warnings
    )


def _budget_label(seconds: float) -> str:
    return next((label for label, value in TUNE_BUDGETS if value == seconds), f"{seconds:.0f} s")


def _error_html(message: str) -> str:
    return f"<span style='color:#b00020'><b>Error:</b> {html.escape(message)}</span>"


def panel(
    model: Any = "mlp", data: Any = None, loss_fn: Any = None, techniques: Any = None, **kwargs: Any
) -> AblationPanel:
    """An ipywidgets control panel for ``wb.ablate``; its arguments are the panel's defaults."""
    return AblationPanel(model=model, data=data, loss_fn=loss_fn, techniques=techniques, **kwargs)
