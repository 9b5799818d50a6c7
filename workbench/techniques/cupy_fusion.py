"""cupy_fusion: hand-written fused CUDA kernels (kernels/*.cu), launched through CuPy.

What it does
    Swaps parts of the model for fused operators whose CUDA source is in kernels/:
    - ``Linear`` with a bias followed by the exact (erf) ``GELU`` (in an ``nn.Sequential``; not
      ``approximate="tanh"``): the matmul runs without its bias, then one kernel adds the bias
      and applies GELU; backward writes the input gradient and the bias gradient in one pass;
    - every ``nn.LayerNorm`` over the last dimension with a weight and a bias: one kernel each way;
    - the built-in pre-LN transformer block: the residual add before ``ln2`` and ``ln2``
      itself become one kernel (the same kernel also fuses dropout, unused here because the
      built-in models have none);
    - ``AdamW``: the whole optimizer step in one launch over all parameters.
    The run's notes count the modules replaced of each kind, and name the first of them. Each
    kernel takes PyTorch's tensors by address (no copy) and runs on PyTorch's current stream.

When it helps
    Memory-bound chains of small ops on a GPU. Every unfused elementwise op reads its inputs
    from DRAM and writes its output back, and each launch costs a few microseconds of CPU
    time; the Baidu AIAK-Training write-up (one of the seed articles) names launch overhead
    and memory traffic as the GPU bottlenecks that operator fusion removes. Small
    transformers (gpt-mini) spend a large share of their step in LayerNorm, GELU and the
    optimizer, so they gain the most.

When it hurts
    Large matmul-bound models: the matmuls do not change, so the saving is a small share of
    the step. ``torch.compile`` generates similar fusions automatically (the benchmark
    compares both), and cannot trace through CuPy launches, so the two are not combined.
    First use compiles each kernel file with NVRTC (about a second, cached per process).
    Unavailable on CPU, without CuPy, on GPUs older than Turing (compute capability 7.5), and
    when nothing in the model matches the enabled patterns and the optimizer is not fused
    (optimizer fusion off, or the run's optimizer is not AdamW): the arm would measure the
    unfused model. Not combined with compile or cuda_graphs.

Settings
    ``bias_gelu``, ``layer_norm``, ``residual_layer_norm``, ``optimizer``: switch each fused
    operator on or off (all True by default), so one ablation can measure each kernel's
    share, e.g. ``{"cupy_fusion": {"optimizer": [True, False]}}``. Only ``torch.optim.AdamW``
    is fused (not amsgrad or maximize); with another optimizer the notes say it was left unfused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workbench.config import check_bool
from workbench.fused_ops import FusedAdamW, describe_replacements, fuse_model
from workbench.raw_kernels import cupy_unavailable_reason
from workbench.techniques.base import Context, Technique

MODULE_PATTERNS = ("bias_gelu", "layer_norm", "residual_layer_norm")


@dataclass(frozen=True)
class CupyFusionConfig:
    bias_gelu: bool = True
    layer_norm: bool = True
    residual_layer_norm: bool = True
    optimizer: bool = True

    def __post_init__(self) -> None:
        for name in (*MODULE_PATTERNS, "optimizer"):
            check_bool("cupy_fusion", name, getattr(self, name))
        if not any(getattr(self, name) for name in (*MODULE_PATTERNS, "optimizer")):
            raise ValueError(
                "cupy_fusion: every fused operator is switched off; keep at least one of "
                "bias_gelu, layer_norm, residual_layer_norm, optimizer"
            )

    def patterns(self) -> dict[str, bool]:
        return {name: getattr(self, name) for name in MODULE_PATTERNS}


class CupyFusion(Technique):
    name = "cupy_fusion"
    summary = "fused CUDA kernels (bias+GELU, residual+LayerNorm, one-launch AdamW) via CuPy"
    order = 16  # before checkpointing (20), which wraps the forwards this one replaces
    group = "compute"
    Config = CupyFusionConfig
    requires = ("cuda", "cupy")
    conflicts = {
        "compile": "torch.compile cannot trace CuPy kernel launches, so every fused op would split its "
        "graph; compare the two as separate arms instead",
    }

    def check(self, ctx: Context, config: CupyFusionConfig) -> str | None:
        # ``requires`` saw a CUDA device and an installed CuPy; this asks whether CuPy imports and
        # reaches the GPU (a CuPy built for another CUDA major version installs, then cannot).
        reason = cupy_unavailable_reason(ctx.device)
        if reason:
            return reason
        # the user's own factory may build AdamW: apply's probe finds out
        fuses_optimizer = config.optimizer and ctx.optimizer != "sgd"
        if ctx.model is not None and not fuses_optimizer:
            if not fuse_model(ctx.model, **config.patterns(), dry_run=True):
                why = (
                    "optimizer fusion is off"
                    if not config.optimizer
                    else f"the run's optimizer is {ctx.optimizer}"
                )
                return (
                    f"{ctx.model_name or 'the model'} has nothing the enabled patterns match (Linear+GELU in "
                    f"a Sequential, LayerNorm, the built-in transformer block), and {why} (the fused "
                    "optimizer is AdamW): the arm would measure the unfused model"
                )
        return None

    def apply(self, setup, config: CupyFusionConfig) -> str:
        replaced = fuse_model(setup.model, **config.patterns())
        notes = [describe_replacements(replaced)]
        fused_optimizer = False
        if config.optimizer:
            fused_optimizer, said = _fuse_the_optimizer(setup)
            notes.append(said)
        if not replaced and not fused_optimizer:  # what check() could not see: a measured no-op
            raise ValueError(f"cupy_fusion fused nothing in this model: {'; '.join(notes)}")
        return "; ".join(notes)


def _fuse_the_optimizer(setup) -> tuple[bool, str]:
    """Make the run's optimizer FusedAdamW where it is torch's AdamW; (fused?, what the notes say)."""
    build = setup.make_optimizer
    # Which optimizer the run uses is only known by building one: probe it on a scalar.
    probe = build([nn.Parameter(torch.zeros(1))])
    if type(probe) is not torch.optim.AdamW:  # a subclass or a namesake may mean something else
        return False, f"optimizer {type(probe).__name__} left unfused (the fused step is torch.optim.AdamW)"
    try:
        FusedAdamW.from_adamw(probe)  # its refusals (amsgrad, maximize) said here, not at the first step
    except ValueError as error:
        return False, f"AdamW left unfused: {error}"
    setup.make_optimizer = lambda params: FusedAdamW.from_adamw(build(params))
    return True, "AdamW steps in one launch per parameter group"


TECHNIQUE = CupyFusion()
