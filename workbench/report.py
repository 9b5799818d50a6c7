"""A report to share: one self-contained HTML file per results folder.

``workbench report DIR`` and ``Results.to_html(path)`` write it: the plots embedded as PNG data,
the reader's table with its verdicts, the warnings, each arm's notes, the environment, and
the command that runs the same ablation again. Nothing in it is fetched from the network, so
it opens offline and can be mailed or attached to an issue as it is.
"""

from __future__ import annotations

import base64
import html
import io
import os
import re
import shlex
from dataclasses import fields
from pathlib import Path
from typing import Any

from workbench.config import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_LOSSES,
    OPTIMIZERS,
    Link,
    RunConfig,
    cli_flag,
    run_options,
)
from workbench.data import BUILTIN_DATA, JPEG_FOLDER_PREFIX
from workbench.models import BUILTIN_MODELS
from workbench.results_folder import ResultsFolder, refuse_a_file_not_ours, write_text_atomic
from workbench.results_view import results_html, resumable, search_html
from workbench.techniques import get_technique, settings_of

GENERATOR = "workbench report"  # in every report's <meta name="generator">: how we know one we wrote
REPORT_NAME = "report.html"


def write_report(results, path: str | os.PathLike | None = None) -> Path:
    """Write ``results``' report to ``path`` (default: report.html in its results folder) and
    return where. A file already there is replaced only if it is a report workbench wrote."""
    if path is None:
        if results.path is None:
            raise ValueError(
                "these results have no folder (ablate(out=False)); pass a path: results.to_html('report.html')"
            )
        target = ResultsFolder(results.path).file(REPORT_NAME)  # entered in the folder's manifest
    else:
        target = Path(path).expanduser()
        if target.is_dir() or str(path).endswith(("/", os.sep)):  # "newdir/" names a folder to make
            target = target / REPORT_NAME
        if target.suffix.lower() not in (".html", ".htm"):  # "report.pdf" would hold HTML under a PDF's name
            raise ValueError(
                f"the report is an HTML page: name it with .html (got {str(path)!r}); "
                "a browser's Print turns it into a PDF"
            )
        target = _entered_where_it_goes(results, target)
    refuse_a_file_not_ours(target, _is_our_report, str(target))
    writable = next((p for p in [target.parent, *target.parent.parents] if p.exists()), Path("."))
    if not os.access(writable, os.W_OK):
        raise ValueError(
            f"{writable} cannot be written; write the report elsewhere (to_html(path), report --out FILE)"
        )
    try:
        write_text_atomic(target, report_html(results))  # a reader never sees half a report
    except OSError as error:  # a folder that cannot be made (under /proc, say): said with its path
        raise ValueError(f"the report cannot be written to {target}: {error.strerror}") from None
    return target


def _entered_where_it_goes(results, target: Path) -> Path:
    """A report inside its own results folder is entered in that folder's manifest (its overwrite
    then removes it); one inside another run's folder is refused: it would replace that run's
    report, or stand there as a file that run did not write, and block its overwrite."""
    folder = Path(results.path).expanduser().resolve() if results.path is not None else None
    if folder is not None and target.resolve().is_relative_to(folder):
        return ResultsFolder(results.path).file(target.resolve().relative_to(folder))
    ResultsFolder(target).refuse_inside_another_run("the report ")
    return target


def _is_our_report(path: Path) -> bool:
    return GENERATOR in path.read_text(errors="replace")[:2000]


def report_html(results) -> str:
    """The whole report as one HTML document."""
    record = results.record
    config = record["config"]
    title = f"workbench: {config['model']} on {config['data']}, {config['device']}"
    sections = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="wb-meta">{html.escape(_when_and_state(record))}</p>',
        *([_search_html(results)] if "tune" in record else []),
        _section(
            "Verdicts" + (" of its last round" if "tune" in record else ""),
            results_html(results.table, results.warnings(), results.path),
        ),  # fmt: skip
        _section("Plots", _figure_img(results.plot(), "speedups, step-time breakdown and memory per arm")),
        _section("Notes per arm", _notes_html(results.table)),
        _section("Reproduce", _reproduce_html(record, results.path)),
        _section("Environment", _environment_html(record)),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="generator" content="{GENERATOR}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_PAGE_CSS}</style></head>"
        f"<body>{''.join(sections)}</body></html>\n"
    )


_PAGE_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto;
  max-width: 1100px; padding: 0 16px; color: #222; line-height: 1.4; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px;
  border-bottom: 1px solid #ddd; padding-bottom: 3px; }
.wb-meta { color: #666; margin-top: 0; }
img { max-width: 100%; height: auto; border: 1px solid #eee; box-sizing: border-box; }  /* the border inside the width: no scrollbar for 2 px */
.wb-figure { overflow-x: auto; }
@media print {  /* paper does not scroll: the figure shrinks to the page, its least width aside */
  body { max-width: none; margin: 0; } .wb-figure img { min-width: 0 !important; } }
pre { background: #f6f6f6; padding: 8px 10px; overflow-x: auto; white-space: pre-wrap;
  word-break: break-word; font-size: 12.5px; }
table.wb-plain { border-collapse: collapse; font-size: 13px; }
table.wb-plain td, table.wb-plain th { text-align: left; padding: 2px 10px 2px 0; vertical-align: top; }
ul.wb-notes li { margin-bottom: 3px; }
"""


def _search_html(results) -> str:
    """A search's answer first (wb.tune): its verdict, its candidates, and their speedups by round."""
    return _section(
        "The search",
        f"<p><b>{html.escape(results.tuning_verdict)}</b></p>"
        + search_html(results.record["tune"])
        + _figure_img(results.plot_tuning(), "each candidate's speedup, round by round"),
    )


def _section(heading: str, body: str) -> str:
    return f"<section><h2>{html.escape(heading)}</h2>{body}</section>"


def _when_and_state(record: dict) -> str:
    state = "complete" if record.get("complete") else "partial: the run was stopped before every block ran"
    workers = record.get("worker_start") or "fresh processes"
    return f"created {record.get('created', '?')}; {state}; workers: {workers}"


FIGURE_MIN_PX = 1000


def _figure_img(figure, alt: str) -> str:
    """A matplotlib figure as an <img> whose PNG is inside the page (a data: URL)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    # Never shrunk below FIGURE_MIN_PX (or its own width): in a narrow window its box scrolls
    # instead, for at 800 px the results plot's legend and labels came out 5 px tall.
    from PIL import Image

    least = min(FIGURE_MIN_PX, Image.open(buffer).size[0])
    image = f'<img alt="{html.escape(alt)}" style="min-width: {least}px" src="data:image/png;base64,{data}">'
    return f'<div class="wb-figure">{image}</div>'


def _notes_html(table) -> str:
    items = [
        f"<li><b>{html.escape(row.arm)}</b>: {html.escape(text)}</li>"
        for row in table.itertuples()
        for text in ([row.notes] if row.notes else [])
    ]
    return f'<ul class="wb-notes">{"".join(items)}</ul>' if items else "<p>No notes.</p>"


def _block_threads(record: dict) -> str:
    """The intra-op threads each block's process ran with ("1", or "1, 2" if they differed)."""
    threads = sorted({b["torch_threads"] for b in record.get("blocks", []) if b.get("torch_threads")})
    return ", ".join(str(t) for t in threads)


def _environment_html(record: dict) -> str:
    env = record.get("environment") or {}
    shown = {
        "device": record["config"].get("device"),
        "GPU": ", ".join(env.get("gpus") or []),
        "driver": env.get("driver_version"),
        "CUDA": env.get("cuda_version"),
        "cuDNN": env.get("cudnn_version"),
        "CPU": env.get("cpu"),
        "cores": f"{env.get('usable_cores')} usable of {env.get('logical_cores')} logical"
        if env.get("logical_cores")
        else None,
        "torch": env.get("torch"),
        # The measuring processes' (the threads setting applies there), not the parent's.
        "torch threads": _block_threads(record) or env.get("torch_threads"),
        "python": env.get("python"),
        "platform": env.get("platform"),
        "numpy": env.get("numpy"),
        "CuPy": env.get("cupy") or "not installed",
        "DALI": env.get("dali") or "not installed",
        "workbench": env.get("workbench"),
        "git revision": env.get("git_revision"),
        "host": env.get("hostname"),
    }
    rows = "".join(
        f"<tr><th>{html.escape(name)}</th><td>{html.escape(str(value))}</td></tr>"
        for name, value in shown.items()
        if value not in (None, "")
    )
    return f'<table class="wb-plain">{rows}</table>'


def _reproduce_html(record: dict, folder) -> str:
    """The same ablation again, measured afresh (into a new folder); and, for a run in its own
    folder, how to add blocks to it instead (the noise note may ask for that)."""
    command, python = reproduce(record)
    parts = ["<p>Each runs the same ablation again, afresh, into a new results folder.</p>"]
    if command is not None:
        parts.append(f"<p>From a shell:</p><pre>{html.escape(command)}</pre>")
    parts.append(f"<p>From Python:</p><pre>{html.escape(python)}</pre>")
    if folder is None or not resumable(folder):
        return "".join(parts)
    where = str(Path(folder).resolve())  # the page may be read from anywhere

    def both(flags: str, keywords: str) -> str:  # the flags only where the CLI can run it
        python = f"<code>{html.escape(keywords)}</code>"
        return python if command is None else f"<code>{html.escape(flags)}</code> ({python})"

    out = shlex.quote(where)
    if not record.get("complete", True):
        # A stopped run: the same command with this folder finishes it, as the run said when it stopped.
        parts.append(
            "<p>This run was stopped before it finished. To finish it, run the same ablation with this "
            f"folder: {both(f'--out {out}', f'out={where!r}')}; the blocks it holds count.</p>"
        )
    else:
        parts.append(
            "<p>To add blocks to this run instead, run it with more blocks and this folder: "
            f"{both(f'--blocks N --out {out}', f'blocks=N, out={where!r}')}; the blocks it holds count.</p>"
        )
    return "".join(parts)


# --- the command that runs the same ablation again ------------------------------------------


def requested_techniques(record: dict) -> dict[str, Any]:
    """The ``techniques=`` mapping the run was given, read back from its arms: each technique's
    settings that differ from its defaults (True when none do), a list where a setting was swept."""
    values: dict[str, dict[str, list]] = {}
    for arm in record.get("arms", []):
        for name, settings in (arm.get("settings") or {}).items():
            seen = values.setdefault(name, {})
            for key, value in settings.items():
                seen.setdefault(key, [])
                if value not in seen[key]:
                    seen[key].append(value)
    chosen: dict[str, Any] = {}
    for name, settings in values.items():
        defaults = settings_of(get_technique(name).Config())
        changed = {
            key: (found[0] if len(found) == 1 else found)
            for key, found in settings.items()
            if found != [defaults.get(key)]
        }
        chosen[name] = changed or True
    return chosen


def _changed_run_settings(config: dict) -> dict[str, Any]:
    """The run settings that differ from RunConfig's defaults (the device as the run resolved it)."""
    # batch_size's auto is recorded as the size it chose: 32 is the default's, another one is said
    defaults = {**RunConfig().to_json(), "batch_size": DEFAULT_BATCH_SIZE}
    return {
        f.name: config[f.name]
        for f in fields(RunConfig)
        if f.name in config and config[f.name] != defaults[f.name]
    }


# The user's own code as the command line took it, and so recorded it: ``models:build``.
TYPED_CODE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
OWN_CODE_FLAGS = {"model": "--model", "data": "--data", "loss_fn": "--loss-fn", "optimizer": "--optimizer"}


def reproduce(record: dict) -> tuple[str | None, str]:
    """The shell command and the Python call that run the same ablation again. The command is
    None where the job holds the user's own Python objects, unless the command line named each
    (``--model models:build``): its flags take them so again."""
    config = record["config"]
    techniques = requested_techniques(record)
    settings = _changed_run_settings(config)
    own = {name: config[name] for name in ("model", "data") if _own(name, config[name])}
    # the loss, the collate function and the optimizer too: left out, a rerun trained otherwise
    own |= {
        name: config[name]
        for name in ("loss_fn", "collate_fn")
        if config.get(name) and config[name] not in DEFAULT_LOSSES
    }
    if config.get("optimizer", OPTIMIZERS[0]) not in OPTIMIZERS:  # a factory of the user's, which sets its lr
        own["optimizer"] = settings.pop("optimizer")
        settings.pop("lr", None)
    python = _python_call(config, techniques, settings, own)
    if any(name not in OWN_CODE_FLAGS or not TYPED_CODE.fullmatch(str(label)) for name, label in own.items()):
        return None, python  # a Python object the command line cannot name
    words = ["workbench", "ablate", "--model", config["model"], "--data", config["data"]]
    words += [
        word for name in ("loss_fn", "optimizer") if name in own for word in (OWN_CODE_FLAGS[name], own[name])
    ]
    for name, value in techniques.items():
        words += ["-t", technique_flag(name, value)]
    for name, value in settings.items():
        words += run_flag(name, value)
    return " ".join(shlex.quote(word) for word in words), python


def _own(name: str, label: str) -> bool:
    """Whether the recorded model or data is the user's own, not a built-in's name or a JPEG folder."""
    if name == "model":
        return label not in BUILTIN_MODELS
    return label not in BUILTIN_DATA and not str(label).startswith(JPEG_FOLDER_PREFIX)


def technique_flag(name: str, value: Any) -> str:
    if value is True:
        return name
    items = []
    for key, setting in value.items():
        shown = "|".join(_flag_word(v) for v in setting) if isinstance(setting, list) else _flag_word(setting)
        items.append(f"{key}={shown}")
    return f"{name}:{','.join(items)}"


def _flag_word(value: Any) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def run_flag(name: str, value: Any) -> list[str]:
    rules = run_options()[name]
    flag = cli_flag(name)
    if rules.kind is bool and rules.choices is None:
        return [flag] if value else ["--no-" + flag[2:]]
    if rules.choices is not None:
        return [flag, rules.word(value)]
    if isinstance(value, dict) and name == "link":
        return [flag, Link(**value).as_text()]
    if isinstance(value, dict) and rules.parts is not None:  # --slurm-partition gpu --slurm-time-min 30
        defaults = rules.parts().__dict__
        return [
            word
            for part, setting in value.items()
            if setting != defaults[part]
            for word in (cli_flag(name, part), str(setting))
        ]
    return [flag, "none" if value is None else str(value)]


def _python_call(config: dict, techniques: dict, settings: dict, own: dict) -> str:
    """``wb.ablate(...)`` with the same job: the user's own code imported where the command line
    named it (``from models import build``), else named as recorded, for the reader to supply."""
    imported, said, arguments = [], [], {}
    for name in ("model", "data", "loss_fn", "collate_fn", "optimizer"):
        label = own.get(name)
        if label is None:
            continue
        if TYPED_CODE.fullmatch(str(label)):
            module, _, attribute = str(label).partition(":")
            imported.append(f"from {module} import {attribute.split('.')[0]}")
            arguments[name] = attribute
            continue
        what = {"model": "your own factory", "data": "your own (its type, or a factory's name)"}.get(
            name, "your own"
        )
        said.append(f"# {name}: {what}, recorded as {label!r}")
        arguments[name] = label
    listed = [
        f"model={arguments.get('model', repr(config['model']))}",
        f"data={arguments.get('data', repr(config['data']))}",
        *(
            f"{name}={arguments[name]}"
            for name in ("loss_fn", "collate_fn", "optimizer")
            if name in arguments
        ),
        f"techniques={techniques!r}",
        *(f"{name}={value!r}" for name, value in settings.items()),
    ]
    call = "results = wb.ablate(\n    " + ",\n    ".join(listed) + ",\n)"
    return "\n".join(["import workbench as wb", *imported, "", *said, call])
