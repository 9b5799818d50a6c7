"""The arithmetic of MFU, without torch: each GPU's dense peak TFLOP/s and the two ratios.

workbench.mfu counts an arm's FLOPs (it needs torch); this module turns them into ``tflops`` and
``mfu_pct`` where results are read (workbench.results, ``workbench show``), which then need not
import torch at all.
"""

from __future__ import annotations

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
    return None, f"no peak for {device_name!r} in workbench.peak_flops.PEAK_TFLOPS; add one to get MFU"


def achieved_tflops(flops_per_sample: float, samples_per_s: float) -> float:
    return flops_per_sample * samples_per_s / 1e12


def mfu_percent(tflops: float, peak: float, gpus: int = 1) -> float:
    """Achieved over peak, in percent, for ``gpus`` GPUs working together."""
    return 100.0 * tflops / (peak * gpus)
