"""Device resolution, the one synchronization point the clocks rely on, the TF32 flags as they
stand (``current_precision``), and whether this CPU computes bfloat16/float16 natively."""

from __future__ import annotations

import platform

import torch

from workbench.config import check_device


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> cuda when a GPU is visible, else cpu. Asking for a missing GPU is an error."""
    check_device(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r} was requested but no CUDA device is visible; use device='cpu'"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} does not exist; this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return resolved


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a clock read afterwards includes it.

    CPU kernels in PyTorch eager mode run synchronously, so there is nothing to wait for.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# PyTorch >= 2.9 holds TF32 as per-backend strings ("tf32", "ieee", "none"); before, as booleans.
# The switch between the two spellings lives here alone.
_PRECISION_STRINGS = hasattr(torch.backends.cuda.matmul, "fp32_precision")
TF32_ON: object = "tf32" if _PRECISION_STRINGS else True  # what tf32_flags reads when it is on


def tf32_flags() -> tuple[object, object]:
    """The (matmul, cuDNN convolution) TF32 flags exactly as torch holds them."""
    if _PRECISION_STRINGS:
        return torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def set_tf32_flags(matmul: object, cudnn: object) -> None:
    """Set both flags, in tf32_flags' spelling (a pair it returned restores the state exactly)."""
    if _PRECISION_STRINGS:
        torch.backends.cuda.matmul.fp32_precision = matmul
        torch.backends.cudnn.conv.fp32_precision = cudnn
    else:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


def current_precision() -> tuple[bool, bool]:
    """Whether float32 (matmuls, cuDNN convolutions) run as TF32 in this process right now."""
    matmul, cudnn = tf32_flags()
    return matmul == TF32_ON, cudnn == TF32_ON


# CPU instructions that compute in a 16-bit float natively, by their /proc/cpuinfo flag (x86
# "flags", Arm "Features"). Without one, PyTorch's CPU kernels and oneDNN convert to float32 and
# back around each operator, so autocast costs time instead of saving it: resnet-mini under
# bfloat16 autocast ran 9x slower than in float32 on an AVX2-only EPYC (BENCHMARKS.md, "When the
# CPU has no bfloat16 instructions"), and 1.5x faster on one with AVX512-BF16.
NATIVE_HALF_FLAGS = {
    "x86": {
        "bfloat16": {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"},
        "float16": {"avx512_fp16": "AVX512-FP16", "amx_fp16": "AMX-FP16"},
    },
    "arm": {"bfloat16": {"bf16": "BF16"}, "float16": {"asimdhp": "FP16 SIMD"}},
}


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags, or None where the system does not say (not Linux, unreadable)."""
    try:
        with open(cpuinfo) as lines:
            for line in lines:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return None


def cpu_lacks_native(
    dtype: str, flags: frozenset[str] | None = None, machine: str | None = None
) -> str | None:
    """Why autocast to ``dtype`` ("bfloat16" or "float16") would be emulated on this CPU; None if
    the CPU has the instructions, or if it cannot be told (no flags to read, another architecture)."""
    machine = (machine or platform.machine()).lower()
    arch = "arm" if machine in ("aarch64", "arm64") else "x86" if machine in ("x86_64", "amd64") else None
    flags = cpu_flags() if flags is None else flags
    if arch is None or flags is None:
        return None
    native = NATIVE_HALF_FLAGS[arch][dtype]
    if flags & native.keys():
        return None
    return (
        f"this CPU has no {dtype} instructions ({' or '.join(native.values())}): each operator "
        "converts to float32 and back, which usually makes it slower than float32"
    )
