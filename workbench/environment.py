"""What machine and software produced a set of numbers. Saved with every result."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import torch

import workbench
from workbench import optional
from workbench.peak_flops import peak_tflops
from workbench.telemetry import usable_cores


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _first_version(*distributions: str) -> str | None:
    for name in distributions:
        version = _version(name)
        if version:
            return f"{name} {version}"
    return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_revision() -> str | None:
    """The workbench checkout's commit (with ``-dirty`` for local changes), if it is a git checkout."""
    source = Path(__file__).resolve().parent.parent
    try:
        revision = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return revision + ("-dirty" if dirty else "")


def _gpu_info() -> dict:
    if not torch.cuda.is_available():
        return {"cuda_available": False}
    info = {
        "cuda_available": True,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
    }
    info["driver_version"] = None
    if optional.missing("pynvml"):
        return info
    try:
        import pynvml

        pynvml.nvmlInit()
        info["driver_version"] = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
    except Exception:  # NVML unusable (no driver): the driver version stays unknown, as set above
        pass
    return info


def environment() -> dict:
    """Versions, device, CPU and cores: a JSON-ready dict."""
    return {
        "workbench": workbench.__version__,
        "git_revision": git_revision(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": _version("numpy"),
        "cupy": _first_version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "dali": _first_version(
            "nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110", "nvidia-dali"
        ),
        **_gpu_info(),
        "optional_packages": optional.report(),
    }


def machine_summary(env: dict | None = None) -> dict:
    """The few facts a recorded benchmark figure must carry: which machine, which software."""
    env = env or environment()
    keys = ("cpu", "usable_cores", "torch", "python", "platform", "gpus", "driver_version", "git_revision")
    return {key: env[key] for key in keys if key in env}


def gpu_line(env: dict) -> str:
    """``gpu       NVIDIA H100 80GB HBM3 (compute capability 9.0, 79.1 GiB; dense peak TFLOP/s: ...)``."""
    name = env["gpus"][0]
    peaks = []
    for dtype in ("bfloat16", "float16", "tf32", "float32"):
        peak, _ = peak_tflops(name, dtype)
        if peak is not None:
            peaks.append(f"{dtype} {peak:g}")
    peak_text = (
        f"dense peak TFLOP/s: {', '.join(peaks)}"
        if peaks
        else "peak unknown: no MFU (see workbench.peak_flops)"
    )
    memory = f", {env['gpu_memory_gib']} GiB" if env.get("gpu_memory_gib") else ""
    count = f"{len(env['gpus'])}x " if len(env["gpus"]) > 1 else ""
    return f"gpu       {count}{name} (compute capability {env['capability']}{memory}; {peak_text})"


def format_environment(env: dict, spell: Callable[[str], str] | None = None) -> str:
    """The environment as aligned lines; ``spell`` rewords the optional packages' (the CLI's flags)."""
    lines = [
        f"workbench {env['workbench']}"
        + (f" (git {env['git_revision']})" if env.get("git_revision") else ""),
        f"python    {env['python']} on {env['platform']}",
        f"cpu       {env['cpu']}: {env['usable_cores']} usable of {env['logical_cores']} logical cores",
        f"torch     {env['torch']} ({env['torch_threads']} intra-op threads)",
        f"cupy      {env['cupy'] or 'not installed'}",
        f"dali      {env['dali'] or 'not installed'}",
    ]
    if env.get("cuda_available"):
        lines.append(
            f"cuda      {env['cuda_version']}, cuDNN {env['cudnn_version']}, driver {env.get('driver_version') or 'unknown'}"
        )
        lines.append(gpu_line(env))
    else:
        lines.append("cuda      no CUDA device visible (GPU-only techniques show as unavailable)")
    lines.append(format_optional_packages(env.get("optional_packages") or optional.report(), spell))
    return "\n".join(lines)


def format_optional_packages(report: list[dict], spell: Callable[[str], str] | None = None) -> str:
    """One line per optional package: installed, or why not and how to install it. ``spell``:
    rewords each line before it is wrapped (the CLI's flags for the API's keywords)."""
    lines = ["optional packages:"]
    for entry in report:
        state = "installed" if entry["unavailable"] is None else f"unavailable. {entry['unavailable']}"
        line = f"{entry['package']:<13} for {entry['for']}: {state}"
        line = spell(line) if spell else line
        # not at hyphens: a package name cut there ("cupy-" / "cuda13x") cannot be copied
        lines.append(
            textwrap.fill(line, 80, initial_indent="  ", subsequent_indent=" " * 16, break_on_hyphens=False)
        )
    return "\n".join(lines)
