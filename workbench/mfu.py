"""Model FLOPs utilization (MFU): how far an arm runs from the GPU's arithmetic limit.

FLOPs per step are counted, not guessed. After the timed window, the worker builds a second
copy of the model on PyTorch's ``meta`` device (shapes without storage: no memory, no
arithmetic, and the measured model is untouched) and runs one forward and backward of a
real batch's shapes under ``torch.utils.flop_counter.FlopCounterMode``. That counts the
matmuls, convolutions and attention products, which is where the arithmetic is;
elementwise ops, normalization and the optimizer step are left out, as in the usual
definition of MFU (Chowdhery et al., "PaLM", 2022, appendix B). Recomputation under
activation checkpointing is not counted either: MFU measures the model's useful FLOPs, not
the hardware's work.

``tflops`` = FLOPs per sample x samples/s (all ranks). ``mfu_pct`` = tflops / (peak x GPUs),
where the peak is the dense (not 2:4-sparse) tensor throughput from NVIDIA's datasheets for
the dtype the arm computes in: the autocast dtype under amp, TF32 when float32 matmuls run
as TF32, float32 otherwise. A GPU missing from ``PEAK_TFLOPS`` gets no MFU (the notes say
so); add a row for it, in the process that calls ``ablate``, which is where MFU is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workbench.data import batch_size_of
from workbench.devices import current_precision
from workbench.loop import CPU_CHECK_MAX_PARAMETERS, build_on_meta, call_model, first_samples, to_device

# Dense peak TFLOP/s per compute dtype. Matched against torch.cuda.get_device_name() in this
# order (first match wins), so more specific names come first ("A100" before "A10").
# Sources: NVIDIA H100, H200, A100, L40S, L4, A10 and V100 datasheets (sparse figures halved).
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}),
    ("H100 PCIe", {"float32": 51.2, "tf32": 378.0, "bfloat16": 756.0, "float16": 756.0}),
    ("H100 NVL", {"float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5}),
    ("H100", {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}),  # SXM
    ("A100", {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0}),
    ("L40S", {"float32": 91.6, "tf32": 183.0, "bfloat16": 362.0, "float16": 362.0}),
    ("L4", {"float32": 30.3, "tf32": 60.0, "bfloat16": 121.0, "float16": 121.0}),
    ("A10", {"float32": 31.2, "tf32": 62.5, "bfloat16": 125.0, "float16": 125.0}),
    ("V100", {"float32": 15.7, "float16": 125.0}),  # no TF32 or bfloat16 tensor cores
]


def peak_tflops(device_name: str, compute_dtype: str) -> tuple[float | None, str]:
    """(dense peak TFLOP/s, which table row) for a GPU name and compute dtype, or (None, why not)."""
    for pattern, peaks in PEAK_TFLOPS:
        if pattern in device_name:
            if compute_dtype not in peaks:
                return None, f"{pattern} has no {compute_dtype} tensor-core peak in the table"
            return peaks[compute_dtype], f"{pattern} {compute_dtype}"
    return None, f"no peak for {device_name!r} in workbench.mfu.PEAK_TFLOPS; add one to get MFU"


def compute_dtype(model: torch.nn.Module, autocast_dtype: torch.dtype | None) -> str:
    """The dtype the matmuls run in: the autocast dtype, else the weights', with TF32 noticed."""
    if autocast_dtype is not None:
        return str(autocast_dtype).removeprefix("torch.")
    parameter = next(model.parameters(), None)
    dtype = parameter.dtype if parameter is not None else torch.float32
    if dtype in (torch.float16, torch.bfloat16, torch.float64):
        return str(dtype).removeprefix("torch.")
    matmul_tf32, _ = current_precision()  # the matmul flag decides; cuDNN convolutions have their own
    return "tf32" if matmul_tf32 else "float32"


def count_flops(
    build: Callable[[], torch.nn.Module],
    inputs: Any,
    targets: torch.Tensor | None,
    loss_fn: Callable[[Any, torch.Tensor | None], torch.Tensor],
) -> int:
    """FLOPs of one forward and backward of a model built by ``build`` on this batch's shapes.

    The model is built on the meta device and the batch is replaced by meta tensors of the
    same shapes, so nothing is computed and no memory is used. A model that cannot run on
    meta tensors (``.item()`` in its forward, as Hugging Face's attention masks do) is built
    on the CPU and runs two samples of the batch for real, scaled to the batch (FLOPs grow
    with the samples); not for a model over CPU_CHECK_MAX_PARAMETERS.
    """
    meta, model = torch.device("meta"), None
    try:
        model = build_on_meta(build)
        return _flops_of(model, to_device(inputs, meta, False), to_device(targets, meta, False), loss_fn)
    except Exception as on_meta:
        if model is None:
            raise  # the factory itself cannot build on meta: nothing to count with
        parameters = sum(p.numel() for p in model.parameters())
        if parameters > CPU_CHECK_MAX_PARAMETERS:
            raise ValueError(
                f"it cannot run on the meta device ({type(on_meta).__name__}: {on_meta}) and, at "
                f"{parameters / 1e6:.0f}M parameters, is too large to count on the CPU"
            ) from None
    batch = batch_size_of(inputs, targets)
    # Two samples, not one: BatchNorm refuses a batch of one in training mode.
    few = min(batch, 2)
    few_inputs, few_targets = first_samples((inputs, targets), few)
    return round(_flops_of(build().cpu(), few_inputs, few_targets, loss_fn) * batch / few)


def _flops_of(model: torch.nn.Module, inputs: Any, targets: Any, loss_fn: Callable) -> int:
    """FLOPs of one forward, loss and backward, as torch's FlopCounterMode counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        loss_fn(call_model(model, inputs), targets).backward()
    return int(counter.get_total_flops())


def achieved_tflops(flops_per_sample: float, samples_per_s: float) -> float:
    return flops_per_sample * samples_per_s / 1e12


def mfu_percent(tflops: float, peak: float, gpus: int = 1) -> float:
    """Achieved over peak, in percent, for ``gpus`` GPUs working together."""
    return 100.0 * tflops / (peak * gpus)
