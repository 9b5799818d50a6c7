"""Run settings and the validation helpers every config dataclass shares.

Every error a user can trigger with a bad value goes through these helpers, so the
messages look alike: ``<owner>: <field> must be <rule>; got <value>``. Unknown names
(technique, model, dataset, mode...) list the valid choices and suggest the closest.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
import os
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from workbench.heap import HEAP_CHOICES

MODES = ("one-at-a-time", "leave-one-out", "grid")
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
OPTIMIZERS = ("adamw", "sgd")
DEFAULT_LR = 1e-3  # adamw's and sgd's; an optimizer factory of the user's sets its own
# The default loss as results.json names it (config["loss_fn"] without a loss_fn of the user's):
# the model's own where it returns one (a Hugging Face output given labels), else cross-entropy;
# the last where the check before the arms could not tell which (a model run on the meta device).
DEFAULT_LOSSES = ("cross_entropy", "the model's own loss", "the model's own loss, else cross_entropy")

# WORKBENCH_SMOKE=1 cuts every run to a smoke test's budget: enough to run every line of a
# notebook (the notebooks tier sets it: tests/conftest.py), far too little to decide anything.
# Blocks stay as given: they are what a notebook's plan and tables show. Two warm-up steps, not
# one: PowerSGD all-reduces in full before its start_iter (2), and those steps must stay untimed.
# A run's processes also share one compiled-code cache (workbench.ablation), so only its first
# block pays torch.compile's cold start.
SMOKE_ENV = "WORKBENCH_SMOKE"
SMOKE_CAPS = {"steps": 3, "warmup": 2}
# batch_size left to auto, where workbench makes the batches (a Dataset, built-in data).
DEFAULT_BATCH_SIZE = 32
SMOKE_BUDGET_S = 30.0  # a search's budget (wb.tune) under WORKBENCH_SMOKE=1
# Its first clause is what a plot's title shows of it (workbench.plots keeps a warning's first clause).
SMOKE_NOTE = (
    f"a smoke test's budget, not for decisions ({SMOKE_ENV}=1): every run was cut to at most "
    f"{SMOKE_CAPS['steps']} steps and {SMOKE_CAPS['warmup']} warm-up steps (a search to "
    f"{SMOKE_BUDGET_S:.0f} s), and its processes shared compiled code, to check that the code runs"
)


def started_by_torchrun() -> bool:
    """Whether torchrun (torch.distributed's elastic agent) started this process, read from the
    environment it sets, without importing torch: its world size is then the run's."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def smoke_test() -> bool:
    """Whether WORKBENCH_SMOKE asks for smoke-test budgets; a value that is neither on nor off
    is refused, naming both, rather than read as either."""
    text = os.environ.get(SMOKE_ENV, "").strip().lower()
    if text in ("", "0", "off", "false", "no"):
        return False
    if text in ("1", "on", "true", "yes"):
        return True
    raise ValueError(
        f"{SMOKE_ENV} must be 1 (cut every run to a smoke test's budget: at most "
        f"{SMOKE_CAPS['steps']} steps and {SMOKE_CAPS['warmup']} warm-up steps) or 0 (the budgets "
        f"as given); got {os.environ[SMOKE_ENV]!r}"
    )


def unknown_name_error(kind: str, name: object, valid: Iterable[str]) -> ValueError:
    """A one-line error for an unknown name, listing the valid ones."""
    valid = list(valid)
    message = f"unknown {kind} {name!r}; valid {kind}s: {', '.join(valid)}"
    text = str(name)
    parts = [part.strip() for part in text.split(",")]
    if len(parts) > 1 and all(part in valid for part in parts):  # "-t amp,compile": two names in one
        named = " and ".join(repr(part) for part in parts)
        return ValueError(f"{message} ({len(parts)} {kind}s in one name: give {named} separately)")
    same_but_case = [choice for choice in valid if choice.lower() == text.lower()]
    close = same_but_case or difflib.get_close_matches(text, valid, n=1)
    if close:
        message += f" (did you mean {close[0]!r}?)"
    return ValueError(message)


def check_int(
    owner: str, field: str, value: object, minimum: int, why: str = "", maximum: int | None = None
) -> int:
    """A Python int (NumPy integers from a sweep are accepted and converted), in range."""
    # bool is an int subclass in Python; `steps=True` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{owner}: {field} must be an integer >= {minimum}; got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {field} must be >= {minimum}; got {value!r}{why}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{owner}: {field} must be <= {maximum}; got {value!r}")
    return int(value)


def check_number(owner: str, field: str, value: object, *, above: float, most: float | None = None) -> float:
    """A finite Python float above ``above`` and at most ``most`` (NaN and infinity are mistakes,
    not settings)."""
    valid = f"> {above}" + (f" and <= {most}" if most is not None else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{owner}: {field} must be a finite number {valid}; got {value!r}")
    if not value > above or (most is not None and value > most):
        raise ValueError(f"{owner}: {field} must be {valid}; got {value!r}")
    return float(value)


def check_bool(owner: str, field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {field} must be True or False; got {value!r}")
    return value


def check_choice(owner: str, field: str, value: object, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        listed = " | ".join(repr(c) for c in choices)
        close = difflib.get_close_matches(value, choices, n=1) if isinstance(value, str) else []
        meant = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{owner}: {field} must be one of {listed}; got {value!r}{meant}")
    return value  # type: ignore[return-value]


# The user's own code the command line imported (--model models:build), by the object: results
# name it as it was typed, which the report's Reproduce turns back into the same flag. Held here
# with the object itself, so that its id is not reused while the process lives.
_TYPED: dict[int, tuple[object, str]] = {}


def name_as_typed(thing: object, text: str) -> None:
    """Remember that ``thing`` came from the command line's ``module:attribute`` ``text``."""
    _TYPED[id(thing)] = (thing, text)


def typed_name(thing: object) -> str | None:
    """The ``module:attribute`` the command line imported ``thing`` from, if it did."""
    held = _TYPED.get(id(thing))
    return held[1] if held is not None and held[0] is thing else None


def without_addresses(text: str) -> str:
    """``text`` without the addresses in default reprs (``<Cfg at 0x7f..>``): they differ in every
    process, so a label or digest holding one would tell a run apart from its own rerun."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def error_text(error: BaseException) -> str:
    """An error in one line, as a message quotes it: its type and the first line of its text."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def callable_label(function: object) -> str:
    """A user's function, class or ``functools.partial`` as results name it: ``small_gpt2``,
    ``partial(SGD, lr=0.1, momentum=0.9)`` (with its arguments, which tell two runs apart), or
    ``models:build`` as the command line named it."""
    if (typed := typed_name(function)) is not None:
        return typed
    if isinstance(function, functools.partial):
        arguments = [callable_label(function.func), *map(repr, function.args)]
        arguments += [f"{k}={v!r}" for k, v in function.keywords.items()]
        text = without_addresses(f"partial({', '.join(arguments)})")  # else no resume would match
        return text if len(text) <= LABEL_CHARACTERS else text[: LABEL_CHARACTERS - 4] + "...)"
    return getattr(function, "__qualname__", None) or type(function).__name__


LABEL_CHARACTERS = 100  # a partial's arguments are cut there (a class weight's repr runs on)


def as_optimizer(value: Any) -> Any:
    """A built-in optimizer's name, or the user's factory: ``params -> torch.optim.Optimizer``."""
    if isinstance(value, str):
        if value in OPTIMIZERS:
            return value
        error = unknown_name_error("optimizer", value, OPTIMIZERS)
        raise ValueError(
            f"{error}; or your own factory, params -> torch.optim.Optimizer (on the command line: "
            "module:attribute)"
        )
    if hasattr(value, "param_groups") and not isinstance(value, type):  # built over one model already
        raise ValueError(
            f"ablate: optimizer is an optimizer already built ({type(value).__name__}), over one model's "
            f"parameters; every arm builds its own model, so pass a factory: {OPTIMIZER_EXAMPLE}"
        )
    if not callable(value):
        raise ValueError(
            f"ablate: optimizer must be one of {', '.join(OPTIMIZERS)} or a factory params -> "
            f"torch.optim.Optimizer, e.g. {OPTIMIZER_EXAMPLE}; got {value!r}"
        )
    return value


OPTIMIZER_EXAMPLE = "functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True)"


def optimizer_label(optimizer: Any) -> str:
    """The run's optimizer as results record it: a built-in's name, or the user's factory's label."""
    return optimizer if isinstance(optimizer, str) else callable_label(optimizer)


# How an arm refused by memory_cap_mb says so: the reader's views find such arms by it.
OVER_THE_CAP = "more than memory_cap_mb="


class NothingMeasured(RuntimeError):
    """What a command needed measured could not be (the advisor's or the tuner's baseline failed,
    or no round finished). The message says why; the command line prints it in one line, exit 1."""


def check_device(value: object) -> str:
    # A torch.device is what PyTorch code has at hand: taken as its name ("cuda:0"), which is what
    # travels to the workers. Recognised by its type's name: the CLI reads this module without torch.
    if type(value).__name__ == "device" and type(value).__module__ == "torch":
        value = str(value)
    if isinstance(value, str) and (value in ("auto", "cpu", "cuda") or _is_cuda_index(value)):
        return value
    raise ValueError(f"unknown device {value!r}; valid devices: {', '.join(DEVICES)}")


def _is_cuda_index(value: str) -> bool:
    prefix, _, index = value.partition(":")
    return prefix == "cuda" and index.isdigit()


@dataclass(frozen=True)
class Link:
    """A simulated network link between the ranks (a simulation, not a measurement)."""

    bandwidth_gbps: float  # gigabits per second, per rank
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        check_number("link", "bandwidth_gbps", self.bandwidth_gbps, above=0.0)
        if (
            isinstance(self.latency_ms, bool)
            or not isinstance(self.latency_ms, (int, float))
            or self.latency_ms < 0
        ):
            raise ValueError(f"link: latency_ms must be a number >= 0; got {self.latency_ms!r}")

    def delay_s(self, wire_bytes: float) -> float:
        return self.latency_ms / 1e3 + 8 * wire_bytes / (self.bandwidth_gbps * 1e9)

    def describe(self) -> str:
        return f"simulated link: {self.bandwidth_gbps:g} Gbit/s, {self.latency_ms:g} ms latency"

    def as_text(self) -> str:
        """As typed on the CLI (``--link``) or in the panel; ``as_link`` reads it back."""
        return f"bandwidth_gbps={self.bandwidth_gbps:g},latency_ms={self.latency_ms:g}"


def _link_text(text: str) -> dict:
    settings = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, equals, number = part.partition("=")
        try:
            settings[key.strip()] = float(number)
        except ValueError:
            raise ValueError(
                f"link: write it as bandwidth_gbps=NUMBER[,latency_ms=NUMBER]; got {text!r}"
            ) from None
    return settings


def as_link(value: Any) -> Link | None:
    """``None``, a Link, a dict like ``{"bandwidth_gbps": 1, "latency_ms": 0.1}``, or that
    dict as text: ``"bandwidth_gbps=1,latency_ms=0.1"``."""
    if value is None or isinstance(value, Link):
        return value
    if isinstance(value, str):  # as typed on the CLI or in the panel: bandwidth_gbps=1,latency_ms=0.1
        value = _link_text(value)
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"bandwidth_gbps", "latency_ms"})
        if unknown:
            raise ValueError(
                f"link: unknown option {unknown[0]!r}; valid options: bandwidth_gbps, latency_ms"
            )
        if "bandwidth_gbps" not in value:
            raise ValueError(
                "link: bandwidth_gbps is required, e.g. link={'bandwidth_gbps': 1.0, 'latency_ms': 0.1}"
            )
        return Link(**value)
    raise ValueError(
        f"link must be None, a dict like {{'bandwidth_gbps': 1.0, 'latency_ms': 0.1}} or the text "
        f"'bandwidth_gbps=1,latency_ms=0.1'; got {value!r}"
    )


EXECUTORS = ("local", "slurm")


def _part(default: Any, help: str) -> Any:
    """A SlurmOptions field: its default and its help (the CLI's --slurm-* flags show it)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class SlurmOptions:
    """What each Slurm job (one block) asks the cluster for, with ``executor="slurm"``.

    None means: leave it to the cluster's defaults, or, for the GPUs and CPUs, decide from the
    run (see each field). The CLI takes each field as a flag (``--slurm-partition gpu``); the
    panel's text box and ``ablate`` also take it as text:
    ``partition=gpu,time_min=30,extra=--exclusive --qos=high``.
    """

    partition: str | None = _part(
        None, "the partition(s) to submit to (sbatch --partition); auto: the cluster's default"
    )
    account: str | None = _part(None, "the account charged (sbatch --account); auto: yours by default")
    time_min: int = _part(60, "each job's time limit in minutes: one whole block, start-up included")
    gpus_per_job: int | None = _part(
        None, "GPUs per job, on its one node; auto: world_size on CUDA (a DDP arm's ranks), else none"
    )
    cpus_per_job: int | None = _part(
        None, "CPU cores per job; auto: as many as this machine has, the cores a local block sees"
    )
    constraint: str | None = _part(
        None, "node features (sbatch --constraint), e.g. h100: keeps every block on one kind of node"
    )
    extra: str = _part("", "further sbatch options, e.g. '--exclusive --qos=high'")
    retries: int = _part(
        2, "how often a block whose job failed, ran out of time or was preempted is submitted again"
    )

    def __post_init__(self) -> None:
        owner = "slurm"
        for name in ("partition", "account", "constraint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{owner}: {name} must be a non-empty name (or None); got {value!r}")
        check_int(owner, "time_min", self.time_min, 1)
        check_int(owner, "retries", self.retries, 0)
        for name in ("gpus_per_job", "cpus_per_job"):
            if getattr(self, name) is not None:
                check_int(owner, name, getattr(self, name), 0 if name == "gpus_per_job" else 1)
        if not isinstance(self.extra, str):
            raise ValueError(f"{owner}: extra must be sbatch arguments as one string; got {self.extra!r}")
        self.sbatch_extra()  # unreadable quoting fails here, not at submission

    def sbatch_extra(self) -> dict[str, Any]:
        """``extra`` as sbatch options: ``--qos=high`` -> {"qos": "high"}, ``--exclusive`` -> {"exclusive": True}."""
        import shlex

        try:
            words = shlex.split(self.extra)
        except ValueError as error:
            raise ValueError(
                f"slurm: extra cannot be read as sbatch arguments ({error}); got {self.extra!r}"
            ) from None
        options: dict[str, Any] = {}
        for index, word in enumerate(words):
            if not word.startswith("--") or len(word) < 3:
                if index and words[index - 1].startswith("--") and "=" not in words[index - 1]:
                    continue  # the value of "--qos high", taken below
                raise ValueError(
                    f"slurm: extra takes long sbatch options (--name=value or --flag); got {word!r} in {self.extra!r}"
                )
            name, equals, value = word[2:].partition("=")
            follows = index + 1 < len(words) and not words[index + 1].startswith("--")
            options[name.replace("-", "_")] = value if equals else (words[index + 1] if follows else True)
        return options

    def as_text(self) -> str:
        """As typed on the CLI or in the panel; ``as_slurm`` reads it back."""
        parts = []
        for item in fields(self):
            value = getattr(self, item.name)
            if value not in (None, "") and value != item.default:
                parts.append(f"{item.name}={value}")
        return ",".join(parts)


def _slurm_text(text: str) -> dict:
    """``key=value,key=value``; ``extra``'s value may hold commas and spaces, so a comma ends a
    value only where the next known key follows it."""
    import re

    names = [item.name for item in fields(SlurmOptions)]
    starts = list(re.finditer(r"(?:^|,)\s*(" + "|".join(names) + r")\s*=", text))
    if text.strip() and (not starts or starts[0].start() != 0 and text[: starts[0].start()].strip()):
        raise ValueError(f"slurm: write it as key=value,key=value with keys {', '.join(names)}; got {text!r}")
    settings = {}
    for index, match in enumerate(starts):
        end = starts[index + 1].start() if index + 1 < len(starts) else len(text)
        settings[match.group(1)] = text[match.end() : end].strip()
    return settings


def as_slurm(value: Any) -> SlurmOptions | None:
    """``None`` (the cluster's defaults), a SlurmOptions, a dict of its fields (values may be
    text, as the CLI's ``--slurm-*`` flags give them), or ``"key=value,..."`` text."""
    if value is None or isinstance(value, SlurmOptions):
        return value
    if isinstance(value, str):
        value = _slurm_text(value)
    if not isinstance(value, Mapping):
        raise ValueError(
            "slurm must be None, a dict like {'partition': 'gpu', 'time_min': 30} or the text "
            f"'partition=gpu,time_min=30'; got {value!r}"
        )
    known = {item.name: item for item in fields(SlurmOptions)}
    settings = {}
    for name, setting in value.items():
        if name not in known:
            raise unknown_name_error("slurm option", name, known)
        if isinstance(setting, str) and name in ("time_min", "retries", "gpus_per_job", "cpus_per_job"):
            text = setting.strip()
            setting = None if text.lower() in ("", "auto") and name.endswith("_per_job") else _as_int(text)
        settings[name] = setting
    return SlurmOptions(**settings)


def _as_int(text: str) -> int | str:
    try:
        return int(text)
    except ValueError:
        return text  # SlurmOptions names the field and its rule


@dataclass(frozen=True)
class Option:
    """One run setting's contract: what it means, which values it takes, how people set it.

    RunConfig's fields carry one each (``field.metadata["option"]``). Validation, ``ablate``'s
    and ``plan``'s signatures and docs, the CLI's flags and the panel's controls are all read
    from these, so a new setting is one field here and nothing else.
    """

    help: str
    kind: type  # int, float, bool or str: what a set value is (choices and check may convert)
    least: float | None = None  # int: the smallest valid value; float: values must exceed it
    most: int | None = None  # int: the largest valid value
    choices: Mapping[str, Any] | None = None  # the word a person picks -> the value it stands for
    auto: bool = False  # None is valid: decided later (from measurements), or nothing at all
    unset: str = "auto"  # the word for None, where None is valid: "auto", or "none" for a link
    parts: type | None = (
        None  # a dataclass whose fields the CLI takes as flags of their own (--slurm-partition)
    )
    check: Callable[[Any], Any] | None = None  # validates and converts when the rules above can't
    main: bool = False  # the panel shows it in its first row rather than under "more settings"
    aliases: tuple[str, ...] = ()  # other names the CLI accepts (former ones, shorter ones)
    why: str = ""  # added to a range error: why the limit exists
    own_code: bool = False  # the CLI also takes the user's own, as module:attribute (--optimizer)

    def validate(self, name: str, value: Any) -> Any:
        """The value to store (converted), or a ValueError that names the rule."""
        if value is None and self.auto:
            return None
        if self.check is not None:
            return self.check(value)
        if self.choices is not None:
            chosen = self.choice_of(value)
            if chosen is not None:
                return chosen[1]
            if all(isinstance(word, str) and word == meant for word, meant in self.choices.items()):
                raise unknown_name_error(name, value, self.choices)
            listed = " | ".join(f"{meant!r} ({word})" for word, meant in self.choices.items())
            raise ValueError(f"ablate: {name} must be one of {listed}; got {value!r}")
        if self.kind is bool:
            return check_bool("ablate", name, value)
        if self.kind is int:
            return check_int("ablate", name, value, int(self.least or 0), self.why, self.most)
        if self.kind is float:
            return check_number("ablate", name, value, above=float(self.least or 0.0))
        return value

    def choice_of(self, value: Any) -> tuple[str, Any] | None:
        """The (word, value) pair that ``value`` is; ``is`` for True/None, so 1 is not True here."""
        assert self.choices is not None
        for word, meant in self.choices.items():
            if value is meant or (isinstance(value, str) and value == meant):
                return word, meant
        return None

    def word(self, value: Any) -> str:
        """The choice word that stands for ``value`` (``"auto"`` for loader_arms=None)."""
        chosen = self.choice_of(value)
        assert chosen is not None, f"{value!r} is none of the choices"
        return chosen[0]

    def text(self, value: Any) -> str:
        """``value`` as a person would type it (the CLI, the panel's text boxes); "" for auto."""
        if value is None:
            return ""
        return value.as_text() if hasattr(value, "as_text") else str(value)

    def parse(self, text: str) -> Any:
        """What a person typed, as the value to validate ("" and "auto" mean auto)."""
        text = text.strip()
        if self.auto and text.lower() in ("", "auto", "none", self.unset):
            return None
        if self.kind in (int, float):
            try:
                return self.kind(text)
            except ValueError:
                return text  # validation names the field and its rule
        return text


def option(default: Any, help: str, kind: type, **rules: Any) -> Any:
    """A RunConfig field: its default and its Option."""
    return field(default=default, metadata={"option": Option(help, kind, **rules)})


def cli_flag(setting: str, part: str | None = None) -> str:
    """The command line's flag for a run setting (``--memory-cap-mb``), or for one part of it
    (``--slurm-time-min``): the CLI adds them by this name and the report writes them back."""
    return "--" + (setting if part is None else f"{setting}_{part}").replace("_", "-")


def run_options() -> dict[str, Option]:
    """Every run setting's Option, in RunConfig's order."""
    return {f.name: f.metadata["option"] for f in fields(RunConfig)}


# Bounds far beyond any real run (ten million steps of 1 ms are three hours per arm and block),
# so that a typo of extra digits is refused at once instead of planning for years, or filling
# memory with the plan (a worker keeps a record per window, the parent per planned block).
MAX_STEPS = 10_000_000
MAX_BLOCKS = 10_000


@dataclass(frozen=True)
class RunConfig:
    """How each arm is trained and timed: the same for every arm, and the one object that
    travels from ``ablate()`` (or ``plan()``, the CLI, the panel) to every worker process."""

    steps: int = option(
        30,
        "timed optimizer steps per arm in each block, split into `rounds` windows",
        int,
        least=1,
        most=MAX_STEPS,
        main=True,
    )
    warmup: int = option(
        5,
        "untimed optimizer steps per arm before its first window",
        int,
        least=1,
        most=MAX_STEPS,
        main=True,
        why=" (the first steps pay one-off costs: allocation, compilation, autotuning)",
    )
    blocks: int = option(
        3,
        "fresh processes, each running every arm side by side (the repeats): each speedup is "
        "computed inside its block and combined over blocks",
        int,
        least=1,
        most=MAX_BLOCKS,
        main=True,
        aliases=("repeats",),
    )
    rounds: int | None = option(
        None,
        "windows per arm in a block: each round runs every arm for steps/rounds steps, in a fresh "
        "random order; auto: windows of about 5 ms (one step, for slower steps), from the warm-up's "
        "step time",
        int,
        least=1,
        auto=True,
    )
    batch_size: int | None = option(
        None,
        "samples per optimizer step (grad_accum splits it, never grows it); auto: "
        f"{DEFAULT_BATCH_SIZE} for a Dataset or built-in data, the size of ready-made batches",
        int,
        least=1,
        auto=True,
        main=True,
    )
    device: str = option("auto", "auto | cpu | cuda | cuda:N", str, check=check_device, main=True)
    seed: int = option(
        0,
        "seeds Python's, NumPy's and torch's generators (NumPy's takes 32 bits)",
        int,
        least=0,
        most=2**32 - 1,
    )
    mode: str = option(
        "one-at-a-time",
        "which arms: each technique alone (one-at-a-time), all but one (leave-one-out), or every "
        "combination (grid)",
        str,
        choices={mode: mode for mode in MODES},
        main=True,
    )
    optimizer: str | Callable = option(
        "adamw",
        "the optimizer every arm trains with: adamw, sgd (momentum 0.9), or your own factory "
        f"params -> torch.optim.Optimizer, called once per arm, e.g. {OPTIMIZER_EXAMPLE} (on the "
        "command line, module:attribute names it)",
        str,
        choices={o: o for o in OPTIMIZERS},
        check=as_optimizer,
        own_code=True,
    )
    lr: float = option(
        DEFAULT_LR,
        "the learning rate of adamw and sgd (your own optimizer factory sets its own)",
        float,
        least=0.0,
    )
    control: bool = option(
        True, "also run the baseline a second time in every block: an A/A check of the noise", bool
    )
    loader_arms: bool | str | None = option(
        None,
        "time the input pipeline alone too (loader rows, a no-op model); auto: when dataloader or "
        "dali is ablated on a Dataset; only: nothing else",
        object,
        choices={"auto": None, "on": True, "off": False, "only": "only"},
    )
    world_size: int = option(
        1,
        "ranks per arm: > 1 runs every arm as a DDP job on this machine (gloo on CPU, NCCL on CUDA), "
        "each rank on its own shard with batch_size samples per step, in a process group of its own "
        "in every block; under torchrun, torchrun's world size",
        int,
        least=1,
    )
    find_unused_parameters: bool = option(
        False,
        "with world_size > 1: DDP's own option, for a model whose steps leave some parameters out "
        "of the loss (a branch taken now and then); it walks the graph after every forward, at a cost",
        bool,
    )
    isolate: bool = option(
        False,
        "every arm in a process of its own, in every block, as before blocks: each ratio then "
        "carries two processes' luck (10-15% here); to compare, or when in doubt about an arm "
        "sharing a process",
        bool,
    )
    link: Link | None = option(
        None,
        "a simulated network between the ranks, e.g. bandwidth_gbps=1,latency_ms=0.1: each "
        "gradient bucket is delayed by latency + bytes / bandwidth (a simulation)",
        str,
        check=as_link,
        auto=True,
        unset="none",
    )
    memory_cap_mb: float | None = option(
        None,
        "treat the device as having this much memory (MiB): an arm whose peak tensor memory in a "
        "step passes it is recorded as out of memory, as it would be on such a device (checked "
        "on the measured peak, not enforced by the allocator); the advisor reads it as the "
        "capacity; auto: the device's own",
        float,
        least=1.0,
        auto=True,
    )
    profile_steps: int = option(
        0,
        "after the timed windows, run this many more steps of each arm under torch.profiler and "
        "record what a step is made of: operations and kernels per step, their median time, the "
        "matmul/conv share (never part of the timed windows); 0: no profiling",
        int,
        least=0,
    )
    trace_dir: str | None = option(
        None,
        "with profile_steps, write each arm's profiler trace into this folder, one JSON file per "
        "arm and block (open it in Perfetto or chrome://tracing); it replaces only this run's own "
        "traces, never a file of yours or another results folder's trace; auto: no trace",
        str,
        auto=True,
        aliases=("trace",),
    )
    start: str = option(
        "template",
        "how each process of the run starts: template forks it from a process that imported torch "
        "once for the run (Linux; about 3.5 s less per process here); spawn starts a new "
        "interpreter each time. Either way every block is a fresh process",
        str,
        choices={"template": "template", "spawn": "spawn"},
    )
    threads: int | None = option(
        None,
        "intra-op CPU threads in each measuring process (torch.set_num_threads); auto: torch's "
        "default, one per core (with several ranks on one machine, the cores shared out). Fewer "
        "than the cores steadies CPU figures on a shared or virtual machine, where how fast the "
        "threads work together can change while a run measures. More than the cores is warned of: threads then wait for cores",
        int,
        least=1,
        auto=True,
    )
    heap: str = option(
        "steady",
        "glibc's malloc in each measuring process: steady fixes its thresholds (chunks up to 32 MiB "
        "from the heap, no trimming), so that what an arm's steps pay in page faults does not depend "
        "on the other arms or on the process's past; as-is leaves glibc's adaptive thresholds (or "
        "an LD_PRELOAD allocator) alone",
        str,
        choices={choice: choice for choice in HEAP_CHOICES},
    )
    executor: str = option(
        "local",
        "where the blocks run: local runs them one after another on this machine; slurm submits "
        "each block as a Slurm job (through submitit, pip install -e .[cluster]), one node each",
        str,
        choices={e: e for e in EXECUTORS},
    )
    slurm: SlurmOptions | None = option(
        None,
        "with executor=slurm, what each job asks for, e.g. partition=gpu,account=lab,time_min=30,"
        "gpus_per_job=1,cpus_per_job=8,constraint=h100,extra=--exclusive,retries=2; auto: the "
        "cluster's defaults, the run's GPUs, this machine's core count",
        str,
        check=as_slurm,
        auto=True,
        parts=SlurmOptions,
    )
    timeout_s: float | None = option(
        None,
        "limit in seconds for one arm in one block; past it the arm is recorded as failed and its "
        "block runs again without it; auto: 15 minutes to build and warm up, then 10x what the "
        "warm-up steps predict (at least 2 minutes)",
        float,
        least=0.0,
        auto=True,
    )

    def __post_init__(self) -> None:
        for name, rules in run_options().items():  # frozen: store the checked, converted value
            object.__setattr__(self, name, rules.validate(name, getattr(self, name)))
        if self.rounds is not None and self.rounds > self.steps:
            raise ValueError(
                f"ablate: rounds={self.rounds} exceeds steps={self.steps}; each round's window needs at least one step"
            )
        if self.trace_dir is not None and not self.profile_steps:
            raise ValueError("ablate: trace_dir writes the profiler's trace, so it needs profile_steps >= 1")
        if self.trace_dir is not None:
            _check_trace_dir(self.trace_dir)
        if self.slurm is not None and self.executor != "slurm":
            raise ValueError("ablate: slurm options describe Slurm jobs, so they need executor='slurm'")
        if self.find_unused_parameters and self.world_size < 2:
            raise ValueError(
                "ablate: find_unused_parameters is DistributedDataParallel's option, so it needs world_size=2 or more"
            )
        if not isinstance(self.optimizer, str) and self.lr != DEFAULT_LR:
            raise ValueError(
                f"ablate: lr={self.lr} is for the built-in optimizers; your optimizer factory "
                f"{callable_label(self.optimizer)} sets its own learning rate: pass it there"
            )
        if self.link is not None and self.world_size < 2:
            raise ValueError("ablate: link simulates the network between ranks, so it needs world_size >= 2")

    @classmethod
    def from_options(cls, caller: str, options: Mapping[str, Any], also: Iterable[str] = ()) -> RunConfig:
        """RunConfig from keyword arguments; an unknown one is named, with the valid ones
        (``also``: the caller's other keywords, listed among the valid ones)."""
        valid = list(run_options())
        for name in options:
            if name not in valid:
                raise unknown_name_error(f"{caller} argument", name, [*also, *valid])
        try:
            run = cls(**options)
        except ValueError as error:  # the checks speak as ablate: tune(steps=-1) is tune's mistake
            message = str(error)
            # (the panel's and the dry run's are ablate's, as the run's would be; wb.plan says plan)
            if caller in ("tune", "advise") and message.startswith("ablate: "):
                raise ValueError(f"{caller}: {message.removeprefix('ablate: ')}") from None
            raise
        if smoke_test():
            run = replace(run, **{name: min(getattr(run, name), cap) for name, cap in SMOKE_CAPS.items()})
        return run

    def to_json(self) -> dict:
        """JSON-ready; ``RunConfig(**run.to_json()) == run``, except for an optimizer factory of
        the user's: the record names it (``optimizer_label``), with no lr, which it sets itself."""
        if isinstance(self.optimizer, str):
            return asdict(self)
        # asdict would deep-copy the factory too, which may hold what cannot be copied
        return {
            **asdict(replace(self, optimizer=OPTIMIZERS[0])),
            "optimizer": optimizer_label(self.optimizer),
            "lr": None,
        }


def _check_trace_dir(trace_dir: str) -> None:
    """Before anything is measured: a trace folder that cannot be made failed every arm after its block ran."""
    path = Path(trace_dir).expanduser()
    if path.is_file():
        raise ValueError(f"ablate: trace_dir={trace_dir!r} is a file; name a folder for the traces")
    existing = next((folder for folder in [path, *path.parents] if folder.exists()), None)
    if existing is None:  # not even its root exists (a missing drive)
        raise ValueError(f"ablate: trace_dir={trace_dir!r} cannot be made: no folder of it exists")
    if not existing.is_dir():
        raise ValueError(f"ablate: trace_dir={trace_dir!r} cannot be made: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"ablate: trace_dir={trace_dir!r} cannot be made: {str(existing)!r} cannot be written"
        )


# The run settings wb.tune decides round by round (the CLI's tune command has no flag for them).
TUNER_DECIDES = ("blocks", "mode", "loader_arms", "profile_steps", "trace_dir")
# advise measures the baseline alone, once: these settings are its own, and the command line has
# no flags for them (nor for mode: with no techniques there is nothing to combine).
ADVISOR_FIXES = {"blocks": 1, "control": False, "loader_arms": False, "isolate": False}
# The advisor calls memory the limit from a peak at this share of the capacity; its plot draws it.
MEMORY_LIMIT = 0.8


def describe_run_options(indent: str = "    ") -> str:
    """RunConfig's settings as a docstring section: name, then help and default, wrapped."""
    width = max(len(name) for name in run_options()) + 2
    lines = []
    for item in fields(RunConfig):
        rules: Option = item.metadata["option"]
        if item.default is None and rules.auto:
            default = rules.unset
        elif rules.choices is not None and not isinstance(item.default, str):
            default = rules.word(item.default)  # loader_arms: "auto", not None
        else:
            default = repr(item.default)
        lines += textwrap.wrap(
            f"{rules.help} (default {default})",
            width=96,
            initial_indent=f"{indent}{item.name:<{width}}",
            subsequent_indent=indent + " " * width,
        )
    return "\n".join(lines)


def takes_run_options(function: Callable) -> Callable:
    """Show RunConfig's settings in ``function(..., **options)``'s signature and docstring.

    ``inspect.signature``, ``help()`` and Jupyter's shift-tab then list them, with their
    defaults, as if each were written out; the function reads them with
    ``RunConfig.from_options``. ``{run_options}`` in the docstring becomes their descriptions.
    """
    signature = inspect.signature(function)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    leading = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    trailing = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
    settings = [
        inspect.Parameter(
            item.name, inspect.Parameter.KEYWORD_ONLY, default=item.default, annotation=item.type
        )
        for item in fields(RunConfig)
    ]
    function.__signature__ = signature.replace(parameters=[*leading, *settings, *trailing])
    if function.__doc__:
        function.__doc__ = function.__doc__.replace("{run_options}", describe_run_options().lstrip())
    return function
