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
as TF32, float32 otherwise. The peaks and this arithmetic live in workbench.peak_flops, without
torch, for where results are read. A GPU missing from its ``PEAK_TFLOPS`` gets no MFU (the notes
say so); add a row for it, in the process that calls ``ablate``, which is where MFU is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workbench.data import batch_size_of
from workbench.devices import current_precision
from workbench.loop import CPU_CHECK_MAX_PARAMETERS, build_on_meta, call_model, first_samples, to_device


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
