"""amp: automatic mixed precision, at level O1 (autocast) or O2 (a 16-bit model with float32
master weights).

What it does
    ``level="O1"`` (the default) runs the forward pass (and so the backward) under
    ``torch.autocast``: matmuls and convolutions run in a 16-bit type, while
    precision-sensitive ops (reductions, softmax, the loss) stay in float32, and the weights
    and optimizer state stay float32. ``level="O2"``, the level NVIDIA's Apex named, casts the
    model itself to the 16-bit type (BatchNorm, InstanceNorm, LayerNorm and GroupNorm stay
    float32; cupy_fusion's fused LayerNorms are cast with the rest, their statistics still
    computed in float32 by the kernel), feeds it 16-bit inputs and computes the loss in float32;
    the optimizer steps float32 master copies of the weights and copies them back after each
    step (workbench.mixed_precision). There is no per-operator autocast: the only casts are the
    inputs, the logits for the loss, the master-weight transfers, and around a norm layer whose
    kernel refuses a 16-bit input beside float32 weights. Activations and gradients are 16-bit.

When it helps
    On GPUs with tensor cores, 16-bit matmuls are several times faster and move half the
    bytes; the ByteTrending overview "Accelerate Model Training" (2025) puts the typical
    gain at around 2x with little or no accuracy loss. Activations also take half the
    memory. On CPUs the gain depends on native bf16 instructions (AVX512-BF16, AMX); without
    them every operator converts to float32 and back, and autocast runs slower than float32
    (9x on resnet-mini on an AVX2-only EPYC here): the arm's notes say so when this CPU lacks
    them, and the advisor does not suggest amp for speed there. Measure it: that is what this
    workbench is for.

When it hurts
    float16 has a narrow exponent range: small gradients underflow to zero. Loss scaling
    (multiply the loss, unscale the gradients, skip steps that overflowed) fixes that, as
    Micikevicius et al. showed in "Mixed Precision Training" (ICLR 2018); a GradScaler does it
    for every float16 O1 run here, and a dynamic loss scaler with the same defaults for float16
    O2. bfloat16 keeps float32's range, so it needs no scaler but has fewer mantissa bits. The
    Baidu AIAK-Training write-up lists AMP (O1 and O2) with loss scaling among its compute
    optimizations. O2 is faster than O1 where the casts cost (many small ops), and riskier:
    operations autocast would have kept in float32 (softmax, sums) run in 16 bits, gradients
    accumulate in 16 bits under grad_accum, and the master copies add 4 bytes per parameter
    (weights then take 2 + 4 bytes instead of 4). Watch the loss parity.

Settings
    ``dtype``: ``"bfloat16"`` (default; no scaler) or ``"float16"`` (with loss scaling).
    ``level``: ``"O1"`` (default, autocast) or ``"O2"`` (a 16-bit model, float32 master weights;
    not with cuda_graphs in either mode: the master copies happen outside the optimizer step a
    graph captures). On a CPU, O2 needs ``dtype="bfloat16"`` (float16 O2 is unavailable there:
    float16 kernels on a CPU are slow emulations). float16 at either level is not combined with
    cuda_graphs (its GradScaler syncs with the CPU).

Unavailable
    bfloat16 on a GPU without bfloat16 support; float16 O2 on a CPU.

Watch
    ``final_loss`` / ``loss_vs_baseline``: a mixed-precision arm should stay close to the
    float32 baseline after the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workbench.config import check_choice
from workbench.devices import cpu_lacks_native
from workbench.mixed_precision import (
    DynamicLossScaler,
    MasterWeightOptimizer,
    cast_keeping_norms_in_float32,
    to_dtype,
)
from workbench.techniques.base import Context, Technique

DTYPES = ("bfloat16", "float16")
LEVELS = ("O1", "O2")


@dataclass(frozen=True)
class AmpConfig:
    dtype: str = field(default="bfloat16", metadata={"choices": DTYPES})
    level: str = field(default="O1", metadata={"choices": LEVELS})

    def __post_init__(self) -> None:
        check_choice("amp", "dtype", self.dtype, DTYPES)
        check_choice("amp", "level", self.level, LEVELS)


class Amp(Technique):
    name = "amp"
    summary = "mixed precision: autocast (O1) or a 16-bit model with fp32 master weights (O2); bf16 or fp16"
    order = 40
    group = "compute"
    # fp16 needs loss scaling, bf16 does not; O2 casts the model instead of each op.
    tune_space = {"dtype": ("bfloat16", "float16"), "level": ("O1", "O2")}
    Config = AmpConfig

    def check(self, ctx: Context, config: AmpConfig) -> str | None:
        if ctx.device.type == "cuda" and config.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            return f"{torch.cuda.get_device_name(ctx.device)} has no bfloat16 support; use dtype='float16'"
        if config.level == "O2" and config.dtype == "float16" and ctx.device.type == "cpu":
            return "O2 on a CPU runs in bfloat16 (float16 kernels there are slow emulations): use dtype='bfloat16'"
        return None

    def conflict_with(self, config: AmpConfig, other: Technique, other_config) -> str | None:
        if config.level == "O2" and other.name == "cuda_graphs":
            return (
                "O2's master-weight copies happen outside the optimizer a CUDA graph captures; use level='O1'"
            )
        return super().conflict_with(config, other, other_config)

    def apply(self, setup, config: AmpConfig) -> str:
        note = self._apply(setup, config)
        # The note says why a 16-bit arm runs slower than float32 on a CPU that has to emulate it.
        emulated = cpu_lacks_native(config.dtype) if setup.device.type == "cpu" else None
        return f"{note}; {emulated}" if emulated else note

    def _apply(self, setup, config: AmpConfig) -> str:
        dtype, device_type = getattr(torch, config.dtype), setup.device.type
        setup.autocast_dtype = dtype
        if config.level == "O2":
            return self._apply_o2(setup, dtype)

        def autocast() -> torch.autocast:
            # Read when each forward starts: cuda_graphs (applied later) turns the cast cache off.
            return torch.autocast(device_type, dtype=dtype, cache_enabled=setup.autocast_cache)

        setup.forward_context = autocast
        if config.dtype == "float16":
            # float16's 5-bit exponent underflows small gradients: scale the loss up for backward,
            # unscale before the optimizer step, skip a step whose gradients overflowed.
            # bfloat16 shares float32's 8 exponent bits and needs none of this.
            setup.make_loss_scaler = lambda: torch.amp.GradScaler(device_type)
        return f"autocast to {config.dtype}" + (
            " with loss scaling (GradScaler)" if setup.loss_scaling else ""
        )

    @staticmethod
    def _apply_o2(setup, dtype: torch.dtype) -> str:
        kept, cast_around = cast_keeping_norms_in_float32(setup.model, dtype)
        setup.input_transforms.append(lambda inputs: to_dtype(inputs, dtype))
        loss_fn, make_optimizer = setup.loss_fn, setup.make_optimizer
        # The loss (softmax and its log over the logits) in float32, as autocast would run it.
        setup.loss_fn = lambda outputs, targets: loss_fn(to_dtype(outputs, torch.float32), targets)
        setup.make_optimizer = lambda parameters: MasterWeightOptimizer(parameters, make_optimizer)
        if dtype == torch.float16:
            setup.make_loss_scaler = DynamicLossScaler
        name = str(dtype).removeprefix("torch.")
        norms = f"{kept} norm layers kept in float32" + (
            f", {cast_around} of them fed float32 (no mixed-input kernel here)" if cast_around else ""
        )
        return f"O2: the model in {name} ({norms}), float32 master weights" + (
            ", dynamic loss scaling" if setup.loss_scaling else ""
        )


TECHNIQUE = Amp()
