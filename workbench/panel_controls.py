"""The panel's controls: each sized to its label and longest value in rows that wrap, a
technique's row (its toggle, its settings while on, or why it cannot run here) and the
groups (data, compute, memory, communication) the rows sit under."""

from __future__ import annotations

import dataclasses
import html
import re
import types
import typing
from typing import Any

from workbench.optional import needed_by

with needed_by("workbench.panel_controls", "ipywidgets"):  # the notebook extra, said with how to install it
    import ipywidgets as w

from workbench.config import Option, callable_label
from workbench.techniques import Technique
from workbench.techniques.base import GROUPS

# Widths: controls sit in wrapping rows, each as wide as its label and its longest value, so none
# is squeezed (flex-shrink 0) and none cut off. Pixels per character of JupyterLab's 13 px widget
# font: DejaVu Sans, the widest of its fallbacks, averages 7.3 on setting names and 8.3 on digits.
# The browser test measures the result.
CHAR_PX = 8.5
INPUT_EXTRA_PX = {"text": 18, "number": 40, "dropdown": 36}  # padding; a number's spinner; an arrow
BOOL_WORDS = {"auto": None, "True": True, "False": False}  # an optional switch's dropdown (None: auto)


def fitted(label: str, longest: int, kind: str) -> dict:
    """Layout and style for a control whose label and longest value both show in full."""
    label_px = CHAR_PX * len(label) + 12 if label else 0  # 12: the label's right margin
    width = label_px + CHAR_PX * longest + INPUT_EXTRA_PX[kind]
    return {
        "layout": w.Layout(width=f"{width:.0f}px", flex="0 0 auto"),
        "style": {"description_width": "initial"},
    }


def _checkbox_px(label: str) -> float:
    return CHAR_PX * len(label) + 30  # the box and its margin


def checkbox(label: str, value: bool, **options: Any) -> w.Checkbox:
    layout = w.Layout(width=f"{_checkbox_px(label):.0f}px", flex="0 0 auto")
    return w.Checkbox(value=value, description=label, indent=False, layout=layout, **options)


def dropdown(label: str, options: list, value: Any, longest: int = 0, **more: Any) -> w.Dropdown:
    """A dropdown as wide as its longest option (or ``longest`` characters, for options to come)."""
    words = [option[0] if isinstance(option, tuple) else str(option) for option in options]
    sized = fitted(label, max(longest, *map(len, words)), "dropdown")
    return w.Dropdown(options=options, value=value, description=label, **sized, **more)


def _field_widget(config_field: dataclasses.Field, value: Any, hints: dict) -> w.Widget:
    """A control for one Config field, chosen from its type and declared choices."""
    annotation = hints.get(config_field.name, str)
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else ()
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    label = config_field.name
    if "choices" in config_field.metadata:
        return dropdown(label, list(config_field.metadata["choices"]), value)
    if base is bool and not optional:
        return checkbox(label, bool(value))
    if base is bool:  # the words are the options: a Dropdown shows a value of None as blank
        return _OptionalSwitch(
            options=list(BOOL_WORDS),
            value=_bool_word(value),
            description=label,
            **fitted(label, 5, "dropdown"),
        )
    if base is int and not optional:
        return w.IntText(value=value, description=label, **fitted(label, max(len(str(value)), 5), "number"))
    shown = "" if value is None or callable(value) else str(value)
    longest = 16 if base is str or not args else 8  # free text (checkpointing's select) needs room
    return w.Text(
        value=shown,
        placeholder="default",
        description=label,
        **fitted(label, max(len(shown), longest), "text"),
    )


class _OptionalSwitch(w.Dropdown):
    """A dropdown for a switch that may also be left to its technique (None): auto, True, False."""


def _bool_word(value: bool | None) -> str:
    return next(word for word, meant in BOOL_WORDS.items() if meant is value)


def _read_field(widget: w.Widget, config_field: dataclasses.Field, hints: dict) -> Any:
    if isinstance(widget, _OptionalSwitch):
        return BOOL_WORDS[widget.value]
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


def _show_field(widget: w.Widget, value: Any) -> None:
    """Set a field's control to ``value``, as the control shows it."""
    if isinstance(widget, w.Text):
        widget.value = "" if value is None or callable(value) else str(value)
    elif isinstance(widget, _OptionalSwitch):
        widget.value = _bool_word(value)
    else:
        widget.value = value


def _short_reason(reason: str) -> str:
    """A reason's first clause: "needs a CUDA device; this run is on cpu" -> "needs a CUDA device"."""
    first = re.split(r"[;:(]|, so |, but ", reason, maxsplit=1)[0].strip().rstrip(",")
    return first if len(first) <= 60 else first[:57].rstrip() + "..."


def _one_line(text: str, tooltip: str, color: str) -> str:
    """HTML for one line of text, cut with an ellipsis where the row is too narrow; the whole
    text in its tooltip."""
    return (
        f"<div title='{html.escape(tooltip, quote=True)}' style='color:{color};white-space:nowrap;"
        f"overflow:hidden;text-overflow:ellipsis'>{html.escape(text)}</div>"
    )


class TechniqueRow(w.VBox):
    """One technique: its place in the order of application, its toggle and a one-line note;
    below them its settings, shown only while it is switched on, in a row that wraps."""

    def __init__(self, technique: Technique, setting: Any, position: int):
        self.technique = technique
        self.hints = typing.get_type_hints(technique.Config)
        enabled = setting is not None and setting is not False
        config = technique.configure(setting) if enabled else technique.Config()
        self.toggle = checkbox(technique.name, enabled)
        self.toggle.add_class(f"workbench-technique-{technique.name}")
        self.fields = {
            f.name: (f, _field_widget(f, getattr(config, f.name), self.hints))
            for f in dataclasses.fields(technique.Config)
        }
        self.note = w.HTML(layout=w.Layout(flex="1 1 0", min_width="0"))
        self.note.add_class("workbench-note")
        self.summary = technique.summary
        self.place = w.HTML(
            f"<span title='applied {_ordinal(position)} when techniques are combined' "
            f"style='color:#888'>{position}</span>",
            layout=w.Layout(width="22px", flex="0 0 auto"),
        )
        self.settings_box = w.HBox(
            [widget for _, widget in self.fields.values()],
            layout=w.Layout(flex_flow="row wrap", margin="0 0 6px 22px"),
        )
        self.settings_box.add_class("workbench-settings")
        header = w.HBox([self.place, self.toggle, self.note], layout=w.Layout(align_items="center"))
        super().__init__([header, self.settings_box])
        self.toggle.observe(lambda _: self._show_settings(), names="value")
        self.unavailable: str | None = None  # why it cannot run here (set_reason)
        self._wanted = False  # ticked when it became unavailable: ticked again when it comes back
        self.set_reason(None)

    def _show_settings(self) -> None:
        shown = self.toggle.value and bool(self.fields)
        self.settings_box.layout.display = None if shown else "none"

    def set_reason(self, reason: str | None) -> None:
        """Disable the row, showing why in one line (the whole reason as its tooltip), when the
        technique cannot run here."""
        was_unavailable, self.unavailable = self.unavailable, reason
        self.toggle.disabled = reason is not None
        self.toggle.tooltip = reason  # the whole reason where the pointer rests, too
        for _, widget in self.fields.values():
            widget.disabled = reason is not None
        if reason:
            if not was_unavailable:  # the user's choice, given back if it becomes available again
                self._wanted = self.toggle.value
            self.toggle.value = False
            self.note.value = _one_line(f"unavailable: {_short_reason(reason)}", reason, "#a33")
        else:
            if was_unavailable and self._wanted:
                self.toggle.value = True  # ddp_compression ticked at 2 ranks, 1 rank, then 2 again
            self._wanted = False
            self.note.value = _one_line(self.summary, self.summary, "#666")
        self._show_settings()

    @property
    def wanted_but_unavailable(self) -> bool:
        """Switched on (by the panel's arguments, or ticked) before it became unavailable here."""
        return self.unavailable is not None and self._wanted

    def set_setting(self, setting: Any) -> None:
        """Switch the technique on with ``setting`` (True, a dict) or off (False), as ablate reads it."""
        enabled = setting is not None and setting is not False
        config = self.technique.configure(setting) if enabled else self.technique.Config()
        self.toggle.value = enabled
        for name, (_, widget) in self.fields.items():
            _show_field(widget, getattr(config, name))

    def setting(self) -> Any:
        """False when off; otherwise the dict of options (validated later, by the API)."""
        if not self.toggle.value:
            return False
        return {name: _read_field(widget, f, self.hints) for name, (f, widget) in self.fields.items()}


def _ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


# The panel's technique headings: each group (techniques.base.GROUPS) and what its techniques change.
GROUP_NOTES = {
    "data": "how batches are made",
    "compute": "how the step computes",
    "memory": "what the step keeps for backward",
    "communication": "what ranks exchange",
}


def technique_groups(rows: dict[str, TechniqueRow]) -> w.Widget:
    """The rows under their groups' headings (a technique of your own without a group under
    "other"), in two columns of about the same height that stack on a narrow page."""
    grouped: dict[str, list[TechniqueRow]] = {}
    for row in rows.values():
        grouped.setdefault(row.technique.group, []).append(row)
    boxes = {group: _group_box(group, members) for group, members in grouped.items()}
    columns = [
        w.VBox(
            [boxes[group] for group in column],
            layout=w.Layout(flex="1 1 400px", min_width="0", margin="0 16px 0 0"),
        )
        for column in _balanced_columns({group: len(members) for group, members in grouped.items()})
    ]
    explanation = w.HTML(
        "<b>Techniques</b> <span style='color:#666'>(the numbers give the order in which they are "
        "applied when combined)</span>"
    )
    return w.VBox([explanation, w.HBox(columns, layout=w.Layout(flex_flow="row wrap"))])


def _group_box(group: str, rows: list[TechniqueRow]) -> w.VBox:
    toggle_px = max(_checkbox_px(row.technique.name) for row in rows)
    for row in rows:  # one width in a group, so that its notes start in one column
        row.toggle.layout.width = f"{toggle_px:.0f}px"
    note = GROUP_NOTES.get(group, "")
    heading = w.HTML(f"<b>{group.capitalize()}</b> <span style='color:#666'>{note}</span>")
    box = w.VBox([heading, *rows], layout=w.Layout(margin="0 0 8px 0"))
    box.add_class(f"workbench-group-{group}")
    return box


def _balanced_columns(sizes: dict[str, int]) -> list[list[str]]:
    """Two columns of groups with about as many rows each: the biggest group first, each into
    the shorter column; inside a column, and from left to right, in GROUPS' order."""
    rank = {group: index for index, group in enumerate([*GROUPS, *sizes])}
    columns: list[list[str]] = [[], []]
    for group in sorted(sizes, key=lambda g: (-sizes[g], rank[g])):
        shorter = min(columns, key=lambda column: sum(sizes[g] + 1 for g in column))  # +1: the heading
        shorter.append(group)
    columns = [sorted(column, key=rank.get) for column in columns if column]
    return sorted(columns, key=lambda column: rank[column[0]])


def setting_control(name: str, rules: Option, value: Any) -> w.Widget:
    """A control for one run setting, from its Option: a dropdown for choices, a checkbox for a
    switch, a number box, or a text box where "auto" (or "none") is a valid answer."""
    common = {"description": name, "tooltip": rules.help}
    if name == "device":  # its choices are this machine's devices
        return dropdown(name, _device_options(value), value, tooltip=rules.help)
    if rules.choices is not None:
        # The words are the options: a Dropdown shows a value of None (loader_arms' "auto") as blank.
        if rules.choice_of(value) is None:  # the user's own (an optimizer factory), beside the words
            options = [(word, word) for word in rules.choices] + [(callable_label(value), value)]
            return dropdown(name, options, value, tooltip=rules.help)
        return dropdown(name, list(rules.choices), rules.word(value), tooltip=rules.help)
    if rules.kind is bool:
        return checkbox(name, value, tooltip=rules.help)
    if rules.kind is int and not rules.auto:
        return w.IntText(value=value, **common, **fitted(name, max(len(str(value)), 6), "number"))
    if rules.kind is float and not rules.auto:
        return w.FloatText(value=value, **common, **fitted(name, max(len(str(value)), 8), "number"))
    shown = rules.text(value)
    longest = 32 if rules.kind is str else 8  # a link's text is long: bandwidth_gbps=1,latency_ms=0.1
    return w.Text(
        value=shown,
        placeholder=rules.unset if rules.auto else "",
        **common,
        **fitted(name, max(len(shown), longest), "text"),
    )


def setting_value(rules: Option, control: w.Widget) -> Any:
    if isinstance(control, w.Text):
        return rules.parse(control.value)
    if rules.choices is not None and isinstance(control.value, str):
        return rules.choices[control.value]  # the word shown -> the value it stands for
    return control.value


def _device_options(device: str) -> list[str]:
    import torch

    options = ["auto", "cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return options if device in options else [*options, device]
