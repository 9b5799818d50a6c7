"""compile: ``torch.compile`` of the model (TorchDynamo + Inductor).

What it does
    Captures the model's forward (and, through AOTAutograd, its backward) as graphs and
    generates fused kernels for them: Triton on GPUs, C++/OpenMP on CPUs. Chains of
    elementwise ops become one kernel that reads and writes memory once.

When it helps
    Models with many small or elementwise ops, where eager mode pays per-op launch and
    memory-traffic costs: the operator fusion that reduces kernel launches in Baidu
    Intelligent Cloud Tech Hub's "How to Supercharge AI Model Training", done by a compiler.
    ``reduce-overhead`` adds CUDA Graphs to cut launch overhead further on GPUs;
    ``max-autotune`` benchmarks kernel variants.

When it hurts
    Start-up: compiling costs seconds to minutes before the first step. That cost is
    reported as ``startup_s`` (time to the end of the first step) and is never part of the
    timed window. Graph breaks, dynamic shapes and recompilations eat the gain; on CPU,
    ``reduce-overhead`` behaves like ``default`` because CUDA Graphs need a GPU.

Unavailable
    On a CPU without a C++ compiler (``$CXX``, g++ or clang++): Inductor generates C++ there.
    Not combined with cupy_fusion (it cannot trace CuPy launches) or with cuda_graphs in
    ``mode="compile"`` (which compiles the model itself).

Settings
    ``mode``: ``"default"`` (default) | ``"reduce-overhead"`` | ``"max-autotune"``.
    ``fullgraph``: fail instead of silently splitting the graph (default False).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

import torch

from workbench.config import check_bool, check_choice
from workbench.techniques.base import Context, Technique

MODES = ("default", "reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class CompileConfig:
    mode: str = field(default="default", metadata={"choices": MODES})
    fullgraph: bool = False

    def __post_init__(self) -> None:
        check_choice("compile", "mode", self.mode, MODES)
        check_bool("compile", "fullgraph", self.fullgraph)


class Compile(Technique):
    name = "compile"
    summary = "torch.compile the model (fused kernels); compile time reported as startup_s"
    order = 90  # after every change to the model; only cuda_graphs (95), which captures the step, is later
    group = "compute"
    Config = CompileConfig
    one_per_process = (
        "TorchDynamo's code cache and inductor's state are per process: a second compiled arm would reuse "
        "the first's (a warm compile) and share its recompilation limit"
    )
    costly_start = "it compiles the model in every process before its first step (16-20 s for mlp on 2 cores)"

    def check(self, ctx: Context, config: CompileConfig) -> str | None:
        if ctx.device.type == "cpu" and not (
            os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
        ):
            return "torch.compile's CPU backend needs a C++ compiler (g++ or clang++) on PATH"
        return None

    def apply(self, setup, config: CompileConfig) -> str:
        setup.model = torch.compile(setup.model, mode=config.mode, fullgraph=config.fullgraph)
        return f"torch.compile(mode={config.mode!r})"


TECHNIQUE = Compile()
