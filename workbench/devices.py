"""Device resolution and the one synchronization point the clocks rely on."""

from __future__ import annotations

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


def current_precision() -> tuple[bool, bool]:
    """Whether float32 (matmuls, cuDNN convolutions) run as TF32 in this process right now."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # the newer per-backend switches
        return (
            torch.backends.cuda.matmul.fp32_precision == "tf32",
            torch.backends.cudnn.conv.fp32_precision == "tf32",
        )
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
