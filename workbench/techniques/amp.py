"""amp: automatic mixed precision.

What it does
    Runs the forward pass (and so the backward) under ``torch.autocast``: matmuls and
    convolutions run in a 16-bit type, while precision-sensitive ops (reductions,
    softmax, the loss) stay in float32, and the weights and optimizer state stay float32.

When it helps
    On GPUs with tensor cores, 16-bit matmuls are several times faster and move half the
    bytes; the ByteTrending overview "Accelerate Model Training" (2025) puts the typical
    gain at around 2x with little or no accuracy loss. Activations also take half the
    memory. On CPUs the gain depends on native bf16 instructions (AVX512-BF16, AMX); without
    them autocast can be slower than float32. Measure it: that is what this workbench is for.

When it hurts
    float16 has a narrow exponent range: small gradients underflow to zero. Loss scaling
    (multiply the loss, unscale the gradients, skip steps that overflowed) fixes that, as
    Micikevicius et al. showed in "Mixed Precision Training" (ICLR 2018); a GradScaler does it
    for every float16 run here. bfloat16 keeps float32's range, so it needs no scaler but
    has fewer mantissa bits. The Baidu AIAK-Training write-up lists AMP with loss scaling
    among its compute optimizations.

Settings
    ``dtype``: ``"bfloat16"`` (default; no scaler) or ``"float16"`` (with a GradScaler).
    The one that matters: bf16 wherever the hardware supports it.

Watch
    ``final_loss`` / ``loss_vs_baseline``: a mixed-precision arm should stay close to the
    float32 baseline after the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workbench.config import check_choice
from workbench.techniques.base import Context, Technique

DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class AmpConfig:
    dtype: str = field(default="bfloat16", metadata={"choices": DTYPES})

    def __post_init__(self) -> None:
        check_choice("amp", "dtype", self.dtype, DTYPES)


class Amp(Technique):
    name = "amp"
    summary = "autocast matmuls/convs to bfloat16 or float16 (float16 with a GradScaler)"
    order = 40
    tune_space = {"dtype": ("bfloat16", "float16")}  # fp16 needs loss scaling; bf16 does not
    Config = AmpConfig

    def check(self, ctx: Context, config: AmpConfig) -> str | None:
        if ctx.device.type == "cuda" and config.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            return f"{torch.cuda.get_device_name(ctx.device)} has no bfloat16 support; use dtype='float16'"
        return None

    def apply(self, setup, config: AmpConfig) -> str:
        dtype, device_type = getattr(torch, config.dtype), setup.device.type
        setup.autocast_dtype = dtype

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


TECHNIQUE = Amp()
