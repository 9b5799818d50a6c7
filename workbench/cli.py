"""The ``workbench`` command: ``list``, ``env``, ``ablate``, ``advise``, ``tune``, ``show`` and ``report``.

Bad input ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import inspect
import io
import json
import os
import re
import shlex
import signal
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from workbench.config import NothingMeasured, cli_flag, name_as_typed, started_by_torchrun

PRESETS: dict[str, dict[str, Any]] = {
    # A CPU ablation that finishes in under a minute on 2 cores: a conv net, where layout and
    # precision both matter, with the memory-for-compute trades beside them. Three blocks: the
    # arms run side by side in each, so the intervals are a few percent wide (BENCHMARKS.md).
    "quick": {
        "model": "resnet-mini",
        "data": "textures",
        "techniques": {
            "amp": {"dtype": "bfloat16"},
            "channels_last": True,
            "checkpointing": True,
            "grad_accum": {"steps": 4},
        },
        "mode": "one-at-a-time",
        "steps": 20,
        "warmup": 3,
        "blocks": 3,
        "batch_size": 32,
    },
}


def _value(text: str) -> Any:
    if "|" in text:  # num_workers=0|1|2: a sweep, one arm per value
        return [_value(part) for part in text.split("|")]
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_technique_flag(flag: str) -> tuple[str, Any]:
    """``amp`` -> ("amp", True); ``amp:dtype=float16`` -> ("amp", {"dtype": "float16"}); ``amp:off`` -> False.

    ``dataloader:num_workers=0|2`` sweeps a setting: {"num_workers": [0, 2]}.
    """
    name, _, options = flag.partition(":")
    if not options:
        return name, True
    if options in ("off", "false"):
        return name, False
    settings = {}
    for item in options.split(","):
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise ValueError(
                f"cannot read technique option {item!r} in {flag!r}; write NAME:key=value,key=value"
            )
        if key in settings:  # one would silently win; a sweep is written key=a|b
            raise ValueError(
                f"technique option {key!r} is given twice in {flag!r}; to try both, write {key}=a|b"
            )
        settings[key] = _value(value)
    return name, settings


def _techniques(args: argparse.Namespace, preset: dict) -> dict | None:
    """--techniques JSON, else the preset's; then each -t flag adds or overrides one.

    With neither JSON nor a preset, the -t flags alone are the techniques; with nothing at
    all, None means every technique with its defaults.
    """
    if args.techniques_json:
        try:
            chosen = json.loads(args.techniques_json)
        except json.JSONDecodeError as error:
            raise ValueError(f"--techniques is not valid JSON: {error}") from None
    else:
        chosen = dict(preset["techniques"]) if "techniques" in preset else None
    given: dict[str, str] = {}
    for flag in args.technique or []:
        name, value = parse_technique_flag(flag)
        if name in given:  # the later would silently win
            raise ValueError(
                f"{name} is given twice (-t {given[name]}, -t {flag}); give it once, and to try both "
                f"settings write them in one flag, as in -t amp:dtype=bfloat16|float16"
            )
        given[name] = flag
        chosen = {} if chosen is None else chosen
        chosen[name] = _none_where_it_is_a_choice(name, value)
    return chosen


def _none_where_it_is_a_choice(name: str, value: Any) -> Any:
    """``none`` reads as None (``bucket_cap_mb=none``: DDP's default), except for a setting whose
    choices name it: ``ddp_compression:hook=none`` is the hook called "none" (it was refused,
    "got None")."""
    if not isinstance(value, dict):
        return value
    from workbench.techniques import get_technique

    try:
        technique = get_technique(name)
    except ValueError:  # an unknown name: parse_techniques refuses it, naming the valid ones
        return value
    choices = {f.name: f.metadata.get("choices", ()) for f in dataclasses.fields(technique.Config)}

    def read(key: str, setting: Any) -> Any:
        if isinstance(setting, list):  # a sweep, hook=none|fp16
            return [read(key, one) for one in setting]
        return "none" if setting is None and "none" in choices.get(key, ()) else setting

    return {key: read(key, setting) for key, setting in value.items()}


def add_run_flags(parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = ()) -> None:
    """A flag per run setting, read from RunConfig's fields: name, help, type and choices.

    A flag left out is None, so the preset's value, or else RunConfig's default, applies.
    ``leave_out``: settings the command decides itself (the tuner's blocks).
    """
    from dataclasses import fields

    from workbench.config import RunConfig

    for item in fields(RunConfig):
        if item.name in leave_out:
            continue
        rules = item.metadata["option"]
        flag = cli_flag(item.name)
        names = [flag, *(cli_flag(alias) for alias in rules.aliases)]
        shown = rules.help.replace("%", "%%")  # argparse formats help with %
        if rules.parts is not None:  # one flag per part: --slurm-partition, --slurm-time-min, ...
            _add_part_flags(parser, item.name, rules.parts)
        elif rules.kind is bool and item.default is True:
            parser.add_argument(
                "--no-" + flag[2:], dest=item.name, action="store_false", default=None, help=f"do not {shown}"
            )
        elif rules.kind is bool:
            parser.add_argument(*names, dest=item.name, action="store_true", default=None, help=shown)
        elif rules.choices is not None and rules.own_code:  # the words or module:attribute, checked later
            parser.add_argument(
                *names,
                dest=item.name,
                metavar="|".join([*rules.choices, OWN_CODE]),
                help=f"{shown} (default {rules.word(item.default)})",
            )
        elif rules.choices is not None:
            parser.add_argument(
                *names,
                dest=item.name,
                choices=list(rules.choices),
                help=f"{shown} (default {rules.word(item.default)})",
            )
        else:
            default = rules.unset if item.default is None else item.default
            parser.add_argument(
                *names,
                dest=item.name,
                type=rules.parse,
                metavar=item.name.upper(),
                help=f"{shown} (default {default})",
            )


def _add_part_flags(parser: argparse.ArgumentParser, name: str, parts: type) -> None:
    """A flag for each field of the dataclass ``parts`` (SlurmOptions): ``--slurm-partition``."""
    from dataclasses import fields

    group = parser.add_argument_group(f"{name} options (each sets one field of {parts.__name__})")
    for part in fields(parts):
        default = "" if part.default is None else f" (default {part.default!r})"  # None: its help says auto
        group.add_argument(
            cli_flag(name, part.name),
            dest=f"{name}__{part.name}",
            metavar=part.name.upper(),
            help=f"{part.metadata['help']}{default}".replace("%", "%%"),
        )


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run settings given as flags (a choice's word turned into the value it stands for)."""
    from dataclasses import fields

    from workbench.config import run_options

    settings = {}
    for name, rules in run_options().items():
        value = getattr(args, name, None)  # None: not given, or a setting the command decides
        if rules.parts is not None:  # its pieces, as text: the option's own check converts them
            given = {p.name: getattr(args, f"{name}__{p.name}", None) for p in fields(rules.parts)}
            value = {key: text for key, text in given.items() if text is not None} or None
        if value is None:
            continue
        if rules.choices is not None and value in rules.choices:
            value = rules.choices[value]
        elif rules.own_code and is_own_code(value):  # --optimizer mypackage.training:make_optimizer
            value = own_code(cli_flag(name), value)
        settings[name] = value
    return settings


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line: the message and where the flags are listed, not the
    usage block before it (the subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _unrecognized(args: argparse.Namespace, extra: list[str]) -> str:
    """argparse's "unrecognized arguments", with what each unknown flag may have meant: another
    command's flag ("--mode" is ablate's, not tune's), else this command's nearest one. The command's
    own parser reports it, ending "(see 'workbench ablate --help')"."""
    parsers = args.command_parsers
    flags = list(parsers[args.command]._option_string_actions)
    hints = []
    for token in (token.split("=")[0] for token in extra if token.startswith("--")):
        elsewhere = [name for name, other in parsers.items() if token in other._option_string_actions]
        # Letters swapped (--modle) before difflib's nearest, which ranks --mode above --model there.
        close = [f for f in flags if sorted(f) == sorted(token)] or difflib.get_close_matches(
            token, flags, n=1
        )
        if elsewhere:
            hints.append(f"{token} is a flag of {' and '.join(elsewhere)}, not of {args.command}")
        elif close:
            hints.append(f"{token}: did you mean {close[0]}?")
    return "; ".join([f"unrecognized arguments: {' '.join(extra)}", *hints])


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="workbench",
        description="Honest, controlled ablations of PyTorch training-acceleration techniques.",
        allow_abbrev=False,
    )
    from workbench import __version__

    parser.add_argument("--version", action="version", version=f"workbench {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.set_defaults(command_parsers=commands.choices)  # for in_cli_terms

    _add_what_is_here_commands(commands)
    ablate = commands.add_parser("ablate", help="run an ablation (flags mirror workbench.ablate)")
    ablate.add_argument("--preset", choices=sorted(PRESETS), help="start from a named configuration")
    ablate.add_argument(
        "--model", help=f"mlp | resnet-mini | gpt-mini | {OWN_CODE} (your zero-argument factory)"
    )
    ablate.add_argument(
        "--data",
        help="digits | textures | text | jpeg | synthetic | jpeg-folder:PATH | "
        f"{OWN_CODE} (your Dataset, batches, or a factory of them) (default: the model's own)",
    )
    ablate.add_argument("--loss-fn", help=LOSS_FN_HELP)
    ablate.add_argument(
        "-t",
        "--technique",
        action="append",
        metavar="NAME[:key=value,...]",
        help="a technique to ablate; repeatable (e.g. -t amp:dtype=bfloat16 -t compile); "
        "key=a|b sweeps a setting (-t dataloader:num_workers=0|2)",
    )
    ablate.add_argument(
        "--techniques",
        dest="techniques_json",
        metavar="JSON",
        help='all techniques as JSON, e.g. \'{"amp": {"dtype": "float16"}}\'',
    )
    add_run_flags(ablate)
    ablate.add_argument("--out", help="results folder (default: a new one under ./workbench-results)")
    ablate.add_argument("--overwrite", action="store_true", help="discard earlier results in --out")
    ablate.add_argument(
        "--retry-failed",
        action="store_true",
        help="when resuming, run again the blocks in which an arm failed, ran out of memory or was skipped",
    )
    ablate.add_argument("--no-progress", action="store_true", help="no progress bar")
    ablate.add_argument("--dry-run", action="store_true", help="print the plan and stop")

    _add_advise_command(commands)
    _add_tune_command(commands)

    _add_saved_results_commands(commands)
    for name, command in commands.choices.items():
        command.allow_abbrev = False  # --mode must not be read as a prefix of --model
        _help_in_cli_terms(name, command, commands.choices)
    return parser


def _add_what_is_here_commands(commands) -> None:
    listing = commands.add_parser("list", help="list the techniques and whether they can run here")
    listing.add_argument(
        "--device",
        help="say what can run on this device: auto, cpu, cuda or cuda:N (default auto)",
    )
    listing.add_argument(
        "--model", default=None, help=f"also check model-specific conditions (a built-in, or {OWN_CODE})"
    )
    listing.add_argument(
        "--models", action="store_true", help="list the built-in models and datasets instead"
    )
    env = commands.add_parser("env", help="versions, device and cores")
    env.add_argument("--json", action="store_true", help="print JSON instead of text")


def _help_in_cli_terms(name: str, command: argparse.ArgumentParser, parsers: dict) -> None:
    """The help is shared with the API's docstrings: here it names the flags ("with
    --profile-steps", not "with profile_steps")."""
    spelled = argparse.Namespace(command=name, command_parsers=parsers)
    for action in command._actions:
        if action.help and action.help != argparse.SUPPRESS:
            action.help = in_cli_terms(action.help, spelled, technique_speaks=False)


def _add_saved_results_commands(commands) -> None:
    show = commands.add_parser("show", help="print a saved results table")
    show.add_argument("path", help="a results folder or its results.json")
    report = commands.add_parser(
        "report", help="write a self-contained HTML report of saved results (opens offline)"
    )
    report.add_argument("path", help="a results folder or its results.json")
    report.add_argument("--out", help="where to write it (default: report.html in the results folder)")
    compare = commands.add_parser(
        "compare", help="set saved runs side by side: each arm's speedup in each, and how it changed"
    )
    compare.add_argument(
        "paths", nargs="+", metavar="path", help="results folders; the first is the reference"
    )
    compare.add_argument(
        "--names", nargs="+", metavar="NAME", help="a name per run (default: the folders' names)"
    )
    compare.add_argument("--plot", metavar="PNG", help="also save the figure: every run's speedups, one axis")


def _add_advise_command(commands) -> None:
    from workbench.config import ADVISOR_FIXES

    advise = commands.add_parser(
        "advise", help="profile a short baseline, name its bottleneck and the techniques to try"
    )
    advise.add_argument("--model", default="mlp", help=f"mlp | resnet-mini | gpt-mini | {OWN_CODE}")
    advise.add_argument("--data", help="as for ablate (default: the model's own)")
    advise.add_argument("--loss-fn", help=LOSS_FN_HELP)
    add_run_flags(advise, leave_out=(*ADVISOR_FIXES, "mode"))
    advise.add_argument("--json", metavar="FILE", help="also write the advice as JSON")
    advise.add_argument("--plot", metavar="PNG", help="also save the figure: the step's parts, memory")
    advise.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_tune_command(commands) -> None:
    from workbench.config import TUNER_DECIDES

    tune = commands.add_parser(
        "tune", help="search, within a time budget, for the fastest combination whose loss still matches"
    )
    tune.add_argument("--budget", required=True, type=parse_budget, metavar="TIME",
                      help="the search's wall-clock budget: 600, 90s, 10m or 1h")  # fmt: skip
    tune.add_argument("--model", default="mlp", help=f"mlp | resnet-mini | gpt-mini | {OWN_CODE}")
    tune.add_argument("--data", help="as for ablate (default: the model's own)")
    tune.add_argument("--loss-fn", help=LOSS_FN_HELP)
    tune.add_argument("-t", "--technique", action="append", metavar="NAME[:key=value,...]",
                      help="search these (key=a|b tries each value) instead of the advisor's ranking")  # fmt: skip
    tune.add_argument("--techniques", dest="techniques_json", metavar="JSON", help="the same, as JSON")
    tune.add_argument("--max-candidates", type=int, help="combinations screened at most (default 24)")
    add_run_flags(tune, leave_out=TUNER_DECIDES)
    tune.add_argument("--out", help="the search's folder (default: a new one under ./workbench-results)")
    tune.add_argument("--overwrite", action="store_true", help="discard an earlier search in --out")
    tune.add_argument("--no-progress", action="store_true", help="no progress bars")


def parse_budget(text: str) -> float:
    """``600`` or ``600s`` -> 600.0; ``10m`` -> 600.0; ``1h`` -> 3600.0."""
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        seconds = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a time like 600, 90s, 10m or 1h; got {text!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"a positive time like 600, 90s, 10m or 1h; got {text!r}")
    return seconds


def _plan_settings(config: dict) -> str:
    """What a preset or the defaults chose, which the table does not show."""
    ranks = config.get("world_size", 1)
    batch = f"batch {config['batch_size']}" + (f" per rank, {ranks} ranks" if ranks > 1 else "")
    return (
        f"{config['model']} on {config['data']}, {config['device']}, {batch}: "
        f"{config['blocks']} block{'s' * (config['blocks'] != 1)}, {config['steps']} timed steps per arm "
        f"after {config['warmup']} warm-up steps, {config['mode']}"
    )


def format_plan(table, spell: Callable[[str], str] = str) -> str:
    """The dry run's table: what runs, one left-aligned row per arm, then why arms run alone or not
    at all, those reasons reworded by ``spell`` (the CLI's flags: "pass --world-size 2"); within
    the terminal's width, long settings and reasons wrapped."""
    from workbench.results_view import terminal_width, wrap_cell

    width = terminal_width()
    shown = table[["name", "role", "process", "blocks", "techniques"]].astype(str)
    # Every column whole but the last, whose settings wrap in the room left; where long arm names
    # leave too little (a sweep's dataloader[num_workers=1]), the settings go under each row.
    widths = [max(len(column), *(len(value) for value in shown[column])) for column in shown.columns[:-1]]
    indent = sum(widths) + 2 * len(widths)
    beside = width - indent >= 24
    lines = [*textwrap.wrap(_plan_settings(table.attrs["config"]), width), ""]
    for row in [list(shown.columns), *shown.itertuples(index=False)]:
        cells = [f"{value:<{w}}" for value, w in zip(row, widths, strict=False)]
        if beside:
            first, *more = wrap_cell(row[-1], width - indent)
            lines += ["  ".join([*cells, first]), *(" " * indent + piece for piece in more)]
        else:
            lines += ["  ".join(cells), *("    " + piece for piece in wrap_cell(row[-1], width - 4))]

    def listed(heading: str, reasons: list[tuple[str, str]]) -> list[str]:
        wrapped = [
            textwrap.fill(f"{name}: {spell(why)}", width, initial_indent="  ", subsequent_indent="    ")
            for name, why in reasons
        ]
        return ["", *textwrap.wrap(heading, width), *wrapped] if reasons else []

    lines += listed(
        "In a process of their own (each compared with a baseline that also runs alone):",
        [(row.name, row.own_process) for row in table.itertuples() if row.process == "own"],
    )
    lines += listed(
        "Unavailable here:", [(row.name, row.unavailable) for row in table.itertuples() if row.unavailable]
    )
    if oversubscribed := table.attrs.get("oversubscribed"):  # as the run's plan line would warn
        warning = f"WARNING: {oversubscribed}: threads will wait for cores, and steps measure that."
        lines += ["", *textwrap.wrap(warning, width)]
    from workbench.progress import no_technique

    if nothing_applied := no_technique(table.to_dict(orient="records")):
        nothing_applied = spell(nothing_applied)
        lines += ["", *textwrap.wrap(nothing_applied[0].upper() + nothing_applied[1:] + ".", width)]
    return "\n".join(line.rstrip() for line in lines)


def _plan_without_the_bar(args: argparse.Namespace) -> Callable[[dict], None]:
    """With --no-progress, the plan's line still: what will run, and where the results go. With the
    bar on, the run prints it itself."""
    from workbench.progress import print_plan

    def on_event(event: dict) -> None:
        if args.no_progress and event["type"] == "plan":
            print_plan(event)

    return on_event


OWN_CODE = "module:attribute"
LOSS_FN_HELP = f"your loss, as {OWN_CODE}: a callable (outputs, targets) -> the batch's mean loss (default: cross-entropy)"


def is_own_code(text: str) -> bool:
    """Whether a flag's value names the user's own code (``module:attribute``), not a built-in's
    name or a folder of JPEG files."""
    from workbench.data import JPEG_FOLDER_PREFIX

    return ":" in text and not text.startswith(JPEG_FOLDER_PREFIX)


def own_code(flag: str, text: str) -> Any:
    """The object ``module:attribute`` names, imported as ``python -m`` would find it: from the
    current folder first, then the installed packages. Each block's process imports it again."""
    module_name, _, attribute = text.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{flag} takes your own code as {OWN_CODE} (e.g. models:build_resnet); got {text!r}")
    if module_name.endswith(".py") or "/" in module_name:  # a file's path, as one would give python
        dotted = module_name.removesuffix(".py").strip("./").replace("/", ".")
        raise ValueError(f"{flag} {text}: name the module, not its file: {flag} {dotted}:{attribute}")
    found = _import_yours(flag, text, module_name)
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ValueError(f"{flag} {text}: {_no_such_attribute(found, part)}")
        found = getattr(found, part)
    name_as_typed(found, text)  # results name it so, and the report's Reproduce gives this flag again
    return found


def _no_such_attribute(holder: Any, part: str) -> str:
    """Why ``part`` is not found in ``holder`` (the user's module, or a class in it): its callables,
    those defined there before those it imported (its own were cut off behind transformers'
    classes), and the nearest name."""
    named = {name: getattr(holder, name) for name in vars(holder) if not name.startswith("_")}
    callables = {name: value for name, value in named.items() if callable(value)}
    home = getattr(holder, "__name__", None)

    def imported(value: Any) -> bool:  # a class or function of another module (not sgd = partial(...))
        named_elsewhere = isinstance(value, type) or inspect.isroutine(value)
        return named_elsewhere and getattr(value, "__module__", None) != home

    public = sorted(callables, key=lambda name: (imported(callables[name]), name))
    listed = ", ".join(public[:12]) + (", ..." if len(public) > 12 else "") if public else "none"
    close = difflib.get_close_matches(part, list(named), n=1)
    meant = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{getattr(holder, '__name__', holder)} has no attribute {part!r}{meant}; its callables: {listed}"


def _import_yours(flag: str, text: str, module_name: str) -> Any:
    """The user's module, or one line saying why it cannot be imported (not found, or raising,
    or a script that exits as it is imported)."""
    import importlib

    if os.getcwd() not in sys.path and "" not in sys.path:  # the console script's path lacks it
        sys.path.insert(0, os.getcwd())
    said_on_import = io.StringIO()  # a script's argparse prints its usage as it exits: not ours to show
    try:
        with contextlib.redirect_stderr(said_on_import):
            module = importlib.import_module(module_name)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - whatever the user's module raises
        missing = isinstance(error, ModuleNotFoundError) and error.name is not None
        if missing and (error.name == module_name or module_name.startswith(f"{error.name}.")):
            where = f"in {os.getcwd()} or the installed packages"
            raise ValueError(f"{flag} {text}: no module named {error.name!r} {where}") from None
        lines = str(error).strip().splitlines()
        said = lines[0] if lines else ""
        if isinstance(error, SystemExit):  # a script that runs when imported, not a module
            said = f"it exits as it is imported ({said or 'sys.exit'}): guard its script part with if __name__ == '__main__':"
        else:
            sys.stderr.write(said_on_import.getvalue())
        raise ValueError(
            f"{flag} {text}: importing {module_name} fails: {type(error).__name__}: {said}"
        ) from error
    sys.stderr.write(said_on_import.getvalue())  # what it said as it imported (a warning), as it said it
    return module


def job_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The command's model, data and loss: built-in names as they are, the user's own code
    (``--model models:build``) imported."""
    job = {}
    for key in ("model", "data", "loss_fn"):
        text = getattr(args, key, None)
        if text is not None:
            job[key] = (
                own_code(f"--{key.replace('_', '-')}", text)
                if key == "loss_fn" or is_own_code(text)
                else text
            )
    return job


def _run_ablate(args: argparse.Namespace) -> int:
    import workbench as wb

    preset = PRESETS[args.preset] if args.preset else {}
    settings = {key: value for key, value in preset.items() if key != "techniques"}
    settings |= job_arguments(args)
    settings |= run_settings(args)
    settings["techniques"] = _techniques(args, preset)
    if args.dry_run:
        from workbench.ablation import check_before_run

        # the folder too: a dry run that passes where the run would be refused tells the user nothing
        plan = check_before_run({**settings, "out": args.out, "overwrite": args.overwrite})
        if _torchrun_rank() in (None, 0):  # every rank checks; rank 0 alone shows, as a run's
            print(format_plan(plan, ablate_spelling(args)))
        return 0
    results = wb.ablate(
        **settings,
        out=args.out,
        progress=not args.no_progress,
        overwrite=args.overwrite,
        retry_failed=args.retry_failed,
        on_event=_plan_without_the_bar(args),
    )
    if results.path is None:  # under torchrun, ranks other than 0 keep nothing: rank 0 reports
        return 0
    from workbench.results_view import terminal_width, use_colour

    print()
    print(results.summary(width=terminal_width(), colour=use_colour(), spell=ablate_spelling(args)))
    saved = f"Saved results.json, table.csv, losses.csv, telemetry.csv and plot.png in {results.path}"
    print("\n" + _fill_to_the_terminal(saved))
    return exit_code(results.table)


ADVICE_GENERATOR = "workbench advise"  # in the files advise writes: it replaces only those


def _check_output_file(flag: str, path: str, written_by_us) -> Path:
    """A file a command will write, checked before anything is measured: its folder exists, it
    is not a folder, and it is new or one workbench wrote (``written_by_us(path)``)."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a folder; name a file")
    if not target.parent.is_dir():
        raise ValueError(f"{flag} {path}: the folder {target.parent} does not exist")
    if not os.access(target.parent, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder {target.parent} cannot be written")
    from workbench.results_folder import ResultsFolder, refuse_a_file_not_ours

    # Not among a run's results: that run's overwrite would refuse a file it did not write.
    ResultsFolder(target).refuse_inside_another_run(f"{flag} ")
    refuse_a_file_not_ours(target, written_by_us, f"{flag} {path}")
    return target


def _advice_json(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("generator") == ADVICE_GENERATOR
    except (ValueError, UnicodeDecodeError, AttributeError, OSError):
        return False


def _png_written_by(generator: str) -> Callable[[Path], bool]:
    """Whether a PNG is one this command wrote (its Software field): only such a one is replaced."""

    def written(path: Path) -> bool:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as image:
                return image.info.get("Software") == generator
        except (UnidentifiedImageError, OSError):
            return False

    return written


def _plot_file(command: str, path: str | None, generator: str) -> Path | None:
    """A command's --plot PNG, checked before anything is done: a .png, new or one it wrote."""
    if path is None:
        return None
    if Path(path).suffix.lower() != ".png":
        raise ValueError(f"{command}: --plot writes a PNG image; name a .png file (got {path})")
    return _check_output_file("--plot", path, _png_written_by(generator))


def _run_advise(args: argparse.Namespace) -> int:
    import workbench as wb

    settings = run_settings(args)
    # Before measuring: a bad path found afterwards would throw the measurement away.
    json_file = _check_output_file("--json", args.json, _advice_json) if args.json else None
    plot_file = _plot_file("advise", args.plot, ADVICE_GENERATOR)
    advice = wb.advise(
        **job_arguments(args), progress=not args.no_progress, on_event=_plan_without_the_bar(args), **settings
    )
    from workbench.results_view import terminal_width

    print()
    print(advice.summary(terminal_width(), spell=lambda message: in_cli_terms(message, args)))
    if advice.recommended:  # the advice's ceilings are not measurements: this measures them
        print(f"\nTo measure what is recommended:\n  {_ablate_command(args, advice.recommended)}")
    if json_file is not None:
        record = {"generator": ADVICE_GENERATOR, **advice.to_json()}
        from workbench.results_folder import write_text_atomic

        write_text_atomic(json_file, json.dumps(record, indent=1, default=str, allow_nan=False))
        print(f"Wrote {json_file}")
    if plot_file is not None:
        advice.plot().savefig(plot_file, dpi=110, metadata={"Software": ADVICE_GENERATOR})
        print(f"Wrote {plot_file}")
    if args.trace_dir:
        print(
            f"\nProfiler traces in {args.trace_dir} (open them in https://ui.perfetto.dev or chrome://tracing)"
        )
    return 0


def _ablate_command(args: argparse.Namespace, techniques: dict[str, Any]) -> str:
    """The ``workbench ablate`` command for this job (its model, data and run flags) with a -t per
    technique, as a shell takes it: advise's mapping (``{'mode': 'default'}``) is Python's."""
    from workbench.report import run_flag, technique_flag

    words = ["workbench", "ablate"]
    for flag, value in (("--model", args.model), ("--data", args.data), ("--loss-fn", args.loss_fn)):
        words += [flag, value] if value is not None else []
    for name, value in run_settings(args).items():
        if name in ("trace_dir", "profile_steps"):  # advise's profiling: measuring needs neither
            continue
        typed = getattr(args, name)
        # the user's own code as typed (--optimizer models:make_optimizer), not the object it names
        words += (
            [cli_flag(name), typed]
            if isinstance(typed, str) and is_own_code(typed)
            else run_flag(name, value)
        )
    for name, settings in techniques.items():
        words += ["-t", technique_flag(name, settings or True)]
    return shell_lines([shlex.quote(word) for word in words])


def shell_lines(words: list[str], width: int = 78) -> str:
    """A command's words in lines of at most ``width`` (a word longer stays whole), continued with
    a backslash as a shell reads them, a flag kept on the line of its value."""
    units: list[str] = []
    for word in words:
        if units and units[-1].startswith("-") and " " not in units[-1] and not word.startswith("-"):
            units[-1] += f" {word}"
        else:
            units.append(word)
    lines = [units[0]]
    for unit in units[1:]:
        if len(lines[-1]) + 1 + len(unit) + 2 <= width:
            lines[-1] += f" {unit}"
        else:
            lines.append(f"    {unit}")
    return " \\\n".join(lines)


def _run_tune(args: argparse.Namespace) -> int:
    import workbench as wb

    techniques = _techniques(args, {}) if (args.technique or args.techniques_json) else None
    limit = {} if args.max_candidates is None else {"max_candidates": args.max_candidates}
    results = wb.tune(
        **job_arguments(args), budget_s=args.budget, techniques=techniques, out=args.out,
        overwrite=args.overwrite, progress=not args.no_progress, on_event=_plan_without_the_bar(args),
        **limit, **run_settings(args),
    )  # fmt: skip
    print()
    # The last round's own warnings (a control off its A/A band, a busy machine) bear on its verdict.
    from workbench.results_view import terminal_width

    for warning in results.warnings():
        said = in_cli_terms(warning, args)
        print(textwrap.fill(f"WARNING: {said}", terminal_width(), break_on_hyphens=False), end="\n\n")
    print(_search_text(results))
    if results.best:
        print(f"\nResults.best: {json.dumps(results.best)}")
    print(f"\nSaved tune.json, tune.csv, tune.png and each round (round-N/) in {results.path}")
    return 0


def _run_list(args: argparse.Namespace) -> int:
    import workbench as wb
    from workbench import optional
    from workbench.environment import format_optional_packages

    if args.models:
        if args.device or args.model:  # what it lists is the same everywhere: the flag would do nothing
            flags = " and ".join(
                flag for flag, given in (("--device", args.device), ("--model", args.model)) if given
            )
            args.command_parsers["list"].error(
                f"--models lists the built-in models and datasets, which {flags} "
                f"{'do' if ' and ' in flags else 'does'} not change: leave out {flags}, or --models to "
                "see which techniques can run there"
            )
        print(format_table(wb.list_models()))
        print()
        print(format_table(wb.list_datasets()))
        return 0
    model = own_code("--model", args.model) if args.model and is_own_code(args.model) else args.model
    table = wb.list_techniques(device=args.device or "auto", model=model)
    spell = ablate_spelling(args)  # "pass world_size=2" is "--world-size 2" here
    shown = table[["name", "available", "summary", "reason"]].assign(
        available=table.available.map({True: "yes", False: "no"}),
        reason=[spell(reason) if reason else reason for reason in table.reason],
    )
    print(format_table(shown.rename(columns={"name": "technique", "reason": "why not"})))
    print()
    print(format_optional_packages(optional.report(), spell))
    return 0


def _run_show(args: argparse.Namespace) -> int:
    from workbench.results import load_results
    from workbench.results_view import terminal_width, use_colour

    saved = load_results(args.path)
    if "tune" in saved.record:  # a search: its last round's table, then what it found
        print("The search's last round:\n")
    print(saved.summary(width=terminal_width(), colour=use_colour(), spell=ablate_spelling(args)))
    if "tune" in saved.record:
        print(f"\n{_search_text(saved)}")
    return 0


COMPARISON_GENERATOR = "workbench compare"  # written into its PNG, so that a later one may replace it


def _run_compare(args: argparse.Namespace) -> int:
    import workbench as wb
    from workbench.results_view import terminal_width

    if len(args.paths) < 2:
        raise ValueError(f"compare needs two results folders or more; got {len(args.paths)}")
    plot_file = _plot_file("compare", args.plot, COMPARISON_GENERATOR)
    comparison = wb.compare(*args.paths, names=args.names)
    print(comparison.text(terminal_width()))
    if plot_file is not None:
        comparison.plot().savefig(plot_file, dpi=110, metadata={"Software": COMPARISON_GENERATOR})
        print(f"Wrote {plot_file}")
    return 0


def _search_text(results) -> str:
    """A search's candidates (how far each got, why it left) and its verdict."""
    from workbench.results_view import search_text, terminal_width

    return search_text(results.record["tune"], results.tuning_verdict, terminal_width())


# A setting whose flag is not its keyword's name with dashes.
FLAG_FOR_KEYWORD = {"tune": {"budget_s": "--budget"}}


def in_cli_terms(message: str, args: argparse.Namespace, technique_speaks: bool = True) -> str:
    """A message from the Python API (an error, a warning, a note, help text), reworded for the
    command line that shows it.

    The checks are shared with ``wb.ablate`` and name its keywords (``ablate: batch_size must
    be >= 1``); on the command line the same message names the flag the user typed
    (``ablate: --batch-size must be >= 1``), and ``advise`` and ``tune`` say their own name
    where they validate through ablate's checks. A technique's own option (``grad_accum:
    steps must be ...``) is written the same way in ``-t grad_accum:steps=4``, so it stays.
    """
    command = args.command
    own = re.match(r"unknown (model|dataset) |(model|data) (must be|is required)", message)
    if own and own[0] == "data is required" and command in COMMANDS_OF_A_JOB:  # a flag can give only one
        message = (
            f"{message.split(':')[0]}: give --data {OWN_CODE}, naming a Dataset, an iterable of batches, "
            "or a callable that returns one"
        )
    elif own and command in COMMANDS_OF_A_JOB:  # where the API takes callables, these take module:attribute
        message += f"; or your own, as {'--data' if 'data' in own[0] else '--model'} {OWN_CODE}"
    # help text: no technique speaks
    flags, switches = _flags_speaking(args, message if technique_speaks else "")
    if command in ("ablate", "advise", "tune") and message.startswith("ablate: "):
        message = f"{command}: {message[len('ablate: ') :]}"
    prefix = f"{command}: "
    head = re.match(r"(\w+) must ", message[len(prefix) :]) if message.startswith(prefix) else None
    if head and head[1] in flags:
        message = prefix + flags[head[1]] + message[len(prefix) + len(head[1]) :]
    # keyword=value where the keyword stands alone ("Pass budget_s=14"), and keywords with an
    # underscore in prose ("a smaller batch_size"), which cannot be ordinary words; not a
    # technique's option inside -t text ("grad_accum:steps=4")
    message = re.sub(
        r"(?<![\w:.,/?&-])(\w+)=True\b", lambda m: flags[m[1]] if m[1] in switches else m[0], message
    )
    # A quoted string (a repr: out='results/x', data 'jpeg-folder:PATH') is a value, never prose:
    # set aside while the rules below run, so that a path such as 'runs/steps=30' keeps its
    # text; after keyword= (a flag's), the flag, then the string as a shell takes it.
    values: list[str] = []

    def set_aside(m: re.Match) -> str:
        keyword, quoted = m[1], m[2]
        if keyword and keyword[:-1] in flags:
            shown = f"{flags[keyword[:-1]]} {shlex.quote(_unquoted(quoted))}"
        else:
            shown = m[0]
        values.append(shown)
        return f"\0{len(values) - 1}\0"

    message = re.sub(
        r"(?<![\w:.,/-])(\w+=)?(?<!\w)('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")(?!\w)", set_aside, message
    )
    # So is a call written as Python (partial(SGD, lr=0.1), grad_accum(steps=4)): its keywords are
    # its own, not flags.
    message = re.sub(
        r"(?<![\w.])[A-Za-z_][\w.]*\([^()\n]*\)",
        lambda m: values.append(m[0]) or f"\0{len(values) - 1}\0",
        message,
    )
    # Not inside a path or a URL either (/tmp/trace_dir, ?threads=2): hence / ? & in the lookbehinds.
    message = re.sub(
        r"(?<![\w:.,/?&=-])(\w+)=(?=\S)", lambda m: f"{flags[m[1]]} " if m[1] in flags else m[0], message
    )
    message = re.sub(r"`(\w+)`", lambda m: f"`{flags[m[1]]}`" if m[1] in flags else m[0], message)  # `rounds`
    message = re.sub(r"(?<![\w:.,=/?&-])([a-z]+_\w+)\b(?!=)", lambda m: flags.get(m[1], m[1]), message)
    return re.sub(r"\0(\d+)\0", lambda m: values[int(m[1])], message)


COMMANDS_OF_A_JOB = ("ablate", "advise", "tune", "list")  # the commands that take --model


def _flags_speaking(args: argparse.Namespace, message: str) -> tuple[dict[str, str], set[str]]:
    """The command's flags by keyword (``batch_size`` -> ``--batch-size``), and its switches (flags
    that take no value: "overwrite=True" is "--overwrite"); less the options of a technique whose
    message this is, which keep their names ("grad_accum: steps=1000")."""
    flags, switches = {}, set()
    for action in args.command_parsers[args.command]._actions:
        if action.option_strings and action.dest != "help":
            flags[action.dest] = next(name for name in action.option_strings if name.startswith("--"))
            if action.nargs == 0:
                switches.add(action.dest)
    flags |= FLAG_FOR_KEYWORD.get(args.command, {})
    speaker = re.match(r"(\w+): ", message)
    if speaker:
        from workbench.techniques import all_techniques

        technique = next((t for t in all_techniques() if t.name == speaker[1]), None)
        if technique is not None:
            for option in dataclasses.fields(technique.Config):
                flags.pop(option.name, None)
                switches.discard(option.name)
    return flags, switches


def _unquoted(quoted: str) -> str:
    """A Python string's repr read back ('a b' -> a b); one that is not a repr, as it stands."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an invalid escape ('C:\d') warns before it fails
            value = ast.literal_eval(quoted)
    except (SyntaxError, ValueError):
        return quoted[1:-1]
    return value if isinstance(value, str) else quoted[1:-1]


def ablate_spelling(args: argparse.Namespace) -> Callable[[str], str]:
    """How a run's warnings and the notes under its table read on the command line, whichever command shows it:
    the API's keywords as ablate's flags (``blocks=9`` as ``--blocks 9``, ``threads=1`` as
    ``--threads 1``), the flags a rerun would take."""
    from workbench.results_view import WHERE_ALL_COLUMNS_ARE, WHERE_OTHER_COLUMNS_ARE

    as_ablate = argparse.Namespace(command="ablate", command_parsers=args.command_parsers)

    def spell(message: str) -> str:
        message = message.replace(WHERE_ALL_COLUMNS_ARE, "table.csv and `workbench report` show them")
        message = message.replace(WHERE_OTHER_COLUMNS_ARE, "is in table.csv and `workbench report`")
        return in_cli_terms(message, as_ablate)

    return spell


def exit_code(table) -> int:
    """0 when every runnable arm ran, 1 when any failed, ran out of memory or was skipped for it."""
    from workbench.results import DID_NOT_RUN

    failed = table[table.status.isin(DID_NOT_RUN)]
    if failed.empty:
        return 0
    print(
        f"\nworkbench: {len(failed)} of {len(table)} arms did not run: {', '.join(failed.arm)}",
        file=sys.stderr,
    )
    return 1


def format_table(table) -> str:
    """A DataFrame as aligned text that fits the terminal (80 columns at most): text wraps in
    its column, left-aligned; numbers right-aligned."""
    import pandas as pd

    from workbench.results_view import terminal_width, text_table

    numeric = [table[c].dtype.kind in "iuf" for c in table.columns]
    rows = [["-" if pd.isna(v) else str(v) for v in row] for row in table.itertuples(index=False)]
    return text_table([str(c) for c in table.columns], rows, numeric, terminal_width(), spaced=True)


def _prewarm_template(args: argparse.Namespace) -> None:
    """Start the run's warm template (workbench.template) before this process imports torch: the
    two imports then overlap on two cores, and the first block starts about 1.5 s sooner."""
    runs_here = args.command in ("ablate", "advise", "tune") and not getattr(args, "dry_run", False)
    if (
        runs_here
        and getattr(args, "executor", None) != "slurm"  # each Slurm job starts its own
        and getattr(args, "start", None) != "spawn"
        and not started_by_torchrun()  # a torchrun rank is the process that measures
    ):
        from workbench.template import prewarm

        prewarm()


_terminated: list[int] = []  # the signal that ended the command, when one did (SIGTERM)


def _raise_terminated(signum, frame) -> None:
    """SIGTERM (``kill``, a container or a scheduler stopping the job), handled as Ctrl-C is: the
    run ends its processes, keeps what finished and says so, and leaves no lock behind."""
    _terminated.append(signum)
    raise KeyboardInterrupt


@contextlib.contextmanager
def _own_warnings_in_one_line():
    """A warning of workbench's own (a corrupt JPEG skipped) printed as the command prints its
    errors, "workbench: warning: ...", not with the Python file and line that raised it; other
    packages' warnings keep Python's format, which says where to look."""
    with warnings.catch_warnings():  # the caller's showwarning again afterwards (main from Python)
        python_format = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not any(Path(filename).resolve().is_relative_to(root) for root in _workbench_folders()):
                return python_format(message, category, filename, lineno, file, line)
            print(f"workbench: warning: {message}", file=file or sys.stderr, flush=True)

        warnings.showwarning = show
        yield


def _workbench_folders() -> list[Path]:
    """The package's folder and its datasets' (a folder of its own in a source checkout), found
    without running workbench.datasets, which imports numpy: asked only when a warning is shown,
    not at every command's start."""
    import importlib.util

    datasets = importlib.util.find_spec("workbench.datasets")
    inside = datasets.submodule_search_locations if datasets is not None else []
    return [Path(__file__).resolve().parent, *(Path(p).resolve() for p in inside or [])]


def _dashed_values_joined(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--budget -5m`` as ``--budget=-5m``. argparse takes a value that starts with a dash for the
    next flag unless it is a plain number, and says only "expected one argument"; joined to its
    flag, the value reaches the flag's own check, which says what is valid."""
    takes_a_value = {
        flag
        for command in parser.get_default("command_parsers").values()
        for action in command._actions
        if action.nargs != 0
        for flag in action.option_strings
        if flag.startswith("--")
    }
    joined: list[str] = []
    for token in argv:
        if joined and joined[-1] in takes_a_value and re.match(r"-\.?\d", token):
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    return joined


def main(argv: list[str] | None = None) -> int:
    with _own_warnings_in_one_line():
        if threading.current_thread() is not threading.main_thread():  # only it is given signals
            return _main(argv)
        _terminated.clear()
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            return _main(argv)
        finally:  # main() called from Python (a test, a script) leaves the caller's handler as it was
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _lines_in_flags(args: argparse.Namespace) -> Iterator[None]:
    """While a command runs, the lines the run prints as it goes (how to resume after Ctrl-C, the
    tuner's rounds) name this command's flags, not the API's keywords (progress.SPELLING)."""
    from workbench.progress import SPELLING

    token = SPELLING.set(lambda text: _fill_to_the_terminal(in_cli_terms(text, args)))
    try:
        yield
    finally:  # main() called from Python (a test, a notebook) leaves the API's spelling behind
        SPELLING.reset(token)


def _fill_to_the_terminal(text: str) -> str:
    """Each line of a run's own text wrapped at the terminal's width, between words only: a line
    left to the terminal breaks inside words and paths. A line's indent carries on to its rest."""
    from workbench.results_view import terminal_width

    width = terminal_width()
    filled = []
    for line in text.split("\n"):
        indent = line[: len(line) - len(line.lstrip())]
        filled.append(
            textwrap.fill(
                line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
            )
            if len(line) > width
            else line
        )
    return "\n".join(filled)


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(
        _dashed_values_joined(parser, sys.argv[1:] if argv is None else argv)
    )
    if extra:
        args.command_parsers[args.command].error(_unrecognized(args, extra))
    _prewarm_template(args)
    try:
        if args.command == "list":
            return _run_list(args)
        if args.command == "env":
            from workbench.environment import environment, format_environment

            env = environment()
            print(json.dumps(env, indent=1) if args.json else format_environment(env, ablate_spelling(args)))
            return 0
        if args.command == "show":
            return _run_show(args)
        if args.command == "compare":
            return _run_compare(args)
        if args.command == "report":
            from workbench.results import load_results

            written = load_results(args.path).to_html(args.out)
            print(f"Wrote {written}")
            return 0
        with _lines_in_flags(args):
            if args.command == "advise":
                return _run_advise(args)
            if args.command == "tune":
                return _run_tune(args)
            return _run_ablate(args)
    except (ValueError, FileNotFoundError) as error:
        _say_failed(f"error: {in_cli_terms(str(error), args)}")
        return 2
    except NothingMeasured as error:  # advise or tune: their baseline failed, or no round finished
        _say_failed(str(error))
        return 1
    except KeyboardInterrupt:
        return 143 if _terminated else 130  # 128 + the signal, as a shell reports it
    except BrokenPipeError:  # `workbench show run | head`: the reader left, which is no error of ours
        # Python would complain again while flushing stdout at exit: point it at nothing first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a pipeline's writer
    except OSError as error:  # a file or folder this user may not read or write, a full disk
        where = f": {error.filename}" if error.filename else ""
        _say_failed(f"error: {error.strerror or error}{where}")
        return 2


def _torchrun_rank() -> int | None:
    """This process's rank when torchrun started it, else None (read without importing torch)."""
    return int(os.environ.get("RANK", "0")) if started_by_torchrun() else None


def _say_failed(text: str) -> None:
    """Why the command failed, on stderr in one write: torchrun's ranks share the terminal, and
    two ranks' lines ran together on one. A rank other than 0 names itself (on another node its
    reason may be its own: a module that is not installed there)."""
    rank = _torchrun_rank()
    who = "workbench" if not rank else f"workbench (rank {rank})"
    sys.stderr.write(f"{who}: {text}\n")
    sys.stderr.flush()


if __name__ == "__main__":
    raise SystemExit(main())
