"""Run settings and the validation helpers every config dataclass shares.

Every error a user can trigger with a bad value goes through these helpers, so the
messages look alike: ``<owner>: <field> must be <rule>; got <value>``. Unknown names
(technique, model, dataset, mode...) list the valid choices and suggest the closest.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MODES = ("one-at-a-time", "leave-one-out", "grid")
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
OPTIMIZERS = ("adamw", "sgd")


def unknown_name_error(kind: str, name: object, valid: Iterable[str]) -> ValueError:
    """A one-line error for an unknown name, listing the valid ones."""
    valid = list(valid)
    message = f"unknown {kind} {name!r}; valid {kind}s: {', '.join(valid)}"
    close = difflib.get_close_matches(str(name), valid, n=1)
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
        raise ValueError(f"{owner}: {field} must be <= {maximum}; got {value!r}{why}")
    return int(value)


def check_number(owner: str, field: str, value: object, *, above: float) -> float:
    """A finite Python float above ``above`` (NaN and infinity are mistakes, not settings)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{owner}: {field} must be a finite number > {above}; got {value!r}")
    if not value > above:
        raise ValueError(f"{owner}: {field} must be > {above}; got {value!r}")
    return float(value)


def check_bool(owner: str, field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {field} must be True or False; got {value!r}")
    return value


def check_choice(owner: str, field: str, value: object, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        listed = " | ".join(repr(c) for c in choices)
        raise ValueError(f"{owner}: {field} must be one of {listed}; got {value!r}")
    return value  # type: ignore[return-value]


def check_device(value: object) -> str:
    if isinstance(value, str) and (value in ("auto", "cpu", "cuda") or _is_cuda_index(value)):
        return value
    raise ValueError(f"unknown device {value!r}; valid devices: {', '.join(DEVICES)}")


def _is_cuda_index(value: str) -> bool:
    prefix, _, index = value.partition(":")
    return prefix == "cuda" and index.isdigit()


@dataclass(frozen=True)
class RunConfig:
    """How each arm is trained and timed. Everything here is the same for every arm."""

    steps: int = 30  # timed optimizer steps per arm per block, split into `rounds` windows
    warmup: int = 5  # untimed optimizer steps per arm before its first window
    blocks: int = 3  # fresh processes, each running every arm side by side (repeats)
    rounds: int | None = None  # windows per arm in a block; None: from the step time (workbench.worker)
    batch_size: int = 32  # samples per optimizer step (grad_accum splits it, never grows it)
    device: str = "auto"
    seed: int = 0
    mode: str = "one-at-a-time"
    optimizer: str = "adamw"
    lr: float = 1e-3
    control: bool = True  # also run the baseline a second time: the A/A noise check
    loader_arms: bool | str | None = None  # loader-only twins of input-pipeline arms; None: automatic
    world_size: int = 1  # ranks per arm: > 1 runs every arm as a DDP job (gloo on CPU, NCCL on CUDA)
    isolate: bool = False  # every arm in a process of its own, in every block (no arms side by side)
    link: object = None  # a Link: a simulated network between the ranks
    # One arm in one block; past it the arm is recorded as failed. None: from the arm's warm-up
    # (workbench.process.ArmTimer).
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        def set_(field: str, value: object) -> None:  # frozen: store the checked, converted value
            object.__setattr__(self, field, value)

        set_("steps", check_int("ablate", "steps", self.steps, 1))
        set_(
            "warmup",
            check_int(
                "ablate",
                "warmup",
                self.warmup,
                1,
                why=" (the first steps pay one-off costs: allocation, compilation, autotuning)",
            ),
        )
        set_("blocks", check_int("ablate", "blocks", self.blocks, 1))
        if self.rounds is not None:
            set_("rounds", check_int("ablate", "rounds", self.rounds, 1))
        if self.rounds is not None and self.rounds > self.steps:
            raise ValueError(
                f"ablate: rounds={self.rounds} exceeds steps={self.steps}; each round's window needs at least one step"
            )
        set_("batch_size", check_int("ablate", "batch_size", self.batch_size, 1))
        # Seeds Python's, NumPy's and torch's generators; NumPy's takes 32 bits.
        set_("seed", check_int("ablate", "seed", self.seed, 0, maximum=2**32 - 1))
        check_device(self.device)
        if self.mode not in MODES:
            raise unknown_name_error("mode", self.mode, MODES)
        if self.optimizer not in OPTIMIZERS:
            raise unknown_name_error("optimizer", self.optimizer, OPTIMIZERS)
        set_("lr", check_number("ablate", "lr", self.lr, above=0.0))
        check_bool("ablate", "control", self.control)
        check_bool("ablate", "isolate", self.isolate)
        if not (self.loader_arms is None or isinstance(self.loader_arms, bool) or self.loader_arms == "only"):
            raise ValueError(
                f"ablate: loader_arms must be None (automatic), True, False or 'only'; got {self.loader_arms!r}"
            )
        if self.timeout_s is not None:
            set_("timeout_s", check_number("ablate", "timeout_s", self.timeout_s, above=0.0))
        set_("world_size", check_int("ablate", "world_size", self.world_size, 1))
        object.__setattr__(self, "link", as_link(self.link))
        if self.link is not None and self.world_size < 2:
            raise ValueError("ablate: link simulates the network between ranks, so it needs world_size >= 2")


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


def as_link(value: Any) -> Link | None:
    """``None``, a Link, or a dict like ``{"bandwidth_gbps": 1, "latency_ms": 0.1}``."""
    if value is None or isinstance(value, Link):
        return value
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
        f"link must be None or a dict like {{'bandwidth_gbps': 1.0, 'latency_ms': 0.1}}; got {value!r}"
    )
