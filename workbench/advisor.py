"""The advisor: where a training step's time goes, and which techniques could win it back.

``advise(model, data, ...)`` runs a short baseline of the user's job in a fresh process (one
block, no control, the usual warm-up and timed windows), then ``profile_steps`` more steps
under ``torch.profiler`` (workbench.profiling), then the same steps timed at the batch and
at half of it. From those figures it splits the median step into four parts and names the
bottleneck:

``data``
    waiting for the next batch (the step clock's data phase);
``communication``
    gradient communication the step waits for: what is still in flight after backward's
    computation ended, as the DDP hooks measured it (data-parallel runs only; the part hidden
    behind backward costs nothing and is shown apart);
``compute``
    the rest of the step: the work that grows with the batch (the profile says how much of
    it is matmul and convolution);
``launch``
    the step time that does not grow with the batch: steps at the batch and at half of it,
    interleaved (t = fixed + batch x per_sample gives fixed = 2 t(b/2) - t(b)). It includes
    the optimizer's step, whose cost follows the weights, not the batch. On a GPU it
    is the time the GPU waits while Python, the dispatcher and the autograd engine launch the
    next kernel; on a CPU, Python and the fixed cost each operator pays whatever its size.

``memory`` overrides the time split when the peak tensor memory of a step reaches 80% of the
capacity (``memory_cap_mb``, or the device's own): the job then cannot grow its batch or its
model, whatever its step time.

Every suggestion carries a bound from Amdahl's law on the measured shares: a technique that
removes at most a share ``s`` of the step is at most ``1 / (1 - s)`` times faster. DataLoader
workers are bounded by a measurement instead, when the data wait is notable: the baseline's
process times a DataLoader with each worker count feeding nothing (data.loader_feed), since
handing a batch over from a worker has a cost Amdahl's bound cannot see. A bound is
a ceiling, not a forecast; ``wb.ablate(techniques=advice.recommended)`` measures the truth.
"""

from __future__ import annotations

import math
import os
import textwrap
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from workbench.ablation import run_ablation
from workbench.config import (
    ADVISOR_FIXES,
    MEMORY_LIMIT,
    NothingMeasured,
    RunConfig,
    takes_run_options,
)
from workbench.data import resolve_data, with_collate_fn
from workbench.devices import cpu_lacks_native
from workbench.results import Results
from workbench.results_folder import json_values
from workbench.stats import PHASES, phase_shares
from workbench.techniques import all_techniques, technique_context
from workbench.telemetry import usable_cores

PARTS = ("data", "launch", "compute", "communication")
WORTH_TRYING = 1.10  # a remedy for another part is still recommended if it could give 10%
# Even for the bottleneck's own part, a remedy whose ceiling is this close to 1 has nothing to
# win (its part of the step is nearly empty): it is said why, not recommended.
NO_HEADROOM = 1.02
# A memory remedy is recommended when it could free this share of the peak; below it, the peak is
# weights, gradients and optimizer state (checkpointing once "freed up to 0 MiB" of a 4.8 MiB peak).
FREES_ENOUGH = 0.10
PROFILE_STEPS = 5

CPU_CAVEAT = (
    "On a CPU the operators run on the cores that dispatch them, so 'launch' is the step time "
    "that does not grow with the batch (Python, the dispatcher, each operator's fixed cost), "
    "not a GPU waiting for work; Tensor Cores, TF32 and MFU do not apply, and the memory capacity is "
    "memory_cap_mb or this machine's RAM, which other programs share. The verdict says where "
    "this job's time goes on this machine: on a GPU the same job can have another bottleneck."
)


@dataclass(frozen=True)
class Facts:
    """What the advisor read from the profiled baseline, in milliseconds per step and MiB."""

    device: str  # "cpu" or "cuda"
    step_ms: float
    data_ms: float
    comm_ms: float  # communication the step waited for (exposed): the part of the step it takes
    overhead_ms: float  # step time that does not grow with the batch (launch)
    batch: int
    half_batch_ms: float  # median step at half the batch (the evidence for overhead_ms)
    full_batch_ms: float  # median step at the batch, interleaved with those
    busy_ms: float  # the profile's time in operators (CPU, self time) or kernels (GPU), per step
    matmul_ms: float  # of which matmul, attention and convolution
    fp32_matmul_ms: float  # GPU matmul kernels in fp32 without Tensor Cores (0 on CPU)
    forward_ms: float
    optimizer_ms: float
    ops: float  # operations (CPU) or kernels (GPU) per step
    median_op_us: float
    peak_mib: float
    activation_mib: float
    capacity_mib: float
    capacity_source: str
    has_conv: bool
    world_size: int
    comm_busy_ms: float = 0.0  # all of the communication, hidden behind backward or not
    emulated_bf16: str | None = None  # why this CPU would emulate bfloat16 (None: native, unknown, GPU)
    # data.loader_feed for each worker count, measured when the step loads its Dataset itself
    loader_feeds: tuple[dict, ...] = ()
    # why the step's fixed part (launch) could not be told from its work (compute): all of the
    # rest then counts as compute, and a caveat says so ("" when the two batch sizes told it)
    split_unknown: str = ""

    @property
    def parts_ms(self) -> dict[str, float]:
        """The step split into PARTS; the four add up to the step."""
        rest = max(self.step_ms - self.data_ms - self.comm_ms, 0.0)
        launch = min(self.overhead_ms, rest)
        compute = rest - launch
        return {"data": self.data_ms, "launch": launch, "compute": compute, "communication": self.comm_ms}

    @property
    def shares(self) -> dict[str, float]:
        return {part: ms / self.step_ms for part, ms in self.parts_ms.items()}

    @property
    def memory_share(self) -> float:
        return self.peak_mib / self.capacity_mib


def bound(share: float) -> float:
    """Amdahl: removing ``share`` of the step makes it at most this many times faster."""
    return 1.0 / max(1.0 - share, 1e-3)


@dataclass(frozen=True)
class Suggestion:
    technique: str
    settings: dict
    part: str  # the bottleneck it attacks
    at_most: float  # the speedup ceiling (< 1 for memory remedies, which cost time)
    why: str
    saves_mib: float = float("nan")  # memory remedies: activation memory it could free


def diagnose(facts: Facts) -> str:
    """The bottleneck: memory if the peak nears the capacity, else the largest part of the step."""
    if facts.memory_share >= MEMORY_LIMIT:
        return "memory"
    shares = facts.shares
    return max(PARTS, key=lambda part: shares[part])


def evidence(facts: Facts) -> pd.DataFrame:
    """The figures behind the verdict, one row each, with what each one measures."""
    gpu = facts.device == "cuda"
    unit = "kernels" if gpu else "operations"
    shares = facts.shares
    rows = [
        ("step time (median)", facts.step_ms, "ms", "the baseline's typical step"),
        ("waiting for data", 100 * shares["data"], "% of step", "the step clock's data phase"),
        (f"{unit} per step", facts.ops, "", "what one step dispatched" + (" to the GPU" if gpu else "")),
        (f"median {unit[:-1]} time", facts.median_op_us, "us", "short ones mean overhead dominates"),
        *_batch_rows(facts),
        ("overhead (launch)", 100 * shares["launch"], "% of step", "does not grow with the batch"),
        ("work (compute)", 100 * shares["compute"], "% of step", "grows with the batch"),
        (
            "optimizer step",
            100 * facts.optimizer_ms / facts.step_ms,
            "% of step",
            "part of the overhead: it follows the weights",
        ),
        (
            "matmul/conv",
            100 * facts.matmul_ms / facts.step_ms,
            "% of step",
            "the work AMP, TF32 and channels_last speed up",
        ),
    ]
    if gpu:
        rows.append(("GPU busy (kernels running)", 100 * facts.busy_ms / facts.step_ms, "% of step",
                     "from the profile; the rest of the step the GPU waits"))  # fmt: skip
        rows.append(("fp32 matmul without Tensor Cores", 100 * facts.fp32_matmul_ms / facts.step_ms, "% of step",
                     "by kernel name: where TF32 or AMP could help"))  # fmt: skip
    rows += [
        (
            "peak tensor memory",
            facts.peak_mib,
            "MiB",
            f"of {facts.capacity_mib:,.0f} MiB ({facts.capacity_source})",
        ),
        (
            "peak / capacity",
            100 * facts.memory_share,
            "%",
            f"memory is the limit from {100 * MEMORY_LIMIT:.0f}%",
        ),
        ("activations", facts.activation_mib, "MiB", "what autograd saved for backward"),
    ]
    if facts.world_size > 1:
        rows.append(("gradient communication", 100 * facts.comm_busy_ms / facts.step_ms, "% of step",
                     "the hooks' busy time, hidden behind backward or not"))  # fmt: skip
        rows.append(("communication exposed", 100 * shares["communication"], "% of step",
                     "still in flight after backward's computation: the step waits for it"))  # fmt: skip
    return pd.DataFrame(rows, columns=["figure", "value", "unit", "meaning"])


def _batch_rows(facts: Facts) -> list[tuple]:
    """The two batch sizes' steps, which split the step into launch and compute; a batch of one
    has no half (its rows said "batch 0")."""
    if facts.batch < 2:
        return [("step at half the batch", math.nan, "ms", "not measured: a batch of one cannot be halved")]
    return [
        (f"step at batch {facts.batch}", facts.full_batch_ms, "ms", "interleaved with the next row's steps"),
        (
            f"step at batch {facts.batch // 2}",
            facts.half_batch_ms,
            "ms",
            "half the work: a step that barely shrinks is overhead",
        ),
    ]


def suggestions(facts: Facts, available: dict[str, str | None]) -> list[Suggestion]:
    """Every remedy for every part of the step, with its ceiling; only techniques available here."""
    found = [
        *_for_data(facts),
        *_for_launch(facts),
        *_for_compute(facts),
        *_for_memory(facts),
        *_for_comm(facts),
    ]
    return [s for s in found if available.get(s.technique, "unknown") is None]


def _pct(value: float) -> str:
    return f"{100 * value:.0f}%"


def _for_data(facts: Facts) -> Iterator[Suggestion]:
    share = facts.shares["data"]
    wait = f"the step waits for its next batch {_pct(share)} of the time"
    failed = [feed["error"] for feed in facts.loader_feeds if "error" in feed]
    if failed:  # measured not to work for this job: no ceiling (nan), and never recommended
        yield Suggestion("dataloader", {}, "data", float("nan"),
                         f"{wait}, but DataLoader workers could not load this Dataset ({failed[0]})")  # fmt: skip
    elif facts.loader_feeds:
        yield _workers_as_measured(facts, wait)
    else:  # no probe (the wait was small, or an older record): Amdahl's bound on the wait
        workers = max(1, min(4, usable_cores() - 1))  # the cores this job may use (taskset, cgroups, Slurm)
        yield Suggestion("dataloader", {"num_workers": workers, "pin_memory": facts.device == "cuda"}, "data",
                         bound(share), f"{wait}; {workers} worker process{'es' * (workers != 1)} prepare{'s' * (workers == 1)} batches during the step")  # fmt: skip
    yield Suggestion(
        "dali", {}, "data", bound(share), f"{wait}; DALI decodes and augments in its own threads"
    )


def _workers_as_measured(facts: Facts, wait: str) -> Suggestion:
    """The worker count whose measured feed gives the shortest step. With workers a step takes
    the rest of its work plus the hand-over of its batch (the CPU time taking one costs), and it
    cannot be shorter than the time the loader needs per batch: still a ceiling, since the
    workers' competition for the cores is not in it. For samples already in memory the hand-over
    alone cost about 3x the loading it moved (1.3-1.7 against 0.5 ms per batch of 64, 2 cores)."""
    rest_ms = max(facts.step_ms - facts.data_ms, 0.0)

    def step_ms(feed: dict) -> float:
        return max(rest_ms + feed["taking_ms"], feed["feed_ms"])

    best = min(facts.loader_feeds, key=step_ms)
    workers = best["workers"]
    measured = (
        f"{wait} ({facts.data_ms:.2f} ms); with {workers} worker{'s' * (workers != 1)} the loader alone "
        f"delivers a batch every {best['feed_ms']:.2f} ms and taking one costs the step {best['taking_ms']:.2f} ms "
        f"(measured after the run)"
    )
    return Suggestion("dataloader", {"num_workers": workers, "pin_memory": facts.device == "cuda"}, "data",
                      facts.step_ms / step_ms(best), measured)  # fmt: skip


def _for_launch(facts: Facts) -> Iterator[Suggestion]:
    share = facts.shares["launch"]
    if facts.device == "cuda":
        idle = f"the GPU idles {_pct(share)} of the step between {facts.ops:.0f} kernels of {facts.median_op_us:.0f} us"
        yield Suggestion(
            "cuda_graphs", {}, "launch", bound(share), f"{idle}; one graph replay launches them all"
        )
        yield Suggestion("compile", {"mode": "reduce-overhead"}, "launch", bound(share),
                         f"{idle}; compiling fuses them and replays them as a CUDA graph")  # fmt: skip
        yield Suggestion(
            "cupy_fusion", {}, "launch", bound(share), f"{idle}; fused kernels launch fewer of them"
        )
    else:
        # compile takes the model's forward and backward, not the optimizer's step.
        model_share = max(share - facts.optimizer_ms / facts.step_ms, 0.0)
        outside = (
            f"{_pct(model_share)} of the step, outside the optimizer, does not grow with the batch: "
            f"Python and the fixed cost of {facts.ops:.0f} operations of {facts.median_op_us:.0f} us each"
        )
        yield Suggestion("compile", {"mode": "default"}, "launch", bound(model_share),
                         f"{outside}; compiling fuses them into fewer, larger ones")  # fmt: skip


def _for_compute(facts: Facts) -> Iterator[Suggestion]:
    # What half precision or a layout can speed up is the matmuls' work, which grows with the
    # batch; the part of their time that does not (each launch's fixed cost) stays. So their share
    # is capped at the compute part: a launch-bound step had amp at x1.24 from a 39% matmul share
    # while the work that grows with the batch was 4% of it (and amp measured x0.88-0.99).
    matmul_all = facts.matmul_ms / facts.step_ms
    matmul = min(facts.matmul_ms, facts.parts_ms["compute"]) / facts.step_ms
    of_step = f"matmul/conv take {_pct(matmul_all)} of the step" + (
        f", {_pct(matmul)} in work that grows with the batch" if matmul < 0.95 * matmul_all else ""
    )
    # Half precision halves the bytes a matmul moves, and on hardware with bf16/fp16 units its
    # time at best: the ceiling removes half of the matmul/conv share.
    dtype = "bfloat16"
    if facts.emulated_bf16:  # converting around every operator costs more than the bytes it saves
        yield Suggestion("amp", {"dtype": dtype}, "compute", 1.0, f"{of_step}, but {facts.emulated_bf16}")
    else:
        # On CUDA, fp32 matmuls that ran without Tensor Cores run on them in half precision, as
        # under tf32: amp's ceiling is at least tf32's (measured on an H100's gpt-mini: amp
        # 1.95x, tf32 1.48x), not the halving alone, which can never exceed 2x.
        fp32 = facts.fp32_matmul_ms / facts.step_ms if facts.device == "cuda" else 0.0
        cores = "; in it, their fp32 kernels run on Tensor Cores" if fp32 > matmul / 2 else ""
        yield Suggestion("amp", {"dtype": dtype}, "compute", bound(max(matmul / 2, fp32)),
                         f"{of_step}; in {dtype} they move half the bytes{cores}")  # fmt: skip
    if facts.device == "cuda":
        fp32 = facts.fp32_matmul_ms / facts.step_ms
        yield Suggestion("tf32", {}, "compute", bound(fp32),
                         f"fp32 matmul kernels without Tensor Cores take {_pct(fp32)} of the step")  # fmt: skip
    if facts.has_conv:
        yield Suggestion("channels_last", {}, "compute", bound(matmul / 2),
                         f"convolutions (with matmul {_pct(matmul_all)} of the step) prefer NHWC memory")  # fmt: skip
    other = max(facts.parts_ms["compute"] - facts.matmul_ms, 0.0) / facts.step_ms
    if facts.device != "cuda":
        yield Suggestion("compile", {"mode": "default"}, "compute", bound(other / 2),
                         f"other operators take {_pct(other)} of the step; fusing them saves memory traffic")  # fmt: skip


def _for_memory(facts: Facts) -> Iterator[Suggestion]:
    # Memory remedies cost time; their "at most" is a slowdown and they are ranked by what they free.
    recompute = facts.forward_ms / facts.step_ms
    act = facts.activation_mib
    peak = f"the peak is {facts.peak_mib:,.0f} of {facts.capacity_mib:,.0f} MiB, {act:,.0f} MiB of it activations"
    yield Suggestion("checkpointing", {}, "memory", 1 / (1 + recompute),
                     f"{peak}; recomputing them in backward frees most, for about {_pct(recompute)} more time",
                     saves_mib=0.7 * act)  # fmt: skip
    yield Suggestion("grad_accum", {"steps": 2}, "memory", 1.0,
                     f"{peak}; two micro-batches hold half the activations at a time", saves_mib=act / 2)  # fmt: skip
    slower = f" ({facts.emulated_bf16})" if facts.emulated_bf16 else ""
    yield Suggestion("amp", {"dtype": "bfloat16"}, "memory", 1.0,
                     f"{peak}; activations saved in bfloat16 take half the bytes{slower}", saves_mib=act / 2)  # fmt: skip


def _for_comm(facts: Facts) -> Iterator[Suggestion]:
    share = facts.shares["communication"]
    if facts.world_size < 2:
        return
    comm = f"the step waits {_pct(share)} of its time for gradient communication"
    yield Suggestion("ddp_compression", {"hook": "powersgd"}, "communication", bound(share),
                     f"{comm}; PowerSGD sends a low-rank sketch, a small fraction of the bytes")  # fmt: skip
    yield Suggestion("ddp_compression", {"hook": "fp16"}, "communication", bound(share / 2),
                     f"{comm}; fp16 sends half the bytes")  # fmt: skip


@dataclass
class Advice:
    """What ``advise()`` found: the bottleneck, its evidence, and what to try (see the module)."""

    bottleneck: str
    evidence: pd.DataFrame
    shares: dict[str, float]
    recommendations: pd.DataFrame  # technique, settings, at_most, saves_mb, why
    not_recommended: pd.DataFrame  # technique, why
    caveats: list[str]
    facts: Facts
    results: Results | None = field(default=None, repr=False)

    @property
    def recommended(self) -> dict[str, dict]:
        """The recommendations as a techniques mapping for ``wb.ablate(techniques=...)``, in the
        advisor's order: those that attack the bottleneck first, then the others, each by its ceiling."""
        mapping: dict[str, dict] = {}
        for row in self.recommendations.itertuples():
            mapping.setdefault(row.technique, row.settings)
        return mapping

    def summary(self, width: int | None = None, spell: Callable[[str], str] | None = None) -> str:
        """The bottleneck, its evidence, what is recommended and not, and the caveats. ``width``:
        wrap the reasons and caveats at that many columns (unwrapped unless given). ``spell``:
        rewords each reason and caveat first (the CLI names its flags for the API's keywords)."""
        spell = spell or (lambda text: text)

        def wrapped(text: str, indent: str = "") -> list[str]:
            text = spell(text)
            if width is None:
                return [indent + text]
            return textwrap.wrap(
                text, width, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False
            )

        lines = [f"bottleneck: {self.bottleneck}", ""]
        named = max((len(figure) for figure in self.evidence.figure), default=0)
        for row in self.evidence.itertuples():
            value = _evidence_value(row.value, row.unit)
            figure = f"  {row.figure:{named}s} {value:>10s} {row.unit:10s} "
            if width is None:
                lines.append(figure + row.meaning)
            else:  # the meaning wraps in its own column
                meaning = textwrap.wrap(
                    row.meaning, max(width - len(figure), 20), break_on_hyphens=False
                ) or [""]
                lines += [figure + meaning[0], *(" " * len(figure) + more for more in meaning[1:])]
        lines += [
            "",
            *wrapped(
                f"recommended (first what attacks the {self.bottleneck} bottleneck, then what helps other "
                "parts of the step, each by its ceiling; 'at most' is a ceiling: Amdahl's from the shares "
                "above, or the DataLoader's from its measured feed):"
            ),
        ]
        if not (self.recommendations.part == self.bottleneck).any():  # said first, not left to be inferred
            others = "" if self.recommendations.empty else "; these help other parts of the step:"
            lines += wrapped(
                f"nothing available here attacks this job's {self.bottleneck} bottleneck{others}", "  "
            )
        for row in self.recommendations.itertuples():
            lines += wrapped(f"{row.technique} {row.settings}: {_gain(row)}; {row.why}", "  ")
        lines += ["", "not recommended:"]
        for row in self.not_recommended.itertuples():
            lines += wrapped(f"{row.technique}: {row.why}", "  ")
        for caveat in self.caveats:  # each after a blank line: several run together otherwise
            lines += ["", *wrapped(caveat)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        from html import escape

        return f"<pre>{escape(self.summary())}</pre>"

    def plot(self, path=None):
        from workbench.plots import plot_advice

        return plot_advice(self, path)

    def to_json(self) -> dict:
        """The advice as JSON values (a figure that does not apply, NaN in the tables, is null)."""
        return json_values({
            "bottleneck": self.bottleneck,
            "shares": self.shares,
            "evidence": self.evidence.to_dict(orient="records"),
            "recommended": self.recommended,
            "recommendations": self.recommendations.to_dict(orient="records"),
            "not_recommended": self.not_recommended.to_dict(orient="records"),
            "caveats": self.caveats,
        })  # fmt: skip


def _gain(row) -> str:
    if row.part == "memory":
        return f"frees up to {row.saves_mb:,.0f} MiB" + (
            f", at most x{row.at_most:.2f}" if row.at_most < 1 else ""
        )
    return f"at most x{row.at_most:.2f}"


def build_advice(facts: Facts, available: dict[str, str | None], results: Results | None = None) -> Advice:
    """The verdict, the ranked recommendations and the reasons against the rest."""
    verdict = diagnose(facts)
    found = suggestions(facts, available)
    chosen = [
        s
        for s in found
        if (s.part == verdict and s.part == "memory" and s.saves_mib >= FREES_ENOUGH * facts.peak_mib)
        or (s.part == verdict and s.part != "memory" and s.at_most >= NO_HEADROOM)
        or (s.part != "memory" and s.at_most >= WORTH_TRYING)
    ]
    key = (lambda s: -np.nan_to_num(s.saves_mib)) if verdict == "memory" else (lambda s: -s.at_most)
    # A technique that attacks two parts is listed once, for its best: compile's x1.07 on the
    # compute part hid its x1.45 on launch, because the bottleneck's part came first.
    best: dict[str, Suggestion] = {}
    for s in sorted(chosen, key=key):
        best.setdefault(s.technique, s)
    chosen = sorted(best.values(), key=lambda s: (s.part != verdict, key(s)))
    recommended = {s.technique for s in chosen}
    rejected = {}
    for s in found:
        if s.technique not in recommended and s.technique not in rejected:
            rejected[s.technique] = _why_not(s, facts, verdict)
    for name, reason in available.items():
        if reason is not None:
            rejected.setdefault(name, f"unavailable here: {reason}")
    for name in available:
        if name not in recommended:
            rejected.setdefault(name, f"does not address this job's {verdict} bottleneck")
    return Advice(
        bottleneck=verdict,
        evidence=evidence(facts),
        shares=facts.shares,
        recommendations=pd.DataFrame(
            [
                {
                    "technique": s.technique,
                    "settings": s.settings,
                    "part": s.part,
                    "at_most": s.at_most,
                    "saves_mb": s.saves_mib,
                    "why": s.why,
                }
                for s in chosen
            ],  # fmt: skip
            columns=["technique", "settings", "part", "at_most", "saves_mb", "why"],
        ),
        not_recommended=pd.DataFrame(sorted(rejected.items()), columns=["technique", "why"]),
        # The run's own warnings (a busy machine) first: they say how far to trust every figure.
        caveats=([facts.split_unknown] if facts.split_unknown else [])
        + (results.warnings() if results is not None else [])
        + ([CPU_CAVEAT] if facts.device != "cuda" else []),
        facts=facts,
        results=results,
    )


def _evidence_value(value: float, unit: str) -> str:
    """A count whole ("466" operations), a measure to one decimal ("6.3" ms), and a small share
    to two significant digits ("0.02" %, not "0.0")."""
    from workbench.results_view import plain_number

    if not math.isfinite(value):
        return "-"
    if unit == "" and float(value).is_integer():
        return f"{value:,.0f}"
    return plain_number(value, digits=2) if 0 < abs(value) < 0.1 else f"{value:,.1f}"


def _why_not(suggestion: Suggestion, facts: Facts, verdict: str) -> str:
    if math.isnan(suggestion.at_most):  # measured not to work here: its why says how it failed
        return suggestion.why
    if suggestion.part == "memory" and verdict == "memory":  # memory is the limit, but this frees little
        return (
            f"frees at most {suggestion.saves_mib:,.1f} MiB of the {facts.peak_mib:,.1f} MiB peak: activations are "
            f"{facts.activation_mib:,.1f} MiB of it, the rest weights, gradients and optimizer state it does not touch"
        )
    if suggestion.part == "memory":
        return (
            f"memory is not the limit (peak {facts.peak_mib:,.0f} of {facts.capacity_mib:,.0f} MiB, "
            f"{_pct(facts.memory_share)}); it would cost time"
            + (f": about {_pct(1 / suggestion.at_most - 1)} per step" if suggestion.at_most < 1 else "")
        )
    if suggestion.at_most < 1:  # measured to cost more than it saves (the DataLoader's hand-over)
        return f"{suggestion.why}: at most x{suggestion.at_most:.2f}, slower than without it"
    if suggestion.part == verdict:  # the right part, but the share it can act on is nearly empty
        return f"{suggestion.why}: at most x{suggestion.at_most:.2f}, too little to be worth measuring"
    return f"{suggestion.why}: at most x{suggestion.at_most:.2f}, and the bottleneck is {verdict}"


# --- running the profiled baseline --------------------------------------------------------------


def facts_from(results: Results, run_device: str, memory_cap_mb: float | None) -> Facts:
    """The Facts of the baseline in ``results`` (one block, profiled)."""
    unit = next(u for u in results.record["units"] if u["arm"] == "baseline")
    if unit["status"] != "ok":
        raise NothingMeasured(f"advise: the baseline did not run ({unit['status']}): {unit['reason']}")
    result, profile = unit["result"], unit["result"]["profile"]
    gpu = run_device == "cuda"
    step_ms = 1e3 * float(np.median(result["step_s"]))
    # The phases divide that typical step by their shares of the timed windows: their own means
    # beside a median step would claim more than the whole step after a few stalls.
    phases = {phase: share * step_ms for phase, share in zip(PHASES, phase_shares(result), strict=True)}
    capacity, source = _capacity(results, gpu, memory_cap_mb)
    matmul_ms = (profile["matmul_conv_kernel_ms"] if gpu else profile["matmul_conv_ms"]) * _unprofiled(
        profile, step_ms
    )
    scaling = profile.get("batch_scaling") or {}  # empty for a batch of one
    unknown = _split_unknown(scaling)
    return Facts(
        device="cuda" if gpu else "cpu",
        step_ms=step_ms,
        data_ms=phases.get("data", 0.0),
        # What the step waits for is the exposed part; without that figure, all of it.
        comm_ms=_first_number(result.get("comm_exposed_ms_per_step"), result.get("comm_ms_per_step")),
        comm_busy_ms=result.get("comm_ms_per_step", 0.0) or 0.0,
        overhead_ms=0.0 if unknown else _overhead_ms(scaling, step_ms - phases.get("data", 0.0)),
        split_unknown=unknown,
        batch=int(scaling.get("batch", 0)),
        half_batch_ms=scaling.get("half_batch_step_ms", float("nan")),
        full_batch_ms=scaling.get("step_ms", float("nan")),
        busy_ms=profile["kernel_ms"] if gpu else profile["op_ms"],
        matmul_ms=matmul_ms,
        # A part of matmul_ms: scaled alike, never more than it.
        fp32_matmul_ms=min(
            profile.get("fp32_matmul_kernel_ms", 0.0) * _unprofiled(profile, step_ms), matmul_ms
        ),
        forward_ms=phases.get("forward", 0.0),
        optimizer_ms=phases.get("optimizer", 0.0),
        ops=profile["kernels"] if gpu else profile["ops"],
        median_op_us=(profile["median_kernel_us"] if gpu else profile["median_op_us"]) or float("nan"),
        peak_mib=result["peak_mem_mib"],
        activation_mib=result.get("activation_mib") or 0.0,
        loader_feeds=tuple(profile.get("loader_feeds") or ()),
        capacity_mib=capacity,
        capacity_source=source,
        has_conv=False,  # advise() reads it from the model
        world_size=int(result.get("world_size", 1)),
        emulated_bf16=None if gpu else cpu_lacks_native("bfloat16"),
    )


def _first_number(*values) -> float:
    return next((float(v) for v in values if v is not None), 0.0)


def _unprofiled(profile: dict, step_ms: float) -> float:
    """Profiled times shrink by this to the unprofiled step (the profiler adds its own cost)."""
    return min(step_ms / profile["profiled_step_ms"], 1.0) if profile.get("profiled_step_ms") else 1.0


# A half batch slower than the full one by more than this is noise, not a fixed cost: with
# t = fixed + batch x per_sample the half batch can only be as slow, when all of it is fixed. A
# little slower is what noise around a step that does not shrink gives (a tiny mlp's 0.7 against
# 0.6 ms: launch-bound, rightly); 49.6 against 21.3 ms is no measurement of the split at all.
HALF_SLOWER_BEYOND = 1.5


def _split_unknown(scaling: dict) -> str:
    """Why the two batch sizes did not tell the step's fixed part from its work ("" when they did)."""
    full, half = scaling.get("step_ms"), scaling.get("half_batch_step_ms")
    if not full or half is None:
        return (
            "A batch of one sample cannot be halved, so the step's fixed part (launch) was not told from "
            "its work (compute): 'compute' here is both, and a remedy for either may help. Measure "
            "them, or advise on a batch of 2 or more"
        )
    if half > HALF_SLOWER_BEYOND * full:
        return (
            f"The half batch's steps took longer than the full batch's ({half:.1f} against {full:.1f} ms, "
            "medians), which only noise can do: the step's fixed part (launch) was not told from its work "
            "(compute), so 'compute' here is both. Rerun on a quieter machine, or with more steps"
        )
    return ""


def _overhead_ms(scaling: dict, work_ms: float) -> float:
    """The part of the step that does not grow with the batch.

    With t(batch) = fixed + batch x per_sample, t(b) and t(b/2) give fixed = 2 t(b/2) - t(b),
    as a share of t(b), applied to ``work_ms``: the timed windows' step less its wait for data,
    since the two sizes are timed on batches loaded beforehand. It holds the optimizer's step,
    whose cost follows the weights, not the batch (the evidence shows it on its own row). Only
    for two sizes that told it (``_split_unknown``): a half batch a little slower than the full
    one is all fixed, and the share is clamped there.
    """
    full, half = scaling["step_ms"], scaling["half_batch_step_ms"]
    fixed = min(max(2 * half - full, 0.0), full)
    return fixed / full * work_ms


def _capacity(results: Results, gpu: bool, memory_cap_mb: float | None) -> tuple[float, str]:
    if memory_cap_mb is not None:
        # in words, not the keyword: the plot shows it as it is, where the CLI's flag would be --memory-cap-mb
        return float(memory_cap_mb), "the run's memory cap"
    if gpu:
        gib = results.record["environment"].get("gpu_memory_gib")
        if gib:
            return 1024.0 * gib, "the GPU's memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20, "this machine's RAM"


# advise's keywords besides the run settings (RunConfig's): named among the valid ones
ADVISE_ONLY = ("model", "data", "loss_fn", "collate_fn", "progress", "on_event", "stop")


@takes_run_options
def advise(
    model="mlp",
    data=None,
    loss_fn=None,
    *,
    collate_fn: Callable[[list], Any] | None = None,
    progress: bool = True,
    on_event: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
    **settings,
) -> Advice:
    """Profile a short baseline of this training job and name its bottleneck, with the evidence.

    Runs the baseline alone in a fresh process (one block, no control arm: ``blocks``,
    ``control``, ``loader_arms`` and ``isolate`` are fixed): the usual warm-up and timed
    windows, then ``profile_steps`` more steps under torch.profiler (0, the default, means 5). The
    step is split into data, launch, compute and communication; memory is the bottleneck when
    the peak reaches 80% of the capacity. Returns an :class:`Advice`: ``.bottleneck``,
    ``.evidence`` (the figures), ``.recommended`` (a techniques mapping for ``wb.ablate``,
    the bottleneck's first, then by ceiling, each with a reason in ``.recommendations``), ``.not_recommended`` and
    ``.plot()``. ``trace_dir`` writes the profiler trace (Perfetto, chrome://tracing).
    ``collate_fn``, ``on_event`` and ``stop`` are ablate's: how a Dataset's samples are batched,
    its events as the run goes, and a way to end it.

    Every other keyword is a run setting, as for ``ablate``:
    {run_options}
    """
    data = with_collate_fn(data, collate_fn)  # how the Dataset's samples are batched, as for ablate
    for name, value in ADVISOR_FIXES.items():
        if name in settings and settings[name] != value:
            raise ValueError(f"advise: {name} is fixed at {value!r} (one block of the baseline alone)")
    settings = {**settings, **ADVISOR_FIXES, "profile_steps": settings.get("profile_steps") or PROFILE_STEPS}
    # Checked here, in advise's words: checked by the ablation inside, an unknown name was "an
    # unknown ablate argument", with ablate's own (out, techniques) listed as valid.
    RunConfig.from_options("advise", settings, also=ADVISE_ONLY)
    # The cap is the capacity the advice judges the peak against, not a limit on the profiled
    # run: a baseline over it was refused as out of memory, and the advice, whose question that
    # is, gave up ("the baseline did not run").
    results = run_ablation(
        model, data, loss_fn, {}, {**settings, "memory_cap_mb": None}, out=False, progress=progress,
        overwrite=False, retry_failed=False, on_event=on_event, stop=stop, bar_label="advise",
    )  # fmt: skip
    if not results.complete:
        raise NothingMeasured(
            "advise: the baseline's run was stopped before it finished; nothing to advise on"
        )
    run = RunConfig(**{k: v for k, v in settings.items() if k in RunConfig.__dataclass_fields__})
    run = replace(run, batch_size=results.record["config"]["batch_size"])  # auto, as the run decided it
    ctx = technique_context(run, model, resolve_data(data, model))
    available = {t.name: t.unavailable_reason(ctx, t.configure({})) for t in all_techniques()}
    facts = facts_from(results, results.record["config"]["device"].split(":")[0], run.memory_cap_mb)
    facts = replace(facts, has_conv=_has_conv(ctx.model))
    return build_advice(facts, available, results)


def _has_conv(model) -> bool:
    import torch

    return model is not None and any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
