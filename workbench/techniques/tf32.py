"""tf32: TensorFloat-32 for float32 matmuls and convolutions on NVIDIA GPUs.

What it does
    Lets float32 matmuls and cuDNN convolutions run on tensor cores in TF32: inputs are
    rounded to a 10-bit mantissa (float16's precision) while keeping float32's 8-bit
    exponent, and products accumulate in float32. The model code does not change.
    PyTorch's defaults already run cuDNN convolutions in TF32 (``torch.backends.cudnn.allow_tf32``
    is True) and matmuls in strict float32. The baseline keeps PyTorch's defaults, as your job
    would, so on a default setup this arm changes the matmuls; ``cudnn`` matters only where the
    process has turned cuDNN's TF32 off.

When it helps
    Ampere and newer GPUs (compute capability 8.0+) run TF32 matmuls several times faster
    than IEEE float32; the Baidu AIAK-Training write-up names TF32 among the Tensor Core
    options. It is a one-line switch for float32 models that cannot adopt amp yet.

When it hurts
    Results differ from float32 in the fourth significant digit; most training does not
    notice, some scientific workloads do. There is no gain on CPUs or older GPUs, so on
    those it is reported as unavailable rather than as a 1.0x "speedup".

Settings
    ``matmul`` (default True) and ``cudnn`` (default True): which kernels this arm switches
    to TF32 (False leaves that kind as the process has it, which for convolutions is TF32
    under PyTorch's defaults).
    The flags are process-wide: workbench sets them around each of the arm's windows and
    restores them after it, so tf32 shares a block's process with the other arms.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from workbench.config import check_bool
from workbench.devices import TF32_ON, set_tf32_flags, tf32_flags
from workbench.techniques.base import Context, Technique


@dataclass(frozen=True)
class Tf32Config:
    matmul: bool = True
    cudnn: bool = True

    def __post_init__(self) -> None:
        check_bool("tf32", "matmul", self.matmul)
        check_bool("tf32", "cudnn", self.cudnn)
        if not (self.matmul or self.cudnn):
            raise ValueError("tf32: matmul and cudnn are both False, which would change nothing")


@contextlib.contextmanager
def precision(matmul: bool, cudnn: bool) -> Iterator[None]:
    """TF32 on for matmuls and/or cuDNN convolutions inside the block (a False leaves that flag
    as it was); after it, every flag exactly as before, so the block's other arms, and the
    check that no arm leaves process-wide state changed, see the flags they saw."""
    previous = tf32_flags()
    set_tf32_flags(TF32_ON if matmul else previous[0], TF32_ON if cudnn else previous[1])
    try:
        yield
    finally:
        set_tf32_flags(*previous)


class Tf32(Technique):
    name = "tf32"
    summary = "TensorFloat-32 tensor-core math for float32 matmuls/convs (Ampere+ GPUs)"
    order = 15
    group = "compute"
    Config = Tf32Config
    requires = ("cuda",)

    def check(self, ctx: Context, config: Tf32Config) -> str | None:
        major, minor = torch.cuda.get_device_capability(ctx.device)
        if major < 8:
            name = torch.cuda.get_device_name(ctx.device)
            return f"{name} (compute capability {major}.{minor}) has no TF32 tensor cores; they start at 8.0 (Ampere)"
        return None

    def apply(self, setup, config: Tf32Config) -> str:
        # A process-wide switch: set around each of this arm's windows and restored after it,
        # so the other arms of a block keep full float32 precision.
        setup.window_settings.append(lambda: precision(config.matmul, config.cudnn))
        kernels = " and ".join(k for k, on in (("matmul", config.matmul), ("cuDNN conv", config.cudnn)) if on)
        return f"TF32 enabled for {kernels}"


TECHNIQUE = Tf32()
