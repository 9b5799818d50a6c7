"""Process-wide state: what arms sharing one process must not change for each other.

A block runs several arms in one process (see workbench.block). Two kinds of process-wide
state matter there:

Random state
    Every arm seeds the random generators the same way before it is built, as if it had the
    process to itself. Each then keeps its own copy of the generators' state (torch's CPU and
    CUDA generators, ``random``, ``numpy``): :class:`ArmRandomState` puts the arm's copy in
    place when one of its windows starts and takes it back when the window ends. So the
    weights, batches and dropout masks an arm sees do not depend on which arms ran between
    its windows, and its losses match a run in a process of its own.

Everything else an arm could leave behind
    :func:`fingerprint` reads the switches that change how later code runs: thread counts,
    backend precision flags, cuDNN modes, the default dtype, grad and autocast modes, and
    monkey-patches of ``torch.nn`` classes and ``torch.nn.functional``. The block reads it
    before any arm is built and again after every arm's build and window; an arm whose
    window leaves a difference behind is dropped from the block, and :func:`differences`
    names what it changed. Techniques that must flip such a switch do it inside
    ``TrainSetup.window_settings`` (entered and left around each window), or declare that
    they need a process of their own.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from workbench.devices import tf32_flags


def _precision_flags() -> dict[str, Any]:
    flags: dict[str, Any] = {"float32_matmul_precision": torch.get_float32_matmul_precision()}
    flags["cuda_matmul_tf32"], flags["cudnn_conv_tf32"] = tf32_flags()
    matmul = torch.backends.cuda.matmul
    flags["cuda_matmul_allow_fp16_reduced_precision"] = matmul.allow_fp16_reduced_precision_reduction
    flags["cuda_matmul_allow_bf16_reduced_precision"] = matmul.allow_bf16_reduced_precision_reduction
    return flags


def _patched_namespaces() -> list[tuple[str, dict]]:
    """The namespaces a process-wide monkey-patch would change: torch.nn.functional, nn's classes."""
    import torch.nn.functional as F

    namespaces = [("torch.nn.functional", vars(F))]
    for name in dir(torch.nn):
        cls = getattr(torch.nn, name)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            namespaces.append((f"torch.nn.{name}", vars(cls)))  # a live view: later patches show through it
    return namespaces


# (label, namespace, attribute) for every attribute the namespaces held when first read.
_WATCHED: list[tuple[str, Any, str]] = []


def _watched() -> list[tuple[str, Any, str]]:
    if not _WATCHED:
        for label, namespace in _patched_namespaces():
            _WATCHED.extend((label, namespace, attribute) for attribute in list(namespace))
    return _WATCHED


def _patch_signature() -> tuple[int, ...]:
    """What ``torch.nn``'s module classes and ``torch.nn.functional`` hold, as identities.

    A technique that monkey-patches ``nn.Linear.forward`` or ``F.gelu`` for every model in
    the process, instead of changing its own model's modules, changes this. Only attributes
    that existed at the first read count: a library that *adds* a helper (transformers adds
    ``nn.Module.smart_apply`` when it builds its first model) changes no existing behaviour.
    Read once per window, so it must be cheap: a few thousand identities.
    """
    return tuple(id(namespace.get(attribute)) for _, namespace, attribute in _watched())


def _patched_names(before: tuple[int, ...], after: tuple[int, ...]) -> list[str]:
    watched = _watched()
    return [
        f"{label}.{attribute}"
        for (label, _, attribute), a, b in zip(watched, before, after, strict=True)
        if a != b
    ]


def fingerprint() -> dict[str, Any]:
    """The process-wide switches an arm must leave as it found them (see the module docstring)."""
    state: dict[str, Any] = {
        "torch_threads": torch.get_num_threads(),
        "default_dtype": str(torch.get_default_dtype()),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "anomaly_detection": torch.is_anomaly_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "autocast_cuda": torch.is_autocast_enabled("cuda"),
        "cudnn_enabled": torch.backends.cudnn.enabled,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        **_precision_flags(),
        "nn_patches": _patch_signature(),
    }
    return state


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """``["torch_threads: 2 -> 1", ...]``: what changed between two fingerprints."""
    changed = []
    for key in before:
        if before[key] != after.get(key):
            if key == "nn_patches":
                names = _patched_names(before[key], after[key])
                shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                changed.append(f"torch.nn classes or torch.nn.functional were monkey-patched ({shown})")
            else:
                changed.append(f"{key}: {before[key]} -> {after.get(key)}")
    return changed


class ArmRandomState:
    """One arm's own copy of the random generators, swapped in around each of its windows."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._saved: tuple | None = None

    def keep(self) -> None:
        """Take the generators' current state as this arm's (call when the arm pauses)."""
        self._saved = (
            torch.get_rng_state(),
            torch.cuda.get_rng_state(self.device) if self.cuda else None,
            random.getstate(),
            np.random.get_state(),
        )

    def resume(self) -> None:
        """Put this arm's state back into the generators (call when the arm runs again)."""
        if self._saved is None:
            return
        cpu, cuda, python, numpy = self._saved
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
        random.setstate(python)
        np.random.set_state(numpy)
