"""The CUDA sources in kernels/: where they are, a CPU-side compile check, and launching them.

Each ``kernels/<name>.cu`` file is one fused operator, instantiated for four element types
(``_f64``, ``_f32``, ``_f16``, ``_bf16`` after each entry point's name). On a GPU, a file is
compiled once per device by CuPy's ``RawModule`` (NVRTC under the hood) and its entry points
are launched on PyTorch's current stream, with each tensor handed over as its device address:
no copy, and no synchronization between the two libraries.

CI machines have no GPU, but NVRTC is a compiler library that needs none: ``compile_check``
compiles every file for the architectures the kernels target (sm_75: T4, sm_80: A100, sm_90:
H100/H200) with cuda-python's NVRTC bindings, so a syntax or type error in kernels/ fails the
tests before anyone reaches a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.optional import install_hint, missing

KERNELS = ("bias_gelu", "residual_dropout_layer_norm", "adamw")
# sm_75 is the oldest that CUDA 13's NVRTC compiles for; common.cuh rounds to bf16 itself there
ARCHITECTURES = ("sm_75", "sm_80", "sm_90")
OLDEST_CAPABILITY = (7, 5)
COMPILE_OPTIONS = ("--std=c++17",)

DTYPE_SUFFIX = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# Arithmetic inside the kernels happens in this type (see kernels/common.cuh).
ACCUMULATE = {torch.float64: torch.float64, torch.float32: torch.float32}

CUPY_HINT = install_hint("cupy")


def kernel_dir() -> Path:
    return Path(str(importlib.resources.files("workbench.kernels")))


HEADER_INCLUDE = '#include "common.cuh"'


def source(name: str) -> str:
    """kernels/<name>.cu, as written."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; the kernels are: {', '.join(KERNELS)}")
    return (kernel_dir() / f"{name}.cu").read_text()


def compiled_source(name: str) -> str:
    """What is compiled of kernels/<name>.cu: the file with common.cuh pasted in place of its
    #include. CuPy's disk cache of compiled kernels is keyed by the source text, not by the files
    it includes, so an edited header alone would otherwise load the kernels built from the old one."""
    return source(name).replace(HEADER_INCLUDE, (kernel_dir() / "common.cuh").read_text())


def entry_points(name: str) -> list[str]:
    """Every extern "C" function the file defines, e.g. bias_gelu_forward_f32."""
    stems = re.findall(r'extern "C" __global__ void (\w+)_##SUFFIX', source(name))
    return [f"{stem}_{suffix}" for stem in stems for suffix in DTYPE_SUFFIX.values()]


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return ACCUMULATE.get(dtype, torch.float32)


def suffix(dtype: torch.dtype) -> str:
    try:
        return DTYPE_SUFFIX[dtype]
    except KeyError:
        valid = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_SUFFIX)
        raise ValueError(f"the fused kernels take {valid} tensors; got {dtype}") from None


# --- the CPU-side compile check -------------------------------------------------------------


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    arch: str
    ok: bool
    seconds: float
    cubin_bytes: int  # size of the compiled machine code; 0 when compilation failed
    entry_points: int  # extern "C" kernels found in the machine code
    log: str  # NVRTC's messages: errors and warnings


def nvrtc_unavailable_reason() -> str | None:
    """None when cuda-python's NVRTC bindings and the NVRTC library load, else why not."""
    reason = missing("cuda.bindings", install_hint("cuda.bindings"))
    if reason:
        return f"the compile check needs cuda-python's NVRTC bindings and the NVRTC library: {reason}"
    try:
        from cuda.bindings import nvrtc

        error, *_ = nvrtc.nvrtcVersion()
    except Exception as exc:  # ImportError, or the shared library is missing
        return (
            "the compile check needs cuda-python's NVRTC bindings and the NVRTC library "
            f"({install_hint('cuda.bindings')}): {exc}"
        )
    if error != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return f"NVRTC did not load: {error}"
    return None


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def compile_kernel(name: str, arch: str) -> CompileResult:
    """Compile kernels/<name>.cu for ``arch`` (e.g. "sm_90") with NVRTC; no GPU is involved."""
    return compile_source(compiled_source(name), name, arch, entry_points(name))


def compile_source(text: str, name: str, arch: str, expected: list[str]) -> CompileResult:
    """Compile CUDA source text with NVRTC and check that the ``expected`` entry points exist."""
    from cuda.bindings import nvrtc

    options = [f"--gpu-architecture={arch}".encode(), f"-I{kernel_dir()}".encode()]
    options += [option.encode() for option in COMPILE_OPTIONS]
    started = time.perf_counter()
    error, program = nvrtc.nvrtcCreateProgram(text.encode(), f"{name}.cu".encode(), 0, [], [])
    _check(error, "nvrtcCreateProgram")
    try:
        (status,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        ok = status == nvrtc.nvrtcResult.NVRTC_SUCCESS
        error, log_size = nvrtc.nvrtcGetProgramLogSize(program)
        _check(error, "nvrtcGetProgramLogSize")
        log = b" " * log_size
        nvrtc.nvrtcGetProgramLog(program, log)
        cubin = b""
        if ok:
            error, cubin_size = nvrtc.nvrtcGetCUBINSize(program)
            _check(error, "nvrtcGetCUBINSize")
            cubin = b" " * cubin_size
            nvrtc.nvrtcGetCUBIN(program, cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    # extern "C" names appear verbatim in the machine code's symbol table.
    missing = [entry for entry in expected if ok and entry.encode() + b"\x00" not in cubin]
    return CompileResult(
        kernel=name,
        arch=arch,
        ok=ok and not missing,
        seconds=time.perf_counter() - started,
        cubin_bytes=len(cubin),
        entry_points=len(expected) - len(missing) if ok else 0,
        log=log.rstrip(b"\x00 ").decode(errors="replace")
        + (f"\nmissing entry points: {', '.join(missing)}" if missing else ""),
    )


def compile_check(archs: tuple[str, ...] = ARCHITECTURES):
    """Compile every kernel for every architecture; a DataFrame with one row per pair."""
    import pandas as pd

    reason = nvrtc_unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    rows = [compile_kernel(name, arch).__dict__ for name in KERNELS for arch in archs]
    return pd.DataFrame(rows)


def _check(error, call: str) -> None:
    from cuda.bindings import nvrtc

    if error != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{call} failed: {error}")


# --- launching on a GPU through CuPy --------------------------------------------------------


def cupy_unavailable_reason(device: torch.device | None = None) -> str | None:
    """None when CuPy can launch the kernels on ``device`` (default: the current CUDA device)."""
    if device is not None and device.type != "cuda":
        return f"the CuPy kernels need a CUDA device; this run is on {device.type}"
    if not torch.cuda.is_available():
        return "the CuPy kernels need a CUDA device; none is visible"
    reason = missing("cupy", CUPY_HINT)  # imports it: a half-installed CuPy's error is the reason
    if reason:
        return f"needs CuPy: {reason}"
    import cupy

    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # a CuPy built for another CUDA major version than the driver's
        return f"CuPy is installed but cannot reach the GPU ({exc}); {CUPY_HINT}"
    capability = torch.cuda.get_device_capability(device if device is not None else None)
    if capability < OLDEST_CAPABILITY:
        oldest = ".".join(map(str, OLDEST_CAPABILITY))
        return (
            f"the CuPy kernels are built for compute capability {oldest} or newer (Turing, T4); "
            f"this GPU has {'.'.join(map(str, capability))}"
        )
    return None


@functools.cache
def _module(name: str, device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=compiled_source(name), options=COMPILE_OPTIONS)
        module.compile()  # compile now, so a failure names the file instead of a later launch
    return module


def kernel(name: str, entry: str, dtype: torch.dtype, device: torch.device):
    """The CuPy RawKernel for ``<entry>_<dtype suffix>`` in kernels/<name>.cu, on ``device``."""
    return _function(name, f"{entry}_{suffix(dtype)}", _index(device))


@functools.cache
def _function(name: str, entry: str, device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):  # loaded on this device, not on whichever is current
        return _module(name, device_index).get_function(entry)


@functools.cache
def cupy_ready_reason() -> str | None:
    """``cupy_unavailable_reason()`` for the visible GPU, asked once per process (ops ask per call)."""
    return cupy_unavailable_reason()


@functools.cache
def multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@contextlib.contextmanager
def on_torch_stream(device: torch.device):
    """Make CuPy launch on PyTorch's current stream, so both libraries' work stays in order."""
    import cupy

    index = _index(device)
    stream = torch.cuda.current_stream(index)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
        yield


def view(tensor: torch.Tensor | None):
    """A contiguous CUDA tensor as the kernel argument it is read through: its device address
    (a null pointer for None).

    Not a CuPy array through DLPack: CuPy 13 refuses bfloat16 there, and CuPy 14 takes it only
    with ml_dtypes installed, while the kernels need nothing but the address. The tensor stays
    alive while the caller holds it, and the launch runs on PyTorch's current stream
    (``on_torch_stream``), where the caching allocator reuses its memory only after the kernel.
    """
    import numpy as np

    if tensor is None:
        return np.uint64(0)
    if not tensor.is_contiguous():
        raise ValueError("the fused kernels read contiguous memory; call .contiguous() first")
    return np.uint64(tensor.data_ptr())
