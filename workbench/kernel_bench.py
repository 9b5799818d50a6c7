"""Microbenchmarks of the fused kernels: achieved bandwidth, and speed against the unfused ops.

For each fused operator and pass (forward, backward), three implementations do the same work
on the same tensors: the CuPy kernel (``fused``), the eager PyTorch chain it replaces
(``eager``) and that chain under ``torch.compile`` (``compiled``). Rounds interleave the
three, each round timing ``calls`` back-to-back calls between two CUDA events after a
warm-up, so drift on the device hits every implementation alike. Reported: the median time
per call, the bytes the fused kernel must move at least (each input read once, each output
written once), the bandwidth that implies, its share of the device's measured copy
bandwidth, and the speedups over eager and compiled with 95% intervals over the rounds.

The copy bandwidth is measured here too (``dst.copy_(src)`` reads and writes every byte),
because it is the practical ceiling for a memory-bound kernel; spec-sheet figures are not.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from workbench import fused_ops, raw_kernels, stats


def _time_calls(function: Callable[[], object], calls: int) -> float:
    """Seconds per call over ``calls`` back-to-back calls, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        function()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / calls


def _interleaved(functions: dict[str, Callable[[], object]], rounds: int, calls: int, warmup: int = 3):
    """Per implementation: one seconds-per-call figure per round, the implementations interleaved."""
    for function in functions.values():
        for _ in range(warmup):
            function()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in functions}
    for round_index in range(rounds):
        order = list(functions) if round_index % 2 == 0 else list(reversed(functions))  # no fixed position
        for name in order:
            times[name].append(_time_calls(functions[name], calls))
    return times


def copy_bandwidth(megabytes: int = 512, rounds: int = 10, calls: int = 20) -> float:
    """The device's measured copy bandwidth in GB/s: bytes read plus bytes written per second."""
    source = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device="cuda")
    target = torch.empty_like(source)
    times = _interleaved({"copy": lambda: target.copy_(source)}, rounds, calls)["copy"]
    return 2 * source.numel() * 4 / float(np.median(times)) / 1e9


def _speedup(baseline: list[float], arm: list[float]) -> tuple[float, float, float]:
    """How many times faster ``arm`` is than ``baseline`` (seconds per call, one per round), with
    its 95% interval. The rounds interleave both in one process, so they pair up: one block whose
    windows are the rounds (workbench.stats)."""
    rounds = lambda seconds: stats.Side([[s] for s in seconds], samples_per_step=1.0)  # noqa: E731
    speedup = stats.combine_blocks([stats.block_ratio(rounds(baseline), rounds(arm), paired=True)])
    return speedup.point, speedup.low, speedup.high


IMPLEMENTATIONS = ("fused", "eager", "compiled")


def _cases(rows: int, cols: int, dtype: torch.dtype, dropout: float):
    """(operator, pass, bytes the fused kernel moves, {implementation: zero-argument call})."""
    device = torch.device("cuda")
    x = torch.randn(rows, cols, device=device, dtype=dtype, requires_grad=True)
    residual = torch.randn_like(x, requires_grad=True)
    grad = torch.randn_like(x)
    # Each implementation's parameters as it would meet them: the eager and compiled chains'
    # in the activations' dtype (else they would promote to float32), the kernels' in their
    # accumulation dtype, which they read without a cast (as under autocast, whose parameters
    # stay float32); handing the kernels bf16 parameters would time a cast kernel with them.
    params = {}
    for name in IMPLEMENTATIONS:
        kind = raw_kernels.accumulate_dtype(dtype) if name == "fused" else dtype
        params[name] = (
            torch.ones(cols, device=device, dtype=kind, requires_grad=True),  # LayerNorm's weight
            torch.zeros(cols, device=device, dtype=kind, requires_grad=True),  # a bias
        )
    yield from _bias_gelu_cases(x, params, grad)
    yield from _residual_layer_norm_cases(x, residual, params, grad, dropout)


def _bias_gelu_cases(x: torch.Tensor, params: dict, grad: torch.Tensor):
    """bias + GELU, forward and backward: fused kernel, eager chain, compiled chain."""
    size = x.element_size()

    def gelu_chain(a, b):
        return F.gelu(a + b)

    functions = {"fused": fused_ops.bias_gelu, "eager": gelu_chain, "compiled": torch.compile(gelu_chain)}
    yield (
        "bias + GELU",
        "forward",
        2 * x.numel() * size,
        {name: (lambda f=f, b=params[name][1]: f(x, b)) for name, f in functions.items()},
    )
    graphs = {name: (f(x, params[name][1]), params[name][1]) for name, f in functions.items()}
    yield (
        "bias + GELU",
        "backward",
        3 * x.numel() * size,
        {
            name: (lambda y=y, b=b: torch.autograd.grad(y, (x, b), grad, retain_graph=True))
            for name, (y, b) in graphs.items()
        },
    )


def _residual_layer_norm_cases(x, residual, params: dict, grad: torch.Tensor, dropout: float):
    """residual + dropout + LayerNorm, forward and backward: fused kernel, eager chain, compiled chain."""
    size, cols = x.element_size(), x.shape[-1]

    def residual_chain(a, r, w, b):
        h = r + F.dropout(a, dropout)
        return h, F.layer_norm(h, (cols,), w, b)

    functions = {
        "fused": lambda a, r, w, b: fused_ops.residual_dropout_layer_norm(a, r, w, b, p=dropout),
        "eager": residual_chain,
        "compiled": torch.compile(residual_chain),
    }
    args = {name: (x, residual, *params[name]) for name in functions}
    yield (
        f"residual + dropout({dropout}) + LayerNorm",
        "forward",
        4 * x.numel() * size,
        {name: (lambda f=f, a=args[name]: f(*a)) for name, f in functions.items()},
    )
    outputs = {name: (f(*args[name]), args[name]) for name, f in functions.items()}
    yield (
        f"residual + dropout({dropout}) + LayerNorm",
        "backward",
        5 * x.numel() * size,
        {
            name: (lambda hy=hy, a=a: torch.autograd.grad(hy, a, (grad, grad), retain_graph=True))
            for name, (hy, a) in outputs.items()
        },
    )


def _adamw_case(parameters: int, dtype: torch.dtype):
    """AdamW over a GPT-shaped list of tensors holding about ``parameters`` values."""
    width = max(64, int(math.sqrt(parameters / 12)) // 64 * 64)
    shapes = [(width, width)] * 12 + [(width,)] * 24  # weight matrices and per-channel vectors
    implementations = {}
    for name in IMPLEMENTATIONS:
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype)) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        if name == "fused":
            optimizer = fused_ops.FusedAdamW(params)
        elif name == "eager":
            optimizer = torch.optim.AdamW(params, foreach=True)  # PyTorch's default on CUDA
        else:
            optimizer = torch.optim.AdamW(params, fused=True)  # PyTorch's own fused CUDA kernel
        implementations[name] = optimizer.step
    count = sum(math.prod(s) for s in shapes)
    size = torch.tensor([], dtype=dtype).element_size()
    moments = 4 if dtype != torch.float64 else 8
    # read parameter, gradient, two moments; write parameter and two moments
    return "AdamW step", "optimizer", count * (2 * size + 2 * moments + size + 2 * moments), implementations


def measure_kernels(
    rows: int = 32768,
    cols: int = 1024,
    dtype: torch.dtype = torch.float32,
    dropout: float = 0.1,
    adamw_parameters: int = 50_000_000,
    rounds: int = 10,
    calls: int = 20,
):
    """One row per (operator, pass): times, bandwidth, % of copy bandwidth, speedups with intervals.

    In the AdamW row ``compiled`` is PyTorch's own fused AdamW (``fused=True``), the strongest
    baseline there is, and ``eager`` its default multi-tensor (foreach) implementation.
    """
    import pandas as pd

    reason = raw_kernels.cupy_unavailable_reason()
    if reason:
        raise RuntimeError(f"cannot run the kernel benchmark: {reason}")
    copy_gbs = copy_bandwidth()
    rows_out = []
    cases = [*_cases(rows, cols, dtype, dropout), _adamw_case(adamw_parameters, dtype)]
    for operator, phase, nbytes, functions in cases:
        times = _interleaved(functions, rounds, calls)
        fused_s = float(np.median(times["fused"]))
        row = {
            "operator": operator,
            "pass": phase,
            "dtype": str(dtype).removeprefix("torch."),
            "MB_moved": nbytes / 1e6,
            "fused_us": fused_s * 1e6,
            "eager_us": float(np.median(times["eager"])) * 1e6,
            "compiled_us": float(np.median(times["compiled"])) * 1e6,
            "fused_GBps": nbytes / fused_s / 1e9,
            "copy_GBps": copy_gbs,
        }
        row["pct_of_copy"] = 100 * row["fused_GBps"] / copy_gbs
        for baseline in ("eager", "compiled"):
            ratio, low, high = _speedup(times[baseline], times["fused"])
            row[f"vs_{baseline}"], row[f"vs_{baseline}_low"], row[f"vs_{baseline}_high"] = ratio, low, high
        rows_out.append(row)
    return pd.DataFrame(rows_out)
